"""Hugging Face checkpoints: a directory with config.json and model.safetensors (or shards listed in
model.safetensors.index.json), for the families hf_families.py lists (llama, mistral, qwen2, qwen3, qwen3_moe,
mixtral, olmo2, granite, gemma2, gemma3, phi3, smollm3).

They are one network with a few options, so config.json maps onto one ModelConfig; hf_families.py says what each
family adds (its parameter names and its config fields), this module does the rest once for all.

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
from .hf_families import FAMILIES, Family, dynamic_ntk, longrope, rope_layers, yarn
from .safetensors import read_safetensors

CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ARCHITECTURES = tuple(FAMILIES)
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings",
    "model.norm.weight": "norm",
    "lm_head.weight": "output",
}
# Buffers some older exports saved alongside the parameters; they are recomputed, never read.
# Multimodal checkpoints' image towers and projectors are not read either.
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq|(model\.)?(vision_tower|multi_modal_projector)\..*")
LAYER_PARAM = re.compile(r"model\.layers\.(\d+)\.(.+)")
BARE_DECODER = re.compile(r"layers\.\d+\.|embed_tokens\.weight$|norm\.weight$")
# sentence-transformers' files beside config.json: the modules in order, and the pooling module's settings
MODULES_FILE = "modules.json"
POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
# One expert's projection (Mixtral: block_sparse_moe.experts.{e}.w1/w2/w3; Qwen3-MoE: mlp.experts.{e}.gate_proj/...),
# stacked into the 3-D [E, ...] canonical tensors at load.
EXPERT_PARAM = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
EXPERT_NAMES = {"w1": "w1_exps", "gate_proj": "w1_exps", "w2": "w2_exps", "down_proj": "w2_exps", "w3": "w3_exps",
                "up_proj": "w3_exps"}


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


def _rope_spec(cfg: dict, source: str, layer_type: str) -> dict:
    """The RoPE parameters of one kind of layer, from either spelling: older configs' top-level `rope_theta` and
    `rope_scaling: {"type" | "rope_type": ..., "factor": ...}`, newer configs' `rope_parameters`, which Gemma 3 gives
    per layer type ({"full_attention": {...}, "sliding_attention": {...}})."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    if isinstance(params, dict) and layer_type in params:
        params = params[layer_type]
    if params is not None and scaling is not None and params != scaling:
        raise ConfigError(f"{source}: both 'rope_parameters' and 'rope_scaling' are given and they disagree")
    spec = params if params is not None else scaling
    if spec is not None and not isinstance(spec, dict):
        raise ConfigError(f"{source}: RoPE parameters must be a JSON object, got {spec!r}")
    return spec or {}


def _rope_settings(cfg: dict, source: str, family: Family) -> dict:
    """ModelConfig's RoPE fields: the base, scaling and rotated fraction of the full-attention layers, and the base of
    sliding layers (0: theirs too)."""
    spec = _rope_spec(cfg, source, "full_attention")
    theta = _rope_number(cfg, spec, "rope_theta", 10000.0, source)
    if not theta > 0:
        raise ConfigError(f"{source}: rope_theta must be > 0, got {theta}")
    fraction = _rope_number(cfg, spec, "partial_rotary_factor", 1.0, source)
    return dict(rope_theta=theta, rope_scaling=_rope_scaling(spec, cfg, source, family),
                partial_rotary_factor=fraction, rope_local_theta=_local_theta(cfg, source, fraction))


def _rope_number(cfg: dict, spec: dict, key: str, default: float, source: str) -> float:
    """A RoPE setting from either layout, the one place that reads them: top level (transformers 4's config.json)
    or inside rope_parameters (transformers 5 moved rope_theta and partial_rotary_factor there); both given must
    agree. ModelConfig checks the value's range."""
    top = _field(cfg, key, source, float, required=False)
    inner = _field(spec, key, source + " rope_parameters", float, required=False)
    if top is not None and inner is not None and top != inner:
        raise ConfigError(f"{source}: {key} {top} disagrees with rope_parameters' {inner}")
    return inner if inner is not None else top if top is not None else default


def _rope_scaling(spec: dict, cfg: dict, source: str, family: Family) -> RopeScaling | None:
    kind = spec.get("rope_type", spec.get("type"))
    kind = "longrope" if kind == "su" else kind  # Phi-3's first name for it
    if kind in (None, "default"):
        return None
    if kind not in family.rope_kinds:
        raise ConfigError(f"{source}: unsupported RoPE scaling type {kind!r} (npllm knows "
                          f"{', '.join(repr(k) for k in family.rope_kinds)} for {cfg.get('model_type')})")
    if kind == "linear":
        return RopeScaling("linear", _field(spec, "factor", source + " rope scaling", float))
    if kind == "longrope":
        return longrope(spec, cfg, source, _field)
    if kind == "yarn":
        return yarn(spec, cfg, source, _field)
    if kind == "dynamic":
        return dynamic_ntk(spec, cfg, source, _field)
    where = source + " llama3 rope scaling"
    return RopeScaling(
        "llama3",
        factor=_field(spec, "factor", where, float),
        low_freq_factor=_field(spec, "low_freq_factor", where, float),
        high_freq_factor=_field(spec, "high_freq_factor", where, float),
        original_max_position_embeddings=_field(spec, "original_max_position_embeddings", where),
    )


def _local_theta(cfg: dict, source: str, fraction: float) -> float:
    """Gemma 3's RoPE base of sliding layers (rope_local_base_freq, or rope_parameters' sliding_attention); 0: none.
    fraction: the full-attention layers' partial_rotary_factor, which the sliding ones must share."""
    params = cfg.get("rope_parameters")
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    if isinstance(local, dict):
        where = source + " sliding_attention rope_parameters"
        theta = _field(local, "rope_theta", where, float)
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"{source}: RoPE scaling of sliding layers is not supported")
        local_fraction = _field(local, "partial_rotary_factor", where, float, default=fraction)
        if local_fraction != fraction:
            raise ConfigError(f"{where}: partial_rotary_factor {local_fraction} differs from the full-attention "
                              f"layers' {fraction}; npllm has one for all layers")
    else:
        theta = _field(cfg, "rope_local_base_freq", source, float, required=False) or 0.0
    if theta < 0:
        raise ConfigError(f"{source}: the RoPE base of sliding layers must be > 0, got {theta}")
    return theta


def _layer_types(cfg: dict, family: Family, n_layers: int, source: str) -> list[str] | None:
    """Each layer's kind ("full_attention" | "sliding_attention"), or None where the config lists none and the
    family's rule gives the same kind to every layer (then `_sliding_window` decides it)."""
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != n_layers:
            raise ConfigError(f"{source}: 'layer_types' must list one type per layer ({n_layers})")
        return [str(t) for t in layer_types]
    if cfg.get("model_type") == "gemma2":  # Gemma 2 slides in even layers
        return ["sliding_attention" if l % 2 == 0 else "full_attention" for l in range(n_layers)]
    if cfg.get("model_type") == "gemma3_text":  # every `sliding_window_pattern`-th layer is global
        pattern = _field(cfg, "sliding_window_pattern", source, default=6)
        return ["full_attention" if (l + 1) % pattern == 0 else "sliding_attention" for l in range(n_layers)]
    if family.sliding == "opt-in":  # SmolLM3: its layers without RoPE slide
        return ["full_attention" if rope else "sliding_attention" for rope in rope_layers(cfg, n_layers, source, _field)]
    return None


def _sliding_window(cfg: dict, family: Family, n_layers: int, source: str) -> tuple[int | None, tuple[bool, ...]]:
    """(the attention window, which layers use it: () for all).

    Mistral slides in every layer. Qwen2/3 slide only with `use_sliding_window`, and then only in layers from
    `max_window_layers` on; SmolLM3 only with `use_sliding_window`, in its layers without RoPE; Gemma alternates;
    `layer_types`, when given, names each layer's kind.
    """
    if family.sliding == "none" or (family.sliding == "opt-in" and not cfg.get("use_sliding_window", False)):
        return None, ()
    window = _field(cfg, "sliding_window", source, required=False)
    layer_types = _layer_types(cfg, family, n_layers, source)
    if layer_types is None and family.sliding == "qwen":
        use = bool(cfg.get("use_sliding_window", False)) and window is not None
        first = min(_field(cfg, "max_window_layers", source, default=0) if use else n_layers, n_layers)
        layer_types = ["full_attention"] * first + ["sliding_attention"] * (n_layers - first)
    if layer_types is None:
        return window, ()
    kinds = set(layer_types)
    if not kinds <= {"full_attention", "sliding_attention"}:
        raise ConfigError(f"{source}: unknown layer types {sorted(kinds)}")
    if "sliding_attention" in kinds and window is None:
        raise ConfigError(f"{source}: layers use sliding attention but 'sliding_window' is not set")
    if kinds == {"full_attention"}:
        return None, ()
    if kinds == {"sliding_attention"}:
        return window, ()
    return window, tuple(t == "sliding_attention" for t in layer_types)


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
    cfg = text_config(cfg, source)
    arch = cfg.get("model_type")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{source}: model_type {arch!r} is not one npllm runs ({', '.join(ARCHITECTURES)})")
    family = FAMILIES[arch]
    _check_unsupported(cfg, arch, family, source)
    n_layers = _field(cfg, "num_hidden_layers", source)
    if not 0 < n_layers <= MAX_LAYERS:  # before anything is sized by it
        raise ConfigError(f"{source}: num_hidden_layers {n_layers} is not a plausible layer count (1..{MAX_LAYERS})")
    n_heads = _field(cfg, "num_attention_heads", source)
    rope = _rope_settings(cfg, source, family)
    window, sliding_layers = _sliding_window(cfg, family, n_layers, source)
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
        rope_layout="half",
        **rope,
        tied_embeddings=_field(cfg, "tie_word_embeddings", source, bool, default=family.tied_default),
        attention_bias=family.attention_bias,
        sliding_window=window,
        sliding_layers=sliding_layers,
        bos_id=bos,
        eos_ids=eos_ids,
        arch=arch,
        **family.options(cfg, source, _field),
    )


def text_config(cfg: dict, source: str) -> dict:
    """The language model's config of a multimodal checkpoint (Gemma 3's model_type "gemma3" nests it as
    text_config; the image tower is not read), its token ids filled in from the outer config; others as they are."""
    if cfg.get("model_type") != "gemma3":
        return cfg
    inner = cfg.get("text_config")
    if not isinstance(inner, dict):
        raise ConfigError(f"{source}: a gemma3 config needs a text_config object")
    ids = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg and inner.get(k) is None}
    return {**inner, **ids, "model_type": "gemma3_text"}


def _check_unsupported(cfg: dict, arch: str, family: Family, source: str) -> None:
    """Refuse the config options npllm does not implement, each by name, before anything is built."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or family.activations[0]
    if act not in family.activations:
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported ({arch} uses {family.activations[0]!r})")
    if cfg.get("mlp_bias"):
        raise ConfigError(f"{source}: mlp_bias is not supported")
    if cfg.get("attention_bias") and not family.attention_bias:
        raise ConfigError(f"{source}: {arch} attention_bias (which also biases o_proj) is not supported")


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
    config = config_from_hf(cfg, path, generation)
    return config.replace(**sentence_transformers_pooling(os.path.dirname(path)))


def sentence_transformers_pooling(directory: str) -> dict:
    """ModelConfig's pooling and normalize_embeddings from sentence-transformers' modules.json (a Pooling module's
    config.json, a Normalize module); {} where there is no modules.json. One mode set, of POOLING_MODES: another
    (max, weighted mean, ...) or several are refused rather than replaced by a pooling the model was not trained
    with."""
    path = os.path.join(directory, MODULES_FILE)
    if not os.path.isfile(path):
        return {}
    modules = _read_json(path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise FormatError(f"{path}: not a list of module objects")
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
    found = {"normalize_embeddings": "Normalize" in kinds}
    if "Pooling" in kinds:
        pooling_path = os.path.join(directory, str(kinds["Pooling"].get("path", "")), CONFIG_FILE)
        settings = _read_json(pooling_path) if os.path.isfile(pooling_path) else None
        if not isinstance(settings, dict):
            raise FormatError(f"{pooling_path}: the Pooling module's settings are missing or not a JSON object")
        modes = [key for key, on in settings.items() if key.startswith("pooling_mode_") and on is True]
        if len(modes) != 1 or modes[0] not in POOLING_MODES:
            raise ConfigError(f"{pooling_path}: pooling {', '.join(modes) or 'none'} is not one npllm computes "
                              f"(one of {', '.join(POOLING_MODES)})")
        found["pooling"] = POOLING_MODES[modes[0]]
    return found


# ----------------------------------------------------------------------------------------------------------------
# RoPE layouts


def to_interleaved(config: ModelConfig, weights: dict[str, np.ndarray]) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """The same model with q/k rows (and biases, and q/k norm gains) in the interleaved RoPE layout."""
    if config.rope_layout == "interleaved":
        return config, weights
    out = dict(weights)
    H, K = config.n_heads, config.n_kv_heads
    per_head = config.qk_norm == "head"  # one [Dh] gain shared by every head: permuted as one head
    for l in range(config.n_layers):
        for name, heads in (("wq", H), ("bq", H), ("wk", K), ("bk", K), ("q_norm", 1 if per_head else H),
                            ("k_norm", 1 if per_head else K)):
            key = f"layers.{l}.{name}"
            if key in out:
                out[key] = permute_qk_half_to_interleaved(out[key], heads, config.head_dim, config.rotary_dims)
    return config.replace(rope_layout="interleaved"), out


# ----------------------------------------------------------------------------------------------------------------
# Weights


def canonical_name(hf_name: str, family: Family = FAMILIES["llama"]) -> str | tuple[str, int] | None:
    """Canonical weight name for an HF parameter name of `family`; (name, expert) for one expert's matrix; None for
    buffers to ignore. Unknown names raise."""
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    if IGNORED.fullmatch(hf_name):
        return None
    m = LAYER_PARAM.fullmatch(hf_name)
    if m and m.group(2) in family.names:
        return f"layers.{int(m.group(1))}.{family.names[m.group(2)]}"
    expert = EXPERT_PARAM.fullmatch(m.group(2)) if m else None
    if expert and expert.group(2) in EXPERT_NAMES and "router" in family.names.values():
        return f"layers.{int(m.group(1))}.{EXPERT_NAMES[expert.group(2)]}", int(expert.group(1))
    raise FormatError(f"unexpected tensor {hf_name!r}: not a parameter of a model npllm knows")


def language_model_name(hf_name: str) -> str:
    """A multimodal checkpoint's language-model parameters under the plain names ("language_model.model.layers.0..."
    or "model.language_model.layers.0..." -> "model.layers.0..."); its vision tower's become buffers to skip. A bare
    decoder's (Qwen3-Embedding saves the model without its LM head: "layers.0...", "embed_tokens.weight") get the
    "model." prefix."""
    for prefix, plain in (("language_model.model.", "model."), ("model.language_model.", "model."),
                          ("language_model.lm_head.", "lm_head.")):
        if hf_name.startswith(prefix):
            return plain + hf_name[len(prefix):]
    if BARE_DECODER.match(hf_name):
        return "model." + hf_name
    return hf_name


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
    family = FAMILIES[config.arch]

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
                name = canonical_name(language_model_name(hf_name), family)
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
    return config, check_weights(config, assembled(config, family, weights, directory), directory)


def assembled(config: ModelConfig, family: Family, weights: dict, source: str) -> dict[str, np.ndarray]:
    """The canonical set from what the files name: experts stacked, fused projections split, Gemma's (1 + w) norm
    gains made the gains applied."""
    experts = {name: weights.pop(name) for name in [n for n in weights if isinstance(n, tuple)]}
    out = dict(weights) | _stacked_experts(config, experts, source)
    for l in range(config.n_layers):
        out |= split_fused_layer(config, out, f"layers.{l}.", source)
    if family.norm_offset:
        for name in [n for n in out if n.endswith("norm")]:
            out[name] = np.asarray(out[name], np.float32) + np.float32(family.norm_offset)
    return out


def _stacked_experts(config: ModelConfig, experts: dict, source: str) -> dict[str, np.ndarray]:
    """{("layers.l.w1_exps", e): [Fe, D]} -> {"layers.l.w1_exps": [E, Fe, D]}; every expert 0..E-1 must be there."""
    by_name: dict[str, dict[int, np.ndarray]] = {}
    for (name, e), array in experts.items():
        by_name.setdefault(name, {})[e] = array
    stacked = {}
    for name, parts in by_name.items():
        if sorted(parts) != list(range(config.n_experts)):
            raise FormatError(f"{source}: {name} has experts {sorted(parts)[:4]}..., the config says "
                              f"{config.n_experts} (0..{config.n_experts - 1})")
        shapes = {parts[e].shape for e in parts}
        if len(shapes) > 1:
            raise FormatError(f"{source}: the experts of {name} differ in shape: {sorted(shapes)}")
        stacked[name] = np.stack([parts[e] for e in range(config.n_experts)])
    return stacked


def split_fused_layer(config: ModelConfig, weights: dict, prefix: str, source: str) -> dict[str, np.ndarray]:
    """Fused projections split along their output rows: Phi-3's qkv_proj [(H + 2K) Dh, D] -> wq, wk, wv and
    gate_up_proj [2F, D] -> w1 (the first F rows: the gate), w3; Granite-MoE's experts [E, 2Fe, D] -> w1_exps,
    w3_exps the same way. Nothing for other families."""
    out = {}
    HD, KD, F, Fe = (config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim, config.hidden_dim,
                     config.moe_hidden_dim)
    for fused, parts in (("wqkv", (("wq", HD), ("wk", KD), ("wv", KD))), ("w13", (("w1", F), ("w3", F))),
                         ("w13_exps", (("w1_exps", Fe), ("w3_exps", Fe)))):
        w = weights.pop(prefix + fused, None)
        if w is None:
            continue
        rows = w.shape[1] if fused.endswith("_exps") else w.shape[0]  # the experts' axis comes first
        if rows != sum(n for _, n in parts):
            raise FormatError(f"{source}: {prefix}{fused} has {rows} rows, the config implies {sum(n for _, n in parts)}")
        start = 0
        for name, n in parts:
            out[prefix + name], start = w[..., start:start + n, :], start + n
    return out
