"""Per-token reports as the command-line front ends print them (`npllm generate` and `npllm chat`, --logprobs).

Both front ends import this; neither imports the other (tests/test_layers.py).
"""

from __future__ import annotations


def logprobs_line(tokenizer, step, label: str = "[logprobs]") -> str:
    """The label, the drawn piece, its log-probability, then the top alternatives, one line.

    step: a Sampled of one row (token_ids, logprobs, top_ids [n], top_logprobs [n]; ids < 0 are empty places)."""
    def piece(token_id):
        return repr(tokenizer.id_to_piece(int(token_id)))

    alternatives = ", ".join(f"{piece(t)} {lp:.3f}" for t, lp in zip(step.top_ids, step.top_logprobs) if t >= 0)
    return f"{label} {piece(step.token_ids)} {step.logprobs:.4f} | {alternatives}"
