"""Render chat templates with Hugging Face transformers, as references for tests/test_chat_templates.py.

    pip install transformers jinja2 tokenizers && python scripts/make_chat_fixtures.py

Writes tests/fixtures/chat/renders.json: for every (template, conversation, add_generation_prompt) the string
transformers' apply_chat_template(..., tokenize=False) returns, or the error it raises. The templates are the ones
model families publish in their tokenizer_config.json (held out from npllm's built-ins, which are also rendered),
plus templates that use namespace(), loop controls, tojson and raise_exception. The tests need none of this.
"""

import json
from pathlib import Path

import transformers
from transformers import PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "chat" / "renders.json"

# As published in the families' tokenizer_config.json files.
HELD_OUT = {
    "chatml": (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
        " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "qwen2": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
        "You are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
        "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "llama2": (
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
        "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}"
        "{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
        "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
        "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
        "{% endfor %}"),
    "llama3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
        "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
        "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
        "{% endif %}"),
    "zephyr": (
        "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
        "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}"
        "\n{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
        "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n"
        "{% endfor %}"),
    # namespace(), a filtered loop, whitespace control
    "namespace": (
        "{%- set ns = namespace(system='', found=false, turns=0) -%}\n"
        "{%- for m in messages -%}\n"
        "    {%- if m['role'] == 'system' -%}{%- set ns.system = m['content'] -%}{%- set ns.found = true -%}"
        "{%- else -%}{%- set ns.turns = ns.turns + 1 -%}{%- endif -%}\n"
        "{%- endfor -%}\n"
        "{{- bos_token -}}\n"
        "{%- if ns.found %}[SYS]{{ ns.system }}[/SYS]\n{% endif -%}\n"
        "{%- for m in messages if m['role'] != 'system' -%}\n"
        "    {%- if m['role'] == 'user' -%}\n"
        "        [INST] {{ m['content'] }} [/INST]\n"
        "    {%- else -%}\n"
        "        {{ ' ' + m['content'] + eos_token }}\n"
        "    {%- endif -%}\n"
        "{%- endfor -%}\n"
        "{{- '(' ~ ns.turns ~ ' turns)' -}}"),
    # loop controls, tojson, indented blocks that lstrip_blocks/trim_blocks clean up, a message's extra key
    "controls": (
        "{% for m in messages %}\n"
        "    {% if m.role == 'system' %}\n"
        "        {% continue %}\n"
        "    {% endif %}\n"
        "{{ loop.index }}. {{ m.role }}: {{ m.content | tojson }}{% if m.name is defined %} ({{ m.name }}){% endif %}\n"
        "    {% if loop.index >= 4 %}\n"
        "        {% break %}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}>>> {% endif %}"),
    # refuses system messages with raise_exception
    "no_system": (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] | trim }}"
        "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
    # a namespace attribute starting with "_" is refused by the sandbox
    "underscore": "{% set ns = namespace() %}{% set ns._secret = 1 %}{{ messages[0]['content'] }}",
    # does not compile
    "syntax_error": "{% for m in messages %}{{ m['content'] }}",
}

CONVERSATIONS = {
    "one_user": [{"role": "user", "content": "Hello!"}],
    "system_first": [
        {"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Arr! Hello."}, {"role": "user", "content": "Tell me a story"}],
    "spacing_unicode": [
        {"role": "user", "content": "  spaced\n\n  "}, {"role": "assistant", "content": "ok "},
        {"role": "user", "content": "äöü 日本 \"quote\" <tag> & it's", "name": "ann"}],
    "none_fields": [
        {"role": "user", "content": "x", "name": None}, {"role": "assistant", "content": "y", "tool_calls": None},
        {"role": "user", "content": "z"}],
    "not_alternating": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    "long": [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(7)],
}

TOKENS = {"llama3": ("<|begin_of_text|>", "<|eot_id|>")}


def render(tokenizer, template, messages, add_generation_prompt):
    try:
        return {"rendered": tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                          add_generation_prompt=add_generation_prompt)}
    except Exception as e:  # the reference's failure is the expected outcome of that case
        return {"error": type(e).__name__, "message": str(e)}


def main():
    import sys

    sys.path.insert(0, str(REPO))
    from npllm.chat import BUILTIN_TEMPLATES

    templates = {**{f"heldout_{k}": v for k, v in HELD_OUT.items()},
                 **{f"builtin_{k}": v for k, v in BUILTIN_TEMPLATES.items()}}
    cases = []
    for name, template in templates.items():
        family = name.split("_", 1)[1]
        bos, eos = TOKENS.get(family, ("<s>", "</s>"))
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_file=str(REPO / "tests/fixtures/hf/llama_gqa/tokenizer.json"), bos_token=bos, eos_token=eos)
        for conv_name, messages in CONVERSATIONS.items():
            for generation_prompt in (False, True):
                cases.append({"template": name, "conversation": conv_name, "bos_token": bos, "eos_token": eos,
                              "add_generation_prompt": generation_prompt,
                              **render(tokenizer, template, messages, generation_prompt)})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"transformers": transformers.__version__, "templates": templates,
                               "conversations": CONVERSATIONS, "cases": cases}, indent=1, ensure_ascii=False) + "\n",
                   encoding="utf-8")
    print(f"{len(cases)} cases ({sum('error' in c for c in cases)} errors) -> {OUT}")


if __name__ == "__main__":
    main()
