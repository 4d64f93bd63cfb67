"""npllm on Ray Data (npllm/ray.py), on a local cluster started here (2 CPUs, no dashboard) and shut down after:
`npllm batch --ray` writes the file the plain run writes, Predictor's rows are the same whatever the actors and
batch size, and distributed perplexity is the figure `npllm perplexity` prints. The model is the embedded
stories260K; every actor loads it once (Numba's compiled kernels come from its cache)."""

from __future__ import annotations

import json

import pytest

import npllm
from npllm.cli import main
from tests_support import under_ci

try:
    import ray
    import ray.data
except ImportError:  # the test extra installs it: CI must run these tests
    if under_ci():
        raise
    pytest.skip("ray[data] is not installed (pip install -e '.[test]')", allow_module_level=True)

import npllm.ray

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["A frog sat on a log", "Mia found a shiny key", "The old tree said", "Sam and his cat", "It was raining"]
STORY = ("Once upon a time, there was a little girl named Lily. She liked to play in the garden with her dog Max. "
         "One day, Max found a big red ball under a tree. Lily and Max played with the ball all day. When the sun "
         "went down, they were tired and happy. Lily gave Max a hug and said, \"You are my best friend.\" ")


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def npllm_cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_batch_on_ray_writes_what_the_plain_run_writes(tmp_path, capsys):
    """--ray with 2 workers and batches of 2: the same file as the plain run (input order, every result equal),
    each greedy text what `npllm generate --temperature 0` prints; a second run finds every id done."""
    rows = [{"id": i, "prompt": p, "max_tokens": 24, "temperature": 0} for i, p in enumerate(PROMPTS)]
    rows += [{"id": "s1", "prompt": "A fish", "max_tokens": 24, "temperature": 0.9, "seed": 11},
             {"id": "bad", "prompt": "x", "top_p": 0}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # what `npllm generate` prints for each prompt, before Ray starts: the cluster's own threads may print a late
    # line of theirs ("(raylet) A worker died ...", when a loaded machine is slow to stop an actor) on this
    # process's stdout at any time after it, which is Ray's and not npllm's output
    printed = [npllm_cli(capsys, "generate", row["prompt"], "--temperature", "0", "--max-new-tokens", "24")[1]
               for row in rows[:len(PROMPTS)]]
    status, out, err = npllm_cli(capsys, "batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "ray.jsonl"),
                                 "--ray", "--workers", "2", "--batch-size", "2")
    assert (status, out) == (0, "") and "6 results written" in err and "1 bad lines" in err
    status, _, _ = npllm_cli(capsys, "batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "plain.jsonl"))
    assert status == 0
    assert (tmp_path / "ray.jsonl").read_text() == (tmp_path / "plain.jsonl").read_text()
    assert json.loads((tmp_path / "ray.errors.jsonl").read_text())["line"] == 7
    results = [json.loads(line) for line in (tmp_path / "ray.jsonl").read_text().splitlines()]
    for row, result, shown in zip(rows, results[:len(PROMPTS)], printed):
        assert row["prompt"] + result["text"] + "\n" == shown
    status, _, err = npllm_cli(capsys, "batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "ray.jsonl"),
                               "--ray")
    assert status == 0 and "0 results written" in err and "6 already there" in err


def test_predictor_rows_do_not_depend_on_actors_or_batch_size():
    """Request columns through map_batches: 1 actor with batches of 4 and 2 actors with batches of 1 give the same
    rows, each the completion LLM.generate gives alone (greedy, or sampled with the row's seed)."""
    items = [{"prompt": p, "max_tokens": 16, "temperature": [0.0, 0.7][i % 2], "seed": 100 + i, "top_p": 1.0}
             for i, p in enumerate(PROMPTS)]
    runs = []
    for workers, size in ((1, 4), (2, 1)):
        out = ray.data.from_items(items).map_batches(
            npllm.ray.Predictor, fn_constructor_kwargs={"model": "stories260K"}, batch_size=size,
            compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=1)
        runs.append(sorted(out.take_all(), key=lambda r: r["prompt"]))
    assert [(r["generated_text"], list(r["tokens"])) for r in runs[0]] == \
           [(r["generated_text"], list(r["tokens"])) for r in runs[1]]
    llm = npllm.load("stories260K")
    for row in runs[0]:
        assert row["error"] == "" and row["completion_tokens"] == len(row["tokens"]) == 16
        assert row["generated_text"] == llm.generate(row["prompt"], 16, temperature=row["temperature"], top_p=1.0,
                                                     seed=row["seed"])


def test_distributed_perplexity_is_the_single_process_figure(tmp_path, capsys):
    lines = [STORY.replace("Lily", name).replace("Max", pet) for name, pet in
             (("Lily", "Max"), ("Anna", "Spot"), ("Ben", "Rex"), ("Sue", "Bo"))]
    (tmp_path / "text.txt").write_text("\n".join(lines), encoding="utf-8")
    status, printed, _ = npllm_cli(capsys, "perplexity", "--text", str(tmp_path / "text.txt"), "--ctx", "64")
    assert status == 0
    result = npllm.ray.perplexity(ray.data.from_items([{"text": t} for t in lines]), "stories260K", ctx=64,
                                  workers=2, batch=2)
    assert result.chunks >= 4
    ours = (f"PPL = {result.ppl:.4f} +/- {result.ppl_stderr:.5f} over {result.tokens} tokens in {result.chunks} "
            f"chunks of 64\n")
    assert ours == printed


def test_run_batch_takes_predictors_loading_keywords_and_refuses_others(tmp_path):
    """run_batch passes its loading keywords to every Predictor actor; one Predictor does not take is refused at the
    call, before any actor starts (else each actor would fail alone, later)."""
    paths = [tmp_path / name for name in ("in.jsonl", "out.jsonl", "errors.jsonl")]
    with pytest.raises(TypeError, match="tokenizr"):
        npllm.ray.run_batch("stories260K", *paths, tokenizr=None)
