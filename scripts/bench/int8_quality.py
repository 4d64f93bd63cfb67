"""Quality of 8-bit activations: stories260K (FFN zero-padded to 192) in Q8_0 or Q4_0, its next-token distribution
as npllm's Numba model computes it (weights kept in their type, every product on int8 activation blocks) against
the same weights dequantized and multiplied in float32 (the exact dequantized model).

    python scripts/bench/int8_quality.py [--type Q8_0] [--stories 12] [--ctx 128]

The text is `stories` stories sampled from the float checkpoint (seeds 1..stories, temperature 1, top-p 0.95); the
measure is llama.cpp's --kl-divergence one (npllm.evaluate.kl_divergence): mean KL(dequantized || int8) over the
second half of each ctx-token chunk, and how often the most probable next token is the same.
"""

import argparse

import numpy as np

import npllm
from npllm import quant
from npllm.evaluate import kl_divergence
from npllm.formats.gguf_write import tensor_type_for
from npllm.formats.llama2c import read_llama2c
from npllm.models import make_model
from npllm.tokenizer import load_tokenizer


def pad_ffn(config, weights, hidden: int):
    """The same function with a wider FFN: extra gate/up rows and down columns of zeros add silu(0) * 0 = 0."""
    padded = dict(weights)
    extra = hidden - config.hidden_dim
    for l in range(config.n_layers):
        for name in ("w1", "w3"):
            w = weights[f"layers.{l}.{name}"]
            padded[f"layers.{l}.{name}"] = np.concatenate([w, np.zeros((extra, w.shape[1]), np.float32)])
        w2 = weights[f"layers.{l}.w2"]
        padded[f"layers.{l}.w2"] = np.concatenate([w2, np.zeros((w2.shape[0], extra), np.float32)], axis=1)
    return config.replace(hidden_dim=hidden), padded


def models(config, weights, qtype: str):
    """(npllm's Numba model on the quantized matrices, which multiplies them by 8-bit activations; the exact
    dequantized float model, the NumPy reference) over the same quantized matrices: every matrix in qtype, or
    where its rows do not split into qtype's blocks, in npllm quantize's fallback (Q8_0 for a K-quant)."""
    kept, exact = dict(weights), dict(weights)
    for name, w in weights.items():
        if w.ndim == 2:
            kept[name] = quant.QuantizedMatrix.from_values(w, tensor_type_for(w.shape, qtype))
            exact[name] = kept[name].dequantize()
    model = make_model(config, kept, "numba")
    assert qtype in model.weight_types  # the weights in their types, products on 8-bit activations
    return model, make_model(config, exact, "numpy")


def sampled_text(config, weights, tokenizer, stories: int) -> list[int]:
    llm = npllm.LLM(make_model(config, weights, "numba", None), tokenizer)
    ids = []
    for seed in range(1, stories + 1):
        ids += [config.bos_id] + list(llm.generate_ids([config.bos_id], 256, temperature=1.0, top_p=0.95, seed=seed))
    return ids


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", default="weights/stories260K/stories260K.bin")
    parser.add_argument("--type", default="Q8_0", choices=quant.INT8_ACTIVATION_TYPES)
    parser.add_argument("--stories", type=int, default=12)
    parser.add_argument("--ctx", type=int, default=128)
    args = parser.parse_args()
    config, weights = read_llama2c(args.checkpoint)
    tokenizer = load_tokenizer(str(args.checkpoint).replace("stories260K.bin", "tok512.bin"))
    config, weights = pad_ffn(config, weights, 192)
    ids = sampled_text(config, weights, tokenizer, args.stories)
    int8_model, exact_model = models(config, weights, args.type)
    d = kl_divergence(int8_model, exact_model, ids, args.ctx)
    print(f"stories260K {args.type}, int8 activations vs dequantized float32: {len(ids)} tokens, ctx {args.ctx}, "
          f"{d.tokens} positions scored in {d.chunks} chunks")
    print(f"  mean KL {d.mean_kl:.3e} +/- {d.kl_stderr:.1e}, top-1 agreement {100 * d.top1_agreement:.2f}%, "
          f"PPL int8 {d.ppl:.4f} vs dequantized {d.base_ppl:.4f}")


if __name__ == "__main__":
    main()
