"""LLM.chat and ChatSession: the template's prompt, replies equal to plain generation, the cache reused across
turns (equal to recomputation, fewer tokens run), the end of turn, /save and /load; `npllm chat` as a script."""

import copy
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import npllm
from npllm.chat.session import ChatSession, ConversationFull, turn_end
from npllm.chat.templates import BUILTIN_TEMPLATES
from npllm.errors import ChatTemplateError, GenerationError
from npllm.generate import generate_ids
from npllm.sampling import SamplingParams
from tests_support import COMPILE_TIMEOUT, template_worker_of, wait_gone

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def llm(stories260k):
    return npllm.load(stories260k)


def test_turn_end_of_the_builtin_templates():
    ends = {name: turn_end(t, "<s>", "</s>") for name, t in BUILTIN_TEMPLATES.items()}
    assert ends == {"llama2": "</s>", "llama3": "<|eot_id|>", "chatml": "<|im_end|>", "zephyr": "</s>",
                    "mistral": "</s>", "gemma": "<end_of_turn>", "phi3": "<|end|>", "granite": "<|end_of_text|>",
                    "olmo2": "</s>"}


def test_prompt_is_the_rendered_template_and_specials_become_ids(llm):
    session = ChatSession(llm, "llama2", system="Be brief.")
    ids = session.prompt_ids(session.messages + HI)
    assert ids[0] == llm.tokenizer.bos_id and ids.count(llm.tokenizer.bos_id) == 1  # "<s>" is BOS, not 3 letters
    assert llm.tokenizer.decode(ids) == "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]"
    chatml = ChatSession(llm, "chatml")
    assert llm.tokenizer.decode(chatml.prompt_ids(HI)) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_a_reply_is_plain_generation_from_the_rendered_prompt(llm):
    session = ChatSession(llm, "chatml")
    reply = llm.chat(HI, chat_template="chatml", max_new_tokens=40, temperature=0.0)
    ids = list(generate_ids(llm.model, session.prompt_ids(HI), 40, SamplingParams(temperature=0.0)))
    assert reply == llm.tokenizer.decode(ids) and reply


def test_the_cache_survives_turns_and_equals_recomputation(llm):
    """Turn 3 of a conversation: the reused cache runs only the tokens after the common prefix, and the greedy
    reply equals one computed on a fresh cache."""
    session = ChatSession(llm, "chatml", system="Tell stories.")
    for text in ("Hi", "Tell me a story"):
        "".join(session.send(text, 30, temperature=0.0))
    messages = session.messages + [{"role": "user", "content": "Another one"}]
    prompt = session.prompt_ids(messages)
    held = list(session.context.tokens)
    before = session.context.prefilled
    reused = "".join(session.stream(messages, 30, temperature=0.0))
    from npllm.context import common_prefix

    shared = common_prefix(held, prompt)
    assert shared > len(prompt) // 2  # most of the conversation was in the cache
    fed_by_reply = session.context.prefilled - before - (len(prompt) - shared)
    assert 0 <= fed_by_reply < 30  # the rest: the reply's tokens fed back, the last one never
    fresh = ChatSession(llm, "chatml").stream(messages, 30, temperature=0.0)
    assert reused == "".join(fresh)


def test_the_end_of_turn_text_ends_the_reply(llm):
    """A template whose turns end with "." stops the reply at the model's first period."""
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}.\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    session = ChatSession(llm, template_file(template))
    assert session.end_of_turn == "."
    reply = "".join(session.stream(HI, 200, temperature=0.0))
    ids = list(generate_ids(llm.model, session.prompt_ids(HI), 200, SamplingParams(temperature=0.0)))
    whole = llm.tokenizer.decode(ids)
    assert "." in whole and reply == whole[:whole.index(".")]


def template_file(text, _n=[0]):
    import tempfile

    _n[0] += 1
    path = os.path.join(tempfile.mkdtemp(), f"t{_n[0]}.jinja")
    with open(path, "w") as f:
        f.write(text)
    return path


def test_save_load_reset_and_system(llm, tmp_path):
    session = ChatSession(llm, "chatml", system="S1")
    "".join(session.send("Hi", 5, temperature=0.0))
    session.save(tmp_path / "c.json")
    saved = json.loads((tmp_path / "c.json").read_text())
    assert [m["role"] for m in saved] == ["system", "user", "assistant"]
    other = ChatSession(llm, "chatml")
    other.load(tmp_path / "c.json")
    assert other.messages == saved and other.system == "S1"
    other.set_system("S2")
    assert other.messages[0] == {"role": "system", "content": "S2"} and len(other.messages) == 3
    other.reset()
    assert other.messages == [{"role": "system", "content": "S2"}]
    (tmp_path / "bad.json").write_text('[{"role": "wizard", "content": "x"}]')
    with pytest.raises(GenerationError, match="role"):
        other.load(tmp_path / "bad.json")


def test_a_model_without_a_template_needs_one(llm):
    with pytest.raises(ChatTemplateError, match="--chat-template"):
        llm.chat(HI)


def test_the_no_template_error_names_the_builtin_of_the_models_architecture(llm):
    """A model that ships no template is told the built-in written in its architecture's layout."""
    model = copy.copy(llm.model)
    model.config = dataclasses.replace(llm.config, arch="gemma2")
    with pytest.raises(ChatTemplateError, match="--chat-template gemma "):
        npllm.LLM(model, llm.tokenizer, llm.source).chat(HI)


def test_a_conversation_past_the_context_is_refused_under_error(llm):
    long = [{"role": "user", "content": "Once upon a time " * 200}]
    with pytest.raises(GenerationError, match="context"):
        llm.chat(long, chat_template="chatml")
    assert llm.chat(long, chat_template="chatml", context_policy="truncate", max_new_tokens=5, temperature=0.0)


def greedy_reply(llm, session, messages, max_new_tokens: int) -> str:
    """The assistant's greedy reply to `messages` computed without the session's cache or decode loop: every step
    recomputes the whole sequence's logits on the NumPy reference (no KV cache, no prefix reuse across turns)."""
    from npllm.generate import stop_ids

    model = npllm.load(llm.source, backend="numpy").model
    prompt, reply = session.prompt_ids(messages), []
    ends = stop_ids(model.config) | session.end_ids
    for _ in range(max_new_tokens):
        token = int(np.argmax(model.logits(prompt + reply)[-1]))
        if token in ends:
            break
        reply.append(token)
    text = llm.tokenizer.decode(reply)
    return text.split(session.end_of_turn)[0] if session.end_of_turn else text


def test_npllm_chat_answers_one_turn_per_line(stories260k, llm):
    """The acceptance script: two lines on stdin, two replies, status 0; a command on the way. Each reply is the
    one a plain greedy loop over the whole conversation gives (no cache kept between turns)."""
    run = subprocess.run([sys.executable, "-m", "npllm", "chat", "--model", str(stories260k), "--chat-template",
                          "chatml", "--max-new-tokens", "40", "--temperature", "0"],
                         input="Hi\n/system You tell stories.\nTell me a story\n", capture_output=True, text=True,
                         timeout=COMPILE_TIMEOUT, cwd=REPO)
    assert run.returncode == 0, run.stderr
    turns = [line for line in run.stderr.splitlines() if "prompt tokens prefilled" in line]
    assert len(turns) == 2
    assert "system message set" in run.stderr
    session = ChatSession(llm, "chatml")
    first = greedy_reply(llm, session, [{"role": "user", "content": "Hi"}], 40)
    second = greedy_reply(llm, session, [{"role": "system", "content": "You tell stories."},
                                         {"role": "user", "content": "Hi"}, {"role": "assistant", "content": first},
                                         {"role": "user", "content": "Tell me a story"}], 40)
    assert first and second and first != second
    assert run.stdout == first + "\n" + second + "\n"


def test_npllm_chat_script_ends_at_the_first_error(stories260k, monkeypatch, capsys):
    import io

    from npllm.cli import main

    monkeypatch.setattr(sys, "stdin", io.StringIO("/nonsense\nHi\n"))
    assert main(["chat", "--model", str(stories260k), "--chat-template", "chatml"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_a_reply_cut_short_is_kept_as_far_as_it_went(llm):
    """What Ctrl-C does in `npllm chat`: the consumer stops reading, the reply so far stays in the conversation."""
    session = ChatSession(llm, "chatml")
    reply = session.send("Hi", 50, temperature=0.0)
    pieces = [next(reply) for _ in range(3)]
    reply.close()
    assert session.messages[-1] == {"role": "assistant", "content": "".join(pieces)}
    "".join(session.send("More", 5, temperature=0.0))  # and the conversation goes on from there
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]


# ----------------------------------------------------------------------------------------------------------------
# A conversation that outgrows the context; a template that fails or runs away, in `npllm chat`
# ----------------------------------------------------------------------------------------------------------------

LONG = "Once upon a time " * 200  # ~600 tokens for stories260K: more than its context of 512


def test_a_conversation_past_the_context_says_how_to_go_on(llm):
    session = ChatSession(llm, "chatml")
    with pytest.raises(ConversationFull) as raised:
        "".join(session.send(LONG))
    assert "reset()" in str(raised.value) and 'context_policy="truncate" or "sinks"' in str(raised.value)
    assert session.messages == []  # the turn that could not start is not kept
    with pytest.raises(ConversationFull, match="max_new_tokens"):
        "".join(session.send("Hi", max_new_tokens=600, ignore_eos=True))


def chat_cli(stories260k, lines: str, *flags, env=None, timeout=COMPILE_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "npllm", "chat", "--model", str(stories260k), "--backend", "numpy",
                           "--max-new-tokens", "4", *flags], input=lines, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})})


def test_npllm_chat_on_a_gemma_without_a_template_names_the_gemma_builtin_and_runs_with_it():
    """transformers' Gemma 2 fixture ships no chat template: `npllm chat` says which built-in fits, and runs with it."""
    gemma = os.path.join(REPO, "tests", "fixtures", "hf", "gemma2")
    run = chat_cli(gemma, "Hi\n")
    assert run.returncode == 2 and run.stdout == ""
    assert "ships no chat template; choose one with --chat-template gemma " in run.stderr.splitlines()[-1]
    run = chat_cli(gemma, "Hi\n", "--chat-template", "gemma", "--temperature", "0")
    assert run.returncode == 0 and run.stdout.endswith("\n"), run.stderr


def test_npllm_chat_past_the_context_names_reset_and_the_flag(stories260k):
    run = chat_cli(stories260k, f"Hi\n{LONG}\n", "--chat-template", "chatml")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("npllm: error:")]
    assert len(errors) == 1 and "/reset" in errors[0] and "--context-policy truncate|sinks" in errors[0]
    assert "context_policy=" not in run.stderr  # not the Python API's spelling
    run = chat_cli(stories260k, "Hi\n", "--chat-template", "chatml", "--ignore-eos", "--max-new-tokens", "600")
    assert run.returncode == 2 and "--max-new-tokens" in run.stderr and "/reset" in run.stderr


@pytest.mark.parametrize("template, says", [("{{ 1/0 }}", "division by zero"),
                                            ("{% include 'x.jinja' %}", "cannot include"),
                                            ("{{ 'a' * 10**9 }}", "went over a limit")])
def test_npllm_chat_with_a_failing_template_writes_one_error_line(stories260k, tmp_path, template, says):
    path = tmp_path / "bad.jinja"
    path.write_text(template)
    run = chat_cli(stories260k, "Hi\n", "--chat-template", str(path))
    assert run.returncode == 2 and run.stdout == "" and "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("npllm: error:")]
    assert len(errors) == 1 and f"the chat template {path}" in errors[0] and says in errors[0]


def test_npllm_chat_stops_a_runaway_template_at_its_deadline(stories260k, tmp_path):
    path = tmp_path / "hang.jinja"
    path.write_text("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    run = chat_cli(stories260k, "Hi\n", "--chat-template", str(path), env={"NPLLM_TEMPLATE_TIMEOUT": "1"})
    assert run.returncode == 2 and run.stdout == "" and "Traceback" not in run.stderr
    assert f"npllm: error: the chat template {path} did not finish within 1 s" in run.stderr


def test_sigterm_ends_npllm_chat_while_a_template_runs(stories260k, tmp_path):
    path = tmp_path / "hang.jinja"
    path.write_text("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    proc = subprocess.Popen([sys.executable, "-m", "npllm", "chat", "--model", str(stories260k), "--backend",
                             "numpy", "--chat-template", str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO, env={**os.environ, "NPLLM_TEMPLATE_TIMEOUT": "120"})
    try:
        worker = template_worker_of(proc.pid, 60)  # loaded, and rendering (one exchange, to find the end of turn)
        time.sleep(0.5)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == -signal.SIGTERM
        assert wait_gone(worker, 10)  # and its worker with it, long before the render's deadline
    finally:
        proc.kill()
        proc.communicate()



class EncodeSpy:
    """A tokenizer that records the length of every text it encodes (by either entry); the rest is the wrapped
    tokenizer's."""

    def __init__(self, tokenizer):
        self.tokenizer, self.encoded = tokenizer, []

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode(self, text, *args, **kwargs):
        self.encoded.append(len(text))
        return self.tokenizer.encode(text, *args, **kwargs)

    def encode_at_most(self, text, *args, **kwargs):
        self.encoded.append(len(text))
        return self.tokenizer.encode_at_most(text, *args, **kwargs)


def test_a_message_far_past_the_context_is_refused_before_it_is_encoded(llm):
    """A chat turn whose rendered conversation cannot fit the context (a 3 MB message) is refused from its bytes
    alone, as a prompt is (context.encode_prompt): ConversationFull with a lower bound, and the message never
    reaches the encoder (encoding takes seconds a megabyte). Under "truncate" it is still encoded and run. (3 MB:
    the template's own limit, NPLLM_TEMPLATE_MAX_CHARS, refuses a rendering past 4 million characters.)"""
    spy = EncodeSpy(llm.tokenizer)
    spied = npllm.LLM(llm.model, spy, llm.source)
    session = ChatSession(spied, "chatml")
    huge = "Once upon a time, there was a little girl named Lily. " * 57_000  # 3 MB
    spy.encoded.clear()
    with pytest.raises(ConversationFull, match=r"the conversation is at least \d+ tokens, more than the model's "
                                               r"context of 512: start over with reset\(\)") as raised:
        "".join(session.send(huge))
    assert raised.value.at_least and raised.value.tokens > 10 * 512 and session.messages == []
    with pytest.raises(ConversationFull):
        spied.chat([{"role": "user", "content": huge}], chat_template="chatml")
    assert max(spy.encoded, default=0) < 100, spy.encoded  # only the parts around it, if anything
    # the exact count is still what a conversation just past the context reports
    with pytest.raises(ConversationFull, match=r"the conversation is \d+ tokens"):
        "".join(session.send(LONG))
    long = [{"role": "user", "content": huge[:20_000]}]
    assert spied.chat(long, 3, chat_template="chatml", context_policy="truncate", temperature=0.0) is not None
