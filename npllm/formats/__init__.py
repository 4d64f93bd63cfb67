"""Checkpoint readers. Each returns (ModelConfig, weights) with weights a dict of float32 arrays named as below.

Canonical weight names (Meta's, as in llama2.c), all matrices stored [out, in] so a projection is x @ W.T:

    tok_embeddings             [V, D]
    layers.{l}.attention_norm  [D]
    layers.{l}.wq              [H*Dh, D]     layers.{l}.bq [H*Dh]   (only with attention_bias)
    layers.{l}.wk              [K*Dh, D]     layers.{l}.bk [K*Dh]
    layers.{l}.wv              [K*Dh, D]     layers.{l}.bv [K*Dh]
    layers.{l}.wo              [D, H*Dh]
    layers.{l}.ffn_norm        [D]
    layers.{l}.w1              [F, D]        gate projection
    layers.{l}.w2              [D, F]        down projection
    layers.{l}.w3              [F, D]        up projection
    norm                       [D]
    output                     [V, D]        absent when config.tied_embeddings

Arrays may be read-only memory maps of the checkpoint file: nothing in npllm writes to a weight.
"""
