"""Backend `cpu-q`: the decoder's dense layers as weight-only quantized matmuls on onnxruntime.

The graph family the NPU's graphs use (`backends/graph/`: the schema, the ONNX exporter,
`OrtRunner`, `GraphBackend`) with two changes: every linear is a `MatMulNBits` (nbits_export.py: GGUF blocks kept exactly
where the kernel holds them, else blocked re-quantization), and the partition is the fused one
(`layer00.qkv`, then one `step` graph per layer: 31 runtime calls per token for a 30-layer model
plus the head, instead of 61). Shapes are dynamic (no padding). Embedding rows are gathered from
the checkpoint file (mmap), attention/RoPE/the F32 KV rows stay in numpy (models/qwen3.py).

Quantized graphs are built on first use into `$EDGE_LLM_HOME/quant/<model>-<weights
digest>-<mode>/` (a temp directory renamed into place under a lock: files.publish_dir) and reused while the
model's weight digest is unchanged. `numerics` = `cpu-q:<mode>:<manifest identity>:<label>:<kernel key>`:
the manifest identity hashes the ONNX bytes (bits, block size, accuracy level, which weights
are exact), the last part names onnxruntime's release, the kernel family MLAS picks on this CPU
and numpy's kernels (`kernel_key`; not the thread count: the bits do not depend on it). See
docs/quantization.md.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edge_llm.backends.graph.backend import GraphBackend
from edge_llm.backends.cost import ForwardCost
from edge_llm.backends.graph.schema import DECODE
from edge_llm.backends.graph.manifest import MANIFEST, Manifest
from edge_llm.backends.cpuq.nbits import BlockSource, Calibration
from edge_llm.errors import ConfigError
from edge_llm.files import publish_dir
from edge_llm.safetext import printable

log = logging.getLogger(__name__)

BLOCK = 32


@dataclass(frozen=True)
class QuantMode:
    name: str
    bits: int
    block: int
    accuracy_level: int  # MatMulNBits (prefill): 4 = int8 activations per block (CompInt8), 0 = float
    passes: int = 1  # MatMulQ (decode): 1 = int8 activations per block, 2 = int8 + int8 of the remainder

    @property
    def label(self) -> str:
        return f"q{self.bits}-b{self.block}-acc{self.accuracy_level}" + (f"-x{self.passes}" if self.passes > 1 else "")


# q4: the weights as 4-bit blocks (the GGUF's own where they reproduce the F32 weights); the
# activations as near float as the kernels allow, because their int8 rounding, not the weights,
# was what separated cpu-q's answers from F32's on the default model (docs/quantization.md, "Where
# the error comes from"): prefill's MatMulNBits with float activations (accuracy level 0), decode's
# MatMulQ in two passes. q4-int8: both with int8 activations (what q4 was until quant format 5).
# An all-8-bit mode was measured and not added; 8-bit blocks come only where a GGUF stores more than 4 bits
# (docs/quantization.md, "8 bits where the GGUF has more than 4").
MODES = {"q4": QuantMode("q4", 4, BLOCK, 0, 2), "q4-int8": QuantMode("q4-int8", 4, BLOCK, 4, 1)}
TARGET = "onnxruntime-cpu"
# what a quantized graph directory holds; older directories are rebuilt on first use
# (2: the decode graph's attention is the AttnRow operator, backends/kernels/_attn.c; 3: the decode graph
# takes T rows, a verify forward of speculative decoding; 4: its 4-bit linears are the MatMulQ
# operator, backends/kernels/_qmatmul.c; 5: q4's activations in float (prefill) and two int8 passes
# (decode))
# 6: weights without exact GGUF blocks by GPTQ + MSE clip (`requant`), not round to nearest
QUANT_FORMAT = 7  # 7: Q5_0/Q5_1/Q4_K/Q5_K blocks held exactly, wider GGUF blocks re-quantized to 8 bits
# how weights without exact GGUF blocks are quantized when the caller hands in calibration rows
# (nbits_export.REQUANT; docs/quantization.md, "GPTQ for re-quantized weights")
REQUANT_DEFAULT = "gptq-mse"
# onnxruntime's pool threads spin between runs by default; here numpy (attention) runs between
# every two graph calls and would share its cores with spinning threads
SESSION_CONFIG = {"session.intra_op.allow_spinning": "0"}
# onnxruntime's MatMulNBits (MlasQNBitGemmBatch) cuts M into 128-row pieces when it has a thread
# pool, and a 1-row piece takes the one-row kernel (other rounding on AVX2 and at accuracy 0):
# with more rows per call, the thread count would decide which rows run alone. So no call
# gets more than 128 rows (docs/quantization.md, "Bits and batches").
MLAS_STRIDE_M = 128
# the decode graph is a whole token in one call (our attention operator runs inside it, on the
# same pool), so its pool threads spin between its nodes (a sleeping thread takes a futex wake
# per parallel node), for at most 50 us at a time (less harm when another process holds a
# core), and stop spinning when the call returns (docs/quantization.md: measured)
DECODE_CONFIG = {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1",
                 "session.intra_op.spin_duration_us": "50"}


def mode(name: str) -> QuantMode:
    try:
        return MODES[name]
    except KeyError:
        raise ConfigError(f"quant {name!r} is not available (available: {', '.join(MODES)})") from None


# ---- threads and cores ------------------------------------------------------------------------
def big_cores(sysroot: str | Path = "/") -> list[int]:
    """The CPUs with the highest `cpu_capacity` when they differ (RK3588: the four Cortex-A76,
    cpus 4-7, capacity 1024 vs 414 of the A55s), else [] (all cores alike)."""
    caps = {}
    for d in (Path(sysroot) / "sys/devices/system/cpu").glob("cpu[0-9]*"):
        try:
            caps[int(d.name[3:])] = int((d / "cpu_capacity").read_text())
        except (OSError, ValueError):
            continue
    if len(set(caps.values())) < 2:
        return []
    top = max(caps.values())
    return sorted(c for c, v in caps.items() if v == top)


def plan_threads(threads: int | None, sysroot: str | Path = "/") -> tuple[int, list[int]]:
    """(threads, cores to pin the process to or []): on a big.LITTLE CPU the big cores, one thread
    each; else the cores this process may use. An explicit `threads` wins (no pinning)."""
    if threads:
        return threads, []
    big = big_cores(sysroot)
    if big:
        return len(big), big
    return max(1, len(os.sched_getaffinity(0))), []


# speculative decoding's cost profiles (edge_llm/backends/__init__.py), default model, 2 threads,
# quiet machine: a verify forward of T rows is one call of the decode graph (AttnRow reads the
# cached rows once for all T query rows; MatMulQ reads a tile's weights from memory once and
# multiplies them by each row): two rows cost 1.07-1.35 one-row steps, five 1.59-2.14, nine
# 2.06-2.77 at 200-2000 rows of context on the AVX-512 VNNI path, 1.18-1.31 / 1.97-2.18 /
# 2.88-3.31 on the AVX2 path (docs/speculative.md). Without the decode graph, every forward runs
# the per-layer graphs
DECODE_GRAPH_COST = ForwardCost(1.2, 0.2)
PER_LAYER_COST = ForwardCost(1.1, 0.15)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernel reports them (/proc/cpuinfo; empty if unreadable)."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("flags", "features")):
                flags |= set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset(flags)


def kernel_isa(flags: frozenset[str] | None = None, machine: str | None = None) -> str:
    """The kernel family onnxruntime's MLAS picks on this CPU for the ops of cpu-q's graphs (their
    bits differ), by the rules of MLAS's platform set-up (docs/quantization.md, "Bits and CPUs").
    x86-64: `MatMulNBits` runs the first of avx512vnni (AVX-512 F/BW/DQ/VL + VNNI), avx512 (the
    same without VNNI), avx2vnni (AVX-VNNI), avx2 (with FMA); float `MatMul`, `Sigmoid` and the
    other float kernels run avx512f, fma3, avx or sse2. AMX and AVX-VNNI-INT8 change only integer
    GEMMs, which these graphs do not have, so they are not part of it. aarch64: dot product,
    i8mm, SVE, SME (KleidiAI). E.g. `x86_64-mlas-avx512vnni-avx512f`."""
    machine = machine or platform.machine()
    f = cpu_flags() if flags is None else flags
    if machine == "x86_64":
        avx512 = "avx512f" in f
        core = avx512 and {"avx512bw", "avx512dq", "avx512vl"} <= f
        if {"avx", "avx2", "fma"} <= f:
            qnbit = ("avx512vnni" if core and "avx512_vnni" in f else "avx512" if core
                     else "avx2vnni" if "avx_vnni" in f else "avx2")
            return f"x86_64-mlas-{qnbit}-{'avx512f' if avx512 else 'fma3'}"
        return f"x86_64-mlas-none-{'avx' if 'avx' in f else 'sse2'}"
    if machine == "aarch64":
        return "-".join(["aarch64-mlas", *[x for x in ("asimddp", "i8mm", "sve", "sme") if x in f]])
    return f"{machine}-mlas"


def kernel_key(ort_version: str) -> str:
    """Everything outside the graph files that decides cpu-q's bits: onnxruntime's release, the
    MLAS kernel family, numpy's kernels (the prompt rows' attention runs in numpy, models/qwen3.py)."""
    from edge_llm.backends.cpu.backend import numpy_kernels

    return f"onnxruntime-{ort_version}:{kernel_isa()}:{numpy_kernels()}"


# ---- the quantized graph directory ------------------------------------------------------------
def quant_root() -> Path:
    from edge_llm.settings import home_dir

    return home_dir() / "quant"


@dataclass(frozen=True)
class Recipe:
    """How the weights without exact GGUF blocks are built: `requant` (nbits_export.REQUANT) on
    the caller's calibration rows (none: round to nearest); `from_f32`: every weight re-quantized,
    the GGUF blocks ignored (a measurement: `bench quant-variants --requantized`)."""

    requant: str = REQUANT_DEFAULT
    from_f32: bool = False

    def method(self, calibration: Calibration | None) -> str:
        return self.requant if calibration is not None else "rtn"

    def suffix(self, calibration: Calibration | None) -> str:
        """The quant directory's name suffix: none for the default recipe, which every caller of
        the product builds, so a measurement's weights never replace those."""
        if not self.from_f32 and self.requant == REQUANT_DEFAULT:
            return ""
        return f"-{'f32-' if self.from_f32 else ''}{self.method(calibration)}"


DEFAULT_RECIPE = Recipe()


def quant_dir(model_dir: str | Path, qm: QuantMode, suffix: str = "") -> Path:
    from edge_llm.weights import weight_digest

    return quant_root() / f"{Path(model_dir).resolve().name}-{weight_digest(model_dir)[:12]}-{qm.name}{suffix}"


def _usable(root: Path, model_dir: Path, qm: QuantMode, method: str | None = None, *,
            building: bool = True) -> Manifest | None:
    """The directory's manifest when it is current for this model and mode (and, with `method`,
    its re-quantized weights were made that way), else None: logged as a rebuild when `building`,
    at debug level for a reader that only asks (the memory estimate), so one rebuild is one line."""
    if not (root / MANIFEST).is_file():
        return None
    try:
        from edge_llm.config import ModelArgs
        from edge_llm.weights import weight_digest

        m = Manifest.read(root)
        m.check_model(ModelArgs.from_dir(model_dir), weight_digest(model_dir))
        if (m.target, m.dtype) != (TARGET, qm.label):
            raise ConfigError(f"made as {m.target} {m.dtype}, wanted {TARGET} {qm.label}")
        if m.build.get("format") != QUANT_FORMAT:  # format 2 on always holds the decode graph
            raise ConfigError(f"quant format {m.build.get('format', 1)}, this edge-llm makes {QUANT_FORMAT}")
        made = m.build.get("summary", {}).get("requant", [])
        if method is not None and made and made != [method]:  # its re-quantized weights made another way (e.g. without calibration)
            raise ConfigError(f"weights re-quantized by {', '.join(made)}, wanted {method}")
        return m
    except ConfigError as e:
        if building:
            log.warning("%s is stale (%s): rebuilding", printable(root), e)
        else:
            log.debug("%s is stale (%s)", printable(root), e)
        return None


def built_weight_bytes(model_dir: str | Path, quant: str) -> int | None:
    """The bytes of the quantized weights of `model_dir` in mode `quant` when they are built and
    current (the memory estimate's exact figure, edge_llm/footprint.py), else None."""
    qm = mode(quant)
    root = quant_dir(model_dir, qm)
    if not (root / MANIFEST).is_file():
        return None
    m = _usable(root, Path(model_dir), qm, building=False)
    return weight_bytes(root, m) if m is not None else None


def weight_bytes(root: Path, m: Manifest | None = None) -> int:
    """The bytes of the quantized weights a built directory holds (what one decode step streams)."""
    m = Manifest.read(root) if m is None else m
    return sum(int(w["bytes"]) for w in m.build["weights"])


def ensure_quantized(model_dir: str | Path, qm: QuantMode, progress: Callable[[str], None] | None = None, *,
                     blocks: BlockSource | None, calibration: Calibration | None = None,
                     recipe: Recipe = DEFAULT_RECIPE) -> tuple[Path, Manifest]:
    """The quantized graph directory of this model and mode, built first if needed. `blocks`:
    the stored blocks of the file the model was imported from (checkpoints.gguf_blocks), kept
    exactly where they reproduce the weights; None quantizes every weight here. Required, not
    defaulted: the directory is shared by every caller, so all must build it from the same source.
    `calibration`: the rows GPTQ weighs the re-quantized weights by (convert.gptq.CpuqInputs; asked
    only when a weight has no exact blocks); None: round to nearest. A directory whose
    re-quantized weights were made another way is rebuilt by a caller with calibration rows; one
    without them takes it as it is (it could not build better). `recipe`: see `Recipe`."""
    model_dir = Path(model_dir)
    root = quant_dir(model_dir, qm, recipe.suffix(calibration))
    if recipe.from_f32:
        blocks = None
    m = publish_dir(root, lambda tmp: build(model_dir, tmp, qm, progress, blocks=blocks, calibration=calibration,
                                            requant=recipe.requant),
                    lambda d: _usable(d, model_dir, qm, None if calibration is None else recipe.requant))
    return root, m


def build(model_dir: Path, out: Path, qm: QuantMode, progress: Callable[[str], None] | None = None, *,
          blocks: BlockSource | None, calibration: Calibration | None = None,
          requant: str = REQUANT_DEFAULT) -> Manifest:
    """Export the fused, dynamic-shape graphs with quantized linears into `out`."""
    try:
        from edge_llm.backends.cpuq.decode_export import export_decode
        from edge_llm.backends.graph.manifest import GraphEntry
        from edge_llm.backends.graph.onnx_export import export_graph_set, rms_norm_op
        from edge_llm.backends.cpuq.nbits_export import QuantLinear, summarize
    except ImportError as e:
        raise ConfigError(f"backend cpu-q needs onnx and onnxruntime ({e}): pip install 'edge-llm[quant]'") from None
    from edge_llm.config import ModelArgs, vision_args_from_dir

    args = ModelArgs.from_dir(model_dir)
    vision = vision_args_from_dir(model_dir)
    deepstack = len(vision.deepstack_visual_indexes) if vision is not None else 0
    t0 = time.perf_counter()
    linear = QuantLinear(args, blocks, qm.bits, qm.block, qm.accuracy_level, requant=requant, calibration=calibration)
    log.info("quantizing %s (%s%s) into %s", printable(model_dir.name), qm.label,
             f", GGUF blocks from {printable(blocks.path.name)}" if blocks else "", printable(out))
    # F32 arithmetic: the plain RMSNorm (the fp16-safe one only adds nodes here)
    m = export_graph_set(model_dir, out, chunks=None, linear=linear, norm=rms_norm_op, fused=True, unfused=deepstack,
                         progress=(lambda s: progress(f"quantizing {s.name}")) if progress else None,
                         target=TARGET, dtype=qm.label)
    # the same weights again, in one graph, its 4-bit linears as MatMulQ (reported once, above)
    row_linear = QuantLinear(args, blocks, qm.bits, qm.block, qm.accuracy_level, row_op=True, passes=qm.passes,
                             requant=requant, calibration=calibration, done=linear.done)
    e = export_decode(model_dir, out / "onnx", row_linear,
                      progress=(lambda s: progress(f"quantizing the decode graph: {s}")) if progress else None)
    report = linear.report
    m.graphs.append(GraphEntry(name=e.spec.name, kind=e.spec.kind, index=0, rows=list(e.spec.rows),
                               inputs=[list(i) for i in e.spec.inputs], outputs=[list(o) for o in e.spec.outputs],
                               vocab=list(e.spec.vocab), onnx=str(e.onnx.relative_to(out)),
                               input_key=e.input_key, onnx_bytes=e.nbytes))
    s = summarize(report)
    linear.done.clear()
    m.build = {"format": QUANT_FORMAT, "quant": qm.name, "summary": s, "weights": report,  # not hashed
               "seconds": round(time.perf_counter() - t0, 1)}
    if any(method != "rtn" for method in s["rounded"]):  # some weight was rounded by GPTQ on captured rows
        m.build["calibration_tokens"] = calibration.tokens
    m.write(out)
    log.info("quantized %s: %d weights exact from GGUF blocks, %d re-quantized%s (%.1f MB) in %.1f s",
             printable(model_dir.name), s["exact"], s["requantized"],
             f" ({', '.join(s['requant'])})" if s["requant"] else "", s["bytes"] / 1e6, m.build["seconds"])
    return m


def open_cpu_q(model_dir: str | Path, quant: str = "q4", threads: int | None = None,
               progress: Callable[[str], None] | None = None, decode_graph: bool = True, *,
               blocks: BlockSource | None, calibration: Calibration | None = None,
               recipe: Recipe = DEFAULT_RECIPE) -> GraphBackend:
    """Build or find the quantized graphs, start onnxruntime on them: a Backend to load.
    `blocks`, `calibration`, `recipe`: as for `ensure_quantized`.
    `decode_graph=False` runs one-row steps on the per-layer graphs too (what cpu-q did before the
    decode graph; `bench quant` compares both): other bits, so another `numerics`."""
    from edge_llm.backends import kernels
    from edge_llm.backends.cpuq.decode_step import OrtDecodeStep
    from edge_llm.backends.graph.runners import OrtRunner
    from edge_llm.config import ModelArgs

    qm = mode(quant)
    root, m = ensure_quantized(model_dir, qm, progress, blocks=blocks, calibration=calibration, recipe=recipe)
    n, cores = plan_threads(threads)
    if cores:
        os.sched_setaffinity(0, cores)
        log.info("cpu-q: pinned to the big cores %s (%d threads)", cores, n)
    files = m.onnx_files(root)
    decode = files.pop(DECODE)
    if decode_graph and kernels.library_path() is None:
        log.warning("cpu-q: the attention operator (_attn.c) was not built at install (no C compiler?): "
                    "one-row steps run on the per-layer graphs (docs/quantization.md)")
        decode_graph = False
    step = OrtDecodeStep(decode, ModelArgs.from_dir(model_dir), n, DECODE_CONFIG, shared_arena=True) \
        if decode_graph else None
    r = OrtRunner(files, threads=n, kind=qm.label, config=SESSION_CONFIG, shared_arena=True)
    # no thread count: these kernels give the same bits on 1, 2 or 3 threads (tests/test_cpu_q.py),
    # so changing `threads` keeps the snapshots; onnxruntime's release, MLAS's kernel family and
    # numpy's kernels do change them (kernel_key). The
    # manifest identity covers the decode graph (its bytes), so one-row steps are in it too.
    # Calls of at most MLAS_STRIDE_M rows keep the thread count out of the bits for any chunk.
    numerics = f"cpu-q:{qm.name}:{m.identity()}:{qm.label}:{kernel_key(r.version)}"
    numerics += f":attn-{kernels.isa()}" if decode_graph else ":per-layer-decode"
    return GraphBackend("cpu-q", [s for s in m.specs() if s.kind != DECODE], r, numerics,
                        mapped_embedding=True, row_step=step, max_rows=MLAS_STRIDE_M,
                        forward_cost=DECODE_GRAPH_COST if decode_graph else PER_LAYER_COST)
