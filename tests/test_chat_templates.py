"""Chat templates render exactly as transformers' apply_chat_template(tokenize=False) renders them.

tests/fixtures/chat/renders.json was written by scripts/make_chat_fixtures.py with transformers itself: published
templates (ChatML, Qwen2, Llama 2 with <<SYS>> and raise_exception, Llama 3, Zephyr), templates using namespace(),
loop controls, tojson, a refused namespace attribute and a syntax error, and npllm's own built-ins, each over several
conversations with and without the generation prompt.
"""

import json
from datetime import datetime
from pathlib import Path

import pytest

from npllm.chat import (BUILTIN_TEMPLATES, find_chat_template, render_chat_template, resolve_chat_template,
                        select_template)
from npllm.errors import ChatTemplateError

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
