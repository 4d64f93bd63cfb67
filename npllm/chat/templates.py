"""Chat templates: a conversation (a list of {"role", "content"} messages) -> the one string the model was trained on.

Instruct models answer well only inside the exact text layout they were tuned with, and Hugging Face ships that
layout as a Jinja template (tokenizer_config.json's `chat_template`, GGUF's `tokenizer.chat_template`). npllm renders
it the way transformers' `apply_chat_template(..., tokenize=False)` does, so the same template and messages give the
same string, byte for byte:

    environment   Jinja's *immutable sandbox* (a template from the internet is untrusted code), with trim_blocks
                  (a newline right after a {% tag %} is dropped) and lstrip_blocks (spaces before a tag on its line
                  are dropped), loop controls ({% break %}, {% continue %}), and `{% generation %}` accepted
    globals       raise_exception(msg) (ends the render with msg), strftime_now(fmt), namespace(...) whose
                  attributes may not start with "_"
    filters       tojson: json.dumps without HTML escaping and without ASCII escaping
    variables     messages (None-valued keys dropped), add_generation_prompt, tools, documents, bos_token,
                  eos_token (the tokenizer's special pieces; unset ones are left undefined), and any extra keyword

Templates come from model files, so a render is bounded: it runs in a worker process (npllm/chat/worker.py) with a
deadline, an output cap and a memory limit, and guards refuse the operations that would pass them
(npllm/chat/sandbox.py). Whatever goes wrong (a syntax error, raise_exception, 1/0, a guard, the deadline) ends in
one ChatTemplateError (a ValueError) whose message names the template and says what happened, the template's own
message kept.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import ChatTemplateError
from .worker import TemplateFailure, TemplateLimits, render_in_worker

# Built-in templates, for models that ship none (`--chat-template NAME`). Each writes its family's published layout.
LLAMA2 = (
    # [INST] ... [/INST] around every user turn, the system prompt folded into the first one between <<SYS>> marks,
    # each exchange closed by EOS and the next one opened by BOS. Roles must alternate user/assistant.
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = none %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% if (message['role'] == 'user') != (loop.index0 is even) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% set content = message['content'] %}"
    "{% if loop.first and system is not none %}"
    "{% set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + content %}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% else %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
LLAMA3 = (
    # BOS once, then per message a header naming the role, two newlines, the stripped content and <|eot_id|>.
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim }}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
CHATML = (
    # <|im_start|>role\ncontent<|im_end|>\n per message; no BOS.
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ZEPHYR = (
    # <|role|>\ncontent</s>\n per message.
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
MISTRAL = (
    # Mistral / Mixtral instruct: BOS once, " [INST] " ... " [/INST]" around every user turn, each reply as " " +
    # reply + EOS. No <<SYS>> block: the system prompt opens the first user turn, followed by a blank line. Roles
    # must alternate user/assistant.
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = none %}{% set turns = messages %}{% endif %}"
    "{{ bos_token }}"
    "{% for message in turns %}"
    "{% if (message['role'] == 'user') != (loop.index0 is even) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{% set prefix = system + '\\n\\n' if loop.first and system is not none else '' %}"
    "{{ ' [INST] ' + prefix + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)
GEMMA = (
    # Gemma 2 / 3: BOS once, then <start_of_turn>ROLE\ncontent<end_of_turn>\n per message, the assistant's role
    # written "model". Gemma has no system role: a system message opens the first user turn, followed by a blank
    # line. Contents are stripped; roles must alternate user/assistant.
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] | trim + '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{{ bos_token }}"
    "{% for message in turns %}"
    "{% if (message['role'] == 'user') != (loop.index0 is even) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
PHI3 = (
    # Phi-3: <|ROLE|>\ncontent<|end|>\n per message (system, user, assistant); no BOS.
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
GRANITE = (
    # Granite 3: <|start_of_role|>ROLE<|end_of_role|>content<|end_of_text|>\n per message; no BOS. (The checkpoints'
    # own templates may add a default system message and tool sections; this writes only the messages given.)
    "{% for message in messages %}"
    "{{ '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_of_role|>assistant<|end_of_role|>' }}{% endif %}"
)
OLMO2 = (
    # OLMo 2 (the Tulu 3 layout): BOS (<|endoftext|> in OLMo 2's vocabulary) once, <|ROLE|>\ncontent\n per system or
    # user message, <|assistant|>\ncontent then EOS per reply (and a newline unless it is the last message).
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\\n' + message['content'] + eos_token }}{% if not loop.last %}{{ '\\n' }}{% endif %}"
    "{% else %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
BUILTIN_TEMPLATES = {"llama2": LLAMA2, "llama3": LLAMA3, "chatml": CHATML, "zephyr": ZEPHYR, "mistral": MISTRAL,
                     "gemma": GEMMA, "phi3": PHI3, "granite": GRANITE, "olmo2": OLMO2}
# The built-in written in each architecture's (ModelConfig.arch) published layout, named when a checkpoint of that
# architecture ships no template. Llama is left out: Llama 2 and Llama 3 chat models use different layouts. A
# llama2.c checkpoint (llama2c) is named llama2: the layout llama2.c's own chat mode (`run -m chat`) writes.
ARCH_TEMPLATES = {"llama2c": "llama2", "mistral": "mistral", "mixtral": "mistral", "qwen2": "chatml", "qwen3": "chatml",
                  "qwen3_moe": "chatml", "gemma2": "gemma", "gemma3": "gemma", "gemma3_text": "gemma", "phi3": "phi3",
                  "granite": "granite", "granitemoe": "granite", "olmo2": "olmo2", "smollm3": "chatml"}


class ChatTemplateLimitError(ChatTemplateError):
    """A render stopped by a limit (its deadline, the output cap, a guard, memory) rather than its own error."""


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = False,
                         bos_token: str | None = None, eos_token: str | None = None, *,
                         template_name: str | None = None, limits: TemplateLimits | None = None, **extra: Any) -> str:
    """The text of `messages` laid out by `template`, as transformers' apply_chat_template(tokenize=False) gives it.

    add_generation_prompt: end with the header that opens an assistant turn (what a model answering needs).
    bos_token, eos_token: the tokenizer's special pieces, as text (e.g. "<s>", "</s>"); None leaves them undefined.
    template_name: how errors name the template (chat_template_name() gives one; default "the chat template").
    limits: the render's deadline, output cap and memory (default TemplateLimits.from_environment()).
    extra: further variables for the template (tools=, documents=, date_string=, ...).
    """
    name = template_name or "the chat template"
    if not isinstance(template, str):
        raise ChatTemplateError(f"a chat template is a string, got {type(template).__name__}")
    variables = {"tools": None, "documents": None, **_defined(bos_token=bos_token, eos_token=eos_token), **extra}
    variables = {key: _plain(value) for key, value in variables.items()}
    variables.update(messages=_normalized(messages), add_generation_prompt=bool(add_generation_prompt))
    try:
        return render_in_worker(template, variables, limits or TemplateLimits.from_environment())
    except TemplateFailure as e:
        raise (ChatTemplateLimitError if e.over_limit else ChatTemplateError)(f"{name} {e}") from None


def chat_template_name(spec: str | None, checkpoint: str | os.PathLike | None = None) -> str:
    """How messages name the template resolve_chat_template(spec, ...) gives: a built-in's name, the file, or the
    checkpoint that ships it."""
    if spec is None:
        return f"the chat template of {checkpoint}" if checkpoint else "the chat template"
    if spec in BUILTIN_TEMPLATES:
        return f"the built-in chat template {spec!r}"
    return f"the chat template {spec}"


def select_template(chat_template: str | list, name: str | None = None) -> str:
    """The template to use from a tokenizer_config.json `chat_template` value: a string, or a list of
    {"name", "template"} entries, of which `name` (default: "default") is taken."""
    if isinstance(chat_template, str):
        return chat_template
    if isinstance(chat_template, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                               and isinstance(t.get("template"), str) for t in chat_template):
        named = {t["name"]: t["template"] for t in chat_template}
        wanted = name or "default"
        if wanted not in named:
            raise ChatTemplateError(f"no chat template named {wanted!r}; this model has {', '.join(named)}")
        return named[wanted]
    raise ChatTemplateError("chat_template must be a string or a list of {name, template} entries, got "
                            f"{type(chat_template).__name__}")


def find_chat_template(checkpoint: str | os.PathLike) -> str | None:
    """The chat template a checkpoint ships: GGUF metadata `tokenizer.chat_template`, or beside a Hugging Face
    checkpoint chat_template.jinja, chat_template.json or tokenizer_config.json's `chat_template`. None if none."""
    path = Path(checkpoint)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from ..formats.gguf import read_gguf_file

        found = read_gguf_file(path).metadata.get("tokenizer.chat_template")
        return found if isinstance(found, str) else None
    folder = path if path.is_dir() else path.parent
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            found = _json(folder / name).get("chat_template")
            if found is not None:
                return select_template(found)
    return None


def resolve_chat_template(spec: str | None, found: str | None, arch: str | None = None) -> str:
    """The template to render with: `spec` (a built-in name or a file: .jinja/.txt as is, .json as
    tokenizer_config.json) when given, else the model's own `found` one. arch (ModelConfig.arch): when the model
    ships none, the error names the built-in written in that architecture's layout."""
    if spec is None:
        if found is None:
            raise ChatTemplateError(f"this {arch + ' ' if arch else ''}model ships no chat template; "
                                    f"choose one with --chat-template {_suggested(arch)}"
                                    f"(built-in: {', '.join(BUILTIN_TEMPLATES)})")
        return found
    if spec in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[spec]
    path = Path(spec)
    if not path.is_file():
        raise ChatTemplateError(f"chat template {spec!r} is neither a built-in ({', '.join(BUILTIN_TEMPLATES)}) "
                                "nor a file")
    if path.suffix.lower() == ".json":
        found = _json(path).get("chat_template")
        if found is None:
            raise ChatTemplateError(f"{path} has no chat_template entry")
        return select_template(found)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ChatTemplateError(f"chat template file {path} is not UTF-8 text ({e})") from None


def _suggested(arch: str | None) -> str:
    """What the no-template error suggests: the built-in in the architecture's layout, where there is one."""
    name = ARCH_TEMPLATES.get(arch or "")
    return f"{name} (the {arch} layout) or NAME|FILE " if name else "NAME|FILE "


# -- inputs ---------------------------------------------------------------------------------------------------------


def _normalized(messages) -> list[dict]:
    """Messages as plain dicts with None-valued keys dropped (an API's content=None or tool_calls=None would
    otherwise render as the word "None")."""
    if isinstance(messages, dict) or not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("cannot render an empty conversation: give at least one message")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"message {i} must be a dict with 'role' and 'content', got {message!r}")
        plain.append({key: _plain(value) for key, value in message.items() if value is not None})
    return plain


def _plain(value):
    """A copy built from JSON's types only (str, int, float, bool, None, dict, list), so a template sees data, not
    objects whose methods the sandbox does not know."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    for kind in (bool, str, int, float):  # subclasses (enums, NumPy scalars) back to the base type
        if isinstance(value, kind):
            return kind(value)
    if hasattr(value, "item"):  # NumPy scalars that are not float subclasses
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _defined(**values) -> dict:
    return {k: v for k, v in values.items() if v is not None}


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ChatTemplateError(f"{path} cannot be read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data
