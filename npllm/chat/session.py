"""A conversation with a model: the template lays the messages out, a Context keeps the cache between turns.

    ChatSession(llm, chat_template=None, system=None, context_policy="error", sinks=4)
        stream(messages, max_new_tokens, ...)  the assistant's reply to `messages`, as text pieces
        send(text, ...)                        a user turn appended to .messages, the reply streamed and appended
        messages, reset(), set_system(text), save(path), load(path)

Every turn renders the whole conversation (add_generation_prompt=True) and tokenizes it; the Context runs only the
tokens after the longest common prefix with what its cache holds, so a turn costs its new tokens, not the
conversation's. A reply ends at the model's end-of-sequence ids, at the template's end-of-turn text (what the
template writes after an assistant message, e.g. "<|im_end|>"), at a stop string, or at max_new_tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from dataclasses import replace

from ..context import DEFAULT_SINKS, Context
from ..errors import ChatTemplateError, GenerationError
from ..generate import Request, decode
from ..sampling import SamplingParams, with_keywords
from ..stop import StopStrings, text_of_steps
from ..tokenizer.base import TokenType
from .templates import (ChatTemplateLimitError, chat_template_name, find_chat_template, render_chat_template,
                        resolve_chat_template)

ROLES = ("system", "user", "assistant", "tool")
_SENTINEL = "\u2063reply\u2063"  # an assistant message no template changes, to find the text written after it


class ChatSession:
    def __init__(self, llm, chat_template: str | None = None, system: str | None = None,
                 context_policy: str = "error", sinks: int = DEFAULT_SINKS, capacity: int | None = None):
        self.llm = llm
        self.tokenizer = llm._require_tokenizer()
        found = find_chat_template(llm.source) if llm.source else None
        self.template = resolve_chat_template(chat_template, found, llm.config.arch)
        self.template_name = chat_template_name(chat_template, llm.source)
        tok = self.tokenizer
        self.special_ids = special_ids(tok, llm.config)
        self.bos_text, self.eos_text = (None if i is None else tok.id_to_piece(i) for i in self.special_ids)
        self.end_of_turn = turn_end(self.template, self.bos_text, self.eos_text, self.template_name)
        end_ids = self.encode(self.end_of_turn) if self.end_of_turn else []
        self.end_ids = frozenset(end_ids) if len(end_ids) == 1 else frozenset()  # a special token such as <|im_end|>
        self.context = Context(llm.model, context_policy, sinks, capacity, getattr(llm, "prefix_cache", None))
        self.system = system
        self.messages: list[dict] = []
        self.reset()

    # -- the conversation ---------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the conversation (the system message stays). The cache is kept: the next turn reuses its prefix."""
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]

    def set_system(self, text: str | None) -> None:
        """Replace the system message (None or "" removes it), keeping the rest of the conversation."""
        self.system = text or None
        rest = [m for m in self.messages if m["role"] != "system"]
        self.messages = ([] if self.system is None else [{"role": "system", "content": self.system}]) + rest

    def save(self, path) -> None:
        try:
            Path(path).write_text(json.dumps(self.messages, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        except OSError as e:
            raise GenerationError(f"cannot save the conversation to {path}: {e}") from None

    def load(self, path) -> None:
        """Take the conversation from a JSON file of messages (as save writes it)."""
        try:
            messages = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise GenerationError(f"cannot read a conversation from {path}: {e}") from None
        self.messages = check_messages(messages)
        systems = [m["content"] for m in self.messages if m["role"] == "system"]
        self.system = systems[0] if systems else None

    # -- turns --------------------------------------------------------------------------------------------------

    def prompt_ids(self, messages) -> list[int]:
        """The token ids of `messages` laid out by the template, opening the assistant's turn. Under context_policy
        "error", a conversation that cannot fit the context is refused (ConversationFull) before it is encoded
        whole, as context.encode_prompt refuses a prompt (encode_within)."""
        text = render_chat_template(self.template, check_messages(messages), add_generation_prompt=True,
                                    bos_token=self.bos_text, eos_token=self.eos_text, template_name=self.template_name)
        return self.encode_within(text, self.context.capacity) if self.context.policy == "error" else self.encode(text)

    def encode(self, text: str) -> list[int]:
        """Rendered template text -> ids. The BOS/EOS pieces the template wrote as text become their ids (a
        SentencePiece encoder would spell "<s>" letter by letter); nothing is added that the template did not write,
        as transformers' apply_chat_template(tokenize=True) does."""
        ids = []
        for part in self._parts(text):
            ids += [part] if isinstance(part, int) else self.tokenizer.encode(part, bos=False)
        return ids

    def encode_within(self, text: str, most: int) -> list[int]:
        """encode(text), or ConversationFull where it cannot fit `most` ids, found the way context.encode_prompt
        finds it before encoding a text whole (seconds a megabyte): first a bound from the bytes of the text
        between the special pieces (Tokenizer.fewest_tokens, each special piece one id), then an encoder that stops
        once past (Tokenizer.encode_at_most). A count it cannot bound is ConversationFull from the exact count."""
        tok, parts = self.tokenizer, self._parts(text)
        fewest = sum(1 if isinstance(part, int) else tok.fewest_tokens(part) for part in parts)
        if fewest > most:
            raise ConversationFull(fewest, most, at_least=True)
        ids = []
        for i, part in enumerate(parts):
            more = [part] if isinstance(part, int) else tok.encode_at_most(part, max(most - len(ids), 0), bos=False)
            if more is None:  # the encoder stopped once past `most`
                raise ConversationFull(most + 1, most, at_least=True)
            ids += more
            if len(ids) > most:  # the parts after this one are not encoded
                raise ConversationFull(len(ids), most, at_least=i < len(parts) - 1)
        return ids

    def _parts(self, text: str) -> list[str | int]:
        """The text split at the BOS/EOS pieces it holds (control pieces only): their ids, and the text between."""
        tok = self.tokenizer
        specials = {tok.id_to_piece(i): i for i in self.special_ids
                    if i is not None and 0 <= i < tok.vocab_size and tok.token_type(i) == TokenType.CONTROL}
        specials = {piece: i for piece, i in specials.items() if piece}
        if not specials:
            return [text] if text else []
        pattern = "(" + "|".join(map(re.escape, specials)) + ")"
        return [specials.get(part, part) for part in re.split(pattern, text) if part]

    def stream(self, messages, max_new_tokens: int = 256, params: SamplingParams | None = None, *,
               ignore_eos: bool = False, on_step: Callable | None = None, constraint=None,
               **sampling) -> Iterator[str]:
        """The assistant's reply to `messages`, streamed as text (stop strings and the end of turn cut it).
        params: how to sample (the sampling keywords beside it replace its fields; any other keyword is a
        TypeError). constraint: a BoundConstraint (LLM.bind_constraint) the reply must follow."""
        params = with_keywords(params, sampling, "ChatSession.stream()")
        prompt = self.prompt_ids(messages)
        self.check_fits(len(prompt), max_new_tokens, ignore_eos)
        stops = StopStrings(tuple(params.stop) + ((self.end_of_turn,) if self.end_of_turn else ()))
        request = Request(prompt, max_new_tokens, replace(params, stop=()), stop_ids=self.end_ids,
                          ignore_eos=ignore_eos, constraint=constraint)
        steps = decode(self.llm.model, request, self.context, report=params.logprobs > 0)
        # a fresh decoder, not primed with the prompt: the reply is text of its own, without a leading space
        yield from text_of_steps(self.tokenizer.stream_decoder(), steps, stops, on_step)

    def check_fits(self, prompt_len: int, max_new_tokens: int, ignore_eos: bool) -> None:
        """ConversationFull when, under context_policy "error", the rendered conversation does not fit the context
        (or, with ignore_eos, it and max_new_tokens do not)."""
        capacity = self.context.capacity
        if self.context.policy != "error":
            return
        if prompt_len > capacity:
            raise ConversationFull(prompt_len, capacity)
        if ignore_eos and prompt_len + max_new_tokens - 1 > capacity:
            raise ConversationFull(prompt_len, capacity, max_new_tokens)

    def send(self, text: str, max_new_tokens: int = 256, params: SamplingParams | None = None, *,
             ignore_eos: bool = False, on_step: Callable | None = None, constraint=None,
             **sampling) -> Iterator[str]:
        """Append a user message, stream the reply (the arguments of stream), and append it as the assistant's
        message. A reply cut short (an exception, Ctrl-C, the caller closing the generator) is kept as far as it
        went."""
        params = with_keywords(params, sampling, "ChatSession.send()")
        self.messages.append({"role": "user", "content": text})
        pieces = []
        try:
            for piece in self.stream(self.messages, max_new_tokens, params, ignore_eos=ignore_eos, on_step=on_step,
                                     constraint=constraint):
                pieces.append(piece)
                yield piece
        except GenerationError:
            self.messages.pop()  # a turn that could not start (the conversation does not fit) is not kept
            raise
        finally:
            if self.messages and self.messages[-1]["role"] == "user":
                self.messages.append({"role": "assistant", "content": "".join(pieces)})


class ConversationFull(GenerationError):
    """The conversation no longer fits the context under context_policy "error". `advice` says what to do in the
    caller's terms; the message gives the Python API's (the chat REPL words its own: /reset, --context-policy)."""

    def __init__(self, tokens: int, capacity: int, max_new_tokens: int | None = None, at_least: bool = False):
        self.tokens, self.capacity, self.max_new_tokens = tokens, capacity, max_new_tokens
        self.at_least = at_least  # tokens is a lower bound: the conversation was refused before it was encoded whole
        super().__init__(self.advice("start over with reset()", 'context_policy="truncate" or "sinks"',
                                     "max_new_tokens"))

    def advice(self, restart: str, policies: str, limit: str) -> str:
        """The message, with the caller's words for starting over, for the policies, and for the token limit."""
        if self.max_new_tokens is None:
            return (f"the conversation is {'at least ' if self.at_least else ''}{self.tokens} tokens, more than the "
                    f"model's context of {self.capacity}: {restart}, or use {policies} to go past the context")
        return (f"the conversation ({self.tokens} tokens) and {self.max_new_tokens} new tokens do not fit the "
                f"model's context of {self.capacity}: ask for fewer with {limit}, {restart}, or use {policies} to go "
                "past the context")


def check_messages(messages) -> list[dict]:
    """A list of {"role", "content"} dicts with a known role and text content, or a GenerationError."""
    if not isinstance(messages, list):
        raise GenerationError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise GenerationError(f"message {i} must be a dict with a role in {', '.join(ROLES)} and text content, "
                                  f"got {m!r:.80}")
    return messages


def special_ids(tok, config) -> tuple[int | None, int | None]:
    """The (BOS, EOS) ids a template's bos_token and eos_token stand for: the tokenizer's, else the model's (a
    tokenizer.json without its tokenizer_config.json names no special tokens); None where neither has one."""
    bos = tok.bos_id if tok.bos_id is not None else config.bos_id
    eos = tok.eos_id if tok.eos_id is not None else (config.eos_ids[0] if config.eos_ids else None)
    return bos, eos


def turn_end(template: str, bos_text: str, eos_text: str, template_name: str | None = None) -> str:
    """The text a template writes right after an assistant message ("<|im_end|>", "</s>", "<|eot_id|>"), found by
    rendering one exchange with a sentinel reply; "" when it writes none or its own error stops it. A template
    that overruns its limits (a deadline, a guard) is an error here already, not at the first turn."""
    exchange = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = render_chat_template(template, exchange, bos_token=bos_text, eos_token=eos_text,
                                    template_name=template_name)
    except ChatTemplateLimitError:
        raise
    except ChatTemplateError:
        return ""
    at = text.find(_SENTINEL)
    return text[at + len(_SENTINEL):].strip() if at >= 0 else ""
