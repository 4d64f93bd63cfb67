"""Beam search references from transformers, for tests/test_search.py (the tests need neither torch nor
transformers).

    pip install torch transformers && python scripts/make_beam_fixtures.py

On the tiny random Llama in tests/fixtures/hf/llama_gqa, for beams 2-4, length penalties 0, 1 and 2, early_stopping True, False and "never",
with an end token the model often proposes (so hypotheses finish early) and with one it never
reaches (so every hypothesis runs to max_new_tokens): generate(num_beams=..., do_sample=False,
num_return_sequences=num_beams, output_scores=True, return_dict_in_generate=True). Writes the new tokens of every
returned sequence (up to and including the first end token) and transformers' sequence scores, best first, to
tests/fixtures/hf/beam_search.json.
"""

import json
from pathlib import Path

import torch
import transformers

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "tests" / "fixtures" / "hf" / "llama_gqa"
OUT = REPO / "tests" / "fixtures" / "hf" / "beam_search.json"
PROMPTS = [[0, 45, 112, 7, 260, 33], [0, 5]]
MAX_NEW = 10


def likely_end_token(model, prompt, never):
    """A token the best of 3 beams emits a few steps in: as an end token, hypotheses then finish early."""
    out = model.generate(torch.tensor([prompt]), num_beams=3, max_new_tokens=6, do_sample=False, eos_token_id=never,
                         pad_token_id=never)
    return int(out[0, len(prompt) + 3])


def main():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    cases = []
    for prompt in PROMPTS:
        never = model.config.vocab_size - 1  # checked below not to appear in any output
        for eos_kind, eos in (("likely", likely_end_token(model, prompt, never)), ("never", never)):
            for beams in (2, 3, 4):
                for length_penalty in (0.0, 1.0, 2.0):
                    for early_stopping in (True, False, "never"):
                        with torch.no_grad():
                            out = model.generate(torch.tensor([prompt]), num_beams=beams, max_new_tokens=MAX_NEW,
                                                 length_penalty=length_penalty, early_stopping=early_stopping,
                                                 eos_token_id=eos, pad_token_id=eos, do_sample=False,
                                                 num_return_sequences=beams, output_scores=True,
                                                 return_dict_in_generate=True)
                        sequences = []
                        for row in out.sequences[:, len(prompt):].tolist():
                            sequences.append(row[: row.index(eos) + 1] if eos in row else row)
                        if eos_kind == "never":
                            assert all(eos not in s for s in sequences)
                        cases.append({"prompt": prompt, "eos": eos, "eos_kind": eos_kind, "num_beams": beams,
                                      "length_penalty": length_penalty, "early_stopping": early_stopping,
                                      "max_new_tokens": MAX_NEW, "sequences": sequences,
                                      "scores": out.sequences_scores.tolist()})
    OUT.write_text(json.dumps({"transformers": transformers.__version__, "cases": cases}, indent=1) + "\n")
    finished = sum(any(c["eos"] in s for s in c["sequences"]) for c in cases)
    print(f"{len(cases)} cases, {finished} with finished hypotheses -> {OUT}")


if __name__ == "__main__":
    main()
