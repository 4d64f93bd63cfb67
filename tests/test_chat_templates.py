"""Chat templates render exactly as transformers' apply_chat_template(tokenize=False) renders them.

tests/fixtures/chat/renders.json was written by scripts/fixtures/make_chat_fixtures.py with transformers itself: published
templates (ChatML, Qwen2, Llama 2 with <<SYS>> and raise_exception, Llama 3, Zephyr), templates using namespace(),
loop controls, tojson, a refused namespace attribute and a syntax error, and npllm's own built-ins, each over several
conversations with and without the generation prompt.
"""

import _thread
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from npllm.chat import (BUILTIN_TEMPLATES, TemplateLimits, find_chat_template, render_chat_template,
                        resolve_chat_template, select_template)
from npllm.chat.templates import ChatTemplateLimitError
from npllm.errors import ChatTemplateError, SettingError
from tests_support import REPO, template_worker_of, template_workers, wait_gone

FIXTURE = json.loads((Path(__file__).parent / "fixtures/chat/renders.json").read_text(encoding="utf-8"))
CASES = FIXTURE["cases"]


def case_id(case):
    return f"{case['template']}-{case['conversation']}-{'gen' if case['add_generation_prompt'] else 'nogen'}"


def render_case(case):
    return render_chat_template(FIXTURE["templates"][case["template"]], FIXTURE["conversations"][case["conversation"]],
                                add_generation_prompt=case["add_generation_prompt"], bos_token=case["bos_token"],
                                eos_token=case["eos_token"])


@pytest.mark.parametrize("case", [c for c in CASES if "rendered" in c], ids=case_id)
def test_render_equals_transformers(case):
    assert render_case(case) == case["rendered"]


@pytest.mark.parametrize("case", [c for c in CASES if "error" in c], ids=case_id)
def test_template_errors_are_npllm_errors_with_the_templates_message(case):
    with pytest.raises(ChatTemplateError) as raised:
        render_case(case)
    assert isinstance(raised.value, ValueError)
    if case["error"] == "TemplateError":  # raise_exception(msg): the template's own words reach the user
        assert case["message"] in str(raised.value)


def test_fixture_covers_what_the_issue_names():
    errors = {c["template"] for c in CASES if "error" in c}
    assert {"heldout_llama2", "heldout_underscore", "heldout_syntax_error", "heldout_no_system"} <= errors
    rendered = {c["template"] for c in CASES if "rendered" in c}
    for family in ("chatml", "llama2", "llama3", "zephyr", "namespace", "controls"):
        assert f"heldout_{family}" in rendered
    for name in BUILTIN_TEMPLATES:
        assert f"builtin_{name}" in rendered
        assert FIXTURE["templates"][f"builtin_{name}"] == BUILTIN_TEMPLATES[name], "fixture is stale: rerun the script"


@pytest.mark.parametrize("name", ["chatml", "llama2", "llama3", "zephyr"])
def test_builtins_render_like_the_published_templates(name):
    """Each built-in gives its family's published layout on every conversation both accept."""
    for case in CASES:
        if case["template"] == f"heldout_{name}" and "rendered" in case:
            builtin = dict(case, template=f"builtin_{name}")
            assert render_case(builtin) == case["rendered"], case_id(case)


# The families' published layouts (their model cards), written out: system + user + assistant + user, with the
# tokenizer's own BOS/EOS pieces. (prompt without the generation prompt, what add_generation_prompt appends)
PIRATE = [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Arr! Hello."}, {"role": "user", "content": "Tell me a story"}]
FAMILY_LAYOUTS = {
    "gemma": (("<bos>", "<eos>"),
              "<bos><start_of_turn>user\nYou are a pirate.\n\nHi<end_of_turn>\n"
              "<start_of_turn>model\nArr! Hello.<end_of_turn>\n"
              "<start_of_turn>user\nTell me a story<end_of_turn>\n",
              "<start_of_turn>model\n"),
    "phi3": (("<s>", "<|endoftext|>"),
             "<|system|>\nYou are a pirate.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nArr! Hello.<|end|>\n"
             "<|user|>\nTell me a story<|end|>\n",
             "<|assistant|>\n"),
    "granite": (("<|end_of_text|>", "<|end_of_text|>"),
                "<|start_of_role|>system<|end_of_role|>You are a pirate.<|end_of_text|>\n"
                "<|start_of_role|>user<|end_of_role|>Hi<|end_of_text|>\n"
                "<|start_of_role|>assistant<|end_of_role|>Arr! Hello.<|end_of_text|>\n"
                "<|start_of_role|>user<|end_of_role|>Tell me a story<|end_of_text|>\n",
                "<|start_of_role|>assistant<|end_of_role|>"),
    "olmo2": (("<|endoftext|>", "<|endoftext|>"),
              "<|endoftext|><|system|>\nYou are a pirate.\n<|user|>\nHi\n<|assistant|>\nArr! Hello.<|endoftext|>\n"
              "<|user|>\nTell me a story\n",
              "<|assistant|>\n"),
    "mistral": (("<s>", "</s>"),
                "<s> [INST] You are a pirate.\n\nHi [/INST] Arr! Hello.</s> [INST] Tell me a story [/INST]",
                ""),  # [/INST] is where the model takes over: no generation prompt of its own
    "chatml": (("<|endoftext|>", "<|im_end|>"),  # Qwen2, Qwen3, Qwen3-MoE
               "<|im_start|>system\nYou are a pirate.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
               "<|im_start|>assistant\nArr! Hello.<|im_end|>\n<|im_start|>user\nTell me a story<|im_end|>\n",
               "<|im_start|>assistant\n"),
}


@pytest.mark.parametrize("name", FAMILY_LAYOUTS)
def test_family_builtins_write_the_published_layout(name):
    (bos, eos), layout, generation_prompt = FAMILY_LAYOUTS[name]
    for add in (False, True):
        text = render_chat_template(BUILTIN_TEMPLATES[name], PIRATE, add_generation_prompt=add, bos_token=bos,
                                    eos_token=eos)
        assert text == layout + (generation_prompt if add else "")


def test_family_builtins_without_a_system_message():
    """No system message: nothing is folded into the first user turn, and nothing stands in for it."""
    rest = PIRATE[1:]
    assert render_chat_template(BUILTIN_TEMPLATES["gemma"], rest, True, "<bos>", "<eos>") == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nArr! Hello.<end_of_turn>\n"
        "<start_of_turn>user\nTell me a story<end_of_turn>\n<start_of_turn>model\n")
    assert render_chat_template(BUILTIN_TEMPLATES["mistral"], rest, True, "<s>", "</s>") == (
        "<s> [INST] Hi [/INST] Arr! Hello.</s> [INST] Tell me a story [/INST]")
    assert render_chat_template(BUILTIN_TEMPLATES["olmo2"], rest[:2], False, "<|endoftext|>", "<|endoftext|>") == (
        "<|endoftext|><|user|>\nHi\n<|assistant|>\nArr! Hello.<|endoftext|>")  # the last reply: no newline


@pytest.mark.parametrize("name", ["gemma", "mistral"])
def test_family_builtins_that_need_alternating_roles_say_so(name):
    with pytest.raises(ChatTemplateError, match="alternate"):
        render_chat_template(BUILTIN_TEMPLATES[name], [{"role": "user", "content": "a"}, {"role": "user",
                                                                                         "content": "b"}])


def test_a_model_without_a_template_is_told_the_builtin_of_its_architecture():
    for arch, name in (("gemma2", "gemma"), ("gemma3_text", "gemma"), ("phi3", "phi3"), ("granite", "granite"),
                       ("olmo2", "olmo2"), ("mixtral", "mistral"), ("qwen3_moe", "chatml"),
                       ("granitemoe", "granite"), ("llama2c", "llama2")):
        with pytest.raises(ChatTemplateError, match=f"--chat-template {name} "):
            resolve_chat_template(None, None, arch)
    with pytest.raises(ChatTemplateError) as raised:  # Llama 2 and Llama 3 chat differ: no guess
        resolve_chat_template(None, None, "llama")
    assert "--chat-template NAME|FILE" in str(raised.value)
    assert resolve_chat_template(None, "mine", "gemma2") == "mine"  # a shipped template is used as it is


def test_empty_and_malformed_conversations():
    for bad in ([], "hello", {"role": "user"}, ["hello"], None):
        with pytest.raises(ChatTemplateError):
            render_chat_template(BUILTIN_TEMPLATES["chatml"], bad)
    with pytest.raises(ChatTemplateError, match="string"):
        render_chat_template(None, [{"role": "user", "content": "x"}])


def test_messages_are_not_mutated_and_unset_tokens_stay_undefined():
    messages = [{"role": "user", "content": "x", "name": None}]
    snapshot = json.dumps(messages)
    text = render_chat_template("{{ bos_token }}|{{ eos_token is defined }}|{{ messages[0] }}", messages)
    assert text == "|False|{'role': 'user', 'content': 'x'}"
    assert json.dumps(messages) == snapshot


def test_strftime_now_and_extra_variables():
    text = render_chat_template("{{ strftime_now('%Y') }} {{ date_string }}", [{"role": "user", "content": ""}],
                                date_string="26 Jul 2024")
    year, date = text.split(" ", 1)
    assert year in {str(datetime.now().year), str(datetime.now().year - 1)} and date == "26 Jul 2024"


def test_sandbox_refuses_python_internals():
    for template in ("{{ messages.__class__.__mro__ }}", "{{ ''.__class__.__subclasses__() }}",
                     "{% set x = messages.append(1) %}"):
        with pytest.raises(ChatTemplateError):
            render_chat_template(template, [{"role": "user", "content": "x"}])


def test_tojson_is_not_html_escaped():
    text = render_chat_template("{{ messages[0]['content'] | tojson }}", [{"role": "user", "content": "<a & 'b'> é"}])
    assert text == json.dumps("<a & 'b'> é", ensure_ascii=False)


def test_select_template_from_a_named_list():
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    assert select_template(named) == "D" and select_template(named, "tool_use") == "T"
    assert select_template("S") == "S"
    with pytest.raises(ChatTemplateError, match="rag"):
        select_template(named[1:], "rag")
    with pytest.raises(ChatTemplateError):
        select_template(named[1:])
    with pytest.raises(ChatTemplateError):
        select_template(42)


def test_find_chat_template_in_hf_folders_and_gguf(tmp_path):
    assert find_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "default",
                                                                                   "template": "X"}]}))
    assert find_chat_template(tmp_path) == "X"
    assert find_chat_template(tmp_path / "model.safetensors") == "X"  # a file inside the folder
    (tmp_path / "chat_template.jinja").write_text("J")
    assert find_chat_template(tmp_path) == "J"  # the separate file wins, as in newer checkpoints

    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_chat_template("G {{ messages[0]['content'] }}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert find_chat_template(path) == "G {{ messages[0]['content'] }}"


def test_resolve_chat_template(tmp_path):
    assert resolve_chat_template("chatml", None) == BUILTIN_TEMPLATES["chatml"]
    assert resolve_chat_template(None, "mine") == "mine"
    assert resolve_chat_template("zephyr", "mine") == BUILTIN_TEMPLATES["zephyr"]  # asked for beats shipped
    with pytest.raises(ChatTemplateError, match="--chat-template"):
        resolve_chat_template(None, None)
    with pytest.raises(ChatTemplateError, match="neither"):
        resolve_chat_template("no-such-template", None)
    (tmp_path / "t.jinja").write_text("T")
    assert resolve_chat_template(str(tmp_path / "t.jinja"), None) == "T"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "C"}))
    assert resolve_chat_template(str(tmp_path / "tokenizer_config.json"), None) == "C"
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ChatTemplateError):
        resolve_chat_template(str(tmp_path / "bad.json"), None)


# ----------------------------------------------------------------------------------------------------------------
# A template is code from a model file: every failure is one ChatTemplateError naming it, and a render is bounded
# ----------------------------------------------------------------------------------------------------------------

HI = [{"role": "user", "content": "hi"}]
NAME = "the chat template bad.jinja"
HANG = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("template, says", [
    ("{{ 1/0 }}", "division by zero"),
    ("{{ nothing | tojson }}", "undefined"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed"),
    ("{% include 'other.jinja' %}", "cannot include"),
    ("{% import 'other.jinja' as o %}", "cannot include"),
    ("{% extends 'other.jinja' %}", "cannot include"),
    ("{{ range(10**10) | length }}", "range"),
    ("{{ 'a' + 1 }}", "concatenate"),
    ("{{ " + "7" * 100_000 + " }}", "does not compile"),
    ("{{ strftime_now(5) }}", "format string"),
    ("{{ 'some words' | wordwrap(0) }}", "width"),
])
def test_template_errors_that_are_not_jinjas_are_chat_template_errors(template, says):
    with pytest.raises(ChatTemplateError) as raised:
        render_chat_template(template, HI, template_name=NAME)
    assert str(raised.value).startswith(NAME + " ") and says in str(raised.value)


@pytest.mark.parametrize("template", [
    "{{ 'a' * 10**9 }}", "{{ ['a'] * 10**9 }}", "{{ 10 ** 100000 }}", "{{ (10**4000) * (10**4000) }}",
    "{{ 'x' | indent(10**9) }}", "{{ 'x' | center(10**9) }}", "{{ 'x'.center(10**9) }}", "{{ 'x'.zfill(10**9) }}",
    "{{ messages | tojson(indent=10**9) }}", "{{ ('a' * 100000).replace('', 'b' * 100000) }}",
    "{{ ('a' * 100000) | replace('', 'b' * 100000) }}", "{{ ('a' * 100000).join(['b' * 100000] * 100000) }}",
    "{{ (['b' * 100000] * 100000) | join }}", "{{ '%1000000000d' | format(1) }}", "{{ '%1000000000d' % 1 }}",
    "{{ '%*d' % (10**9, 1) }}", "{{ '{:>1000000000}'.format(1) }}", "{{ '{:{}}'.format(1, 10**9) }}",
    "{{ ('\t' * 100000).expandtabs(100000) }}", "{{ (range(10) | list) | slice(10**9) | list }}",
    "{% set ns = namespace(x=['a' * 1000]) %}{% for i in range(40) %}{% set ns.x = ns.x + ns.x %}{% endfor %}",
    "{{ lipsum(10**9) }}",
])
def test_guards_refuse_a_huge_result_before_making_it(template):
    """Each would take seconds and gigabytes; the guard refuses it at once (a generous deadline: not what stops it)."""
    started = time.monotonic()
    with pytest.raises(ChatTemplateLimitError, match="went over a limit") as raised:
        render_chat_template(template, HI, template_name=NAME, limits=TemplateLimits(seconds=60))
    assert str(raised.value).startswith(NAME) and time.monotonic() - started < 10


def test_a_runaway_template_is_stopped_at_its_deadline_and_the_next_render_works():
    started = time.monotonic()
    with pytest.raises(ChatTemplateLimitError, match="did not finish within 1 s") as raised:
        render_chat_template(HANG, HI, template_name=NAME, limits=TemplateLimits(seconds=1))
    assert str(raised.value).startswith(NAME) and time.monotonic() - started < 5
    assert render_chat_template(BUILTIN_TEMPLATES["chatml"], HI) == "<|im_start|>user\nhi<|im_end|>\n"


def test_the_output_cap_and_the_memory_limit():
    many = "{% for i in range(100000) %}{% for j in range(100000) %}0123456789{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateLimitError, match="wrote more than 1,000 characters"):
        render_chat_template(many, HI, limits=TemplateLimits(max_chars=1000))
    assert len(render_chat_template("{{ 'x' * 1000 }}", HI, limits=TemplateLimits(max_chars=1000))) == 1000
    # 10,000 references to one 3 MB string pass the guards; printing the list would make 30 GB
    huge = "{% set x = [['a' * 3000000] * 100] * 100 %}{{ x }}"
    with pytest.raises(ChatTemplateLimitError, match="64 MiB of memory"):
        render_chat_template(huge, HI, limits=TemplateLimits(seconds=60, memory_mib=64))


def test_limits_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("NPLLM_TEMPLATE_TIMEOUT", "1.5")
    monkeypatch.setenv("NPLLM_TEMPLATE_MAX_CHARS", "100")
    assert TemplateLimits.from_environment() == TemplateLimits(seconds=1.5, max_chars=100)
    with pytest.raises(ChatTemplateLimitError, match="wrote more than 100 characters"):
        render_chat_template("{{ 'x' * 60 }}{{ 'y' * 60 }}", HI)
    for variable, bad in (("NPLLM_TEMPLATE_TIMEOUT", "soon"), ("NPLLM_TEMPLATE_MAX_CHARS", "-1"),
                          ("NPLLM_TEMPLATE_MEMORY_MIB", "1.5")):
        monkeypatch.setenv(variable, bad)
        with pytest.raises(SettingError, match=variable):
            TemplateLimits.from_environment()
        monkeypatch.delenv(variable)


LIMIT_VARIABLES = ("NPLLM_TEMPLATE_TIMEOUT", "NPLLM_TEMPLATE_MAX_CHARS", "NPLLM_TEMPLATE_MEMORY_MIB")


@pytest.mark.parametrize("variable", LIMIT_VARIABLES)
@pytest.mark.parametrize("value", ["1e300", "1e20", "100000000000000000000", "nan", "inf", "-1", "0", "abc", "1e-400"])
def test_template_limits_out_of_range_are_refused_when_read_naming_variable_value_and_range(monkeypatch, variable,
                                                                                          value):
    """1e300 seconds and 1e20 MiB were accepted, then failed every render (the worker's alarm and address-space
    limit overflowed)."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingError, match=rf"{variable} must be a (whole )?number .*(to|<=) [0-9,]+, got '{value}'"):
        TemplateLimits.from_environment()


@pytest.mark.parametrize("fields", [{"seconds": 1e300}, {"seconds": math.nan}, {"memory_mib": 1 << 40},
                                    {"max_chars": 1 << 31}, {"max_chars": 10.5}, {"seconds": 0}])
def test_template_limits_given_in_code_have_the_same_ranges(fields):
    with pytest.raises(SettingError, match=f"template limit {next(iter(fields))} must be"):
        TemplateLimits(**fields)


def test_limits_at_their_maxima_are_accepted(monkeypatch):
    for variable, value in zip(LIMIT_VARIABLES, ("3600", str(1 << 30), str(1 << 20))):
        monkeypatch.setenv(variable, value)
    assert TemplateLimits.from_environment() == TemplateLimits(3600.0, 1 << 30, 1 << 20)


@pytest.mark.parametrize("command", [["chat"], ["serve", "--port", "0"],
                                     ["batch", "-i", "in.jsonl", "-o", "out.jsonl"]])
def test_a_bad_limit_variable_stops_chat_serve_and_batch_before_the_model_loads(monkeypatch, capsys, command):
    from npllm.cli import main

    monkeypatch.setenv("NPLLM_TEMPLATE_TIMEOUT", "1e300")
    assert main([*command, "--model", "no-such-model-anywhere"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["npllm: error: NPLLM_TEMPLATE_TIMEOUT must be a number > 0 and <= 3,600, got '1e300'"]


def test_a_normal_render_stays_fast():
    """The server renders once per chat request: a ten-message ChatML conversation takes well under a millisecond
    in the worker (0.1 ms measured); a worker started per render would take ~50 ms."""
    messages = [{"role": ("user", "assistant")[i % 2], "content": "Tell me a story about a cat. " * 5}
                for i in range(10)]
    render_chat_template(BUILTIN_TEMPLATES["chatml"], messages)  # the worker starts
    times = []
    for _ in range(30):
        started = time.perf_counter()
        render_chat_template(BUILTIN_TEMPLATES["chatml"], messages, add_generation_prompt=True)
        times.append(time.perf_counter() - started)
    assert sorted(times)[len(times) // 2] < 0.02


def test_ctrl_c_during_a_render_stops_it():
    timer = threading.Timer(0.5, _thread.interrupt_main)
    timer.start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        render_chat_template(HANG, HI, limits=TemplateLimits(seconds=60))
    assert time.monotonic() - started < 5
    assert render_chat_template("{{ messages[0]['content'] }}", HI) == "hi"


def test_a_worker_does_not_outlive_its_parent():
    """The parent killed in the middle of a render (SIGKILL: nothing of it runs): its worker exits too, long before
    the render's own deadline."""
    code = ("from npllm.chat import render_chat_template, TemplateLimits\n"
            f"render_chat_template({HANG!r}, [{{'role': 'user', 'content': 'x'}}], limits=TemplateLimits(seconds=120))")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    try:
        worker = template_worker_of(parent.pid, 60)
        time.sleep(0.3)  # rendering
        parent.kill()
        parent.wait()
        assert wait_gone(worker, 10)
    finally:
        parent.kill()
        parent.wait()


def dead(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie its parent has not reaped yet counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.mark.parametrize("wait_for_death", [True, False])
def test_a_worker_killed_while_idle_is_replaced_for_the_next_render(wait_for_death):
    """The OOM killer may end an idle worker (SIGKILL): the next render starts a new one, unseen by the caller,
    whether the worker is already gone when the request is sent or dies as it arrives."""
    assert render_chat_template("{{ messages[0]['content'] }}", HI) == "hi"  # a worker is now idle
    workers = template_workers(os.getpid())
    assert workers
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while wait_for_death and not all(map(dead, workers)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert render_chat_template("{{ messages[0]['content'] }}!", HI) == "hi!"
    assert render_chat_template("{{ messages[0]['content'] }}?", HI) == "hi?"


def test_a_worker_killed_during_its_render_fails_that_render_clearly_and_the_next_works():
    """What ends the worker while it renders may be the template's doing: that render fails (it is not run again),
    and the next one gets a new worker."""
    render_chat_template("{{ 1 }}", HI)
    threading.Timer(0.5, lambda: [os.kill(pid, signal.SIGKILL) for pid in template_workers(os.getpid())]).start()
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match=f"{NAME} stopped its worker process \\(killed by signal 9\\)"):
        render_chat_template(HANG, HI, template_name=NAME, limits=TemplateLimits(seconds=60))
    assert time.monotonic() - started < 10
    assert render_chat_template("{{ messages[0]['content'] }}", HI) == "hi"
