"""LLM: a loaded model with its tokenizer, and the calls users make on it."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from . import batching, embed
from .config import MAX_CONTEXT, ModelConfig
from .constraint import BoundConstraint, Constraint
from .errors import ConfigError, FormatError, GenerationError, TokenizerError
from .context import DEFAULT_SINKS, Context, check_policy, encode_prompt
from .stop import StopStrings, text_of_steps
from .generate import Request, check_prompt, check_request, decode, generate_ids
from .hub import resolve
from .models import Model
from .prefix_cache import PrefixCache
from .sampling import Sampled, SamplingParams, with_keywords
from .speculative import Speculative, speculative_decode
from .tokenizer import Tokenizer, load_tokenizer


# A padded vocabulary adds a few rows (Qwen2.5: 151,665 tokens, 151,936 rows); a tokenizer much smaller than the
# embedding belongs to another model.
MIN_TOKENIZER_SHARE = 0.9


def fit_tokenizer(tokenizer: Tokenizer, config: ModelConfig, path) -> int | None:
    """How many ids the model may produce when its embedding is padded past the tokenizer (the model's
    config.usable_vocab: its lm_head masks the rest); None when they match. A tokenizer with more ids than the
    embedding has rows, or far fewer, belongs to another model."""
    n = tokenizer.vocab_size
    if n == config.vocab_size:
        return None
    if n > config.vocab_size or n < MIN_TOKENIZER_SHARE * config.vocab_size:
        raise TokenizerError(f"tokenizer {path} has {n} pieces but the model's vocabulary is {config.vocab_size}")
    return n


class LLM:
    def __init__(self, model: Model, tokenizer: Tokenizer | None, source: str = "", backend: str = "numba",
                 threads: int | None = None, prefix_cache_mib: float = 0):
        self.model = model
        # shared beginnings of prompts, computed once across calls (npllm.prefix_cache); None when off
        self.prefix_cache = PrefixCache.of_mib(model, prefix_cache_mib)
        self.tokenizer = tokenizer
        self.source = source
        self.backend, self.threads = backend, threads  # how drafts for speculative decoding are built
        self._drafts: dict = {}
        self._chats: dict = {}  # ChatSessions by (template, context policy, sinks), each with its kept cache

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def logits(self, token_ids) -> np.ndarray:
        """Logits of every position of a causal forward on a fresh cache.  # [T] -> [T, V] float32"""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        check_prompt(self.config, ids)
        return self.model.logits(ids).astype(np.float32)

    def generate_ids(self, prompt_ids, max_new_tokens: int = 256, params: SamplingParams | None = None,
                     **sampling) -> Iterator[int]:
        """Yield new token ids for a prompt given as ids. params: how to sample (SamplingParams); sampling keywords
        given beside it (or instead) replace its fields."""
        params = with_keywords(params, sampling, "LLM.generate_ids()")
        return generate_ids(self.model, list(prompt_ids), max_new_tokens, params)

    def stream(self, prompt: str = "", max_new_tokens: int = 256, params: SamplingParams | None = None, *,
               echo: bool = False, on_step=None, context_policy: str = "error", ignore_eos: bool = False,
               sinks: int = DEFAULT_SINKS, speculative: Speculative | None = None, constraint: Constraint | None = None,
               **keywords) -> Iterator[str]:
        """Yield the completion's text as it is produced (with echo, the prompt's text first). How to sample:
        params=SamplingParams(...) (default SamplingParams()); its fields given as keywords replace the params' own.

        Text is released only once whole UTF-8 characters are known, so a character split over byte tokens is
        never printed broken, and only once it cannot be the start of a stop string (`stop=`), which ends the
        completion and is not part of it. on_step(Sampled) is called for every generated token with its draw: the id,
        and with logprobs=N >= 1 its log-probability and the N most probable alternatives (else NaN and none).

        Speculative decoding (npllm.speculative): speculative=Speculative(...), and/or its fields as keywords: draft=
        another LLM (or a checkpoint path) with the same vocabulary, or draft_layers=N (this model's first N layers)
        proposes num_draft tokens a round; the output keeps the model's distribution (greedy: the very same tokens).
        speculation: a SpeculationStats to fill in.

        Past the context (npllm.context): context_policy "error" (never past it: generation ends when the context
        is full), "truncate" (recompute over the most recent half context) or "sinks" (StreamingLLM: `sinks` first
        tokens + the most recent window, bounded memory). ignore_eos: end-of-sequence ids do not end the completion.

        Structured outputs (npllm.constraint, docs/structured.md): constraint=Constraint.json(schema) (or
        Constraint.json(), .regex(pattern), .grammar(text)) sets every token that would leave the language to -inf
        before every other sampling stage; the completion ends ("stop") once the language allows nothing more, and
        at EOS only where the language may end.

        Any other keyword is a TypeError naming it.
        """
        params, speculative = _call_options("LLM.stream()", params, speculative, keywords)
        bound = self.bind_constraint(constraint)
        tokenizer = self._require_tokenizer()
        # "error" refuses a prompt past the context, and one far past it before it is encoded whole
        prompt_ids = (encode_prompt(tokenizer, self.config, prompt) if context_policy == "error"
                      else tokenizer.encode(prompt, bos=True))
        steps = self._steps(prompt_ids, max_new_tokens, params, speculative, context_policy, ignore_eos, sinks, bound)
        yield from _text_of(self.tokenizer, prompt_ids, steps, params.stop, echo, on_step)

    def _steps(self, prompt_ids, max_new_tokens, params, speculative: Speculative, context_policy, ignore_eos,
               sinks, constraint: BoundConstraint | None = None) -> Iterator:
        """The generation steps stream() asked for: speculative, or the single-sequence loop (generate.decode) on
        a Context under the policy asked for."""
        check_policy(context_policy, sinks)
        if context_policy == "error":
            check_request(self.config, prompt_ids, max_new_tokens)  # before the echo: a bad request prints nothing
        if speculative.on and (context_policy != "error" or ignore_eos):
            raise GenerationError("speculative decoding runs inside the context and stops at EOS: it takes neither "
                                  "context_policy nor ignore_eos")
        if speculative.on:
            return self._speculative_steps(prompt_ids, max_new_tokens, params, speculative, constraint)
        # "error" never goes past prompt + max_new_tokens positions: a cache that size, not the whole context
        room = min(self.config.max_seq_len, len(prompt_ids) + max(max_new_tokens, 1))
        context = Context(self.model, context_policy, sinks, room if context_policy == "error" else None,
                          self.prefix_cache)
        request = Request(prompt_ids, max_new_tokens, dataclasses.replace(params, stop=()), ignore_eos=ignore_eos,
                          constraint=constraint)
        steps = decode(self.model, request, context, report=params.logprobs > 0)
        return _started(steps)  # a request refused (ignore_eos past the context) fails before the echo

    def generate(self, prompt: str | list[str] = "", max_new_tokens: int = 256, params: SamplingParams | None = None,
                 *, on_step=None, context_policy: str = "error", ignore_eos: bool = False, sinks: int = DEFAULT_SINKS,
                 speculative: Speculative | None = None, constraint: Constraint | None = None,
                 **keywords) -> str | list[str]:
        """The completion of one prompt (without the prompt); for a list of prompts, the list of their completions,
        generated together by ragged batching, each one what it would be alone (every prompt uses params.seed).
        params, the keywords (SamplingParams' and Speculative's fields) and the rest are stream's.

        on_step: for one prompt, on_step(Sampled) per generated token (see stream); for a list, on_step(i, Sampled)
        for prompt i's tokens, prompt after prompt once the batch is done, up to where each completion ends (the
        token that completes a stop string included, as stream does)."""
        params, speculative = _call_options("LLM.generate()", params, speculative, keywords)
        if isinstance(prompt, str):
            return "".join(self.stream(prompt, max_new_tokens, params, on_step=on_step, context_policy=context_policy,
                                       ignore_eos=ignore_eos, sinks=sinks, speculative=speculative,
                                       constraint=constraint))
        if context_policy != "error" or ignore_eos or speculative.on:
            raise GenerationError("a batch of prompts is generated inside the context, stops at EOS and is not "
                                  "speculative: context_policy, ignore_eos and a draft apply to a single prompt")
        return self._generate_batch(list(prompt), max_new_tokens, params, on_step, self.bind_constraint(constraint))

    def chat_stream(self, messages: list[dict], max_new_tokens: int = 256, params: SamplingParams | None = None, *,
                    chat_template: str | None = None, context_policy: str = "error", sinks: int = DEFAULT_SINKS,
                    ignore_eos: bool = False, on_step=None, constraint: Constraint | None = None,
                    **sampling) -> Iterator[str]:
        """The assistant's reply to `messages` ([{"role", "content"}, ...]), streamed as text. params and the
        sampling keywords beside it: as stream's.

        The conversation is laid out by the model's chat template (tokenizer_config.json, GGUF
        tokenizer.chat_template) or chat_template= (a built-in name: llama2, llama3, chatml, zephyr, mistral, gemma,
        phi3, granite, olmo2; or a file).
        The reply ends at the model's EOS, at the template's end-of-turn text, at a stop string or after
        max_new_tokens. The KV cache is kept between calls with the same template and policy: a conversation that
        grows by a turn runs only the new tokens through the model (npllm.chat.ChatSession, npllm.context).
        constraint: the reply's structured-output constraint, as stream's (it ends at the end of turn only where the
        language may end).
        """
        params = with_keywords(params, sampling, "LLM.chat_stream()")
        session = self.chat_session(chat_template, context_policy=context_policy, sinks=sinks)
        return session.stream(messages, max_new_tokens, params, ignore_eos=ignore_eos, on_step=on_step,
                              constraint=self.bind_constraint(constraint))

    def chat(self, messages: list[dict], max_new_tokens: int = 256, params: SamplingParams | None = None, *,
             chat_template: str | None = None, context_policy: str = "error", sinks: int = DEFAULT_SINKS,
             ignore_eos: bool = False, on_step=None, constraint: Constraint | None = None, **sampling) -> str:
        """The assistant's reply to `messages`, whole (the arguments of chat_stream)."""
        params = with_keywords(params, sampling, "LLM.chat()")
        return "".join(self.chat_stream(messages, max_new_tokens, params, chat_template=chat_template,
                                        context_policy=context_policy, sinks=sinks, ignore_eos=ignore_eos,
                                        on_step=on_step, constraint=constraint))

    def chat_session(self, chat_template: str | None = None, system: str | None = None,
                     context_policy: str = "error", sinks: int = DEFAULT_SINKS):
        """A ChatSession on this model (one per template and policy, kept: its cache serves the next call too).
        A new system prompt starts from the same session's cache."""
        from .chat.session import ChatSession

        key = (chat_template, context_policy, int(sinks))
        if key not in self._chats:
            self._chats[key] = ChatSession(self, chat_template, None, context_policy, sinks)
        session = self._chats[key]
        session.set_system(system)
        session.reset()
        return session

    def _generate_batch(self, prompts: list[str], max_new_tokens: int, params: SamplingParams,
                        on_step=None, constraint: BoundConstraint | None = None) -> list[str]:
        """The prompts' completions by ragged batching; each one's draws then become text as stream's do (the
        decoder primed with its prompt, cut at the first stop string to complete), with on_step(i, Sampled)."""
        tokenizer = self._require_tokenizer()
        token_level = dataclasses.replace(params, stop=())  # stop strings are text: cut below
        requests = [batching.Request(encode_prompt(tokenizer, self.config, p), max_new_tokens, token_level,
                                     constraint=constraint) for p in prompts]
        draws = [[] for _ in requests]
        batching.ragged_generate(self.model, requests, on_draw=lambda i, drawn: draws[i].append(drawn),
                                 prefix_cache=self.prefix_cache)
        return ["".join(_text_of(tokenizer, r.prompt, steps, params.stop, False,
                                 None if on_step is None else functools.partial(on_step, i)))
                for i, (r, steps) in enumerate(zip(requests, draws))]

    def generate_tokens(self, prompt_tokens: list[list[int]], max_gen_len: int, temperature: float = 0.6,
                        top_p: float = 0.9, logprobs: bool = False, echo: bool = False, strategy: str = "ragged",
                        seed: int | None = None) -> tuple[list[list[int]], list[list[float]] | None]:
        """Meta's generate() on token ids, batched by `strategy` ("static", "ragged" or "continuous"); see
        npllm.batching.generate_tokens."""
        return batching.generate_tokens(self.model, prompt_tokens, max_gen_len, temperature, top_p, logprobs, echo,
                                        strategy, seed)

    def beam_search(self, prompt_ids, num_beams: int, max_new_tokens: int, length_penalty: float = 1.0,
                    early_stopping: bool | str = True, eos_token_id=None, num_return_sequences: int | None = None,
                    stop: tuple[str, ...] = (), constraint: Constraint | None = None):
        """The best continuations of prompt_ids by beam search, best first (npllm.search.beam_search):
        hypotheses with .tokens (new tokens, the ending EOS included) and .score (summed log-probability /
        len(tokens) ** length_penalty), as transformers' generate(num_beams=...) finds them.

        stop: strings that end a hypothesis as EOS does, once its text (after the prompt) contains one; the token
        that completes it is the hypothesis' last (completion_text(..., stop=stop) gives the text before it).
        constraint: every hypothesis follows it (each beam its own state; see npllm.search.beam_search)."""
        from .search import beam_search

        stop = SamplingParams(stop=stop).stop  # checked as a sampling option is

        def stopped(tokens) -> bool:
            return self._completion(prompt_ids, tokens, stop)[1]

        return beam_search(self.model, list(prompt_ids), num_beams, max_new_tokens, length_penalty, early_stopping,
                           eos_token_id, num_return_sequences, stopped if stop else None,
                           self.bind_constraint(constraint))

    def completion_text(self, prompt_ids, token_ids, echo: bool = False, stop: tuple[str, ...] = ()) -> str:
        """The text of token_ids continuing prompt_ids (the decoder primed with the prompt, as stream's), ended
        before the first stop string to complete; with echo, the prompt's text first."""
        text, _ = self._completion(prompt_ids, token_ids, tuple(stop), echo)
        return text

    def _completion(self, prompt_ids, token_ids, stop: tuple[str, ...], echo: bool = False) -> tuple[str, bool]:
        """(completion_text, whether a stop string ended it)."""
        stops = StopStrings(stop)
        steps = (Sampled(int(t), float("nan"), *_NO_ALTERNATIVES) for t in token_ids)
        decoder = self._require_tokenizer().stream_decoder()
        prompt_text = "".join(decoder.feed(int(t)) for t in prompt_ids)
        text = "".join(text_of_steps(decoder, steps, stops))
        return (prompt_text if echo else "") + text, stops.stopped

    def draft_model(self, draft=None, draft_layers: int | None = None) -> Model:
        """The draft for speculative decoding: another LLM's model, a checkpoint loaded on this backend, or this
        checkpoint's first `draft_layers` layers (built once, then kept)."""
        if (draft is None) == (draft_layers is None):
            raise GenerationError("give either draft (a model) or draft_layers (this model's first N layers)")
        if isinstance(draft, LLM):
            return draft.model
        key = ("layers", int(draft_layers)) if draft is None else ("model", str(draft))
        if key not in self._drafts:
            if draft is not None:
                self._drafts[key] = load(draft, backend=self.backend, threads=self.threads).model
            else:
                from .formats import read_checkpoint
                from .models import make_model
                from .speculative import first_layers

                config, weights = first_layers(*read_checkpoint(self.source), int(draft_layers))
                self._drafts[key] = make_model(config, weights, self.backend, self.threads)
        return self._drafts[key]

    def _speculative_steps(self, prompt_ids, max_new_tokens, params, speculative: Speculative,
                           constraint: BoundConstraint | None = None) -> Iterator:
        """speculative_decode's ids as the Sampled records generate_steps yields (no log-probabilities). The request
        and the draft are checked (and the draft built) here, before anything is generated."""
        num_draft = speculative.num_draft
        if params.logprobs:
            raise GenerationError("log-probabilities (logprobs) are not available with speculative decoding")
        if not isinstance(num_draft, (int, np.integer)) or num_draft < 1:
            raise GenerationError(f"num_draft must be a positive integer, got {num_draft!r}")
        request = Request(prompt_ids, max_new_tokens, dataclasses.replace(params, stop=()), constraint=constraint)
        draft = self.draft_model(speculative.draft, speculative.draft_layers)
        tokens = speculative_decode(self.model, draft, request, num_draft, stats=speculative.speculation)
        return (Sampled(token, float("nan"), *_NO_ALTERNATIVES) for token in tokens)

    def embed(self, inputs, pooling: str | None = None, normalize: bool | None = None) -> np.ndarray:
        """One embedding per input (npllm.embed): a text, a list of texts, one text's token ids, or a list of token
        id lists; texts are encoded as a prompt is (the tokenizer's template: BOS, or Qwen's end token). pooling
        "last" | "mean" | "cls" and normalize default to what the model's files say (ModelConfig.pooling; a model
        whose files say nothing: "last", not normalized). Each input is its own forward, so its vector is what it
        would be alone.                                                                        # -> [N, D] float32"""
        pooling, normalize = embed.resolve_pooling(self.config, pooling, normalize)
        texts = embed_inputs(inputs)
        ids = [self._require_tokenizer().encode(t, bos=True) if isinstance(t, str) else t for t in texts]
        for row in ids:
            embed.check_ids(self.config, row)  # all checked before the first forward
        return np.stack([embed.embed_ids(self.model, row, pooling, normalize) for row in ids])
    def bind_constraint(self, constraint: Constraint | None) -> BoundConstraint | None:
        """A Constraint bound to this model's tokenizer and vocabulary (kept: each sequence starts its own state)."""
        if constraint is None:
            return None
        if not isinstance(constraint, Constraint):
            raise GenerationError(f"constraint must be an npllm.Constraint (Constraint.json(schema), .regex(pattern), "
                                  f".grammar(text)), got {type(constraint).__name__}")
        return constraint.bind(self._require_tokenizer(), self.config.vocab_size)

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise FormatError(f"no tokenizer was found for {self.source}: pass tokenizer=PATH")
        return self.tokenizer


_NO_ALTERNATIVES = np.empty(0, np.int64), np.empty(0)  # a Sampled's top_ids, top_logprobs when none were asked for


def embed_inputs(inputs) -> list:
    """LLM.embed's inputs as a list of texts and token id lists (each one text)."""
    if isinstance(inputs, str) or _is_ids(inputs):
        return [inputs]
    if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(x, str) or _is_ids(x) for x in inputs):
        return list(inputs)
    raise GenerationError("embed takes a text, a list of texts, a list of token ids or a list of token id lists")


def _is_ids(x) -> bool:
    return (isinstance(x, (list, tuple, np.ndarray)) and len(x) > 0
            and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in x))


def _text_of(tokenizer, prompt_ids, steps, stop, echo: bool, on_step) -> Iterator[str]:
    """A completion's text (see text_of_steps), the decoder primed with the prompt; with echo, the prompt's text
    first."""
    decoder = tokenizer.stream_decoder()
    prompt_text = "".join(decoder.feed(t) for t in prompt_ids)
    if echo:
        yield prompt_text
    yield from text_of_steps(decoder, steps, StopStrings(stop), on_step)


def _call_options(caller: str, params: SamplingParams | None, speculative: Speculative | None,
                  keywords: dict) -> tuple[SamplingParams, Speculative]:
    """A call's (SamplingParams, Speculative), built once at the call: the keywords named by Speculative's fields
    replace `speculative`'s, the others are sampling keywords (with_keywords: an unknown one is a TypeError)."""
    speculative, sampling = Speculative.split_keywords(speculative, keywords)
    return with_keywords(params, sampling, caller), speculative


def _started(steps: Iterator) -> Iterator:
    """steps with its first item computed now: the prefill runs, and a refused request raises, at the call."""
    steps = iter(steps)
    try:
        first = next(steps)
    except StopIteration:
        return iter(())
    return itertools.chain([first], steps)


def load(model: str | os.PathLike = "stories260K", tokenizer: str | os.PathLike | None = None,
         backend: str = "numba", threads: int | None = None, weight_dtype: str = "file",
         kv_dtype: str = "float32", cold_start: str = "wait", context: int | None = None,
         prefix_cache_mib: float = 0) -> LLM:
    """Load a checkpoint (a path or a known name such as "stories260K") and its tokenizer.

    backend: "numba" (compiled CPU kernels, the default), "numpy" (the reference), "cuda" (an NVIDIA GPU through
    numba.cuda; a DeviceError says what is missing when it cannot run) or "auto" (cuda when a GPU is usable, else
    numba). threads: CPU cores to use. weight_dtype: how the matrices are stored, the same on every backend: "file"
    (each in its file type, the default), "float32", "float16" or "q8_0" (a file's own blocks of that type kept byte
    for byte, other matrices rounded to it); see npllm.models.make_model.
    kv_dtype "float16": the KV cache stores keys and values in half precision, half the bytes (numba and numpy).
    cold_start "exact" or "reference": where the numba backend's code is not compiled yet, run the NumPy reference
    (computing as the Numba model does) while a detached process compiles it for later runs, rather than wait for
    the compile ("wait", the default); "exact" only where the reference gives the compiled model's greedy tokens
    (float32 weights, not a GGUF file's quantized ones; npllm.models.make_model).
    context: the positions the model runs with (default: what it was trained for); the KV caches hold this many,
    and longrope (Phi-3) chooses its factors by it, as llama.cpp does by its context size.
    prefix_cache_mib: MiB of host memory for the keys and values of prompt beginnings (npllm.prefix_cache), so that
    stream, generate (one prompt or many) and chat sessions compute a shared beginning once; 0 (the default) is off.
    """
    from .formats import read_checkpoint
    from .models import make_model, resolve_backend
    from .models.reference import Transformer

    backend = resolve_backend(backend)  # before reading weights: a missing GPU is reported at once
    checkpoint, found_tokenizer = resolve(model)
    config, weights = read_checkpoint(checkpoint)  # in their file types: make_model decides the storage
    config = with_context(config, context)
    tok, config = _tokenizer_for(config, tokenizer if tokenizer is not None else found_tokenizer)
    model = make_model(config, weights, backend, threads, weight_dtype, kv_dtype, cold_start)
    if isinstance(model, Transformer):
        backend = "numpy"  # (the reference stands in for numba while its code compiles) drafts are built the same way
    return LLM(model, tok, str(checkpoint), backend, threads, prefix_cache_mib)


def with_context(config: ModelConfig, context: int | None) -> ModelConfig:
    """The config run with `context` positions (None: as trained)."""
    if context is None:
        return config
    if isinstance(context, bool) or not isinstance(context, int) or not 0 < context <= MAX_CONTEXT:
        raise ConfigError(f"context must be a whole number of positions in 1..{MAX_CONTEXT}, got {context!r}")
    return config.replace(max_seq_len=context)


def _tokenizer_for(config: ModelConfig, tok_path) -> tuple[Tokenizer | None, ModelConfig]:
    """The tokenizer at tok_path (None: none) checked against the model's vocabulary, and the config with
    usable_vocab set when the embedding is padded past it."""
    if tok_path is None:
        return None, config
    tok_path = Path(tok_path)
    if tok_path.exists() and not tok_path.is_file():
        raise TokenizerError(f"tokenizer {tok_path} is not a regular file")
    # a llama2.c .bin does not record its size: it is read for exactly the model's ids (a padded llama2.c
    # vocabulary does not exist); other tokenizers know their size and may be smaller than a padded embedding
    tok = load_tokenizer(tok_path, vocab_size=config.vocab_size if tok_path.suffix.lower() == ".bin" else None)
    n_tokens = fit_tokenizer(tok, config, tok_path)
    return tok, (config if n_tokens is None else config.replace(usable_vocab=n_tokens))


def load_tokenizer_of(model: str | os.PathLike = "stories260K",
                      tokenizer: str | os.PathLike | None = None) -> tuple[Tokenizer, ModelConfig]:
    """The tokenizer load(model, tokenizer) pairs with the model, and the model's config, without building the
    model (the checkpoint is only mapped; nothing is compiled): for a process that only encodes text."""
    from .formats import read_checkpoint

    checkpoint, found = resolve(model)
    config, _ = read_checkpoint(checkpoint)
    tok, config = _tokenizer_for(config, tokenizer if tokenizer is not None else found)
    if tok is None:
        raise FormatError(f"no tokenizer was found for {checkpoint}: pass tokenizer=PATH")
    return tok, config
