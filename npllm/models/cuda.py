"""CudaTransformer: the reference Transformer on an NVIDIA GPU, through the numba.cuda kernels of kernels/cuda.py.

Same interface (models/base.py), same arithmetic in float32; what differs:
    weights      uploaded once, stacked over layers (float32, or float16 or Q8_0 storage read into float32 sums)
    KV cache     CudaKVCache: RingKVCache's layout, resident on the device
    forward      returns the final hidden states as a *device* array [T, D]: activations never leave the GPU
    lm_head      brings logits to the host (for code that samples there; padding ids -inf, as every backend's)
    sample       runs the LM head and the sampler on the device over the tokenizer's ids only (a padded
                 vocabulary's rows are not even computed): only the token ids come back (sample_next's route)

A forward call of T tokens runs the forward kernel's schedule of steps (the embedding, each layer's stages, the final
norm; the layer loop is written once, in kernels/cuda.py _forward_kernel): matrix-vector products for T <= 8
(decode_step_kernel), tiled matrix-matrix products beyond (batch_step_kernel). Compiled cooperative, one launch runs
every step with a grid-wide barrier between them (numba's per-launch cost, ~10 us + 4 us per array argument, would
otherwise dominate decoding); where cooperative launches fail, the same kernel compiled without the barrier runs one
step a launch, the same arithmetic in the same order (the same bits).
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np

from .. import ops
from ..config import SCALING_FEATURES, ModelConfig
from ..device import cuda_problem, cuda_simulated
from ..errors import ConfigError, DeviceError, GenerationError
from ..quant import as_matrix, quantize_q8_0
from ..tensors import permute_qk_half_to_interleaved
from .base import Model, kv_storage, sampler_rows
from .weights import Weights, fused_qkv

STORAGES = ("float32", "float16", "q8_0")  # how the matrices (embedding and LM head included) live on the device


def _cuda():
    problem = cuda_problem()
    if problem is not None:
        raise DeviceError(f"the CUDA model cannot run: {problem}")
    from numba import cuda

    from ..kernels import cuda as kernels

    return cuda, kernels


class CudaKVCache:
    """RingKVCache's ring on the device: k, v [L, B, C, K, Dh] float32 and positions [B, C] int32 (-1 = empty).

    Entries are read only where `positions` says they are filled, so the ring starts uninitialised. `lengths`
    (the next position of each slot) lives on the host: only the host decides where a sequence continues.
    """

    def __init__(self, config: ModelConfig, capacity: int | None = None, slots: int = 1):
        cuda, _ = _cuda()
        capacity = config.max_seq_len if capacity is None else int(capacity)
        if capacity <= 0 or slots <= 0:
            raise GenerationError(f"KV cache capacity and slots must be positive, got {capacity} and {slots}")
        self.config, self.capacity, self.slots = config, capacity, slots
        shape = (config.n_layers, slots, capacity, config.n_kv_heads, config.head_dim)
        self.k = cuda.device_array(shape, np.float32)
        self.v = cuda.device_array(shape, np.float32)
        self.positions = cuda.to_device(np.full((slots, capacity), -1, np.int32))
        self.lengths = np.zeros(slots, np.int64)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def reset(self, slot: int | None = None) -> None:
        """Forget one slot (or all): its entries become empty and its next position 0."""
        if slot is None:
            self.positions.copy_to_device(np.full((self.slots, self.capacity), -1, np.int32))
            self.lengths[:] = 0
        else:
            self.positions[slot].copy_to_device(np.full(self.capacity, -1, np.int32))
            self.lengths[slot] = 0

    def to_host(self):
        """A RingKVCache holding a copy of this one (for inspection and tests)."""
        from ..cache import RingKVCache

        host = RingKVCache(self.config, self.capacity, self.slots, np.float32)
        host.positions[:] = self.positions.copy_to_host()
        filled = host.positions >= 0  # [B, C]: copy only those, the rest is uninitialised memory
        host.k[:, filled] = self.k.copy_to_host()[:, filled]
        host.v[:, filled] = self.v.copy_to_host()[:, filled]
        host.lengths[:] = self.lengths
        return host


class DeviceArray:
    """Hidden states on the GPU that index as generation code indexes a NumPy array (npllm.batching does).

    Basic indexing and reshape give views on the device (reshaping a strided view first copies it into a
    contiguous one, on the device); integers along the first axis (hidden[rows]) gather on the device;
    np.asarray and copy_to_host bring the values to the host. lm_head and sample take it as it is.
    """

    def __init__(self, data, model: "CudaTransformer"):
        self.data = data  # a numba device array
        self.model = model

    shape = property(lambda self: self.data.shape)
    ndim = property(lambda self: self.data.ndim)
    dtype = property(lambda self: self.data.dtype)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index):
        if isinstance(index, (list, np.ndarray)):
            return self._gather(np.asarray(index))
        picked = self.data[index]
        return DeviceArray(picked, self.model) if hasattr(picked, "copy_to_host") else picked

    def reshape(self, *shape):
        return DeviceArray(self._contiguous().reshape(*shape), self.model)

    def copy_to_host(self) -> np.ndarray:
        return self._contiguous().copy_to_host()

    def __array__(self, dtype=None, copy=None):
        return self.copy_to_host() if dtype is None else self.copy_to_host().astype(dtype)

    def _gather(self, rows: np.ndarray) -> "DeviceArray":
        """Rows by index (negative counts from the end).          # [R, D], [N] -> [N, D]"""
        if rows.ndim != 1 or rows.dtype.kind not in "iu" or self.ndim != 2:
            raise IndexError(f"a device array of shape {self.shape} takes basic indices or a 1-D array of row "
                             f"numbers, got an index of shape {rows.shape} and dtype {rows.dtype}")
        R = self.shape[0]
        if len(rows) and not (-R <= rows.min() and rows.max() < R):
            raise IndexError(f"row index out of range for {R} rows: {rows.min()}..{rows.max()}")
        cuda, g = self.model.cuda, self.model.geometry
        out = cuda.device_array((len(rows), self.shape[1]), self.dtype)
        if len(rows):
            index = cuda.to_device(np.ascontiguousarray(rows % R, np.int32))
            self.model.kernels.gather_rows_kernel()[g.grid(len(rows)), g.threads](self.data, index, out)
        return DeviceArray(out, self.model)

    def _contiguous(self):
        if self.data.is_c_contiguous():
            return self.data
        if self.ndim not in (2, 3):
            raise IndexError(f"only 2-D and 3-D strided device arrays can be copied, this one is {self.shape}")
        cuda, g = self.model.cuda, self.model.geometry
        out = cuda.device_array(self.shape, self.dtype)
        self.model.kernels.compact_kernel(self.ndim)[g.grid(int(np.prod(self.shape[:-1]))), g.threads](self.data, out)
        return out


@dataclasses.dataclass
class _Workspace:
    """Device buffers of one forward call of T tokens (kept and reused for the next call of the same T)."""

    meta: object  # [6, T] int32
    x: object  # [T, D] residual stream
    xn: object  # [T, D] normed input of a projection (tiled products)
    qkv: object  # [T, W]
    att: object  # [T, H Dh]
    gate_up: object  # [T, 2F] (tiled products)
    h: object  # [T, F]
    scores: object  # [blocks, C + T] attention scratch
    o: object  # [T, D] a block's output before its post-norm (block_norms "sandwich", "post")
    probs: object  # [T, E] the router's probabilities (E = 0 for a dense model)
    chosen: object  # [T, k] int32 the experts each token uses
    routed: object  # [T, k] their weights
    he: object  # [T, k, Fe] their hidden units


class CudaTransformer(Model):
    backend = "cuda"
    # every dense family's options, as run-time data of the one forward kernel (kernels.StepShape, StepWeights)
    FEATURES = Model.FEATURES | {"ffn_activation", "embedding_multiplier", "residual_multiplier", "attention_scale",
                                 "attn_logit_softcap", "qk_norm", "block_norms", "sliding_layers", "rope_local_theta",
                                 "n_experts", "partial_rotary_factor", "rope_layers", *SCALING_FEATURES}
    """The Transformer on the GPU. dtype: how matrices are stored (make_model passes what models.storage decides
    for the weight_dtype asked for; this model carries it out): float32, float16, or "q8_0" (GGUF's Q8_0 blocks,
    32 int8 values and a float16 scale, kernels.Q8_0_BLOCK), each weight widened to float32 as it is read, the sums
    in float32. With q8_0 a checkpoint's own Q8_0 matrices (quant.QuantizedMatrix, as formats.gguf's
    read_gguf_quantized gives them) go to the device byte for byte; any other matrix is quantized at load
    (quant.quantize_q8_0, rows zero-padded to whole blocks).
    geometry: kernels.Geometry (block sizes; the default suits the hardware or the simulator, whichever runs).
    one_launch: run each forward call as one cooperative launch (kernels.decode_step_kernel for up to 8 tokens,
    kernels.batch_step_kernel for more); when the device or toolkit cannot (no cooperative launch, no cudadevrt
    library), it warns once and runs the same kernel's steps one a launch, as with False."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], dtype=np.float32, geometry=None,
                 one_launch: bool = True):
        named = Weights.from_checkpoint(config, weights)
        storage = dtype if isinstance(dtype, str) else np.dtype(dtype).name
        if storage not in STORAGES:
            raise ConfigError(f"CudaTransformer stores weights as {', '.join(STORAGES)}, got {dtype!r}")
        self.cuda, self.kernels = _cuda()
        super().__init__(config)
        self.q8_0 = storage == "q8_0"
        # the device matrices' dtype (float32, float16 or the Q8_0 block record); forward computes in float32
        self.weight_dtype = np.dtype(self.kernels.Q8_0_BLOCK if self.q8_0 else storage)
        self.geometry = geometry or (self.kernels.SIMULATOR if cuda_simulated() else self.kernels.HARDWARE)
        if config.head_dim > self.kernels.MAX_HEAD_DIM:
            raise ConfigError(f"head_dim {config.head_dim} is above the CUDA kernels' limit "
                              f"{self.kernels.MAX_HEAD_DIM}")
        self._upload(named)
        self.rope_freqs, self.rope_positions = None, 0  # the frequencies [R, Dh/2] and positions of the tables
        self._capacities: dict[int, tuple] = {}  # per cache capacity: frequencies, windows, RoPE rows
        self._workspaces: dict[tuple[int, int], _Workspace] = {}
        self._grids: dict[tuple, int] = {}  # cooperative grid size of each step kernel, once compiled
        self.one_launch = one_launch

    # -- weights ------------------------------------------------------------------------------------------------

    def _upload(self, weights: Weights) -> None:
        """Stack each kind of tensor over the layers and copy it to the device, one layer at a time (no host copy
        of the whole model): wqkv = fused_qkv so one pass computes q, k and v (RoPE layout kept: the kernels know
        both), w13 = [w1; w3] for SwiGLU."""
        c, cuda = self.config, self.cuda
        L = c.n_layers
        matrix = self._matrix

        def stacked(layer_array):
            first = layer_array(weights.layers[0])
            dev = cuda.device_array((L, *first.shape), first.dtype)
            for l, layer in enumerate(weights.layers):
                dev[l].copy_to_device(first if l == 0 else layer_array(layer))
            return dev

        def vectors(*arrays):
            return np.ascontiguousarray(np.stack(arrays) if len(arrays) > 1 else arrays[0], dtype=np.float32)

        def gains(*arrays):  # norm gains, an empty axis where the family has none (the kernels then skip the norm)
            return vectors(*(np.zeros(0) if a is None else a for a in arrays))

        permute = self.key_layout != c.rope_layout  # partial rotary in HF's layout: see key_layout

        def qk_rows(*arrays):  # q and k rows (or q/k norm gains, [Dh] per head or [heads Dh]) in the kernels' order
            if not permute:
                return arrays
            return [a if a is None else a[permute_qk_half_to_interleaved(np.arange(len(a)), len(a) // c.head_dim,
                                                                         c.head_dim, c.rotary_dims)] for a in arrays]

        self.tok_embeddings = cuda.to_device(matrix(weights.tok_embeddings))
        self.output = self.tok_embeddings if c.tied_embeddings else cuda.to_device(matrix(weights.output))
        self.norms = stacked(lambda w: gains(w.attention_norm, w.ffn_norm))  # [L, 2, D or 0]
        self.q_norm = stacked(lambda w: gains(*qk_rows(w.q_norm)))  # [L, n]
        self.k_norm = stacked(lambda w: gains(*qk_rows(w.k_norm)))
        self.post_norms = stacked(lambda w: gains(w.post_attention_norm, w.post_ffn_norm))  # [L, 2, D or 0]
        self.final_norm = cuda.to_device(vectors(weights.norm))
        # [wq; wk; wv] (RoPE layout kept: the kernels know both) and [w1; w3], fused block row by block row, so a
        # checkpoint's Q8_0 blocks are never requantized
        self.wqkv = stacked(lambda w: np.concatenate([*qk_rows(matrix(w.wq), matrix(w.wk)), matrix(w.wv)]))
        self.bqkv = stacked(lambda w: vectors(fused_qkv(c, w, interleave_rope=permute)[1]))
        self.wo = stacked(lambda w: matrix(w.wo))
        self._upload_ffn(stacked, weights.layers)
        layers = sum(a.nbytes for a in (self.norms, self.final_norm, self.wqkv, self.bqkv, self.wo, self.w13, self.w2,
                                        self.q_norm, self.k_norm, self.post_norms, self.router, self.w13_exps,
                                        self.w2_exps))
        # A decode step streams every layer and the LM head; of the embedding it reads only the tokens' rows.
        self.step_weight_bytes = layers + self.output.nbytes
        self.weight_bytes = layers + self.output.nbytes + (0 if c.tied_embeddings else self.tok_embeddings.nbytes)

    def _upload_ffn(self, stacked, layers) -> None:
        """The feed-forward's matrices, stacked over the layers by `stacked` (_upload's): dense w13 = [w1; w3]
        [L, 2, F, D] and w2 [L, D, F], or the experts' router [L, E, D] (float32), w13_exps [L, E, 2, Fe, D] and
        w2_exps [L, E, D, Fe]; the kind a model lacks has an empty axis (F = 0, or E = 0), as the kernels expect."""
        c, matrix = self.config, self._matrix
        cols = matrix(np.zeros((1, c.dim), np.float32)).shape[1]  # D, or its Q8_0 blocks
        if c.n_experts:
            if any(w.router is None for w in layers):
                raise ConfigError("the cuda backend runs a mixture of experts only where every layer routes")
            self.w13 = stacked(lambda w: np.zeros((2, 0, cols), self.weight_dtype))
            self.w2 = stacked(lambda w: np.zeros((c.dim, 0), self.weight_dtype))
            self.router = stacked(lambda w: self._rounded(w.router))
            self.w13_exps = stacked(lambda w: np.stack([np.stack([matrix(w.w1_exps[e]), matrix(w.w3_exps[e])])
                                                        for e in range(c.n_experts)]))
            self.w2_exps = stacked(lambda w: np.stack([matrix(w.w2_exps[e]) for e in range(c.n_experts)]))
        else:
            self.w13 = stacked(lambda w: np.stack([matrix(w.w1), matrix(w.w3)]))
            self.w2 = stacked(lambda w: matrix(w.w2))
            self.router = stacked(lambda w: np.zeros((0, c.dim), np.float32))
            self.w13_exps = stacked(lambda w: np.zeros((0, 2, 0, cols), self.weight_dtype))
            self.w2_exps = stacked(lambda w: np.zeros((0, c.dim, 0), self.weight_dtype))

    def _rounded(self, w) -> np.ndarray:
        """A matrix's values as this model's storage rounds them, in float32: the router, which the kernels read
        as float32, holds the numbers the NumPy model computes with under the same weight_dtype."""
        if self.q8_0:
            blocks = q8_0_blocks(w, self.kernels.Q8_0_BLOCK)  # [N, K / 32] of (d, qs[32])
            values = blocks["d"].astype(np.float32)[..., None] * blocks["qs"].astype(np.float32)
            return np.ascontiguousarray(values.reshape(len(blocks), -1)[:, :as_matrix(w).shape[1]])
        return np.ascontiguousarray(np.asarray(self._matrix(w)), dtype=np.float32)

    @property
    def key_layout(self) -> str:
        """The kernels pair (2i, 2i+1) or (i, i + Dh/2): a partial rotary in Hugging Face's layout, whose pairs are
        (i, i + r/2), is uploaded in the interleaved one (its first r rows of each head permuted at _upload)."""
        c = self.config
        return "half" if c.rope_layout == "half" and c.rotary_dims == c.head_dim else "interleaved"

    def _matrix(self, w) -> np.ndarray:
        """A host matrix as the device stores it: float32 or float16 [N, K], or Q8_0 blocks [N, ceil(K / 32)]."""
        if self.q8_0:
            return q8_0_blocks(w, self.kernels.Q8_0_BLOCK)
        return np.ascontiguousarray(w, dtype=self.weight_dtype)

    def _rope_table(self, freqs: np.ndarray, positions: int) -> None:
        """cos, sin [R, P, Dh/2] of positions 0 .. P-1 for each row of frequencies and amplitudes [R, 2, Dh/2]
        (Model.padded_rope_tables), the very numbers ops.rope_angles gives the NumPy model."""
        tables = [ops.rope_angles(np.arange(positions), row, np.float32, amplitude) for row, amplitude in freqs]
        self.cos = self.cuda.to_device(np.stack([cos for cos, _ in tables]))
        self.sin = self.cuda.to_device(np.stack([sin for _, sin in tables]))
        self.rope_freqs, self.rope_positions = freqs, positions

    def _per_capacity(self, capacity: int) -> tuple:
        """For a cache of `capacity` positions: the RoPE frequencies and amplitudes [R, 2, Dh/2]
        (Model.padded_rope_tables: a row per kind of layer, pairs past the rotary dims turning by angle 0), and on
        the device each layer's
        window [L] and row of the RoPE tables [L] (int32), as Model.windows and Model.rope_rows say."""
        if capacity not in self._capacities:
            cuda = self.cuda
            freqs = self.padded_rope_tables()  # [R, 2, Dh/2]: full attention (, sliding) (, no RoPE)
            rows = self.rope_rows().astype(np.int32)
            windows = cuda.to_device(self.windows(capacity).astype(np.int32))
            self._capacities[capacity] = (freqs, windows, cuda.to_device(rows))
        return self._capacities[capacity]

    # -- the forward pass ---------------------------------------------------------------------------------------

    def new_cache(self, capacity: int | None = None, slots: int = 1, kv_dtype: str | None = None) -> CudaKVCache:
        if kv_dtype is not None and kv_storage(kv_dtype) != np.float32:
            raise ConfigError(f"kv_dtype {kv_dtype}: the cuda backend's cache stores float32")
        return CudaKVCache(self.config, capacity, slots)

    def move_cached_keys(self, cache, slot: int, src, dst, shift: int) -> None:
        """Not on the GPU yet: the ring lives in device memory and no kernel re-rotates its keys."""
        raise GenerationError("attention sinks (context_policy='sinks') are not supported by the cuda backend "
                              "(its KV cache lives on the GPU): use backend='numba', or context_policy='truncate'")

    def forward(self, tokens, positions, cache: CudaKVCache, slots=None) -> DeviceArray:
        """Final-norm hidden states of the given tokens, updating the cache.      # [T], [T], [T] -> [T, D] on the GPU

        As Model.forward: slots[t] is the cache slot of token t (all 0 when omitted); within a slot,
        tokens come in increasing position order and follow what the slot's cache already holds.
        """
        meta = self._meta(tokens, positions, slots, cache)
        T = meta.shape[1]
        ws = self._workspace(T, cache)
        ws.meta.copy_to_device(meta)
        hidden = self.cuda.device_array((T, self.config.dim), np.float32)
        if self.one_launch:
            self._one_launch(ws, cache, hidden)
        else:
            self._step_by_step(ws, cache, hidden)
        for slot in np.unique(meta[2]):
            cache.lengths[slot] = max(cache.lengths[slot], int(meta[1][meta[2] == slot].max()) + 1)
        return DeviceArray(hidden, self)

    def _meta(self, tokens, positions, slots, cache: CudaKVCache) -> np.ndarray:
        """[6, T] int32 rows TOKEN, POS, SLOT, KEEP, RING, FIRST (see kernels/cuda.py), checked: out-of-range
        indices on a GPU read or write other memory silently, so they are refused here."""
        tokens, positions, slots = self.call_arrays(tokens, positions, slots)
        if len(tokens) == 0:
            raise GenerationError("a forward call on the GPU needs at least one token")
        self.check_call(tokens, positions, slots, cache)
        if positions.max() >= np.iinfo(np.int32).max:
            raise GenerationError(f"positions must lie in [0, 2^31 - 1), got {positions.min()}..{positions.max()}")
        freqs = self._per_capacity(cache.capacity)[0]
        if freqs is not self.rope_freqs and not np.array_equal(freqs, self.rope_freqs):  # longrope's, by capacity
            self._rope_table(freqs, max(int(positions.max()) + 1, self.config.max_seq_len))
        elif positions.max() >= self.rope_positions:
            self._rope_table(freqs, max(int(positions.max()) + 1, 2 * self.rope_positions))
        # When one call brings more than C positions of a slot, only its last C survive in the ring.
        last = {int(s): int(positions[slots == s].max()) for s in np.unique(slots)}
        keep = np.array([p > last[int(s)] - cache.capacity for p, s in zip(positions, slots)])
        # Positions p < length sit at index p % C: the ring entries that can be filled are its first min(length, C).
        ring = np.minimum(cache.lengths[slots], cache.capacity)
        first = np.array([np.argmax(slots == s) for s in slots])  # attention scans this call from there to t
        return np.stack([tokens, positions, slots, keep, ring, first]).astype(np.int32)

    def _workspace(self, T: int, cache: CudaKVCache) -> _Workspace:
        key = (T, cache.capacity)
        if key not in self._workspaces:
            c, cuda = self.config, self.cuda
            W = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
            blocks = self.geometry.attention_blocks

            def buf(*shape, dtype=np.float32):
                return cuda.device_array(shape, dtype)

            if len(self._workspaces) >= 4:  # decode reuses one T; prefills of many lengths must not pile up
                self._workspaces.pop(next(iter(self._workspaces)))
            self._workspaces[key] = _Workspace(
                meta=buf(6, T, dtype=np.int32), x=buf(T, c.dim), xn=buf(T, c.dim), qkv=buf(T, W),
                att=buf(T, c.n_heads * c.head_dim), gate_up=buf(T, 2 * c.hidden_dim), h=buf(T, c.hidden_dim),
                scores=buf(blocks, cache.capacity + T), o=buf(T, c.dim), probs=buf(T, c.n_experts),
                chosen=buf(T, c.n_experts_used, dtype=np.int32), routed=buf(T, c.n_experts_used),
                he=buf(T, c.n_experts_used, c.expert_hidden_dim or c.hidden_dim))
        return self._workspaces[key]

    def _heads(self):
        c = self.config
        return np.int32(c.n_heads), np.int32(c.n_kv_heads), np.int32(c.head_dim)

    def _one_launch(self, ws: _Workspace, cache: CudaKVCache, hidden) -> None:
        """Every step of the forward kernel's schedule in one cooperative launch; where that fails, a warning, and
        step by step from then on."""
        key, kernel, threads, args = self._forward_kernel(ws, cache, hidden, cooperative=True)
        args += (np.int32(0), np.int32(self._steps(ws)))
        blocks = self._grids.get(key)
        if blocks is not None:
            kernel[blocks, threads](*args)
            return
        try:  # the first launch compiles: that is where a missing cooperative-launch support shows
            blocks = min(self.geometry.max_blocks, cooperative_blocks(kernel, args, threads))
            kernel[blocks, threads](*args)
        except Exception as e:  # noqa: BLE001 - whatever the driver or linker says, the stage path still works
            warnings.warn(f"npllm: one-launch CUDA forward failed ({type(e).__name__}: {e}); running every stage "
                          "as its own launch from now on", RuntimeWarning, stacklevel=3)
            self.one_launch = False
            self._step_by_step(ws, cache, hidden)
            return
        self._grids[key] = blocks

    def _step_by_step(self, ws: _Workspace, cache: CudaKVCache, hidden) -> None:
        """The same schedule, one step a launch, the kernel compiled without the grid-wide barrier."""
        _, kernel, threads, args = self._forward_kernel(ws, cache, hidden, cooperative=False)
        launch = kernel[self.geometry.max_blocks, threads]
        for step in range(self._steps(ws)):
            launch(*args, np.int32(step), np.int32(1))

    def _steps(self, ws: _Workspace) -> int:
        return self.kernels.forward_steps(self.config.n_layers, ws.x.shape[0] > self.kernels.MAX_ROWS)

    def _forward_kernel(self, ws: _Workspace, cache: CudaKVCache, hidden, cooperative: bool):
        """(cache key, kernel, threads per block, arguments before first and count) of the forward kernel for this
        call: kernels.decode_step_kernel (matrix-vector products, compiled for 1 or 8 token rows) for up to 8
        tokens, kernels.batch_step_kernel (tiled products) for more."""
        c, k, g = self.config, self.kernels, self.geometry
        T, L = ws.x.shape[0], c.n_layers
        interleaved = self.key_layout == "interleaved"
        if T <= k.MAX_ROWS:
            rows = 1 if T == 1 else k.MAX_ROWS
            key, threads = ("decode", rows), g.threads
            kernel = k.decode_step_kernel(rows, g.threads, g.lanes, interleaved, self.q8_0, cooperative)
            w13 = self.w13
        else:
            key, threads = ("batch",), g.matmul_threads
            kernel = k.batch_step_kernel(g.tile, interleaved, self.q8_0, cooperative)
            w13 = self.w13.reshape(L, 2 * self.w13.shape[2], self.w13.shape[3])  # W1's rows, then W3's: one product
        weights = k.StepWeights(self.tok_embeddings, self.norms, self.wqkv, self.bqkv, self.wo, w13, self.w2,
                                self.final_norm, self.q_norm, self.k_norm, self.post_norms, self.router, self.w13_exps,
                                self.w2_exps)
        _, windows, rope_rows = self._per_capacity(cache.capacity)
        f32 = np.float32
        shape = k.StepShape(f32(c.norm_eps), *self._heads(), f32(c.score_scale), f32(c.attn_logit_softcap),
                            np.int32(k.ACTIVATIONS.index(c.ffn_activation)), f32(c.embedding_multiplier),
                            f32(c.residual_multiplier), windows, rope_rows, np.int32(c.expert_weights_norm))
        work = k.StepWork(ws.x, ws.xn, ws.qkv, ws.att, ws.gate_up, ws.h, ws.scores, ws.o, ws.probs, ws.chosen,
                          ws.routed, ws.he)
        args = (kernel_record(weights), kernel_record(shape), self.cos, self.sin, ws.meta,
                kernel_record(k.StepCache(cache.k, cache.v, cache.positions)), kernel_record(work), hidden)
        return key, kernel, threads, args

    def _matmul(self, x, w, y, residual: bool) -> None:
        """y (+)= x W^T: the matrix-vector kernel for up to MAX_ROWS rows of x, else the tiled matrix-matrix one.
                                                                                     # [M, K], [N, K] -> [M, N]"""
        k, g = self.kernels, self.geometry
        M, N = x.shape[0], w.shape[0]
        if M <= k.MAX_ROWS:
            rows = 1 << (M - 1).bit_length()  # compiled for 1, 2, 4 or 8 rows
            per_block = g.threads // g.lanes * max(1, k.MAX_ROWS // rows)  # output rows a block takes at a time
            kernel = k.matvec_kernel(rows, g.threads, g.lanes, False, residual, False, self.q8_0)
            kernel[g.grid(-(-N // per_block)), g.threads](x, self.final_norm, np.float32(0), w, y, np.float32(1),
                                                          np.int32(0))
        else:
            BM, BN = g.tile[:2]
            tiles = -(-M // BM) * -(-N // BN)
            k.matmul_kernel(g.tile, residual, self.q8_0)[g.grid(tiles), g.matmul_threads](x, w, y, np.float32(1))

    # -- logits and sampling ------------------------------------------------------------------------------------

    def _device_logits(self, h, ids: int | None = None):
        """Logits of the first `ids` ids (default all V) on the device.  # [T, D] -> device [T, ids]"""
        if isinstance(h, DeviceArray):
            h = h.data
        elif not hasattr(h, "copy_to_host"):  # a host array: upload it
            h = self.cuda.to_device(np.ascontiguousarray(h, np.float32))
        ids = self.config.vocab_size if ids is None else ids
        logits = self.cuda.device_array((h.shape[0], ids), np.float32)
        self._matmul(h, self.output if ids == self.config.vocab_size else self.output[:ids], logits, residual=False)
        return logits

    def synchronize(self) -> None:
        """Wait until the device has finished what was queued (launches return before the work is done)."""
        self.cuda.synchronize()

    def head_logits(self, h) -> np.ndarray:
        """Logits from final hidden states, on the host.  # [T, D] -> [T, V]"""
        return self._device_logits(h).copy_to_host()

    def sample(self, h, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, uniforms=0.0) -> np.ndarray:
        """Token ids chosen on the device from final hidden states, one per row: greedy at temperature 0, else
        sampling.sample_with's draw with the given uniform numbers in [0, 1) (kernels.sample_rows). Each option is
        one value for every row or one per row. Only the tokenizer's ids are computed and drawn from (the first
        config.usable_vocab): the same draw as from lm_head's logits, whose padding ids are -inf.
                                                                    # [B, D] -> [B] int ids on the host"""
        k, g = self.kernels, self.geometry
        logits = self._device_logits(h, self.config.usable_vocab)
        B, V = logits.shape
        params = sampler_rows(B, temperature, top_k, top_p, min_p, uniforms, np.float32)
        params[:, 4] = np.minimum(params[:, 4], UNIFORM_MAX)
        ids = self.cuda.device_array(B, np.int32)
        probs = self.cuda.device_array((B, V), np.float32)
        launch = k.sample_kernel(g.sampler_threads)[g.grid(B), g.sampler_threads]
        launch(logits, self.cuda.to_device(params), probs, ids)
        return ids.copy_to_host()


def q8_0_blocks(w, block_type: np.dtype) -> np.ndarray:
    """W [N, K] as Q8_0 blocks [N, ceil(K / 32)] of block_type (kernels.Q8_0_BLOCK): a Q8_0 QuantizedMatrix's own
    bytes, else quant.quantize_q8_0 of its float32 values, each row zero-padded to whole blocks (a zero changes no
    block's scale, and the kernels never read past K)."""
    m = as_matrix(w)
    if m.qtype == "Q8_0":
        raw = np.ascontiguousarray(m.raw)
    else:
        values = np.asarray(m, dtype=np.float32)
        N, K = values.shape
        padded = np.zeros((N, -(-K // 32) * 32), np.float32)
        padded[:, :K] = values
        raw = quantize_q8_0(padded).reshape(N, -1)
    return raw.view(block_type)


def device_bandwidth_gb_s(mib: int = 2048, repeat: int = 5) -> float:
    """The GPU's memory bandwidth: a device-to-device copy of `mib` MiB reads and writes each byte once; best of
    `repeat`. Decoding at batch 1 streams every weight once per token, so this is its roofline."""
    import time

    cuda, _ = _cuda()
    a = cuda.to_device(np.ones(mib * 2**20 // 4, np.float32))
    b = cuda.device_array_like(a)
    best = float("inf")
    for _ in range(repeat):
        cuda.synchronize()
        start = time.perf_counter()
        b.copy_to_device(a)
        cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * a.nbytes / best / 1e9


def kernel_record(record):
    """A record of device arrays as a kernel argument (kernels.StepWeights, ...). On hardware, as it is. The
    simulator wraps a kernel's top-level array arguments (so that a record dtype's fields read as attributes,
    Q8_0's block.d) but not those inside a tuple: here they get the same wrapper."""
    if not cuda_simulated():
        return record
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray, FakeWithinKernelCUDAArray

    return type(record)(*(FakeWithinKernelCUDAArray(v) if isinstance(v, FakeCUDAArray) else v for v in record))


UNIFORM_MAX = np.nextafter(np.float32(1), np.float32(0))  # a float64 uniform below 1 may round up to 1 in float32


def cooperative_blocks(kernel, args, threads: int) -> int:
    """How many blocks of `threads` threads of this kernel fit on the device at once (a cooperative launch must
    not exceed it). The simulator runs cooperative grids of one block only."""
    if cuda_simulated():
        return 1
    argtypes = tuple(kernel.typeof_pyval(a) for a in args)
    return kernel.compile(argtypes).max_cooperative_grid_blocks(threads)
