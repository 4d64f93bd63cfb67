"""Regenerate tests/fixtures/hf: tiny random-weight Hugging Face checkpoints and what transformers computes on them.

Dev-only: needs torch, transformers and tokenizers (the tests read the results with NumPy alone).

    python scripts/make_hf_fixtures.py [--out tests/fixtures/hf]

For every fixture directory it writes
    config.json, model.safetensors (or shards + model.safetensors.index.json), tokenizer.json
    reference.npz   tokens [T] int64, logits [T, V] float32: one forward of `tokens` in float32
    greedy.json     {"prompt_ids": [...], "generated_ids": [... 32 ids]}: generate(do_sample=False), EOS disabled
and at the top level
    tokenizer_cases.json   texts and the ids the `tokenizers` library encodes them to, for the fixture tokenizer.

Weights are re-drawn at a larger scale than transformers' initialisation (and norms/biases made non-trivial) so the
logits are far from uniform: a wrong layout, a missing bias or a misplaced window changes them visibly.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import shutil

import numpy as np
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
BOS, EOS = 0, 1  # ids of the first two specials (added first by the trainer)
GREEDY_TOKENS = 32
PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, hidden_act="silu", bos_token_id=BOS, eos_token_id=EOS)


def training_corpus() -> list[str]:
    """English prose and code from the standard library's docstrings, plus a few other scripts."""
    texts = []
    for module in (json, os, argparse, inspect, shutil, np.linalg, torch.nn.functional):
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj)
            if doc:
                texts.append(doc)
    texts += ["Ünïcödé naïve café — “quotes” … 東京は日本の首都です。 😀👍 Привет, мир! 123456789 3.14159"] * 20
    return texts


def train_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(training_corpus(), trainer)
    assert tok.token_to_id(SPECIALS[0]) == BOS and tok.token_to_id(SPECIALS[1]) == EOS
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIALS[0]} $A", pair=f"{SPECIALS[0]} $A {SPECIALS[0]} $B", special_tokens=[(SPECIALS[0], BOS)])
    return tok


def tokenizer_cases(tok: Tokenizer) -> list[dict]:
    texts = [
        "Once upon a time, there was a little girl named Lily.",
        "  leading spaces,\ttabs\tand\n\nnewlines\r\n  trailing  ",
        "Numbers: 1234567 3.14159 2024-06-01 0x1F",
        "def f(x):\n    return x ** 2  # square\n",
        "I'm sure you'll see they've said it's 'quoted' and DON'T SHOUT",
        "Ünïcödé naïve café — “quotes” … 東京は日本の首都です。 😀👍 Привет, мир!",
        "e\u0301 (combining) \u200b zero width, \U0001F468\u200d\U0001F469\u200d\U0001F467 family",
        "<|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|begin_of_text|>text with a special in the middle <|eot_id|> and after",
        "",
        " ",
    ]
    return [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids,
             "ids_with_bos": tok.encode(t, add_special_tokens=True).ids} for t in texts]


def redraw_weights(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:  # small enough that a tied head does not just echo the last token
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:  # [out, in] projection: unit-variance outputs for unit-variance inputs, a little hotter
                p.copy_(1.5 * torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)


def build(cls_config, cls_model, seed: int, **kwargs):
    torch.manual_seed(seed)
    config = cls_config(**{**COMMON, **kwargs})
    config._attn_implementation = "eager"
    model = cls_model(config).eval()
    redraw_weights(model, seed)
    return model


def forward_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens[None], dtype=torch.long)).logits[0].float().numpy()


def greedy(model, prompt: np.ndarray) -> list[int]:
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = EOS
    ids = torch.tensor(prompt[None], dtype=torch.long)
    with torch.no_grad():  # an explicit mask: otherwise generate guesses one from the pad id and may hide tokens
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS)
    generated = out[0, len(prompt):].tolist()
    assert len(generated) == GREEDY_TOKENS
    return generated


def save(model, out_dir: str, tokenizer: Tokenizer, tokens: np.ndarray, prompt: np.ndarray, *,
         dtype=torch.float32, max_shard_size=None) -> None:
    """Save the checkpoint in `dtype`; the references are computed in float32 from the weights as saved."""
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True, **kwargs)
    # The references come from the checkpoint as saved, reloaded in float32 (bf16 weights widened exactly, as
    # npllm does; casting the live model back would leave its RoPE buffer rounded to bf16).
    model = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    eos = model.config.eos_token_id
    generated = greedy(model, prompt)
    assert eos not in generated, "pick another seed: greedy output hit EOS"
    # Greedy is only a fair comparison when no step is a near tie between the top two tokens.
    steps = forward_logits(model, np.concatenate([prompt, generated]))[len(prompt) - 1:-1]
    assert steps.argmax(-1).tolist() == generated, "generate() disagrees with the argmax of one full forward"
    top2 = np.sort(steps, axis=-1)[:, -2:]
    margin = float((top2[:, 1] - top2[:, 0]).min())
    assert margin > 1e-3, f"greedy run has a near tie (margin {margin})"
    print(f"  smallest top-1/top-2 logit margin in the greedy run: {margin:.4f}")
    np.savez(os.path.join(out_dir, "reference.npz"), tokens=tokens.astype(np.int64),
             logits=forward_logits(model, tokens).astype(np.float32))
    with open(os.path.join(out_dir, "greedy.json"), "w") as f:
        json.dump({"prompt": PROMPT, "prompt_ids": prompt.tolist(), "generated_ids": generated}, f)
    sizes = {f: os.path.getsize(os.path.join(out_dir, f)) for f in sorted(os.listdir(out_dir))}
    print(out_dir, {f: f"{s // 1024} KiB" for f, s in sizes.items()})


def differs(model, tokens, **config_changes) -> float:
    """Max |logits change| when config fields are altered: proves a fixture actually exercises a feature."""
    altered_config = copy.deepcopy(model.config)
    for k, v in config_changes.items():
        setattr(altered_config, k, v)
    altered_model = type(model)(altered_config).eval()
    altered_model.load_state_dict(model.state_dict())
    return float(np.abs(forward_logits(altered_model, tokens) - forward_logits(model, tokens)).max())


def _bias_effect(model, tokens) -> float:
    zeroed = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in zeroed.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
    return float(np.abs(forward_logits(zeroed, tokens) - forward_logits(model, tokens)).max())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "hf"))
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    print("transformers", transformers.__version__, "torch", torch.__version__)

    tokenizer = train_tokenizer(vocab_size=320)
    V = tokenizer.get_vocab_size()
    with open(os.path.join(out, "tokenizer_cases.json"), "w") as f:
        json.dump(tokenizer_cases(tokenizer), f, ensure_ascii=False, indent=0)
    rng = np.random.default_rng(0)
    prompt = np.array(tokenizer.encode(PROMPT, add_special_tokens=True).ids)
    assert 64 < len(prompt) < 96, len(prompt)  # longer than the llama3 fixture's original context

    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    # Llama with grouped-query attention (4 query heads share 2 KV heads), untied head.
    tokens = rng.integers(2, V, size=48)
    model = build(LlamaConfig, LlamaForCausalLM, 1, vocab_size=V, max_position_embeddings=128)
    save(model, os.path.join(out, "llama_gqa"), tokenizer, tokens, prompt)

    # Llama 3 style: rope_theta 500000, llama3 scaling with original context 64 < the 80-token sequence, tied head.
    # With Dh = 16 the 8 wavelengths span all three bands of the llama3 rule (kept, blended, divided by factor).
    tokens = rng.integers(2, V, size=80)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model = build(LlamaConfig, LlamaForCausalLM, 2, vocab_size=V, max_position_embeddings=256,
                  tie_word_embeddings=True, rope_parameters=rope)
    print("  llama3 scaling changes logits by", differs(model, tokens, rope_parameters={"rope_type": "default",
                                                                                        "rope_theta": 500000.0}))
    save(model, os.path.join(out, "llama3_tied"), tokenizer, tokens, prompt)

    # Mistral with a 16-position sliding window, shorter than the 40-token sequence and the greedy run.
    tokens = rng.integers(2, V, size=40)
    model = build(MistralConfig, MistralForCausalLM, 13, vocab_size=V, max_position_embeddings=128,
                  sliding_window=16, head_dim=16)
    print("  sliding window changes logits by", differs(model, tokens, sliding_window=None))
    save(model, os.path.join(out, "mistral_window"), tokenizer, tokens, prompt)

    # Qwen2: biases on q/k/v (drawn non-zero), rope_theta 1e6.
    tokens = rng.integers(2, V, size=40)
    model = build(Qwen2Config, Qwen2ForCausalLM, 4, vocab_size=V, max_position_embeddings=128,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, use_sliding_window=False)
    print("  q/k/v biases change logits by", _bias_effect(model, tokens))
    save(model, os.path.join(out, "qwen2_bias"), tokenizer, tokens, prompt)

    # BF16 on disk; references computed in float32 from the bf16-rounded weights.
    tokens = rng.integers(2, V, size=40)
    model = build(LlamaConfig, LlamaForCausalLM, 5, vocab_size=V, max_position_embeddings=128)
    save(model, os.path.join(out, "llama_bf16"), tokenizer, tokens, prompt, dtype=torch.bfloat16)

    # Sharded: several safetensors files and model.safetensors.index.json.
    tokens = rng.integers(2, V, size=40)
    model = build(LlamaConfig, LlamaForCausalLM, 6, vocab_size=V, max_position_embeddings=128,
                  num_key_value_heads=4)
    save(model, os.path.join(out, "llama_sharded"), tokenizer, tokens, prompt, max_shard_size="100KB")


if __name__ == "__main__":
    main()
