"""Time to first token of each turn of a chat, with the cache kept between turns and without it.

    python scripts/bench/bench_chat.py [--model stories260K] [--template chatml] [--reply 24] [--repeat 3] [--json]

One conversation grows turn by turn (user messages "Tell me about friend number N.", greedy replies of up to
--reply tokens) until the next turn no longer fits the context. Each turn is answered twice from the same messages:
by the kept ChatSession, whose Context runs only the tokens after the common prefix with its cache, and by a fresh
ChatSession that runs the whole conversation (each the median of --repeat runs; the kept session's runs each start
from the cache as the previous turn left it). Reported per turn: the conversation's
tokens, the tokens each prefilled, and each one's time to first token (prefill + first draw).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import npllm  # noqa: E402
from npllm.chat.session import ChatSession  # noqa: E402
from npllm.errors import GenerationError  # noqa: E402


def first_token_ms(session, messages, reply: int) -> tuple[float, int, str]:
    """(ms to the first drawn token, tokens prefilled for it, the whole reply) of one turn on `session`."""
    marks = []
    before = session.context.prefilled
    start = time.perf_counter()

    def on_step(step):
        if not marks:
            marks.append((time.perf_counter(), session.context.prefilled - before))

    text = "".join(session.stream(messages, reply, temperature=0.0, on_step=on_step))
    at, prefilled = marks[0]
    return 1e3 * (at - start), prefilled, text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="stories260K")
    parser.add_argument("--template", default="chatml")
    parser.add_argument("--reply", type=int, default=24)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    llm = npllm.load(args.model)
    first_token_ms(ChatSession(llm, args.template), [{"role": "user", "content": "Hi"}], 4)  # compiled, warm
    kept = ChatSession(llm, args.template, system="You are a storyteller.")
    messages = list(kept.messages)
    rows = []
    for turn in range(1, 1000):
        messages.append({"role": "user", "content": f"Tell me about friend number {turn}."})
        held = list(kept.context.tokens)
        try:
            runs = []
            for _ in range(args.repeat):  # each run starts from the cache as the previous turn left it
                if held:
                    kept.context.prefill(held)
                else:
                    kept.context.reset()
                runs.append(first_token_ms(kept, messages, args.reply))
        except GenerationError:
            break  # the conversation no longer fits the context
        ms, prefilled, reply = statistics.median(r[0] for r in runs), runs[0][1], runs[0][2]
        fresh = [first_token_ms(ChatSession(llm, args.template, system="You are a storyteller."), messages, args.reply) for _ in range(args.repeat)]
        fresh_ms = statistics.median(f[0] for f in fresh)
        tokens = len(kept.prompt_ids(messages))
        rows.append({"turn": turn, "conversation_tokens": tokens, "prefilled_kept": prefilled,
                     "ttft_kept_ms": round(ms, 2), "prefilled_fresh": fresh[0][1], "ttft_fresh_ms": round(fresh_ms, 2)})
        messages.append({"role": "assistant", "content": reply})
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"{args.model}, template {args.template}, greedy replies of <= {args.reply} tokens, context "
          f"{llm.config.max_seq_len}")
    print("turn  conversation  prefilled(kept)  TTFT kept ms  prefilled(fresh)  TTFT fresh ms")
    for r in rows:
        print(f"{r['turn']:4d}  {r['conversation_tokens']:12d}  {r['prefilled_kept']:15d}  {r['ttft_kept_ms']:12.2f}  "
              f"{r['prefilled_fresh']:16d}  {r['ttft_fresh_ms']:13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
