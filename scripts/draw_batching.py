"""Draw what each batching strategy computes at each step (docs/batching.png, and the same as text).

    python scripts/draw_batching.py              # writes docs/batching.png (needs matplotlib), prints the text form
    python scripts/draw_batching.py --text       # only the text form

The drawing is made from real runs: a tiny random model (seed chosen so that the sequences end at different steps)
and the seed's workload scaled down (one 1-token prompt, three 6-token prompts, at most 5 new tokens). Every cell
is one sequence in one forward call, read from the Work log that the strategies fill in.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from npllm.batching import ContinuousEngine, Request, Work, needed_rows, ragged_generate, static_generate  # noqa: E402
from npllm.config import ModelConfig  # noqa: E402
from npllm.formats.random import random_weights  # noqa: E402
from npllm.models.reference import Transformer  # noqa: E402
from npllm.sampling import SamplingParams  # noqa: E402

PROMPTS = [[1], [1, 5, 6, 7, 8, 9], [1, 9, 8, 7, 6, 5], [1, 4, 4, 5, 5, 6]]
LATE = [1, 3, 3]  # a fifth request, submitted to the continuous engine after its second step
NAMES = "ABCDE"
GEN = 5
GREEDY = SamplingParams(temperature=0)

# What a cell means, its text form and its colour.
KINDS = {
    "prefill": ("P{n}", "#4c78a8", "prompt tokens fed in one call (n of them); the first new token is drawn"),
    "forced": ("p{n}×", "#9ecae9", "prompt tokens fed (n of them); the token drawn is thrown away: a prompt token overwrites it"),
    "prompt": ("p", "#9ecae9", "the last prompt token fed alone; the first new token drawn"),
    "decode": ("g", "#54a24b", "the last new token fed; the next one drawn"),
    "wasted": ("##", "#e45756", "fed after the output was complete: wasted"),
    "waiting": ("..", "#eeeeee", "submitted, waiting for a free slot"),
}


def demo_model() -> Transformer:
    config = ModelConfig(dim=16, hidden_dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=12, max_seq_len=32,
                         eos_ids=(2,))
    return Transformer(config, random_weights(config, seed=68, dtype=np.float64))


def classify(log, completions) -> dict[tuple[int, int], tuple[str, int]]:
    """{(step, sequence): (kind, tokens fed)} from a Work log and the completions it produced."""
    needed = {i: needed_rows(len(c.prompt), c.sampled) for i, c in completions.items()}
    cells = {}
    for step, entries in enumerate(log):
        for seq, first, n, forced in entries:
            last = first + n - 1  # position of the call's last row: it makes the prediction
            if last >= needed[seq]:
                kind = "wasted"
            elif forced:
                kind = "forced"
            elif first < len(completions[seq].prompt):
                kind = "prefill" if first == 0 or n > 1 else "prompt"
            else:
                kind = "decode"
            cells[step, seq] = (kind, n)
    return cells


def runs():
    """[(title, cells, row labels, waiting spans)] for static, ragged and continuous batching."""
    model = demo_model()
    panels = []

    work = Work(log=[])
    done = dict(enumerate(static_generate(model, PROMPTS, GEN, GREEDY, work=work)))
    labels = [f"{NAMES[i]} {len(c.prompt)}+{len(c.tokens)} {c.finish_reason}" for i, c in done.items()]
    panels.append((f"static (Meta): {work.steps} calls, {work.rows} token-positions, {work.wasted_rows} wasted; "
                   f"{work.wasted_samples} of {work.samples} draws thrown away", classify(work.log, done), labels, {}))

    work = Work(log=[])
    done = dict(enumerate(ragged_generate(model, [Request(p, GEN, GREEDY) for p in PROMPTS], work=work)))
    labels = [f"{NAMES[i]} {len(c.prompt)}+{len(c.tokens)} {c.finish_reason}" for i, c in done.items()]
    panels.append((f"ragged: {work.steps} calls, {work.rows} token-positions, nothing wasted",
                   classify(work.log, done), labels, {}))

    work = Work(log=[])
    engine = ContinuousEngine(model, slots=2, work=work)
    handles = [engine.submit(Request(p, GEN, GREEDY)) for p in PROMPTS]
    engine.step()
    engine.step()
    handles.append(engine.submit(Request(LATE, 3, GREEDY)))
    for _ in engine.run():
        pass
    done = {h.id: h.result() for h in handles}
    labels = [f"{NAMES[h.id]} {len(h.request.prompt)}+{len(h.tokens)} {h.finish_reason}, slot {h.slot}"
              for h in handles]
    waiting = {h.id: (h.submitted_at, h.started_at) for h in handles}
    panels.append((f"continuous, 2 slots (E submitted after step 2): {work.steps} calls, {work.rows} token-positions, "
                   f"nothing wasted", classify(work.log, done), labels, waiting))
    return panels


def text_form(panels) -> str:
    lines = []
    for title, cells, labels, waiting in panels:
        steps = 1 + max(step for step, _ in cells)
        lines.append(title)
        lines.append(" " * 26 + "".join(f"{s + 1:<4d}" for s in range(steps)).rstrip())
        for seq, label in enumerate(labels):
            row = []
            for step in range(steps):
                if (step, seq) in cells:
                    kind, n = cells[step, seq]
                    row.append(KINDS[kind][0].format(n=n))
                elif seq in waiting and waiting[seq][0] <= step < waiting[seq][1]:
                    row.append(KINDS["waiting"][0])
                else:
                    row.append("")
            lines.append(f"  {label:24}" + "".join(f"{c:<4}" for c in row).rstrip())
        lines.append("")
    for k, (symbol, _, meaning) in KINDS.items():
        lines.append(f"  {symbol.format(n='n'):<4} {meaning}")
    return "\n".join(lines)


def draw(panels, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    width = max(1 + max(step for step, _ in cells) for _, cells, _, _ in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.1 * len(panels) + 0.8))
    for ax, (title, cells, labels, waiting) in zip(axes, panels):
        for seq in range(len(labels)):
            if seq in waiting:
                start, end = waiting[seq]
                for step in range(start, end):
                    ax.add_patch(Rectangle((step, seq), 0.94, 0.86, color=KINDS["waiting"][1]))
        for (step, seq), (kind, n) in cells.items():
            ax.add_patch(Rectangle((step, seq), 0.94, 0.86, color=KINDS[kind][1]))
            text = KINDS[kind][0].format(n=n) if kind in ("prefill", "forced", "prompt") else ""
            ax.text(step + 0.47, seq + 0.45, text, ha="center", va="center", fontsize=8,
                    color="white" if kind == "prefill" else "black")
        ax.set_xlim(0, width)
        ax.set_ylim(len(labels), 0)
        ax.set_yticks([s + 0.43 for s in range(len(labels))], labels, fontsize=8)
        ax.set_xticks([s + 0.47 for s in range(width)], [str(s + 1) for s in range(width)], fontsize=8)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1].set_xlabel("forward call (step)", fontsize=9)
    handles = [Patch(color=KINDS[k][1], label=KINDS[k][2]) for k in KINDS]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", action="store_true", help="print the text form only")
    args = parser.parse_args()
    panels = runs()
    print(text_form(panels))
    if not args.text:
        draw(panels, REPO / "docs" / "batching.png")


if __name__ == "__main__":
    main()
