"""The w8a8 decoder on int8 matmuls (`edge-llm convert npu-mm`; docs/npu.md, "The matmul path").

Every linear of the decoder is one int8 x int8 -> int32 matmul through an `Int8Matmul` engine
(int8.py: the host emulation, or librknnrt's matmul API on the board); everything else runs
here on the CPU in float32. Per layer four matmuls (q/k/v fused, o, gate/up fused, down) and the
head once per forward:

    xn   = RMSNorm(x)                      the gain folded into W_qkv (always), rows of x R
    qkv  = deq(mm(qkv, q(xn))) (+ bias)    q(): quantize_rows, one scale per row, at run time
    h    = x + deq(mm(o, q(attn)))         W_o's columns rotated (x R basis)
    hn   = RMSNorm(h)                      the gain folded into W_gu
    a    = SiLU(gate) * up                 (the CPU backend's formula)
    a    = a H (optional)                  the online Hadamard of down_proj's input, H^T in W_down
    out  = h + deq(mm(down, q(a)))
    logits = deq(mm(head, q(RMSNorm(x))))  the final gain folded into W_head

deq() is `int8.dequantize` (row scale x channel scale). With the residual rotation R (an
orthogonal randomized Hadamard matrix, `convert/npu_mm.py`) the stream lives in the basis x R:
`embed` and `residual` rotate rows on their way in, and RMSNorm commutes with R. The ops around
the matmuls are `row_ops`' (the C ops when the operator library is built: a handful of calls per
layer, the rotation as a fast transform; else the numpy reference). The row quantization and
every op are elementwise or per row, so a row's bits depend on that row only (the engine's
integer product is exact): restore == recompute holds bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import zipfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from edge_llm.backends import QKVArrays, RowStep
from edge_llm.backends import kernels
from edge_llm.backends.npu.matmul import row_ops
from edge_llm.backends.npu.matmul import row_step
from edge_llm.backends.npu.matmul import verify
from edge_llm.backends.cpu.backend import numpy_kernels
from edge_llm.backends.cost import ForwardCost
from edge_llm.backends.npu.matmul.int8 import Int8Matmul
from edge_llm.config import ModelArgs
from edge_llm.errors import ConfigError
from edge_llm.files import write_atomic
from edge_llm.weights import Weights

log = logging.getLogger(__name__)

FORMAT = "edge-llm-npu-mm/1"
MANIFEST = "manifest.json"
WEIGHTS = "weights.npz"
LAYOUT = "row-major-KN"  # B as (K, N) int8 rows; the NPU engine converts to its native layout at load
# A bandwidth-bound NPU reads every weight once per forward whatever its row count: a verify
# forward of T rows costs one decode step plus the CPU's per-row work (norms, quantization,
# attention) and the NPU's int8 compute. Predicted for Qwen3-VL-2B at 512 rows of context (CPU
# work measured on x86-64 AVX-512 with the C ops, the engine's time per round measured over the
# tests' fake library, the NPU at the published rates): 2/4/8 rows cost 1.03/1.08/1.19 one-row
# steps (docs/npu.md "Prediction (the matmul path)").
FORWARD_COST = ForwardCost(1.03, 0.03)


@dataclass
class MmManifest:
    """`manifest.json` of an `edge-llm convert npu-mm` directory. `identity()` hashes what
    decides the numerics: format, dtype, scale granularity, rotations, clip, layout, the source
    weights' digest and the digest of weights.npz."""

    model: dict[str, Any]  # name, model_type, weights_sha256, config (identity fields)
    layers: int
    rotation: str  # residual stream: none | hadamard
    down_rotation: str  # online Hadamard of down_proj's input: none | hadamard
    clip: str  # per-channel weight scale: none (absmax) | mse (MSE-optimal clip per channel)
    gptq_tokens: int  # GPTQ on this many calibration tokens (convert/gptq.py); 0: round to nearest
    weights_sha256: str  # of weights.npz
    vo_rotation: str = "none"  # attention values per head times a Hadamard matrix, folded into W_v and W_o
    format: str = FORMAT
    dtype: str = "w8a8"
    scales: str = "activation per row (run time), weight per output channel"
    layout: str = LAYOUT
    build: dict[str, Any] = field(default_factory=dict)  # seconds, peak RSS: informational

    def identity(self) -> str:
        doc = {k: v for k, v in asdict(self).items() if k not in ("build", "model")}
        doc["source"] = self.model.get("weights_sha256")
        return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]

    def write(self, root: Path) -> None:
        write_atomic(root / MANIFEST, json.dumps({**asdict(self), "identity": self.identity()}, indent=1) + "\n")

    @classmethod
    def read(cls, root: str | Path) -> "MmManifest":
        path = Path(root) / MANIFEST
        doc = read_doc(path)
        if doc.get("format") != FORMAT:
            raise ConfigError(f"{path}: format {doc.get('format')!r}, expected {FORMAT!r}")
        doc.pop("identity", None)
        try:
            return cls(**doc)
        except TypeError as e:
            raise ConfigError(f"{path}: malformed ({e})") from None

    def check_model(self, args: ModelArgs, weights_sha256: str | None) -> None:
        if self.model.get("config") != json.loads(json.dumps(args.identity_fields())):
            raise ConfigError(f"npu-mm weights were converted from a different model config "
                              f"({self.model.get('name')}, {self.model.get('model_type')})")
        if weights_sha256 is not None and self.model.get("weights_sha256") != weights_sha256:
            raise ConfigError(f"npu-mm weights were converted from other weights ({self.model.get('name')}): "
                              "re-run `edge-llm convert npu-mm` for this model")


def read_doc(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found (make it with `edge-llm convert npu-mm MODEL {path.parent}` "
                          "or `edge-llm convert rknn`)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: unreadable ({e})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: not a manifest (a JSON object expected)")
    return doc


def is_mm_dir(root: str | Path) -> bool:
    """Whether `root/manifest.json` declares this format (else: a graph directory, or nothing)."""
    path = Path(root) / MANIFEST
    return path.is_file() and read_doc(path).get("format") == FORMAT


def matmul_shapes(root: str | Path) -> list[tuple[int, int]]:
    """The (K, N) of every int8 weight in `root`'s weights.npz, from the arrays' headers only (the
    self-test's largest part is decided before anything is loaded; the bytes are verified at load)."""
    path = Path(root) / WEIGHTS
    shapes = []
    try:
        with zipfile.ZipFile(path) as z:
            for name in z.namelist():
                if name.endswith(".w.npy"):
                    with z.open(name) as f:
                        fmt = np.lib.format
                        version = fmt.read_magic(f)
                        read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
                        shape = read(f)[0]
                    shapes.append((int(shape[0]), int(shape[1])))
    except (OSError, ValueError, IndexError, zipfile.BadZipFile) as e:
        raise ConfigError(f"{path}: unreadable ({e}): re-run `edge-llm convert npu-mm`") from None
    if not shapes:
        raise ConfigError(f"{path}: no int8 weights: re-run `edge-llm convert npu-mm`")
    return shapes


class MmBackend:
    """A `Backend` (see `edge_llm.backends`) over an `Int8Matmul` engine and a converted directory."""

    name = "rknn"
    chunk_sizes: tuple[int, ...] = ()
    row_step: RowStep | None = None
    forward_cost = FORWARD_COST

    def __init__(self, root: str | Path, manifest: MmManifest, engine: Int8Matmul,
                 ops: row_ops.RowOps | None = None):
        self.root, self.m, self.engine = Path(root), manifest, engine
        # the NPU engine's start-up self-test (selftest.py), shown by /health, doctor and the page
        self.selftest: dict | None = engine.selftest.to_dict() if engine.selftest is not None else None
        self.ops = row_ops.ops() if ops is None else ops  # the C ops when built (their bits: the tag)
        self.numerics = self._numerics(manifest)  # until `load`: what the manifest claims
        self.scales: dict[str, np.ndarray] = {}
        self.bias: dict[int, np.ndarray] = {}
        self.rotation: np.ndarray | None = None
        self.rotation_factors: row_ops.Factors | None = None
        self.down_block: np.ndarray | None = None

    def load(self, args: ModelArgs, weights: Weights) -> None:
        if self.m.layers != args.num_hidden_layers:
            raise ConfigError(f"{self.root}: converted {self.m.layers} layers, the model has "
                              f"{args.num_hidden_layers} (converted with --layers? convert all layers to serve)")
        self.args, self.eps = args, np.float32(args.rms_norm_eps)
        self.q_dim, self.kv_dim, self.inter, self.vocab = args.q_dim, args.kv_dim, args.intermediate_size, args.vocab_size
        self.table = weights.pop_rows(f"{args.weight_prefix}embed_tokens.weight")  # exact F32 rows, read when used
        path = self.root / WEIGHTS
        try:
            self._load_weights(path)
        except BaseException:  # an engine that ran out of NPU memory half-way: release what it holds
            self.engine.close()
            raise
        missing = [n for n in self._names() if n not in self.scales]
        if missing:
            self.engine.close()
            raise ConfigError(f"{path}: no weight {missing[0]!r} ({len(missing)} missing): re-run "
                              "`edge-llm convert npu-mm`")
        # decode forwards in one call, attention by the operator library's kernel (row_step.py); its
        # code path decides the K/V rows' bits, so it joins the numerics
        self.row_step = row_step.make(self, args, weights)
        if self.row_step is not None:
            self.numerics = f"{self.numerics}:rowstep-{kernels.isa()}"
        log.info("npu-mm backend: %d layers, engine %s, rotation %s, down %s, row step %s", self.m.layers,
                 self.engine.numerics, self.m.rotation, self.m.down_rotation,
                 "on" if self.row_step is not None else "off (the operator library is not built)")

    def _numerics(self, m: MmManifest) -> str:
        tag = f":{self.ops.tag}" if self.ops.tag else ""
        return f"rknn-mm:{m.identity()}:{self.engine.numerics}:{numpy_kernels()}{tag}"

    def _load_weights(self, path: Path) -> None:
        """The arrays of weights.npz, read from the descriptor its digest was checked on
        (verify.py); the numerics (and so the snapshot namespace) from the verified digest."""
        factors: dict[str, np.ndarray] = {}
        f, digest = verify.open_weights(path, self.m.weights_sha256)
        try:
            with f, np.load(f) as z:
                for key in z.files:
                    arr = z[key]
                    verify.check_array(path, key, arr)
                    kind = key.rsplit(".", 1)[-1]
                    if kind == "w":
                        self.engine.add(key[:-2], np.ascontiguousarray(arr))
                    elif kind == "s":
                        self.scales[key[:-2]] = np.array(arr, np.float32)
                    elif kind == "b":
                        self.bias[int(key.split(".")[1])] = np.array(arr, np.float32)
                    elif key == "rotation":
                        self.rotation = np.array(arr, np.float32)
                    elif key == "down_block":
                        self.down_block = np.array(arr, np.float32)
                    elif key in ("rotation_block", "rotation_scale"):
                        factors[key] = np.array(arr, np.float32)
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
            raise ConfigError(f"{path}: unreadable ({e}): re-run `edge-llm convert npu-mm`") from None
        self.m = replace(self.m, weights_sha256=digest)
        self.numerics = self._numerics(self.m)
        if self.rotation is not None and len(factors) == 2:
            self.rotation_factors = (factors["rotation_block"], factors["rotation_scale"])
            if self.ops.uses_factors:  # derivable from the factors: not kept (16 MB for the 2B)
                self.rotation = None

    def _names(self) -> list[str]:
        return [f"layer.{i}.{k}" for i in range(self.m.layers) for k in ("qkv", "o", "gu", "down")] + ["head"]

    # ---- the seam -------------------------------------------------------------------------
    def embed(self, tokens: np.ndarray) -> np.ndarray:
        return self.residual(self.table[tokens].astype(np.float32, copy=False))

    def residual(self, rows: np.ndarray) -> np.ndarray:
        if self.rotation is None and self.rotation_factors is None:
            return rows
        return self.ops.rotate(rows, self.rotation, self.rotation_factors)

    def qkv(self, layer: int, x: np.ndarray) -> QKVArrays:
        name, ops = f"layer.{layer}.qkv", self.ops
        q8, s = ops.norm_quant(x, self.eps)
        y = ops.dequant(self.engine.run(name, q8), s, self.scales[name], self.bias.get(layer))
        q, kv = self.q_dim, self.kv_dim
        return y[:, :q], y[:, q:q + kv], y[:, q + kv:]

    def post(self, layer: int, attn: np.ndarray, x: np.ndarray,
             fuse_next: bool = True) -> tuple[np.ndarray, QKVArrays | None]:
        p, ops, sc = f"layer.{layer}.", self.ops, self.scales
        q8, s = ops.quant(attn)
        h, q8, s = ops.dequant_add_norm_quant(self.engine.run(p + "o", q8), s, sc[p + "o"], x, self.eps)
        q8, s = ops.swiglu_quant(self.engine.run(p + "gu", q8), s, sc[p + "gu"], self.inter, self.down_block)
        # (x + o) + m, as the CPU backend adds
        return ops.dequant_add(self.engine.run(p + "down", q8), s, sc[p + "down"], h), None

    def logits(self, x: np.ndarray) -> np.ndarray:
        q8, s = self.ops.norm_quant(x, self.eps)
        y = self.ops.dequant(self.engine.run("head", q8), s, self.scales["head"], None)
        return y if y.shape[1] == self.vocab else np.ascontiguousarray(y[:, :self.vocab])

    def close(self) -> None:
        self.engine.close()

