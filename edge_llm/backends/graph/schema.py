"""The graph schema: which graphs a decoder is cut into, their tensor names and static shapes.

One place for every name: the ONNX exporter writes these graph/tensor names, every runner
(onnxruntime, the rknn-toolkit2 simulator, RKNNLite on the board) is called with them, and
`manifest.json` lists them. Per layer `l`:

- `layerLL.qkv`:  x (T, hidden) -> qkv (T, q_dim + 2 kv_dim)
                  input RMSNorm + fused q/k/v projections (+ bias)
- `layerLL.post`: attn (T, q_dim), x (T, hidden) -> attn_out (T, hidden), mlp_out (T, hidden)
                  attn_out = attn @ Wo; h = x + attn_out; mlp_out = SwiGLU(RMSNorm(h))
or, fused (the quantized CPU backend, docs/quantization.md: half the runtime calls per token),
`layer00.qkv` and then per layer
- `layerLL.step`: attn (T, q_dim), x (T, hidden) -> h (T, hidden), qkv (T, q_dim + 2 kv_dim)
                  h = x + attn_out + mlp_out (in that order, float32); qkv = layer LL+1's qkv of h
                  (the last layer's step has no qkv output)
or, for int8 graphs (w8a8 on the NPU, docs/npu.md "w8a8"), the norms on the CPU and pure
matmul graphs, so no int8 tensor ever holds the residual stream (its massive activations would
set every static scale), per layer
- `layerLL.qkv_n`: xn (T, hidden) -> qkv: xn = RMSNorm(x) with the gain (and smoothing) on the CPU
- `layerLL.o`:     attn (T, q_dim) -> attn_out (T, hidden)
- `layerLL.mlp`:   hn (T, hidden) -> mlp_out (T, hidden): SwiGLU of hn = RMSNorm(x + attn_out)
and `head_n` / `head_n.P`: xn (T, hidden) -> logits (the final RMSNorm on the CPU);
and one head (or `--head-split N` parts over vocab ranges):
- `head` / `head.P`: x (T, hidden) -> logits (T, vocab part), final RMSNorm + lm_head
The quantized CPU backend adds one graph for decode forwards (decode_export.py: a one-row step,
or a speculative verify forward of T rows):
- `decode`:       x (T, hidden), cos, sin (T, head_dim/2), kLL, vLL (S, kv_dim) per layer ->
                  logits (T, vocab), knewLL, vnewLL (T, kv_dim) per layer (`decode_kv_names`)

A `post` graph returns deltas, not the new residual stream: `GraphBackend.post` adds them in
float32 (`x + attn_out + mlp_out`, in that order, as the CPU backend does), so on an fp16 NPU the
stream is not rounded to fp16 at every layer. A `step` graph (F32 only) returns h itself, added in
that order inside the graph, and layer LL+1's qkv of that h; `GraphBackend.post` hands the qkv to
the model only when the model says it will not change h first (`fuse_next`). Qwen3-VL changes h
after its first N layers (DeepStack), so its steps there stop at h and the next layer's qkv is a
graph of its own (`graph_specs(unfused=N)`).

NPU graphs are static-shape: layer graphs are built for the row counts `chunks` (default 1, 32,
128), the head for 1 row and for the smallest multi-row chunk (`head_rows`: a speculative
verify forward's rows). `row_plan` is the one place that maps T rows onto those shapes.
Graphs for onnxruntime alone may be dynamic (`rows == ()`: any row count, no padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_llm.config import ModelArgs, VisionArgs
from edge_llm.errors import ConfigError

QKV, POST, HEAD, STEP, DECODE = "qkv", "post", "head", "step", "decode"
VISION = "vision"  # the whole vision tower in one graph (vision_spec)
QKV_N, O, MLP, HEAD_N = "qkv_n", "o", "mlp", "head_n"  # the norms-on-the-CPU partition
INPUTS: dict[str, tuple[str, ...]] = {QKV: ("x",), POST: ("attn", "x"), HEAD: ("x",), STEP: ("attn", "x"),
                                      QKV_N: ("xn",), O: ("attn",), MLP: ("hn",), HEAD_N: ("xn",)}
OUTPUTS: dict[str, tuple[str, ...]] = {QKV: ("qkv",), POST: ("attn_out", "mlp_out"), HEAD: ("logits",),
                                       STEP: ("h", "qkv"), QKV_N: ("qkv",), O: ("attn_out",), MLP: ("mlp_out",),
                                       HEAD_N: ("logits",)}
DEFAULT_CHUNKS: tuple[int, ...] = (1, 32, 128)
def head_rows(chunks: tuple[int, ...]) -> tuple[int, ...]:
    """The head's static shapes: one row (a decode step, a prompt's last row) and the smallest
    multi-row layer chunk, which a speculative verify forward's T rows run at (their logits all
    count; one `.rknn` with both shapes shares one copy of the weights: docs/speculative.md)."""
    multi = [c for c in chunks if c > 1]
    return (1, min(multi)) if multi else (1,)
OPSET = 13
KEY_PAD = -30000.0  # kbias of a padding patch: exp() of it is 0 in F32 and fp16 alike
SAMPLE_SEED = 1234


@dataclass(frozen=True)
class GraphSpec:
    """One graph: its name, kind, layer (or head part), static row counts and tensor widths."""

    name: str
    kind: str  # QKV | POST | STEP | HEAD | DECODE
    index: int  # layer number, or head part number
    rows: tuple[int, ...]  # static T shapes it is built for; () = any T (dynamic)
    inputs: tuple[tuple[str, int], ...]  # (tensor name, width) in call order
    outputs: tuple[tuple[str, int], ...]
    vocab: tuple[int, int] = (0, 0)  # head part: logits columns [lo, hi)


def sample_inputs(spec: GraphSpec, rows: int, seed: int = SAMPLE_SEED) -> list[np.ndarray]:
    """Deterministic N(0, 1) inputs for one graph (tests, benchmarks of speed; the converter's
    accuracy check uses real activations instead: `convert/calibration.py`). Here, not in the
    exporter, so `bench npu` on a board runs without the `onnx` package (docs/npu.md)."""
    rng = np.random.default_rng([seed, spec.index, list(INPUTS).index(spec.kind)])
    return [rng.standard_normal((rows, w), dtype=np.float32) for _, w in spec.inputs]


def layer_name(layer: int, kind: str) -> str:
    return f"layer{layer:02d}.{kind}"


def capture_key(spec: GraphSpec) -> str:
    """The seam call whose inputs a graph takes: `layerLL.qkv`, `layerLL.post` (a fused step takes
    post's inputs) or `head` (every head part): how real activations are matched to graphs."""
    if spec.kind == QKV:
        return layer_name(spec.index, QKV)
    if spec.kind in (POST, STEP):
        return layer_name(spec.index, POST)
    if spec.kind in (HEAD, HEAD_N):
        return HEAD
    if spec.kind == QKV_N:
        return layer_name(spec.index, QKV)
    if spec.kind in (O, MLP):
        return layer_name(spec.index, POST)
    raise ValueError(f"graph kind {spec.kind} takes no seam call's inputs")


def decode_kv_names(layer: int) -> tuple[str, str, str, str]:
    """The decode graph's tensors of one layer: (past K, past V, new K, new V)."""
    return f"k{layer:02d}", f"v{layer:02d}", f"knew{layer:02d}", f"vnew{layer:02d}"


def decode_spec(args: ModelArgs) -> GraphSpec:
    """The decode graph's manifest entry: T rows in (any T: a decode step or a verify forward),
    their logits out; its per-layer K/V tensors (`decode_kv_names`) are not listed (their row
    count S is the cache length)."""
    half = args.head_dim // 2
    return GraphSpec(DECODE, DECODE, 0, (), (("x", args.hidden_size), ("cos", half), ("sin", half)),
                     (("logits", args.vocab_size),), (0, args.vocab_size))


def vision_spec(v: VisionArgs, rows: tuple[int, ...] = (), blocks: tuple[int, int] | None = None) -> GraphSpec:
    """The vision tower as a graph (tower/export.py, docs/vision.md "The tower as one graph"):
    patch embedding, every block, the final and the DeepStack mergers, for one image of N patches;
    or one segment of it, blocks [a, b) (onnxruntime runs the tower in segments, so a long encode
    reports progress between them). Inputs:

    - pixels (N, patch_dim), pos (N, hidden) (the first segment) or h (N, hidden) (the others):
      flattened patches in merge-block order and the learned position embeddings resampled to
      the image's grid, or the hidden states the previous segment returned
    - cos, sin (N, head_dim): the 2-D rotary tables of the grid
    - kbias (N, 1): 0 for a patch, KEY_PAD for a padding patch (its key is never attended to)

    Outputs: h_out (N, hidden) (the next segment's h) unless the segment ends the tower; features (N, W / merge^2) when it
    ends the tower or holds a DeepStack block: the row-major bytes of (N / merge^2, W), per
    decoder token [final merger if it ends the tower | its DeepStack mergers in order], each
    out_hidden wide. The whole tower: [merger | DeepStack 0 | DeepStack 1 ...].

    Every tensor has N rows, so the graph is an ordinary row graph to every runner: `rows` are
    the static patch counts an NPU build holds (padding fills a smaller image up to one), () is
    any count (onnxruntime). What depends on the grid alone is computed on the CPU and fed in,
    so one graph serves every grid of a given patch count."""
    a, b = blocks or (0, v.depth)
    if not 0 <= a < b <= v.depth:
        raise ConfigError(f"vision blocks [{a}, {b}) outside [0, {v.depth})")
    group = v.spatial_merge_size ** 2
    width = ((b == v.depth) + sum(a <= i < b for i in v.deepstack_visual_indexes)) * v.out_hidden_size
    if width % group:
        raise ConfigError(f"vision features of width {width} do not split into {group} rows per token")
    ins = (("pixels", v.patch_dim), ("pos", v.hidden_size)) if a == 0 else (("h", v.hidden_size),)
    ins += (("cos", v.head_dim), ("sin", v.head_dim), ("kbias", 1))
    outs = ((("h_out", v.hidden_size),) if b < v.depth else ()) + ((("features", width // group),) if width else ())
    name = VISION if (a, b) == (0, v.depth) else f"{VISION}.{a:02d}-{b:02d}"
    return GraphSpec(name, VISION, a, tuple(rows), ins, outs)


def vision_segments(v: VisionArgs, rows: tuple[int, ...] = (), blocks: int | None = None) -> list[GraphSpec]:
    """The tower in segments of `blocks` blocks (None: one graph), in call order."""
    step = blocks or v.depth
    return [vision_spec(v, rows, (a, min(a + step, v.depth))) for a in range(0, v.depth, step)]


def head_name(part: int, parts: int, kind: str = HEAD) -> str:
    return kind if parts == 1 else f"{kind}.{part}"


def head_ranges(vocab: int, parts: int) -> list[tuple[int, int]]:
    """Split [0, vocab) into `parts` contiguous column ranges (sizes differ by at most one)."""
    if not 1 <= parts <= vocab:
        raise ConfigError(f"head split {parts} must be in [1, vocab={vocab}]")
    base, extra = divmod(vocab, parts)
    out, lo = [], 0
    for p in range(parts):
        hi = lo + base + (1 if p < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def check_chunks(chunks: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """Sorted, unique, positive chunk sizes; 1 must be among them (decode runs one row)."""
    out = tuple(sorted(set(int(c) for c in chunks)))
    if not out or out[0] < 1:
        raise ConfigError(f"chunk sizes must be positive integers, got {list(chunks)}")
    if out[0] != 1:
        raise ConfigError(f"chunk sizes must include 1 (decode steps run one row), got {list(out)}")
    return out


def graph_specs(args: ModelArgs, chunks: tuple[int, ...] | None = DEFAULT_CHUNKS, layers: int | None = None,
                head_split: int = 1, fused: bool = False, unfused: int = 0,
                cpu_norm: bool = False) -> list[GraphSpec]:
    """Every graph of a model in execution order: qkv/post per layer (or qkv + fused steps, or
    with `cpu_norm` qkv_n/o/mlp), then the head part(s). `chunks=None`: dynamic row counts. `unfused`: the first N layers'
    steps leave the next qkv to a graph of its own, because the decoder may change h after them
    (Qwen3-VL adds DeepStack image rows after layers 0..N-1, and then calls post with
    fuse_next=False and qkv for the next layer: that qkv needs a graph)."""
    chunks = () if chunks is None else check_chunks(chunks)
    heads = head_rows(chunks) if chunks else ()
    n = args.num_hidden_layers if layers is None else layers
    if not 1 <= n <= args.num_hidden_layers:
        raise ConfigError(f"--layers {n} must be in [1, {args.num_hidden_layers}]")
    h, qkv = args.hidden_size, args.q_dim + 2 * args.kv_dim
    out: list[GraphSpec] = []
    if fused:
        out.append(GraphSpec(layer_name(0, QKV), QKV, 0, chunks, (("x", h),), (("qkv", qkv),)))
        for i in range(n):
            fuse_next = i + 1 < n and i >= unfused
            outs = (("h", h), ("qkv", qkv)) if fuse_next else (("h", h),)
            out.append(GraphSpec(layer_name(i, STEP), STEP, i, chunks, (("attn", args.q_dim), ("x", h)), outs))
            if i + 1 < n and not fuse_next:
                out.append(GraphSpec(layer_name(i + 1, QKV), QKV, i + 1, chunks, (("x", h),), (("qkv", qkv),)))
    for i in range(n if cpu_norm else 0):
        out.append(GraphSpec(layer_name(i, QKV_N), QKV_N, i, chunks, (("xn", h),), (("qkv", qkv),)))
        out.append(GraphSpec(layer_name(i, O), O, i, chunks, (("attn", args.q_dim),), (("attn_out", h),)))
        out.append(GraphSpec(layer_name(i, MLP), MLP, i, chunks, (("hn", h),), (("mlp_out", h),)))
    for i in range(n if not (fused or cpu_norm) else 0):
        out.append(GraphSpec(layer_name(i, QKV), QKV, i, chunks, (("x", h),), (("qkv", qkv),)))
        out.append(GraphSpec(layer_name(i, POST), POST, i, chunks, (("attn", args.q_dim), ("x", h)),
                             (("attn_out", h), ("mlp_out", h))))
    ranges = head_ranges(args.vocab_size, head_split)
    kind, x = (HEAD_N, "xn") if cpu_norm else (HEAD, "x")
    for p, (lo, hi) in enumerate(ranges):
        out.append(GraphSpec(head_name(p, len(ranges), kind), kind, p, heads, ((x, h),),
                             (("logits", hi - lo),), vocab=(lo, hi)))
    return out


def row_plan(T: int, rows: tuple[int, ...], cap: int | None = None) -> list[tuple[int, int, int]]:
    """Cover T rows with static shapes: a list of (start, stop, shape) with stop - start <= shape.

    Full pieces of the largest shape first; the remainder goes into the smallest shape that
    holds it (padded). A dynamic graph (`rows == ()`) takes the rows in calls of at most `cap`
    rows (None: one call), unpadded. The one place where rows meet graph shapes.
    """
    if T < 1:
        raise ValueError("need at least one row")
    if not rows:
        step = T if cap is None else cap
        return [(a, min(a + step, T), min(a + step, T) - a) for a in range(0, T, step)]
    big = max(rows)
    plan = [(a, a + big, big) for a in range(0, T - T % big, big)]
    rest = T % big
    if rest:
        a = T - rest
        plan.append((a, T, min(r for r in rows if r >= rest)))
    return plan
