"""ctypes mirror of librknnrt's matmul API: `binding.h` of RKNN runtime 2.x (2.1 onwards:
`iommu_domain_id`, dynamic shapes, the 5-argument `rknn_B_normal_layout_to_native_layout`) and
the parts of `rknn_api.h` it uses (`rknn_tensor_mem`, the error codes, tensor types, core masks).

Structs and enums are declared once here, argtypes/restype set once at load, and every call is
checked: a non-zero return (or a NULL `rknn_create_mem`) raises `RknnMatmulError` naming the
function, the code and the code's name. Nothing else lives here: the engine on top of it is
`engine.py` (docs/npu.md, "The matmul API binding").

`rknn_context` is uint64_t on 64-bit targets (the RK3588 runs aarch64; the 32-bit arm typedef
is not mirrored).
"""

from __future__ import annotations

import ctypes
import os
import re
from ctypes import POINTER, Structure, c_char, c_int, c_int8, c_int16, c_int32, c_uint32, c_uint64, c_void_p
from enum import IntEnum

from edge_llm.errors import ConfigError, RknnMatmulError
from edge_llm.settings import LIBRKNNRT_ENV, LIBRKNNRT_NAME

MAX_NAME_LEN = 256  # RKNN_MAX_NAME_LEN
MAX_DIMS = 16  # RKNN_MAX_DIMS
K_MAX = 10240  # rknn_matmul_set_io_mem: "K max: k <= 10240"
ALIGN_INT8 = 32  # RK3588 int8: K and N aligned to 32
NATIVE_K_SEGMENT = 8192  # RK3588: B is split into ceil(K / 8192) segments above this

# rknn_api.h, "Error code returned by the RKNN API"
ERRORS = {
    0: "RKNN_SUCC", -1: "RKNN_ERR_FAIL", -2: "RKNN_ERR_TIMEOUT", -3: "RKNN_ERR_DEVICE_UNAVAILABLE",
    -4: "RKNN_ERR_MALLOC_FAIL", -5: "RKNN_ERR_PARAM_INVALID", -6: "RKNN_ERR_MODEL_INVALID",
    -7: "RKNN_ERR_CTX_INVALID", -8: "RKNN_ERR_INPUT_INVALID", -9: "RKNN_ERR_OUTPUT_INVALID",
    -10: "RKNN_ERR_DEVICE_UNMATCH", -11: "RKNN_ERR_INCOMPATILE_PRE_COMPILE_MODEL",
    -12: "RKNN_ERR_INCOMPATILE_OPTIMIZATION_LEVEL_VERSION", -13: "RKNN_ERR_TARGET_PLATFORM_UNMATCH",
}


class TensorType(IntEnum):  # rknn_tensor_type
    FLOAT32 = 0
    FLOAT16 = 1
    INT8 = 2
    UINT8 = 3
    INT16 = 4
    UINT16 = 5
    INT32 = 6
    UINT32 = 7
    INT64 = 8
    BOOL = 9
    INT4 = 10
    BFLOAT16 = 11


class CoreMask(IntEnum):  # rknn_core_mask (rknn_api.h). A matmul context takes AUTO or one core:
    # boards answer -1 ("Not support core mask") for 0_1 and 0_1_2 (docs/npu.md, "Core masks")
    AUTO = 0
    CORE_0 = 1
    CORE_1 = 2
    CORE_2 = 4
    CORE_0_1 = 3
    CORE_0_1_2 = 7
    ALL = 0xFFFF


CORE_MASKS = (CoreMask.CORE_0, CoreMask.CORE_1, CoreMask.CORE_2)  # NPU core i -> its one-core mask


class MatmulType(IntEnum):  # rknn_matmul_type (rknn_matmul_api.h of runtime 2.3.2; 13 and 14 are unused)
    FLOAT16_MM_FLOAT16_TO_FLOAT32 = 1
    INT8_MM_INT8_TO_INT32 = 2
    INT8_MM_INT8_TO_INT8 = 3
    FLOAT16_MM_FLOAT16_TO_FLOAT16 = 4
    FLOAT16_MM_INT8_TO_FLOAT32 = 5
    FLOAT16_MM_INT8_TO_FLOAT16 = 6
    FLOAT16_MM_INT4_TO_FLOAT32 = 7
    FLOAT16_MM_INT4_TO_FLOAT16 = 8
    INT8_MM_INT8_TO_FLOAT32 = 9
    INT4_MM_INT4_TO_INT16 = 10
    INT8_MM_INT4_TO_INT32 = 11
    FLOAT16_MM_INT4_TO_BFLOAT16 = 12
    INT8_MM_INT4_TO_FLOAT16 = 15


LAST_MATMUL_TYPE = max(MatmulType)  # 15


class Layout(IntEnum):  # rknn_matmul_layout
    NORM = 0
    NATIVE = 1
    TP_NORM = 2


class QuantType(IntEnum):  # rknn_matmul_quant_type, the values of rknn_matmul_info.B_quant_type
    # (the enum and the demos' use; the struct's comment "1: per channel, 2: per group" is older)
    PER_LAYER_SYM = 0
    PER_LAYER_ASYM = 1
    PER_CHANNEL_SYM = 2
    PER_CHANNEL_ASYM = 3
    PER_GROUP_SYM = 4
    PER_GROUP_ASYM = 5


class TensorMem(Structure):  # rknn_tensor_mem (rknn_api.h)
    _fields_ = [("virt_addr", c_void_p), ("phys_addr", c_uint64), ("fd", c_int32), ("offset", c_int32),
                ("size", c_uint32), ("flags", c_uint32), ("priv_data", c_void_p)]


class MatmulInfo(Structure):  # rknn_matmul_info
    _fields_ = [("M", c_int32), ("K", c_int32), ("N", c_int32), ("type", c_int),
                ("B_layout", c_int16), ("B_quant_type", c_int16), ("AC_layout", c_int16), ("AC_quant_type", c_int16),
                ("iommu_domain_id", c_int32), ("group_size", c_int16), ("reserved", c_int8 * 34)]


class TensorAttr(Structure):  # rknn_matmul_tensor_attr
    _fields_ = [("name", c_char * MAX_NAME_LEN), ("n_dims", c_uint32), ("dims", c_uint32 * MAX_DIMS),
                ("size", c_uint32), ("type", c_int)]


class IoAttr(Structure):  # rknn_matmul_io_attr
    _fields_ = [("A", TensorAttr), ("B", TensorAttr), ("C", TensorAttr)]


class Shape(Structure):  # rknn_matmul_shape
    _fields_ = [("M", c_int32), ("K", c_int32), ("N", c_int32)]


Context = c_uint64  # rknn_matmul_ctx = rknn_context
MemPtr = POINTER(TensorMem)

# entry point -> (restype, argtypes), as the header declares them
_SIGNATURES: dict[str, tuple[type | None, list]] = {
    "rknn_matmul_create": (c_int, [POINTER(Context), POINTER(MatmulInfo), POINTER(IoAttr)]),
    "rknn_matmul_create_dynamic_shape": (c_int, [POINTER(Context), POINTER(MatmulInfo), c_int, POINTER(Shape),
                                                 POINTER(IoAttr)]),
    "rknn_matmul_set_dynamic_shape": (c_int, [Context, POINTER(Shape)]),
    "rknn_matmul_set_io_mem": (c_int, [Context, MemPtr, POINTER(TensorAttr)]),
    "rknn_matmul_set_core_mask": (c_int, [Context, c_int]),
    "rknn_matmul_run": (c_int, [Context]),
    "rknn_matmul_destroy": (c_int, [Context]),
    "rknn_create_mem": (MemPtr, [Context, c_uint32]),
    "rknn_destroy_mem": (c_int, [Context, MemPtr]),
    "rknn_B_normal_layout_to_native_layout": (c_int, [c_void_p, c_void_p, c_int, c_int, POINTER(MatmulInfo)]),
}


# entry points of rknn_api.h the start-up self-test uses when the library has them (selftest.py)
_OPTIONAL: dict[str, tuple[type | None, list]] = {
    "rknn_query": (c_int, [Context, c_int, c_void_p, c_uint32]),
    "rknn_mem_sync": (c_int, [Context, MemPtr, c_int]),
}
QUERY_SDK_VERSION = 5  # rknn_query_cmd RKNN_QUERY_SDK_VERSION
SYNC_TO_DEVICE, SYNC_FROM_DEVICE = 1, 2  # rknn_mem_sync_mode


class SdkVersion(Structure):  # rknn_sdk_version (rknn_api.h)
    _fields_ = [("api_version", c_char * 256), ("drv_version", c_char * 256)]


# the RKNPU driver's version as rknn_query's drv_version ("0.9.8"), its debugfs file ("RKNPU driver:
# v0.9.8") or the kernel log at probe time ("Initialized rknpu 0.9.8 ...") names it
NPU_DRIVER_DEBUGFS = "sys/kernel/debug/rknpu/version"
_DRIVER_VERSION = re.compile(r"(?:RKNPU driver: v|Initialized rknpu |^v?)(\d+\.\d+\.\d+)", re.M)


def npu_driver_version(text: str) -> str | None:
    """The driver version `text` names ("0.9.8"), or None."""
    m = _DRIVER_VERSION.search(text.strip())
    return m.group(1) if m else None


def library_path(lib: str | None = None) -> str:
    """`lib`, else `$EDGE_LLM_LIBRKNNRT`, else "librknnrt.so" (found by the dynamic loader)."""
    return lib or os.environ.get(LIBRKNNRT_ENV) or LIBRKNNRT_NAME


def _check(function: str, ret: int, detail: str = "") -> None:
    if ret != 0:
        raise RknnMatmulError(function, ret, ERRORS.get(ret, "unknown code"), detail)


class MatmulLib:
    """The loaded library: one checked method per entry point of the matmul API."""

    def __init__(self, path: str):
        try:
            self.cdll = ctypes.CDLL(path)
        except OSError as e:
            raise ConfigError(
                f"cannot load {path} ({e}): the NPU matmul path needs librknnrt.so from Rockchip's rknpu2 "
                f"runtime (the one rknn-toolkit-lite2 uses; runtime 2.1 or newer) installed where the loader finds "
                f"it (e.g. /usr/lib), or ${LIBRKNNRT_ENV} pointing at the file") from None
        missing = [name for name in _SIGNATURES if not hasattr(self.cdll, name)]
        if missing:
            raise ConfigError(f"{path} has no {', '.join(missing)}: the NPU matmul path needs librknnrt 2.1 or newer "
                              f"(or ${LIBRKNNRT_ENV} pointing at such a file)")
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(self.cdll, name)
            fn.restype, fn.argtypes = restype, argtypes
        for name, (restype, argtypes) in _OPTIONAL.items():
            if hasattr(self.cdll, name):
                fn = getattr(self.cdll, name)
                fn.restype, fn.argtypes = restype, argtypes
        self.path = path

    def has(self, name: str) -> bool:
        """Whether the library exports `name` (an entry point of _OPTIONAL)."""
        return hasattr(self.cdll, name)

    def sdk_version(self, ctx: int) -> tuple[str, str]:
        """(api_version, drv_version) from `rknn_query(ctx, RKNN_QUERY_SDK_VERSION)`."""
        v = SdkVersion()
        _check("rknn_query", self.cdll.rknn_query(ctx, QUERY_SDK_VERSION, ctypes.byref(v), ctypes.sizeof(v)),
               "RKNN_QUERY_SDK_VERSION")
        return v.api_version.decode(errors="replace"), v.drv_version.decode(errors="replace")

    def mem_sync(self, ctx: int, mem: ctypes._Pointer, mode: int) -> None:
        _check("rknn_mem_sync", self.cdll.rknn_mem_sync(ctx, mem, mode), f"mode {mode}")

    def create_dynamic_shape(self, info: MatmulInfo, shapes: list[Shape]) -> tuple[int, list[IoAttr]]:
        ctx = Context(0)
        arr = (Shape * len(shapes))(*shapes)
        attrs = (IoAttr * len(shapes))()
        _check("rknn_matmul_create_dynamic_shape",
               self.cdll.rknn_matmul_create_dynamic_shape(ctypes.byref(ctx), ctypes.byref(info), len(shapes), arr,
                                                          attrs),
               f"K={info.K} N={info.N} type={info.type} M in {[s.M for s in shapes]}")
        return ctx.value, list(attrs)

    def set_dynamic_shape(self, ctx: int, shape: Shape) -> None:
        _check("rknn_matmul_set_dynamic_shape", self.cdll.rknn_matmul_set_dynamic_shape(ctx, ctypes.byref(shape)),
               f"M={shape.M} K={shape.K} N={shape.N}")

    def set_core_mask(self, ctx: int, mask: int) -> None:
        _check("rknn_matmul_set_core_mask", self.cdll.rknn_matmul_set_core_mask(ctx, mask), f"mask {mask}")

    def set_io_mem(self, ctx: int, mem: ctypes._Pointer, attr: TensorAttr) -> None:
        _check("rknn_matmul_set_io_mem", self.cdll.rknn_matmul_set_io_mem(ctx, mem, ctypes.byref(attr)),
               f"tensor {attr.name.decode(errors='replace')}, {mem.contents.size} bytes for {attr.size}")

    def run(self, ctx: int) -> None:
        _check("rknn_matmul_run", self.cdll.rknn_matmul_run(ctx))

    def destroy(self, ctx: int) -> None:
        _check("rknn_matmul_destroy", self.cdll.rknn_matmul_destroy(ctx))

    def create_mem(self, ctx: int, size: int) -> ctypes._Pointer:
        mem = self.cdll.rknn_create_mem(ctx, size)
        if not mem:
            raise RknnMatmulError("rknn_create_mem", None, "NULL", f"no {size} bytes for the context (its IOMMU "
                                  "domain maps 4 GiB: NPU memory full?)")
        return mem

    def destroy_mem(self, ctx: int, mem: ctypes._Pointer) -> None:
        _check("rknn_destroy_mem", self.cdll.rknn_destroy_mem(ctx, mem))

    def b_to_native(self, b_normal: int, b_native: int, k: int, n: int, info: MatmulInfo) -> None:
        """`rknn_B_normal_layout_to_native_layout` from the address of B (K, N) to a native buffer."""
        _check("rknn_B_normal_layout_to_native_layout",
               self.cdll.rknn_B_normal_layout_to_native_layout(b_normal, b_native, k, n, ctypes.byref(info)),
               f"K={k} N={n}")


def load_library(path: str) -> MatmulLib:
    """Load librknnrt.so (or a stand-in at `path`); a missing file or entry point is a ConfigError."""
    return MatmulLib(path)
