"""CPU backend: numpy float32 with BLAS sgemm/sgemv for every projection.

Weights are stored transposed to (in, out) and C-contiguous so `x @ W` is a plain NN sgemm;
q/k/v and gate/up are fused into one matrix each so a layer runs four matmuls. OpenBLAS splits
work by output blocks, so a given (shape, thread count) always gives the same bits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache

import numpy as np

from edge_llm.backends.cost import ForwardCost
from edge_llm.config import ModelArgs
from edge_llm.weights import Weights

log = logging.getLogger(__name__)


@cache  # numpy picks its loops at import and its BLAS kernels at load: fixed for the process
def numpy_kernels() -> str:
    """The kernels numpy computes float32 with in this process (part of `numerics`,
    docs/identity.md): its version, the SIMD targets its loops dispatch to on this CPU (exp,
    reductions, ...; `NPY_DISABLE_CPU_FEATURES` changes them) and the BLAS behind `np.matmul` with
    the kernel family it picked at load (OpenBLAS: per CPU, or `OPENBLAS_CORETYPE`). Each of them
    moves the last bits of the rows, e.g. `numpy-2.4.6-AVX512_SPR.X86_V3.X86_V4.baseline(X86_V2)
    :openblas-0.3.31.188.0-SkylakeX`."""
    from numpy.lib.introspect import opt_func_info
    from threadpoolctl import threadpool_info

    targets = sorted({sig["current"] for func in opt_func_info().values() for sig in func.values()})
    build = str(np.show_config(mode="dicts")["Build Dependencies"]["blas"].get("name", ""))
    blas = [f"{i['internal_api']}-{i['version']}-{i.get('architecture') or 'generic'}"
            for i in threadpool_info() if i["user_api"] == "blas" and i["internal_api"] in build]
    return f"numpy-{np.__version__}-{'.'.join(targets)}:{'+'.join(blas) or build or 'no-blas'}"


def swiglu(gu: np.ndarray, inter: int) -> np.ndarray:
    """silu(gate) * up of a fused (T, 2 inter) gate/up product: g / (1 + exp(-g)) * u, in that
    order of float32 operations (every numpy path computes the MLP with these bits)."""
    gate, up = gu[:, :inter], gu[:, inter:]
    with np.errstate(over="ignore"):  # exp(-g) -> inf for g << 0 gives silu = -0, correct
        act = np.exp(np.negative(gate))
    act += np.float32(1.0)
    np.divide(gate, act, out=act)
    act *= up
    return act


def cpu_numerics() -> str:
    """The numpy backends' `numerics`: F32 on numpy's kernels, which decide the last bits."""
    return f"cpu-f32:{numpy_kernels()}"


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """HF RMSNorm in float32 over the last axis: weight * x / sqrt(mean(x^2) + eps)."""
    var = np.mean(np.square(x), axis=-1, keepdims=True)
    return weight * (x * (np.float32(1.0) / np.sqrt(var + np.float32(eps))))


def _t(*mats: np.ndarray) -> np.ndarray:
    """Transpose (out, in) matrices into one contiguous (in, sum(out)) matrix, one copy each."""
    out = np.empty((mats[0].shape[1], sum(m.shape[0] for m in mats)), dtype=np.float32)
    col = 0
    for m in mats:
        out[:, col:col + m.shape[0]] = m.T
        col += m.shape[0]
    return out


@dataclass
class DenseLayer:
    """One decoder layer's dense tensors, F32, matrices transposed to (in, out) and fused.

    The graph exporter (`backends/graph/onnx_export.py`) builds its graphs from exactly these arrays.
    """

    in_norm: np.ndarray  # (hidden,)
    post_norm: np.ndarray  # (hidden,)
    w_qkv: np.ndarray  # (hidden, q_dim + 2 kv_dim)
    b_qkv: np.ndarray | None  # (q_dim + 2 kv_dim,) qwen2 only
    w_o: np.ndarray  # (q_dim, hidden)
    w_gu: np.ndarray  # (hidden, 2 inter): gate columns, then up columns
    w_down: np.ndarray  # (inter, hidden)

    @property
    def nbytes(self) -> int:
        arrs = (self.in_norm, self.post_norm, self.w_qkv, self.w_o, self.w_gu, self.w_down)
        return sum(a.nbytes for a in arrs) + (0 if self.b_qkv is None else self.b_qkv.nbytes)


def load_layer(args: ModelArgs, weights: Weights, i: int) -> DenseLayer:
    """Pop layer i's dense tensors from `weights` and fuse/transpose them."""
    lp = f"{args.weight_prefix}layers.{i}."
    return DenseLayer(
        in_norm=weights.pop(f"{lp}input_layernorm.weight"),
        post_norm=weights.pop(f"{lp}post_attention_layernorm.weight"),
        w_qkv=_t(*(weights.pop(f"{lp}self_attn.{n}_proj.weight") for n in "qkv")),
        b_qkv=(np.concatenate([weights.pop(f"{lp}self_attn.{n}_proj.bias") for n in "qkv"])
               if args.attention_bias else None),
        w_o=_t(weights.pop(f"{lp}self_attn.o_proj.weight")),
        w_gu=_t(*(weights.pop(f"{lp}mlp.{n}_proj.weight") for n in ("gate", "up"))),
        w_down=_t(weights.pop(f"{lp}mlp.down_proj.weight")),
    )


class CPUBackend:
    """Dense decoder work in numpy float32 (see `edge_llm.backends.Backend`)."""

    name = "cpu"
    chunk_sizes: tuple[int, ...] = ()
    row_step = None
    # numpy F32, default model, 2 threads, AVX-512 (OpenBLAS SkylakeX), 200-2000 rows of context:
    # two rows cost 1.8-2.5 one-row steps (sgemv -> packed sgemm), nine 2.5-2.8 (docs/speculative.md)
    forward_cost = ForwardCost(2.3, 0.07)

    def __init__(self) -> None:
        self.numerics = cpu_numerics()  # numpy's kernels decide the bits (docs/identity.md)
        self.args: ModelArgs | None = None
        self.layers: list[DenseLayer] = []

    def setup(self, args: ModelArgs) -> None:
        """Sizes and eps only (the graph exporter then sets `layers` one layer at a time)."""
        self.args = args
        self.eps = np.float32(args.rms_norm_eps)
        self.q_dim, self.kv_dim, self.inter = args.q_dim, args.kv_dim, args.intermediate_size

    def load(self, args: ModelArgs, weights: Weights) -> None:
        self.setup(args)
        p = args.weight_prefix
        self.embed_tokens = weights.pop(f"{p}embed_tokens.weight")  # (vocab, hidden)
        # lm_head stays (vocab, hidden): x @ W.T is a transposed-B sgemm, and a tied model
        # shares the embedding table instead of holding a second 0.6-1.2 GB copy
        self.lm_head = self.embed_tokens if args.tie_word_embeddings else weights.pop(args.lm_head_name)
        self.final_norm = weights.pop(f"{p}norm.weight")
        self.layers = [load_layer(args, weights, i) for i in range(args.num_hidden_layers)]
        log.debug("cpu backend: %d layers, %.1f MB of weights", len(self.layers), self.nbytes / 1e6)

    @property
    def nbytes(self) -> int:
        """Bytes of weight arrays held (a tied lm_head counted once)."""
        n = self.embed_tokens.nbytes + self.final_norm.nbytes
        if self.lm_head is not self.embed_tokens:
            n += self.lm_head.nbytes
        return n + sum(L.nbytes for L in self.layers)

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        return self.embed_tokens[tokens]

    def residual(self, rows: np.ndarray) -> np.ndarray:
        return rows

    def qkv_fused(self, layer: int, x: np.ndarray) -> np.ndarray:
        """(T, hidden) -> (T, q_dim + 2 kv_dim): what the `qkv` graph computes."""
        L = self.layers[layer]
        y = rms_norm(x, L.in_norm, self.eps) @ L.w_qkv  # (T, q_dim + 2 kv_dim)
        if L.b_qkv is not None:
            y += L.b_qkv
        return y

    def qkv(self, layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # QKVArrays
        y = self.qkv_fused(layer, x)
        q, kv = self.q_dim, self.kv_dim
        return y[:, :q], y[:, q:q + kv], y[:, q + kv:]

    def attn_out(self, layer: int, attn: np.ndarray, x: np.ndarray) -> np.ndarray:
        out = attn @ self.layers[layer].w_o
        out += x
        return out

    def post(self, layer: int, attn: np.ndarray, x: np.ndarray, fuse_next: bool = True) -> tuple[np.ndarray, None]:
        # never fused: qkv is a separate sgemm either way, so fusing would save no call
        return self.mlp(layer, self.attn_out(layer, attn, x)), None

    def post_deltas(self, layer: int, attn: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """What the `post` graph computes: (attn @ Wo, MLP(RMSNorm(x + attn @ Wo)))."""
        o = attn @ self.layers[layer].w_o
        return o, self.mlp_delta(layer, x + o)

    def mlp(self, layer: int, x: np.ndarray) -> np.ndarray:
        out = self.mlp_delta(layer, x)
        out += x
        return out

    def mlp_delta(self, layer: int, x: np.ndarray) -> np.ndarray:
        """SwiGLU MLP of the post-attention RMSNorm, without the residual."""
        L = self.layers[layer]
        gu = rms_norm(x, L.post_norm, self.eps) @ L.w_gu  # (T, 2 inter)
        return swiglu(gu, self.inter) @ L.w_down

    def logits(self, x: np.ndarray) -> np.ndarray:
        return rms_norm(x, self.final_norm, self.eps) @ self.lm_head.T

    def close(self) -> None:
        """Nothing outside the heap to release."""
