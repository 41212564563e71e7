"""Before anything is loaded: what the configuration will hold in memory (`estimate_memory`), how much memory this process may really use
(`available_memory`: MemAvailable and the cgroup's limit), and the refusal when it does not fit
(`admit`). The server, `edge-llm generate` and `edge-llm doctor` all go through these, so the
refusal at start-up and doctor's "memory" line print the same numbers (docs/board.md, "Memory").
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path

from edge_llm.config import ModelArgs
from edge_llm.errors import ConfigError
from edge_llm.settings import Settings

log = logging.getLogger(__name__)

GiB = 2**30
MiB = 2**20
# exit status of a start refused for memory (sysexits' EX_CONFIG): the unit's
# RestartPreventExitStatus= lists it, so systemd does not restart into the same refusal
EXIT_REFUSED = 78
# cpu-q's 4-bit blocks of 32 (4-bit codes + an F32 scale + a 4-bit zero point per block, padded):
# bytes per byte of the same weight in F32 (docs/quantization.md, measured 1.03 GiB / 6.41 GiB
# for the Qwen3-VL-2B geometry); used until the quantized graphs exist and say their own size
Q4_PER_F32 = 0.75 / 4
# what the process holds besides weights and KV: the interpreter, numpy/BLAS, tokenizers, the
# HTTP stack and their buffers (measured on the default model; `edge-llm bench quant-memory` and
# tests/test_footprint.py compare the whole estimate with the measured peak RSS)
RUNTIME_BASE = {"cpu": 160 * MiB, "cpu-q": 340 * MiB, "rknn": 200 * MiB}
# the stated margin: the estimate is at least the measured peak RSS and at most this many times it
ESTIMATE_MARGIN = 1.3


class MemoryRefused(ConfigError):
    """The configuration would not fit the memory this process may use (exit EXIT_REFUSED)."""


# ---- the model's sizes ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSizes:
    """Byte counts of a checkpoint, read from its headers (no tensor data)."""

    label: str
    matmul_f32: int  # the text decoder's 2-D weights (projections, MLP, an untied lm_head) as F32
    embed_f32: int  # the token embedding table as F32
    other_f32: int  # norms, biases
    vision_file: int  # the vision tower's tensors as stored (mapped from the file, not copied)
    kv_bytes_per_token: int
    kv_bytes_per_layer_token: int
    tied: bool
    vision_f32: int = 0  # the vision tower as F32 (cpu-q's tower graph, mapped from its file)

    @property
    def weights_f32(self) -> int:
        return self.matmul_f32 + self.embed_f32 + self.other_f32

    @classmethod
    def of_dir(cls, model_dir: str | Path, label: str | None = None) -> ModelSizes:
        from edge_llm.weights import DTYPE_BYTES, index_tensors

        d = Path(model_dir)
        args = ModelArgs.from_dir(d)
        matmul = embed = other = vision = vision_f32 = 0
        for name, t in index_tensors(d).items():
            n = math.prod(t.shape)
            if "visual." in name:
                vision += n * DTYPE_BYTES[t.dtype]
                vision_f32 += 4 * n
            elif name.endswith("embed_tokens.weight"):
                embed += 4 * n
            elif len(t.shape) == 2:
                matmul += 4 * n
            else:
                other += 4 * n
        g = args.geometry
        return cls(label or d.name, matmul, embed, other, vision, g.kv_bytes_per_token,
                   g.kv_bytes_per_token // g.n_layers, args.tie_word_embeddings, vision_f32)

    @classmethod
    def of_params(cls, label: str, params: int, kv_bytes_per_token: int, layers: int) -> ModelSizes:
        """From a parameter count alone (a GGUF not imported yet): all of it counted as matmuls."""
        return cls(label, 4 * params, 0, 0, 0, kv_bytes_per_token, kv_bytes_per_token // max(layers, 1), False)


# ---- the estimate --------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryEstimate:
    """What a configuration holds resident once loaded and serving (docs/board.md, "Memory")."""

    backend: str
    max_seq: int
    parts: tuple[tuple[str, int], ...]  # (what, bytes), in display order

    @property
    def total(self) -> int:
        return sum(b for _, b in self.parts)

    def describe(self) -> str:
        parts = " + ".join(f"{what} {b / GiB:.2f} GiB" for what, b in self.parts if b)
        return f"backend {self.backend}, max_seq {self.max_seq}: {parts} = {self.total / GiB:.2f} GiB"


def _quantized_bytes(model_dir: Path | None, quant: str) -> int | None:
    """The real size of cpu-q's quantized weights when they were built already, else None."""
    if model_dir is None:
        return None
    try:
        from edge_llm.backends.cpuq.backend import built_weight_bytes

        return built_weight_bytes(model_dir, quant)
    except Exception:  # not built, or unreadable: the estimate falls back to the ratio
        return None


def _has_npu_tower(rknn_dir: str | Path) -> bool:
    from edge_llm.backends.graph.manifest import MANIFEST
    from edge_llm.backends.tower.graph import VISION_DIR

    return (Path(rknn_dir) / VISION_DIR / MANIFEST).is_file()


def estimate_memory(s: Settings, backend: str, sizes: ModelSizes, model_dir: str | Path | None = None
                    ) -> MemoryEstimate:
    """The resident memory of `backend` (a chosen one: cpu, cpu-q or rknn) for a model of `sizes`
    with the settings' `max_seq`: weights in the backend's format, the KV cache, the vision tower
    (mapped), the snapshot writer's one-layer buffer, and the runtime itself."""
    parts: list[tuple[str, int]] = []
    if backend == "cpu-q":
        q = _quantized_bytes(Path(model_dir) if model_dir else None, s.quant)
        q4 = q if q is not None else int((sizes.matmul_f32 + (sizes.embed_f32 if sizes.tied else 0)) * Q4_PER_F32)
        # the decode graph's session holds a second copy (MatMulQ's records, ~the same bytes)
        parts.append(("q4 weights x2 (decode_graph)" if s.decode_graph else "q4 weights", q4 * (2 if s.decode_graph else 1)))
        parts.append(("embedding (mapped)", sizes.embed_f32 // 2))  # gathered from the file (BF16)
    elif backend == "rknn":  # fp16 graphs in the NPU's DMA memory; embedding + norms on the CPU
        parts.append(("NPU fp16 graphs", sizes.matmul_f32 // 2 + (sizes.embed_f32 // 2 if sizes.tied else 0)))
        parts.append(("embedding", sizes.embed_f32))
    else:
        parts.append(("F32 weights", sizes.weights_f32))
    parts.append(("KV", s.max_seq * sizes.kv_bytes_per_token))
    if sizes.vision_file:
        parts.append(("vision tower (mapped)", sizes.vision_file))
        if backend == "cpu-q" and s.vision_graph:  # its F32 graph's weights, mapped as well
            parts.append(("vision tower graph (mapped F32)", sizes.vision_f32))
        elif backend == "rknn" and s.vision_graph and s.rknn_dir and _has_npu_tower(s.rknn_dir):
            parts.append(("NPU fp16 vision tower", sizes.vision_f32 // 2))
    if s.disk_kv is not None:  # compaction reads one layer's rows of a chain into one buffer
        parts.append(("snapshot writer", s.max_seq * sizes.kv_bytes_per_layer_token))
    parts.append(("runtime", RUNTIME_BASE.get(backend, RUNTIME_BASE["cpu"])))
    return MemoryEstimate(backend, s.max_seq, tuple(parts))


# the rows a record measurement's caches hold: its teacher-forced text, or a chat prompt and its answer
RECORD_ROWS = 512


def record_estimate(s: Settings, sizes: ModelSizes, model_dir: str | Path) -> MemoryEstimate:
    """What measuring cpu-q's accuracy record holds at once (qrecord.record_backend): the F32
    reference model beside cpu-q, each with a cache of RECORD_ROWS rows (no snapshot writer), in
    one process (cpu-q's runtime part, which includes onnxruntime)."""
    small = replace(s, max_seq=RECORD_ROWS, disk_kv=None)
    ref, q = estimate_memory(small, "cpu", sizes), estimate_memory(small, "cpu-q", sizes, model_dir)
    return MemoryEstimate("cpu-q record", RECORD_ROWS,
                          tuple((f"F32 reference {w}", b) for w, b in ref.parts if w != "runtime")
                          + tuple((f"cpu-q {w}", b) for w, b in q.parts))


def calibration_estimate(sizes: ModelSizes, model_dir: str | Path, tokens: int) -> MemoryEstimate:
    """What cpu-q's GPTQ calibration holds at once (convert/gptq.py `capture`): the F32 model and
    every linear's input rows on `tokens` tokens (q/k/v, o, gate/up and down of each layer, the head)."""
    a = ModelArgs.from_dir(model_dir)
    rows = 4 * tokens * (a.num_hidden_layers * (2 * a.hidden_size + a.q_dim + a.intermediate_size) + a.hidden_size)
    return MemoryEstimate("cpu-q calibration", tokens, (("F32 weights", sizes.weights_f32),
                                                       ("captured rows", rows), ("runtime", RUNTIME_BASE["cpu"])))


# ---- what is available ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Available:
    """The memory this process may still use, and where the bound comes from."""

    bytes: int
    source: str  # e.g. "MemAvailable" or "cgroup memory.max /system.slice/edge-llm.service"
    mem_available: int
    cgroup_room: int | None

    def describe(self) -> str:
        return f"{self.bytes / GiB:.2f} GiB available ({self.source})"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text in ("", "max") else int(text)


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except OSError:
        pass
    return 0


def cgroup_room(root: Path = Path("/"), cgroup_file: str = "proc/self/cgroup") -> tuple[int, str] | None:
    """(bytes left below this process's cgroup memory limit, which limit) for the tightest limit
    on the path from its cgroup to the root; None without a limit. cgroup v2 `memory.max` or v1
    `memory.limit_in_bytes`; usage counts the cgroup's reclaimable page cache as free."""
    try:
        lines = (root / cgroup_file).read_text().splitlines()
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            base, limit_f, usage_f, stat_key = root / "sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"
        elif "memory" in controllers.split(","):
            base, limit_f, usage_f, stat_key = (root / "sys/fs/cgroup/memory", "memory.limit_in_bytes",
                                                "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        rel = Path(path.lstrip("/"))
        for d in [rel, *rel.parents]:
            cg = base / d
            limit = _read_int(cg / limit_f)
            if limit is None or limit >= 1 << 60:  # no limit (v1 writes a huge number)
                continue
            usage = (_read_int(cg / usage_f) or 0) - _stat_value(cg / "memory.stat", stat_key)
            room = max(limit - max(usage, 0), 0)
            if best is None or room < best[0]:
                best = (room, f"cgroup {limit_f} {limit / GiB:.2f} GiB at /{d}".replace("/.", "/"))
    return best


def available_memory(root: Path = Path("/"), mem_available: int | None = None) -> Available:
    """What this process may still grow by: MemAvailable (psutil; `mem_available` overrides it),
    bounded by its cgroup's limit, plus what it holds already (its RSS: inside the estimate's
    runtime part). `root`: where /proc/self/cgroup and /sys/fs/cgroup are read (tests)."""
    import psutil

    mem = psutil.virtual_memory().available if mem_available is None else mem_available
    rss = psutil.Process().memory_info().rss
    cg = cgroup_room(root)
    if cg is not None and cg[0] < mem:
        return Available(cg[0] + rss, cg[1], mem, cg[0])
    return Available(mem + rss, "MemAvailable", mem, cg[0] if cg else None)


def refusal(est: MemoryEstimate, avail: Available) -> str | None:
    """The one line a start that cannot fit is refused with (None when it fits): what was
    estimated, what is available, and the fixes."""
    if est.total <= avail.bytes:
        return None
    fixes = ["a smaller max_seq"]
    if est.backend == "cpu":
        fixes.append('backend = "cpu-q" (4-bit weights, pip install \'edge-llm[quant]\')')
    if est.backend != "rknn":
        fixes.append("converting for the NPU (edge-llm convert rknn)")
    return (f"memory: refusing to start: estimated {est.describe()}, but only {avail.describe()}; "
            f"fix: {', or '.join(fixes)} (docs/board.md, \"Memory\")")


def admit(est: MemoryEstimate, root: Path = Path("/")) -> Available:
    """Raise MemoryRefused with `refusal`'s line when `est` does not fit; else what is available."""
    avail = available_memory(root)
    line = refusal(est, avail)
    if line is not None:
        raise MemoryRefused(line)
    log.info("memory: estimated %s; %s", est.describe(), avail.describe())
    return avail
