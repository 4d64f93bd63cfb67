"""Chat: Hugging Face chat templates rendered as transformers renders them, and the built-in ones.

    render_chat_template(template, messages, add_generation_prompt=False, bos_token=..., eos_token=...) -> str
    BUILTIN_TEMPLATES                    llama2, llama3, chatml, zephyr, mistral, gemma, phi3, granite, olmo2
    ARCH_TEMPLATES                       architecture -> the built-in in its published layout (gemma2 -> gemma)
    find_chat_template(checkpoint)       tokenizer_config.json's or GGUF's template of a checkpoint, else None
    resolve_chat_template(spec, found, arch)  a --chat-template NAME|FILE, else the model's own
    chat_template_name(spec, checkpoint) how error messages name that template
    TemplateLimits                       a render's deadline, output cap and memory (NPLLM_TEMPLATE_* variables)
"""

from .templates import (ARCH_TEMPLATES, BUILTIN_TEMPLATES, chat_template_name, find_chat_template,
                        render_chat_template, resolve_chat_template, select_template)
from .worker import TemplateLimits

__all__ = ["ARCH_TEMPLATES", "BUILTIN_TEMPLATES", "TemplateLimits", "chat_template_name", "find_chat_template",
           "render_chat_template", "resolve_chat_template", "select_template"]
