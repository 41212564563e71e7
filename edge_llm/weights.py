"""safetensors checkpoints: tensor index, name/shape checks against ModelArgs, F32 loading, digest.

Files are validated with the `safetensors` library (header bounds, offsets). A tensor is read
from an `mmap.mmap` of its file and widened to F32 piece by piece, each piece's file pages dropped
(`MADV_DONTNEED`) once converted: peak RSS stays near the F32 weights, not weights + file. Tensors
used only in bursts or gathered from stay in the file (`MappedRows`, `MappedMatrix`: one shared
map per file). BF16 and F16 widen to F32 exactly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from safetensors import safe_open

from edge_llm.config import ModelArgs, VisionArgs
from edge_llm.errors import WeightsError
from edge_llm.files import open_regular, write_atomic
from edge_llm.safetext import printable
from edge_llm.settings import digest_cache_path

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
_NP_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1}  # safetensors tags
_DIGEST_CHUNK = 8 << 20
_CONVERT_ELEMS = 8 << 20  # 32 MiB of F32 per conversion piece


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, absolute byte offset, dtype tag and shape."""

    file: Path
    offset: int
    dtype: str
    shape: tuple[int, ...]


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's files: those named by the shard index if present, else every *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightsError(f"{index}: unreadable shard index ({e})") from None
        files = sorted({model_dir / name for name in weight_map.values()})
        for f in files:
            if not f.exists():
                raise WeightsError(f"{INDEX_FILE} names shard {f.name} which does not exist")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise WeightsError(f"{model_dir}: no *.safetensors files")
    for f in files:  # a FIFO would block the safetensors library's open: refused here, unread
        open_regular(f, WeightsError).close()
    return files


def _read_header(path: Path) -> tuple[dict, int]:
    """The JSON header and the absolute offset where tensor data starts."""
    with open_regular(path, WeightsError) as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def index_tensors(model_dir: str | Path) -> dict[str, TensorInfo]:
    """Map tensor name -> TensorInfo over all files (headers only, no tensor data read)."""
    out: dict[str, TensorInfo] = {}
    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="numpy") as f:  # the library validates the header
                names = set(f.keys())
        except Exception as e:  # safetensors raises its own SafetensorError / OSError
            raise WeightsError(f"{path.name}: not a valid safetensors file ({e})") from None
        header, data_start = _read_header(path)
        for name in names:
            entry = header[name]
            begin, _end = entry["data_offsets"]
            out[name] = TensorInfo(path, data_start + begin, entry["dtype"], tuple(entry["shape"]))
    return out


def expected_tensors(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor name the text decoder needs, with its HF shape (out, in) for linears."""
    p, h, d = args.weight_prefix, args.hidden_size, args.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        f"{p}embed_tokens.weight": (args.vocab_size, h),
        f"{p}norm.weight": (h,),
    }
    if not args.tie_word_embeddings:
        shapes[args.lm_head_name] = (args.vocab_size, h)
    for i in range(args.num_hidden_layers):
        lp = f"{p}layers.{i}."
        shapes |= {
            f"{lp}input_layernorm.weight": (h,),
            f"{lp}post_attention_layernorm.weight": (h,),
            f"{lp}self_attn.q_proj.weight": (args.q_dim, h),
            f"{lp}self_attn.k_proj.weight": (args.kv_dim, h),
            f"{lp}self_attn.v_proj.weight": (args.kv_dim, h),
            f"{lp}self_attn.o_proj.weight": (h, args.q_dim),
            f"{lp}mlp.gate_proj.weight": (args.intermediate_size, h),
            f"{lp}mlp.up_proj.weight": (args.intermediate_size, h),
            f"{lp}mlp.down_proj.weight": (h, args.intermediate_size),
        }
        if args.attention_bias:
            shapes |= {
                f"{lp}self_attn.q_proj.bias": (args.q_dim,),
                f"{lp}self_attn.k_proj.bias": (args.kv_dim,),
                f"{lp}self_attn.v_proj.bias": (args.kv_dim,),
            }
        if args.qk_norm:
            shapes |= {f"{lp}self_attn.q_norm.weight": (d,), f"{lp}self_attn.k_norm.weight": (d,)}
    return shapes


def vision_tensors(v: VisionArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Qwen3-VL vision tower (HF names and shapes): the one schema that the
    loader checks and `model synth` writes."""
    p, h, m = v.weight_prefix, v.hidden_size, v.merged_dim
    shapes: dict[str, tuple[int, ...]] = {
        f"{p}patch_embed.proj.weight": (h, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
        f"{p}patch_embed.proj.bias": (h,),
        f"{p}pos_embed.weight": (v.num_position_embeddings, h),
    }
    for i in range(v.depth):
        bp = f"{p}blocks.{i}."
        shapes |= {
            f"{bp}norm1.weight": (h,), f"{bp}norm1.bias": (h,),
            f"{bp}norm2.weight": (h,), f"{bp}norm2.bias": (h,),
            f"{bp}attn.qkv.weight": (3 * h, h), f"{bp}attn.qkv.bias": (3 * h,),
            f"{bp}attn.proj.weight": (h, h), f"{bp}attn.proj.bias": (h,),
            f"{bp}mlp.linear_fc1.weight": (v.intermediate_size, h), f"{bp}mlp.linear_fc1.bias": (v.intermediate_size,),
            f"{bp}mlp.linear_fc2.weight": (h, v.intermediate_size), f"{bp}mlp.linear_fc2.bias": (h,),
        }
    mergers = [f"{p}merger."] + [f"{p}deepstack_merger_list.{j}." for j in range(len(v.deepstack_visual_indexes))]
    for j, mp in enumerate(mergers):
        norm = h if j == 0 else m  # the main merger normalises each patch, DeepStack ones the 2x2 group
        shapes |= {
            f"{mp}norm.weight": (norm,), f"{mp}norm.bias": (norm,),
            f"{mp}linear_fc1.weight": (m, m), f"{mp}linear_fc1.bias": (m,),
            f"{mp}linear_fc2.weight": (v.out_hidden_size, m), f"{mp}linear_fc2.bias": (v.out_hidden_size,),
        }
    return shapes


def _check(found: dict[str, TensorInfo], want: dict[str, tuple[int, ...]]) -> None:
    missing = [n for n in want if n not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightsError(f"tensor {missing[0]!r} missing from the checkpoint{more}")
    for name, shape in want.items():
        info = found[name]
        if info.shape != shape:
            raise WeightsError(f"tensor {name!r} has shape {list(info.shape)}, expected {list(shape)}")
        if info.dtype not in _NP_DTYPES:
            raise WeightsError(f"tensor {name!r} has dtype {info.dtype}; supported: F32, F16, BF16")


def _drop_pages(mm: mmap.mmap, start: int, length: int) -> None:
    """Tell the kernel we are done with these mapped file pages (they leave our RSS)."""
    page = mmap.PAGESIZE
    lo = -(-start // page) * page  # only whole pages inside the range
    hi = (start + length) // page * page
    if hi > lo and hasattr(mm, "madvise"):
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def read_tensor(info: TensorInfo) -> np.ndarray:
    """Read one tensor as an owned, C-contiguous float32 array (exact for F32/F16/BF16)."""
    if info.dtype not in _NP_DTYPES:
        raise WeightsError(f"dtype {info.dtype} is not supported (F32, F16, BF16)")
    count = int(np.prod(info.shape, dtype=np.int64))
    if count == 0:
        return np.zeros(info.shape, dtype=np.float32)
    itemsize = np.dtype(_NP_DTYPES[info.dtype]).itemsize
    out = np.empty(count, dtype=np.float32)
    with open_regular(info.file, WeightsError) as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        raw = np.frombuffer(mm, dtype=_NP_DTYPES[info.dtype], count=count, offset=info.offset)
        # convert piecewise and drop each piece's file pages at once, so peak RSS is the F32
        # result plus one piece, not result + whole mapped tensor (+ a temporary)
        for a in range(0, count, _CONVERT_ELEMS):
            b = min(count, a + _CONVERT_ELEMS)
            if info.dtype == "BF16":
                # bfloat16 is the top half of a float32: shifting the bits back is exact
                dst = out[a:b].view(np.uint32)
                dst[:] = raw[a:b]
                dst <<= 16
            else:
                out[a:b] = raw[a:b]  # F16 -> F32 is exact; F32 is a plain copy
            _drop_pages(mm, info.offset + a * itemsize, (b - a) * itemsize)
        del raw  # release the buffer export so the map can close
    return out.reshape(info.shape)


def _map(path: Path) -> mmap.mmap:
    with open_regular(path, WeightsError) as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


class MappedRows:
    """Rows of a 2-D tensor read from its file when asked (mmap), widened to float32 exactly.

    For an embedding table that is only ever gathered from: no F32 copy of the whole table is
    held (1.2 GB for Qwen3-VL-2B), only the file pages of rows looked up, which the kernel can
    drop under memory pressure."""

    def __init__(self, info: TensorInfo, mm: mmap.mmap):
        if info.dtype not in _NP_DTYPES or len(info.shape) != 2:
            raise WeightsError(f"{info.file.name}: cannot map rows of a {info.dtype} {list(info.shape)} tensor")
        self.dtype, self.shape = info.dtype, info.shape
        self._mm = mm  # the checkpoint file's map, shared with its other mapped tensors
        count = info.shape[0] * info.shape[1]
        self._raw = np.frombuffer(self._mm, dtype=_NP_DTYPES[info.dtype], count=count,
                                  offset=info.offset).reshape(info.shape)

    def __getitem__(self, idx) -> np.ndarray:
        raw = self._raw[idx]
        if self.dtype == "BF16":
            wide = raw.astype(np.uint32)
            wide <<= 16
            return wide.view(np.float32)
        return raw.astype(np.float32)


class MappedMatrix:
    """A 2-D (out, in) weight left in its file (mmap), widened to float32 when used.

    For weights used in bursts (the vision tower, once per image): between uses they cost no
    anonymous memory, only file pages the kernel may drop. `t()` is the (in, out) float32 view
    of a fresh widened copy, so a projection is `x @ m.t()` (BLAS reads the transposed operand
    in place; no transposed copy is made)."""

    def __init__(self, info: TensorInfo, mm: mmap.mmap):
        self.rows = MappedRows(info, mm)
        self.shape = info.shape

    def t(self) -> np.ndarray:
        return self.rows[:].T


class Weights(Mapping[str, np.ndarray]):
    """Validated checkpoint: every expected tensor exists with the right shape and a supported dtype.

    Tensors are read lazily (`pop` hands one over and forgets it) so loading never holds
    two copies of the whole model.
    """

    def __init__(self, args: ModelArgs, tensors: dict[str, TensorInfo]):
        self.args = args
        self._infos = tensors
        self._total = len(tensors)
        self._maps: dict[Path, mmap.mmap] = {}
        # progress(done, total) after each tensor handed over: loading GBs from eMMC is slow, and
        # the server turns this into systemd start-timeout extensions
        self.progress: Callable[[int, int], None] | None = None

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            info = self._infos[name]
        except KeyError:
            raise WeightsError(f"tensor {name!r} missing from the checkpoint") from None
        try:
            return read_tensor(info)
        except WeightsError as e:
            raise WeightsError(f"tensor {name!r}: {e}") from None

    def pop(self, name: str) -> np.ndarray:  # type: ignore[override]
        """Read a tensor and drop it from this mapping."""
        arr = self[name]
        del self._infos[name]
        if self.progress is not None:
            self.progress(self._total - len(self._infos), self._total)
        return arr

    def pop_rows(self, name: str) -> MappedRows:
        """Like `pop`, but the tensor stays in its file: rows are read when indexed."""
        info = self._take(name)
        return MappedRows(info, self._mapped(info.file))

    def pop_matrix(self, name: str) -> MappedMatrix:
        """Like `pop_rows`, for a weight matrix read whole when used (`MappedMatrix.t()`)."""
        info = self._take(name)
        return MappedMatrix(info, self._mapped(info.file))

    def _mapped(self, path: Path) -> mmap.mmap:
        """One map (and one descriptor) per checkpoint file, shared by every tensor left in it."""
        if path not in self._maps:
            self._maps[path] = _map(path)
        return self._maps[path]

    def _take(self, name: str) -> TensorInfo:
        try:
            info = self._infos.pop(name)
        except KeyError:
            raise WeightsError(f"tensor {name!r} missing from the checkpoint") from None
        if self.progress is not None:
            self.progress(self._total - len(self._infos), self._total)
        return info

    def __contains__(self, name: object) -> bool:
        return name in self._infos  # without reading the tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, name: str) -> TensorInfo:
        return self._infos[name]


def load_weights(model_dir: str | Path, args: ModelArgs) -> Weights:
    """Index the checkpoint and check all names, shapes and dtypes against `args` (no data read).

    Only the text decoder's tensors are kept (a qwen3_vl vision tower is ignored). With tied
    embeddings a stored `lm_head.weight` is ignored: the embedding is used.
    """
    found = index_tensors(model_dir)
    want = expected_tensors(args)
    _check(found, want)
    log.debug("checkpoint %s: %d tensors checked (%d ignored)", printable(model_dir), len(want),
              len(found) - len(want))
    return Weights(args, {n: found[n] for n in want})


def load_vision_weights(model_dir: str | Path, args: ModelArgs, vision: VisionArgs) -> Weights | None:
    """The vision tower's tensors, checked like the decoder's; None if the checkpoint has none
    (a text-only export of a qwen3_vl model: it still serves text)."""
    found = index_tensors(model_dir)
    want = vision_tensors(vision)
    if not any(n.startswith(vision.weight_prefix) for n in found):
        return None
    _check(found, want)
    return Weights(args, {n: found[n] for n in want})


# ---- weight digest ---------------------------------------------------------------------------
def hash_into(h: hashlib._Hash, f: BinaryIO, progress: Callable[[int], None] | None = None) -> int:
    """Stream an open (unbuffered) file's remaining bytes into `h` through one reusable buffer;
    `progress(bytes done)` after every 256 MiB (hashing GBs on eMMC takes minutes). The one hashing
    loop: whole files here, a graph's file pairs (graph/manifest.py), and weights.npz hashed through
    the descriptor it is then read from (npu/matmul/verify.py). Returns the bytes hashed."""
    buf = bytearray(_DIGEST_CHUNK)
    view = memoryview(buf)
    done, step = 0, 256 << 20
    while n := f.readinto(buf):
        h.update(view[:n])
        done += n
        if progress is not None and done % step < n:
            progress(done)
    return done


def sha256_file(path: str | Path, progress: Callable[[int], None] | None = None) -> str:
    """Hex sha256 of a file's bytes (`hash_into`)."""
    h = hashlib.sha256()
    with open_regular(path, WeightsError, buffering=0) as f:
        hash_into(h, f, progress)
    return h.hexdigest()


def weight_digest(model_dir: str | Path, progress: Callable[[str], None] | None = None) -> str:
    """sha256 over the checkpoint's safetensors files (name + per-file sha256, in name order).

    Per-file digests are cached in `digests.json` keyed by absolute path, size and mtime, so
    hashing gigabytes happens once per install; a cache that cannot be read or written is
    only logged.
    """
    cache_path = digest_cache_path()
    try:
        cache = json.loads(cache_path.read_text())
        if not isinstance(cache, dict):
            cache = {}
    except (OSError, json.JSONDecodeError):
        cache = {}
    total = hashlib.sha256()
    dirty = False
    for path in safetensors_files(model_dir):
        st = path.stat()
        key = str(path.resolve())
        entry = cache.get(key)
        if not (isinstance(entry, dict) and entry.get("size") == st.st_size
                and entry.get("mtime_ns") == st.st_mtime_ns and isinstance(entry.get("sha256"), str)):
            log.info("hashing %s (%d bytes)", printable(path.name), st.st_size)
            report = None if progress is None else (
                lambda done, p=path, size=st.st_size: progress(f"hashing {p.name} {done >> 20}/{size >> 20} MiB"))
            entry = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(path, report)}
            cache[key] = entry
            dirty = True
        total.update(f"{path.name}:{entry['sha256']}\n".encode())
    if dirty:
        try:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            # atomic: concurrent processes never see half a file; a cache, so no fsync (a lost
            # update costs one more hash)
            write_atomic(cache_path, json.dumps(cache, indent=1, sort_keys=True), durable=False)
        except OSError as e:
            log.warning("could not write digest cache %s: %s", printable(cache_path), e)
    return total.hexdigest()
