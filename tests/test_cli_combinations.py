"""Options given together: each combination either works or is refused before anything loads, with one
`npllm: error:` line, exit 2 and nothing on stdout (never silently ignored). The refusals are read off the tables
in npllm.cli.parser (GENERATE_MODES, GENERATE_NEEDS, CHAT_NEEDS, PERPLEXITY_MODES); the combinations made to work have
their own tests below."""

import io
import re

import pytest

import npllm
from npllm import cli
from npllm.cli import shared
from tests_support import load_campaign

# A non-default value for every option of each command: the refusal tests combine these.
GENERATE_VALUES = {
    "prompt": ["Once"], "model": ["--model", "other.bin"], "tokenizer": ["--tokenizer", "tok.model"],
    "backend": ["--backend", "numpy"], "threads": ["--threads", "1"], "weight_dtype": ["--weight-dtype", "float16"],
    "kv_dtype": ["--kv-dtype", "float16"], "context": ["--context", "128"], "max_new_tokens": ["--max-new-tokens", "3"],
    "temperature": ["--temperature", "0"], "top_p": ["--top-p", "0.5"], "seed": ["--seed", "1"],
    "top_k": ["--top-k", "5"], "min_p": ["--min-p", "0.1"], "typical_p": ["--typical-p", "0.5"],
    "repetition_penalty": ["--repetition-penalty", "1.2"], "presence_penalty": ["--presence-penalty", "0.5"],
    "frequency_penalty": ["--frequency-penalty", "0.5"], "no_repeat_ngram": ["--no-repeat-ngram", "3"],
    "stop": ["--stop", "."], "logprobs": ["--logprobs", "2"], "context_policy": ["--context-policy", "sinks"],
    "sinks": ["--sinks", "8"], "ignore_eos": ["--ignore-eos"], "prompt_file": ["--prompt-file", "prompts.txt"],
    "explain": ["--explain"], "json": ["--json"], "draft": ["--draft", "stories260K"],
    "draft_layers": ["--draft-layers", "2"], "num_draft": ["--num-draft", "2"], "num_beams": ["--num-beams", "3"],
    "json_schema": ["--json-schema", "schema.json"], "json_object": ["--json-object"], "regex": ["--regex", "a+"],
    "grammar": ["--grammar", "grammar.lark"],
}
CHAT_VALUES = {k: v for k, v in GENERATE_VALUES.items() if k not in
               ("prompt", "prompt_file", "explain", "json", "draft", "draft_layers", "num_draft", "num_beams")}
CHAT_VALUES.update({"system": ["--system", "Be brief."], "chat_template": ["--chat-template", "chatml"]})
PERPLEXITY_VALUES = {k: GENERATE_VALUES[k] for k in ("model", "tokenizer", "backend", "threads", "weight_dtype",
                                                     "kv_dtype", "context", "json")}
PERPLEXITY_VALUES.update({"text": ["--text", "text.txt"], "ctx": ["--ctx", "64"], "batch": ["--batch", "2"],
                          "stride": ["--stride", "32"], "kl_divergence": ["--kl-divergence", "stories260K"]})
VALUES = {"generate": GENERATE_VALUES, "chat": CHAT_VALUES, "perplexity": PERPLEXITY_VALUES}
BASE = {"generate": [], "chat": [], "perplexity": ["--text", "text.txt"]}  # perplexity's --text is required


def options_of(command: str) -> set[str]:
    """The argparse dests of a sub-command (help aside)."""
    parser = cli.build_parser()._subparsers._group_actions[0].choices[command]
    return {a.dest for a in parser._actions if a.dest != "help"}


@pytest.mark.parametrize("command", sorted(VALUES))
def test_every_option_has_a_value_to_combine(command):
    """A new option must be given a value here, so the table tests below combine it with every mode."""
    assert set(VALUES[command]) == options_of(command)


def test_the_values_differ_from_the_defaults():
    """Each value counts as given (differs from the default), or the combination would not be tested."""
    for command, values in VALUES.items():
        for dest, argv in values.items():
            args = cli.build_parser().parse_args([command, *BASE[command], *argv])
            assert dest in cli.given_options(args), (command, dest)


def refused_combinations():
    """(command, argv, dest of the option refused) for every option a mode does not take, and every option whose
    needs are not met, read off the CLI's tables."""
    cases = []
    for command, modes in (("generate", cli.GENERATE_MODES), ("perplexity", cli.PERPLEXITY_MODES)):
        values = VALUES[command]
        for mode in modes:
            for dest in values:
                if dest != mode.option and dest not in mode.takes:
                    cases.append((command, [*values[mode.option], *values[dest]], dest))
    for command, needs in (("generate", cli.GENERATE_NEEDS), ("chat", cli.CHAT_NEEDS)):
        for need in needs:
            cases.append((command, VALUES[command][need.option], need.option))
    return cases


@pytest.fixture
def nothing_loads(monkeypatch):
    """A check that comes too late would load a model: make that fail the test."""
    def loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(shared, "load_with_tokenizer", loading)  # where every command loads
    monkeypatch.setattr(npllm, "load", loading)


def refused(capsys, argv) -> str:
    """Run the CLI in-process; assert exit 2, nothing on stdout and one `npllm: error:` line; return the line."""
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("npllm: error: "), err
    return lines[0]


@pytest.mark.parametrize("command, argv, dest", refused_combinations(),
                         ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_a_combination_the_table_refuses_is_one_error_line(nothing_loads, capsys, command, argv, dest):
    line = refused(capsys, [command, *BASE[command], *argv])
    assert cli.flag(dest) in line


@pytest.mark.parametrize("argv, named", [
    # issue 41, item 11, as reported
    (["--prompt-file", "p.txt", "--num-beams", "2"], ["--prompt-file", "--num-beams"]),
    (["--prompt-file", "p.txt", "--draft", "stories260K"], ["--prompt-file", "--draft"]),
    (["--prompt-file", "p.txt", "--draft-layers", "2"], ["--prompt-file", "--draft-layers"]),
    (["Once", "--num-beams", "2", "--draft-layers", "2"], ["--num-beams", "--draft-layers"]),
    (["Once", "--num-beams", "2", "--logprobs", "3"], ["--num-beams", "--logprobs"]),
    (["Once", "--num-beams", "2", "--temperature", "0"], ["--num-beams", "--temperature"]),
    (["Once", "--num-beams", "2", "--temperature", "0.7"], ["--num-beams", "--temperature"]),
    (["Once", "--explain", "--num-beams", "2"], ["--num-beams", "--explain"]),
    # found in the audit
    (["Once", "--num-beams", "2", "--seed", "3"], ["--num-beams", "--seed"]),
    (["Once", "--num-beams", "2", "--repetition-penalty", "1.3"], ["--num-beams", "--repetition-penalty"]),
    (["Once", "--draft", "stories260K", "--draft-layers", "2"], ["--draft", "--draft-layers"]),
    (["Once", "--draft-layers", "2", "--logprobs", "1"], ["--draft-layers", "--logprobs"]),
    (["Once", "--draft-layers", "2", "--context-policy", "truncate"], ["--draft-layers", "--context-policy"]),
    (["Once", "--draft-layers", "2", "--ignore-eos"], ["--draft-layers", "--ignore-eos"]),
    (["Once", "--explain", "--stop", "."], ["--explain", "--stop"]),
    (["Once", "--explain", "--logprobs", "2"], ["--explain", "--logprobs"]),
    (["Once", "--explain", "--draft-layers", "2"], ["--explain", "--draft-layers"]),
    (["Once", "--num-draft", "2"], ["--num-draft", "--draft"]),
    (["Once", "--sinks", "8"], ["--sinks", "--context-policy sinks"]),
    (["Once", "--context-policy", "truncate", "--sinks", "8"], ["--sinks", "--context-policy sinks"]),
    (["Once", "--json"], ["--json", "--explain"]),
    (["Once", "--prompt-file", "p.txt"], ["--prompt-file", "PROMPT"]),
    (["--prompt-file", "p.txt", "--ignore-eos"], ["--prompt-file", "--ignore-eos"]),
])
def test_the_reported_combinations_are_refused(nothing_loads, capsys, argv, named):
    line = refused(capsys, ["generate", *argv])
    for name in named:
        assert name in line


@pytest.mark.parametrize("argv, named", [
    (["chat", "--sinks", "2"], ["--sinks"]),
    (["perplexity", "--text", "t.txt", "--stride", "64", "--kl-divergence", "stories260K"],
     ["--stride", "--kl-divergence"]),
    (["perplexity", "--text", "t.txt", "--stride", "64", "--batch", "4"], ["--stride", "--batch"]),
])
def test_chat_and_perplexity_combinations_are_refused(nothing_loads, capsys, argv, named):
    line = refused(capsys, argv)
    for name in named:
        assert name in line


@pytest.mark.parametrize("argv", [
    ["generate", "Once", "--num-beams", "2", "--stop", ".", "--max-new-tokens", "3", "--kv-dtype", "float16"],
    ["generate", "--prompt-file", "p.txt", "--logprobs", "2", "--stop", ".", "--temperature", "0.5", "--seed", "1"],
    ["generate", "Once", "--draft-layers", "2", "--num-draft", "3", "--stop", ".", "--top-k", "4"],
    ["generate", "Once", "--explain", "--json", "--temperature", "0.5", "--top-p", "0.8"],
    ["generate", "Once", "--context-policy", "sinks", "--sinks", "8", "--ignore-eos", "--logprobs", "2"],
    ["generate", "Once", "--num-beams", "1", "--temperature", "0.5"],  # one beam: plain generation
    ["chat", "--context-policy", "sinks", "--sinks", "8", "--logprobs", "2", "--kv-dtype", "float16"],
    ["perplexity", "--text", "t.txt", "--stride", "32", "--ctx", "64", "--json"],
    ["perplexity", "--text", "t.txt", "--kl-divergence", "stories260K", "--batch", "2"],
])
def test_combinations_that_work_pass_the_check(argv):
    """The check lets these through (they are run for real below or in their own modules)."""
    args = cli.build_parser().parse_args(argv)
    modes = {"generate": cli.GENERATE_MODES, "perplexity": cli.PERPLEXITY_MODES}.get(argv[0], ())
    needs = {"generate": cli.GENERATE_NEEDS, "chat": cli.CHAT_NEEDS}.get(argv[0], ())
    cli.check_combinations(args, modes, needs)


# --------------------------------------------------------------------------------------------------------------
# The combinations made to work


def generate(capsys, *argv):
    assert cli.main(["generate", *argv]) == 0
    return capsys.readouterr()


def logprob_lines(err: str, label: str) -> list[str]:
    return [line[len(label) + 1:] for line in err.splitlines() if line.startswith(label + " ")]


def test_prompt_file_with_logprobs_reports_each_prompts_tokens(stories260k, tmp_path, capsys):
    """--prompt-file --logprobs: the same text as without, and for prompt i the very lines `--logprobs` prints for
    that prompt alone ("[logprobs i]" instead of "[logprobs]"), the stop string cutting both at the same token."""
    prompts = ["Once upon a time", "Lily and Ben"]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n", encoding="utf-8")
    common = ["-m", str(stories260k), "--max-new-tokens", "12", "--temperature", "0.8", "--seed", "3",
              "--stop", "ing"]
    plain = generate(capsys, "--prompt-file", str(path), *common)
    reported = generate(capsys, "--prompt-file", str(path), *common, "--logprobs", "2")
    assert reported.out == plain.out
    for i, prompt in enumerate(prompts, 1):
        alone = generate(capsys, prompt, *common, "--logprobs", "2")
        lines = logprob_lines(reported.err, f"[logprobs {i}]")
        assert lines and lines == logprob_lines(alone.err, "[logprobs]")


def test_generate_on_a_list_reports_each_prompts_draws(stories260k):
    """LLM.generate([...], on_step=...) calls on_step(i, Sampled) with prompt i's tokens, as stream does alone."""
    llm = npllm.load(stories260k)
    prompts = ["Once upon a time", "The dog"]
    seen = {0: [], 1: []}
    texts = llm.generate(prompts, 10, temperature=0, logprobs=1, on_step=lambda i, s: seen[i].append(s))
    for i, prompt in enumerate(prompts):
        alone = []
        assert texts[i] == llm.generate(prompt, 10, temperature=0, logprobs=1, on_step=alone.append)
        assert [s.token_ids for s in seen[i]] == [s.token_ids for s in alone]
        assert [s.logprobs for s in seen[i]] == pytest.approx([s.logprobs for s in alone], abs=1e-5)


def second_long_word(text: str) -> str:
    """A stop string the free search writes a few words in ("little" in "there was a little girl")."""
    return [w for w in re.findall(r"\w+", text) if len(w) >= 5][1]


def test_a_stop_string_ends_a_beam_as_eos_does(stories260k):
    """LLM.beam_search(stop=...): every hypothesis ends at EOS, at the length limit, or with the token that
    completes a stop string in its text (the text of the tokens before it has none)."""
    from npllm.generate import stop_ids

    llm = npllm.load(stories260k, backend="numpy")
    ids = llm.tokenizer.encode("Once upon a time", bos=True)
    free = llm.beam_search(ids, 3, 30)
    stop = second_long_word(llm.completion_text(ids, free[0].tokens))
    found = llm.beam_search(ids, 3, 30, stop=(stop,))
    ended_by_stop = 0
    for h in found:
        tokens = list(h.tokens)
        if tokens[-1] in stop_ids(llm.config) or len(tokens) == 30:
            assert stop not in llm.completion_text(ids, tokens[:-1])
            continue
        assert stop in llm.completion_text(ids, tokens) and stop not in llm.completion_text(ids, tokens[:-1])
        assert llm.completion_text(ids, tokens, stop=(stop,)) == llm.completion_text(ids, tokens).split(stop)[0]
        ended_by_stop += 1
    assert ended_by_stop >= 1


def test_num_beams_with_stop_prints_the_best_beam_cut_before_the_stop(stories260k, capsys):
    from npllm.generate import stop_ids

    llm = npllm.load(stories260k)
    ids = llm.tokenizer.encode("Once upon a time", bos=True)
    free = generate(capsys, "Once upon a time", "-m", str(stories260k), "--num-beams", "3",
                    "--max-new-tokens", "30").out
    stop = second_long_word(free[len("Once upon a time"):])
    out = generate(capsys, "Once upon a time", "-m", str(stories260k), "--num-beams", "3", "--max-new-tokens",
                   "30", "--stop", stop).out
    best = llm.beam_search(ids, 3, 30, stop=(stop,))[0]
    tokens = [t for t in best.tokens if t not in stop_ids(llm.config)]
    assert out == llm.completion_text(ids, tokens, echo=True, stop=(stop,)) + "\n"
    assert stop not in out[len("Once upon a time"):] and out != free


def chat(monkeypatch, capsys, *argv, lines="Hi\nTell me a story\n"):
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    assert cli.main(["chat", *argv]) == 0
    return capsys.readouterr()


def test_chat_with_logprobs_reports_every_reply_token(stories260k, monkeypatch, capsys):
    common = ["-m", str(stories260k), "--chat-template", "chatml", "--temperature", "0", "--max-new-tokens", "8"]
    plain = chat(monkeypatch, capsys, *common)
    reported = chat(monkeypatch, capsys, *common, "--logprobs", "2")
    assert reported.out == plain.out and "[logprobs]" not in plain.err
    new_tokens = sum(int(n) for n in re.findall(r"(\d+) new;", reported.err))
    assert new_tokens >= 2 and len(logprob_lines(reported.err, "[logprobs]")) == new_tokens


def test_chat_honours_kv_dtype(stories260k, monkeypatch, capsys):
    loaded = []
    original = shared.load_with_tokenizer

    def load_with_tokenizer(args, **options):
        loaded.append(original(args, **options))
        return loaded[-1]

    monkeypatch.setattr(shared, "load_with_tokenizer", load_with_tokenizer)
    chat(monkeypatch, capsys, "-m", str(stories260k), "--chat-template", "chatml", "--temperature", "0",
         "--max-new-tokens", "4", "--kv-dtype", "float16", lines="Hi\n")
    assert loaded[0].model.kv_dtype == "float16"


# --------------------------------------------------------------------------------------------------------------
# The bad-input campaign's kind "combo" (scripts/bad_inputs.py), through the real command line


def test_the_campaign_reports_the_combinations_refused_or_run(tmp_path, capsys):
    """Every refused combination exits 2 with one `npllm: error:` line naming its first option, nothing on stdout;
    the ones made to work run; the summary counts them under "combo" with no problem."""
    from concurrent.futures import ThreadPoolExecutor

    campaign = load_campaign()
    (tmp_path / "files").mkdir()
    cases = campaign.combination_cases(tmp_path / "files")
    assert {c.kind for c in cases} == {"combo"} and sum(c.expect == "error" for c in cases) >= 20
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda c: campaign.run_case(c, 240, tmp_path), cases))
    for r in results:
        assert r.problems == [], (r.case.name, r.stderr_tail)
        if r.case.expect == "error":
            last = r.stderr_tail.strip().splitlines()[-1]
            assert r.status == 2 and last.startswith("npllm: error: "), (r.case.name, r.stderr_tail)
            assert r.stderr_tail.count("npllm: error:") == 1
            assert r.case.name.split()[0 if r.case.args[0] == "generate" else 1] in last, (r.case.name, last)
    assert campaign.report(results, as_json=False) == 0
    summary = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("combo")]
    refused = sum(c.expect == "error" for c in cases)
    problems = ["0"] * 7  # traceback, hang, stdout_on_error, bad_status, accepted, refused, damaged
    assert summary == [["combo", str(len(cases)), str(refused), str(len(cases) - refused), *problems]]
