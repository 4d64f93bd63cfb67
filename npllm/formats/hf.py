"""Hugging Face checkpoints: a directory with config.json and model.safetensors (or shards listed in
model.safetensors.index.json), for the Llama family: model_type llama, mistral, qwen2.

The three architectures are one network with a few options, so config.json maps onto one ModelConfig:

    llama    the reference; optional RoPE scaling ("linear", "llama3"), optional tied embeddings
    mistral  + sliding-window attention over the last `sliding_window` positions
    qwen2    + biases on the q/k/v projections (never on o_proj)

HF stores q_proj/k_proj rows in the "half-split" RoPE layout (dimension i pairs with i + Dh/2); the weights are
returned as stored, with `rope_layout="half"`. `to_interleaved` converts to Meta's interleaved layout (pairs (2i, 2i+1))
for readers and tests that want it (npllm.tensors.permute_qk_half_to_interleaved); both layouts compute the same
logits.
"""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np

from ..config import MAX_LAYERS, ModelConfig, RopeScaling
from ..errors import ConfigError, FormatError
from ..tensors import check_weights, permute_qk_half_to_interleaved
from .safetensors import read_safetensors

CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ARCHITECTURES = ("llama", "mistral", "qwen2")

# HF parameter name -> canonical name (npllm/formats/__init__.py). `{l}` is the layer index.
LAYER_NAMES = {
    "input_layernorm.weight": "attention_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "w1",
    "mlp.down_proj.weight": "w2",
    "mlp.up_proj.weight": "w3",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings",
    "model.norm.weight": "norm",
    "lm_head.weight": "output",
}
# Buffers some older exports saved alongside the parameters; they are recomputed, never read.
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
LAYER_PARAM = re.compile(r"model\.layers\.(\d+)\.(.+)")


# ----------------------------------------------------------------------------------------------------------------
# config.json -> ModelConfig


def _field(cfg: dict, key: str, source: str, kind=int, default=None, required=True):
    value = cfg.get(key, default)
    if value is None:
        if required:
            raise ConfigError(f"{source}: required field {key!r} is missing")
        return None
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{source}: {key!r} must be an integer, got {value!r}")
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{source}: {key!r} must be a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{source}: {key!r} must be a finite number, got {value}")
    if kind is bool and not isinstance(value, bool):
        raise ConfigError(f"{source}: {key!r} must be true or false, got {value!r}")
    return value


def _rope_settings(cfg: dict, source: str) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from either spelling.

    Older configs: top-level `rope_theta` and `rope_scaling: {"type" | "rope_type": ..., "factor": ...}`.
    Newer configs: `rope_parameters: {"rope_type": ..., "rope_theta": ..., "factor": ...}`.
    """
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    if params is not None and scaling is not None and params != scaling:
        raise ConfigError(f"{source}: both 'rope_parameters' and 'rope_scaling' are given and they disagree")
    spec = params if params is not None else scaling
    if spec is not None and not isinstance(spec, dict):
        raise ConfigError(f"{source}: RoPE parameters must be a JSON object, got {spec!r}")
    spec = spec or {}

    theta_top = _field(cfg, "rope_theta", source, float, required=False)
    theta_inner = _field(spec, "rope_theta", source + " rope_parameters", float, required=False)
    if theta_top is not None and theta_inner is not None and theta_top != theta_inner:
        raise ConfigError(f"{source}: rope_theta {theta_top} disagrees with rope_parameters' {theta_inner}")
    theta = theta_inner if theta_inner is not None else theta_top
    theta = 10000.0 if theta is None else theta
    if not theta > 0:
        raise ConfigError(f"{source}: rope_theta must be > 0, got {theta}")

    kind = spec.get("rope_type", spec.get("type"))
    if kind in (None, "default"):
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", _field(spec, "factor", source + " rope scaling", float))
    if kind == "llama3":
        where = source + " llama3 rope scaling"
        return theta, RopeScaling(
            "llama3",
            factor=_field(spec, "factor", where, float),
            low_freq_factor=_field(spec, "low_freq_factor", where, float),
            high_freq_factor=_field(spec, "high_freq_factor", where, float),
            original_max_position_embeddings=_field(spec, "original_max_position_embeddings", where),
        )
    raise ConfigError(f"{source}: unsupported RoPE scaling type {kind!r} (npllm knows 'linear' and 'llama3')")


def _sliding_window(cfg: dict, arch: str, n_layers: int, source: str) -> int | None:
    """The attention window, which npllm applies to every layer alike.

    Mistral slides in every layer. Qwen2 slides only with `use_sliding_window`, and then only in layers from
    `max_window_layers` on; `layer_types`, when given, names each layer's kind and overrides both.
    """
    if arch == "llama":
        return None
    window = _field(cfg, "sliding_window", source, required=False)
    layer_types = cfg.get("layer_types")
    if layer_types is None:  # the set of kinds, without a list as long as a (maybe corrupt) layer count
        if arch == "qwen2":
            use = bool(cfg.get("use_sliding_window", False)) and window is not None
            first = _field(cfg, "max_window_layers", source, default=0) if use else n_layers
            kinds = {"full_attention"} if min(first, n_layers) > 0 else set()
            kinds |= {"sliding_attention"} if n_layers - first > 0 else set()
        else:
            kinds = {"full_attention" if window is None else "sliding_attention"}
    elif not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise ConfigError(f"{source}: 'layer_types' must list one type per layer ({n_layers})")
    else:
        kinds = set(map(str, layer_types))
    if not kinds <= {"full_attention", "sliding_attention"}:
        raise ConfigError(f"{source}: unknown layer types {sorted(map(str, kinds))}")
    if len(kinds) > 1:
        raise ConfigError(f"{source}: sliding-window layers mixed with full-attention layers are not supported")
    if kinds == {"sliding_attention"}:
        if window is None:
            raise ConfigError(f"{source}: layers use sliding attention but 'sliding_window' is not set")
        return window
    return None


def _eos_ids(eos, source: str) -> tuple[int, ...]:
    if isinstance(eos, int) and not isinstance(eos, bool):
        return (eos,)
    if isinstance(eos, list) and eos and all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
        return tuple(eos)
    raise ConfigError(f"{source}: 'eos_token_id' must be an integer or a non-empty list of them, got {eos!r}")


def _token_ids(cfg: dict, source: str, generation: dict | None) -> tuple[int | None, tuple[int, ...]]:
    """(bos id or None, end-of-sequence ids). A null or missing eos_token_id (transformers writes null for a Qwen2
    config without one) is taken from generation_config.json; absent there too, the model has no end token and
    generation stops at its length limit."""
    eos = cfg.get("eos_token_id")
    if eos is None and generation is not None:
        eos, source = generation.get("eos_token_id"), GENERATION_FILE
    eos_ids = () if eos is None else _eos_ids(eos, source)
    bos = cfg.get("bos_token_id")
    if bos is None and eos_ids:
        # Vocabularies without a BOS (GPT-2 style) use their end-of-text token for both.
        bos = eos_ids[0]
    bos = _field({"bos_token_id": bos}, "bos_token_id", source, required=False)
    return bos, eos_ids


def config_from_hf(cfg: dict, source: str = CONFIG_FILE, generation: dict | None = None) -> ModelConfig:
    """Map a parsed config.json onto ModelConfig (rope_layout "half": HF's q/k row order); `generation`, the parsed
    generation_config.json, supplies the end token when config.json has none."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{source}: not a JSON object")
    arch = cfg.get("model_type")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{source}: model_type {arch!r} is not one npllm runs ({', '.join(ARCHITECTURES)})")
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported (the Llama family uses 'silu')")
    if cfg.get("mlp_bias"):
        raise ConfigError(f"{source}: mlp_bias is not supported")
    attention_bias = arch == "qwen2"
    if arch == "llama" and cfg.get("attention_bias"):
        raise ConfigError(f"{source}: Llama attention_bias (which also biases o_proj) is not supported")

    n_layers = _field(cfg, "num_hidden_layers", source)
    if not 0 < n_layers <= MAX_LAYERS:  # before anything is sized by it
        raise ConfigError(f"{source}: num_hidden_layers {n_layers} is not a plausible layer count (1..{MAX_LAYERS})")
    n_heads = _field(cfg, "num_attention_heads", source)
    theta, scaling = _rope_settings(cfg, source)
    bos, eos_ids = _token_ids(cfg, source, generation)
    return ModelConfig(
        dim=_field(cfg, "hidden_size", source),
        hidden_dim=_field(cfg, "intermediate_size", source),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=_field(cfg, "num_key_value_heads", source, default=n_heads),
        vocab_size=_field(cfg, "vocab_size", source),
        max_seq_len=_field(cfg, "max_position_embeddings", source),
        head_dim=_field(cfg, "head_dim", source, required=False) or 0,
        norm_eps=_field(cfg, "rms_norm_eps", source, float),
        rope_theta=theta,
        rope_layout="half",
        rope_scaling=scaling,
        tied_embeddings=_field(cfg, "tie_word_embeddings", source, bool, default=False),
        attention_bias=attention_bias,
        sliding_window=_sliding_window(cfg, arch, n_layers, source),
        bos_id=bos,
        eos_ids=eos_ids,
        arch=arch,
    )


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"{path}: cannot read as JSON: {e}") from None


def read_config_json(path: str | os.PathLike) -> ModelConfig:
    """config.json, with generation_config.json beside it when there is one."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FormatError(f"{path}: not found (a Hugging Face checkpoint needs config.json)")
    cfg = _read_json(path)
    generation_path = os.path.join(os.path.dirname(path), GENERATION_FILE)
    generation = _read_json(generation_path) if os.path.isfile(generation_path) else None
    if generation is not None and not isinstance(generation, dict):
        raise FormatError(f"{generation_path}: not a JSON object")
    return config_from_hf(cfg, path, generation)


# ----------------------------------------------------------------------------------------------------------------
# RoPE layouts


def to_interleaved(config: ModelConfig, weights: dict[str, np.ndarray]) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """The same model with q/k rows (and biases) in the interleaved RoPE layout."""
    if config.rope_layout == "interleaved":
        return config, weights
    out = dict(weights)
    for l in range(config.n_layers):
        for name, heads in (("wq", config.n_heads), ("bq", config.n_heads), ("wk", config.n_kv_heads),
                            ("bk", config.n_kv_heads)):
            key = f"layers.{l}.{name}"
            if key in out:
                out[key] = permute_qk_half_to_interleaved(out[key], heads, config.head_dim)
    return config.replace(rope_layout="interleaved"), out


# ----------------------------------------------------------------------------------------------------------------
# Weights


def canonical_name(hf_name: str) -> str | None:
    """Canonical weight name for an HF parameter name; None for buffers to ignore. Unknown names raise."""
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    if IGNORED.fullmatch(hf_name):
        return None
    m = LAYER_PARAM.fullmatch(hf_name)
    if m and m.group(2) in LAYER_NAMES:
        return f"layers.{int(m.group(1))}.{LAYER_NAMES[m.group(2)]}"
    raise FormatError(f"unexpected tensor {hf_name!r}: not a parameter of a Llama-family model npllm knows")


def _shard_files(directory: str) -> tuple[list[str], dict | None]:
    """The safetensors files of a checkpoint directory: one file, or the shards its index lists."""
    index_path = os.path.join(directory, INDEX_FILE)
    single = os.path.join(directory, SINGLE_FILE)
    if os.path.exists(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                index = json.load(f)
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise FormatError(f"{index_path}: cannot read as JSON: {e}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise FormatError(f"{index_path}: 'weight_map' must map tensor names to file names")
        files = sorted(set(weight_map.values()))
        for name in files:
            if os.path.basename(name) != name:
                raise FormatError(f"{index_path}: shard {name!r} is not a plain file name in the checkpoint directory")
            if not os.path.exists(os.path.join(directory, name)):
                raise FormatError(f"{index_path}: shard {name!r} is listed but not present in {directory}")
        return [os.path.join(directory, n) for n in files], weight_map
    if os.path.exists(single):
        return [single], None
    found = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if len(found) == 1:
        return [os.path.join(directory, found[0])], None
    if found:
        raise FormatError(f"{directory}: several .safetensors files but no {INDEX_FILE} to say how they fit together")
    raise FormatError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}")


def read_hf(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read an HF checkpoint: a directory (or its index.json), or a .safetensors file with config.json beside it."""
    path = os.fspath(path)
    if path.endswith(INDEX_FILE):
        path = os.path.dirname(path) or "."
    if os.path.isdir(path):
        directory = path
        files, weight_map = _shard_files(directory)
    elif path.endswith(".safetensors"):
        directory = os.path.dirname(path) or "."
        files, weight_map = [path], None
    else:
        raise FormatError(f"{path}: neither a checkpoint directory nor a .safetensors file")
    config = read_config_json(os.path.join(directory, CONFIG_FILE))

    weights: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    seen: set[str] = set()
    for file in files:
        header, tensors = read_safetensors(file)
        seen |= set(tensors)
        for hf_name, array in tensors.items():
            if weight_map is not None and weight_map.get(hf_name) != os.path.basename(file):
                raise FormatError(f"{file}: holds {hf_name!r}, which {INDEX_FILE} places elsewhere")
            try:
                name = canonical_name(hf_name)
            except FormatError as e:
                raise FormatError(f"{file}: {e}") from None
            if name is None:
                continue
            if name in weights:
                raise FormatError(f"{file}: tensor {hf_name!r} also appears in {origin[name]}")
            weights[name], origin[name] = array, file
    if weight_map is not None:
        listed_missing = sorted(set(weight_map) - seen)
        if listed_missing:
            raise FormatError(f"{directory}: {INDEX_FILE} lists {listed_missing[0]!r} but no shard holds it")
    return config, check_weights(config, weights, directory)
