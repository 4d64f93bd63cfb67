"""LLM: a loaded model with its tokenizer, and the calls users make on it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .device import resolve_device
from .errors import FormatError
from .generate import check_prompt, generate_ids
from .hub import resolve
from .model import Transformer
from .sampling import SamplingParams
from .tokenizer import Tokenizer, load_tokenizer


class LLM:
    def __init__(self, model: Transformer, tokenizer: Tokenizer | None, source: str = ""):
        self.model = model
        self.tokenizer = tokenizer
        self.source = source

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def logits(self, token_ids) -> np.ndarray:
        """Logits of every position of a causal forward on a fresh cache.  # [T] -> [T, V] float32"""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        check_prompt(self.config, ids)
        return self.model.logits(ids).astype(np.float32)

    def generate_ids(self, prompt_ids, max_new_tokens: int = 256, **sampling) -> Iterator[int]:
        """Yield new token ids for a prompt given as ids (sampling keywords as in SamplingParams)."""
        return generate_ids(self.model, list(prompt_ids), max_new_tokens, SamplingParams(**sampling))

    def stream(self, prompt: str = "", max_new_tokens: int = 256, echo: bool = False, **sampling) -> Iterator[str]:
        """Yield the completion's text as it is produced (with echo, the prompt's text first).

        Text is released only once whole UTF-8 characters are known, so a character split over byte tokens is
        never printed broken.
        """
        params = SamplingParams(**sampling)
        prompt_ids = self._require_tokenizer().encode(prompt, bos=True)
        decoder = self.tokenizer.stream_decoder()
        prompt_text = "".join(decoder.feed(t) for t in prompt_ids)
        if echo:
            yield prompt_text
        for token in generate_ids(self.model, prompt_ids, max_new_tokens, params):
            piece = decoder.feed(token)
            if piece:
                yield piece
        tail = decoder.flush()
        if tail:
            yield tail

    def generate(self, prompt: str = "", max_new_tokens: int = 256, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int | None = None, **sampling) -> str:
        """The completion of one prompt (without the prompt)."""
        return "".join(self.stream(prompt, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                   **sampling))

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise FormatError(f"no tokenizer was found for {self.source}: pass tokenizer=PATH")
        return self.tokenizer


def load(model: str | os.PathLike = "stories260K", tokenizer: str | os.PathLike | None = None,
         device: str = "cpu") -> LLM:
    """Load a checkpoint (a path or a known name such as "stories260K") and its tokenizer.

    device: "cpu", "cuda" (an NVIDIA GPU through numba.cuda; a DeviceError says what is missing when it cannot
    run) or "auto" (CUDA when a GPU is usable, else CPU).
    """
    from .formats import read_checkpoint

    device = resolve_device(device)  # before reading weights: a missing GPU is reported at once
    checkpoint, found_tokenizer = resolve(model)
    config, weights = read_checkpoint(checkpoint)
    tok_path = tokenizer if tokenizer is not None else found_tokenizer
    tok = None
    if tok_path is not None:
        tok = load_tokenizer(Path(tok_path), vocab_size=config.vocab_size)
    if device == "cuda":
        from .cuda_model import CudaTransformer

        return LLM(CudaTransformer(config, weights), tok, str(checkpoint))
    return LLM(Transformer(config, weights), tok, str(checkpoint))
