"""npllm perplexity: a text's perplexity (llama.cpp's chunks or Hugging Face's strided windows), or the KL
divergence to a base model."""

from __future__ import annotations

import sys

from ..errors import GenerationError
from . import shared
from .parser import PERPLEXITY_MODES, check_combinations


def run_perplexity(args) -> int:
    import json

    from .. import load
    from ..evaluate import kl_divergence, perplexity, strided_perplexity

    check_combinations(args, PERPLEXITY_MODES)
    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise GenerationError(f"--text {args.text}: cannot read it ({e})") from None
    llm = shared.load_with_tokenizer(args, kv_dtype=args.kv_dtype)
    ids = llm._require_tokenizer().encode(text, bos=True)
    ctx = args.ctx or min(512, llm.config.max_seq_len)
    progress = sys.stderr.isatty()
    if args.kl_divergence is not None:
        # the base keeps a float32 cache: `--kv-dtype float16 --kl-divergence SAME_MODEL` measures the cache's rounding
        base = load(args.kl_divergence, args.tokenizer, backend=args.backend, threads=args.threads,
                    weight_dtype=args.weight_dtype, context=args.context)
        result = kl_divergence(llm.model, base.model, ids, ctx, args.batch, progress=progress)
        sentence = (f"mean KL = {result.mean_kl:.6f} +/- {result.kl_stderr:.6f} nats, top-1 agreement "
                    f"{100 * result.top1_agreement:.2f}% over {result.tokens} tokens; PPL {result.ppl:.4f} "
                    f"(base {result.base_ppl:.4f})")
    elif args.stride is not None:
        result = strided_perplexity(llm.model, ids, ctx, args.stride, progress=progress)
        sentence = f"PPL = {result.ppl:.4f} over {result.tokens} tokens in {result.chunks} windows (strided)"
    else:
        result = perplexity(llm.model, ids, ctx, args.batch, progress=progress)
        sentence = (f"PPL = {result.ppl:.4f} +/- {result.ppl_stderr:.5f} over {result.tokens} tokens in "
                    f"{result.chunks} chunks of {ctx}")
    print(json.dumps(result.as_dict()) if args.json else sentence)
    print(f"[npllm] {result.seconds:.2f} s", file=sys.stderr)
    return 0
