"""The NPU matmul engine over a librknnrt.so (the tests' fake, which stands in for Rockchip's closed
library: tests/fake_librknnrt/fake_rknnrt.c), checked against the host emulation; run in-process by
tests/test_rknn_matmul.py and as a script on the emulated arm64 board by tests/test_board_emulated.py.

    python npu_matmul_check.py --lib PATH/librknnrt.so   # prints one JSON object

bitwise(): `NpuInt8Matmul` results equal `HostInt8Matmul`'s bit for bit (random int8 with the
extremes +-127, weights cut over three cores by N, by K and both, M padded to a dynamic shape and
split above the largest, K above 8192 where RK3588's native layout has two segments). domains(): the Qwen3-VL-2B decoder's
int8 weights as `NpuInt8Matmul` allocates them (same cut over the cores, dynamic shapes and io attr sizes;
B left unwritten, so nothing is touched) in IOMMU domain 0 beside a vision-tower-sized buffer in
the same domain (the driver attaches one domain at a time: docs/npu.md, "IOMMU domains"); the fp16
graphs' bytes and the tower in one domain are refused (each domain maps 4 GiB, page-rounded).
"""

from __future__ import annotations

import argparse
import ctypes
import json

import numpy as np

from edge_llm.backends.npu.matmul import binding as api
from edge_llm.backends.npu.matmul.int8 import HostInt8Matmul
from edge_llm.backends.npu.matmul.engine import M_SHAPES, open_npu_matmul, split_weight
from edge_llm.checkpoints.synth import QWEN3_VL_2B_TEXT
from edge_llm.config import ModelArgs
from edge_llm.errors import RknnMatmulError

# (K, N, row counts): N = 224 splits 96 + 64 + 64 over three cores; 128 x 128 two halves of N over
# K's first 96 rows and all of N over the rest; 192 x 64 by K (partial products summed); K = 10240
# (by N) has two native segments
SMALL_CASES = ((64, 224, (1, 3, 33, 200)), (128, 128, (1, 3)), (192, 64, (2,)), (10240, 64, (3,)))
TOWER_BYTES = 850_000_000  # the Qwen3-VL-2B vision tower's fp16 .rknn (docs/vision.md, "NPU memory")
FP16_GRAPHS_BYTES = 3_490_000_000  # the fp16 decoder's .rknn graphs (docs/npu.md, "Memory budget")


def live(lib_path: str) -> tuple[int, int]:
    """(contexts, buffers) alive in the fake library (its test hook; the same loaded instance)."""
    fake = ctypes.CDLL(lib_path)
    c, m = ctypes.c_int64(), ctypes.c_int64()
    fake.fake_live_objects(ctypes.byref(c), ctypes.byref(m))
    return c.value, m.value


def context_info(lib_path: str, ctx: int) -> list[int]:
    """[core mask, IOMMU domain] the fake recorded for a context."""
    fake = ctypes.CDLL(lib_path)
    mask, domain = ctypes.c_int(), ctypes.c_int()
    assert fake.fake_context_info(ctypes.c_uint64(ctx), ctypes.byref(mask), ctypes.byref(domain)) == 0
    return [mask.value, domain.value]


def domain_bytes(lib_path: str, domain: int) -> int:
    fake = ctypes.CDLL(lib_path)
    fake.fake_domain_bytes.restype = ctypes.c_uint64
    return int(fake.fake_domain_bytes(domain))


def bitwise(lib_path: str, cases=SMALL_CASES, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    npu, host = open_npu_matmul(lib_path), HostInt8Matmul()
    checked, mismatches = 0, []
    try:
        for K, N, rows in cases:
            w = rng.integers(-127, 128, (K, N), dtype=np.int8)
            w[0, :] = 127  # the extremes: the largest |sum| a row can reach
            w[1, :] = -127
            name = f"w{K}x{N}"
            npu.add(name, w)
            host.add(name, w)
            for m in rows:
                a = rng.integers(-127, 128, (m, K), dtype=np.int8)
                a[0, :2] = (127, -127)
                got, want = npu.run(name, a), host.run(name, a)
                checked += 1
                if got.dtype != np.int32 or not np.array_equal(got, want):
                    mismatches.append([K, N, m])
        parts = {name: [[p.core, p.blk.k0, p.blk.k1, p.blk.n0, p.blk.n1] for p in ps] for name, ps in npu.weights.items()}
        masks = sorted({tuple(context_info(lib_path, p.ctx)) for ps in npu.weights.values() for p in ps})
        during = list(live(lib_path))
    finally:
        npu.close()
        host.close()
    return {"checked": checked, "mismatches": mismatches, "parts": parts, "masks_domains": [list(m) for m in masks],
            "live_during": during,
            "live_after": list(live(lib_path)), "numerics": npu.numerics}


def decoder_shapes() -> list[tuple[int, int]]:
    """(K, N) of every int8 matmul of Qwen3-VL-2B's decoder: per layer qkv, o, gate_up, down; the head."""
    a = ModelArgs.from_dict({"model_type": "qwen3_vl", "text_config": QWEN3_VL_2B_TEXT})
    h, hd = a.hidden_size, a.head_dim
    layer = [(h, (a.num_attention_heads + 2 * a.num_key_value_heads) * hd), (a.num_attention_heads * hd, h),
             (h, 2 * a.intermediate_size), (a.intermediate_size, h)]
    return layer * a.num_hidden_layers + [(h, a.vocab_size)]


class _Held:
    """Contexts and buffers made at the library level, all released by release()."""

    def __init__(self, lib: api.MatmulLib):
        self.lib, self.items = lib, []  # (ctx, [mems])

    def context(self, K: int, n: int, domain: int) -> tuple[int, list[api.IoAttr]]:
        info = api.MatmulInfo(K=K, N=n, type=api.MatmulType.INT8_MM_INT8_TO_INT32, B_layout=api.Layout.NATIVE,
                              iommu_domain_id=domain)
        ctx, attrs = self.lib.create_dynamic_shape(info, [api.Shape(m, K, n) for m in M_SHAPES])
        self.items.append((ctx, []))
        return ctx, attrs

    def mem(self, ctx: int, size: int) -> None:
        mem = self.lib.create_mem(ctx, size)
        next(ms for c, ms in self.items if c == ctx).append(mem)

    def decoder(self, domain: int) -> None:
        for K, N in decoder_shapes():
            for b in split_weight(K, N, 3):
                ctx, attrs = self.context(b.k1 - b.k0, b.n1 - b.n0, domain)
                for size in (attrs[-1].A.size, attrs[-1].B.size, attrs[-1].C.size):
                    self.mem(ctx, size)

    def buffer(self, size: int, domain: int) -> None:
        ctx, _ = self.context(32, 32, domain)
        self.mem(ctx, size)

    def release(self) -> None:
        for ctx, mems in self.items:
            for mem in mems:
                self.lib.destroy_mem(ctx, mem)
            self.lib.destroy(ctx)
        self.items.clear()


def _attempt(lib: api.MatmulLib, steps) -> str | None:
    """Run `steps(held)`; the refusal's message or None; everything released either way."""
    held = _Held(lib)
    try:
        steps(held)
        return None
    except RknnMatmulError as e:
        return str(e)
    finally:
        held.release()


def domains(lib_path: str) -> dict:
    lib = api.load_library(lib_path)
    out: dict = {"decoder_int8_bytes": sum(K * N for K, N in decoder_shapes())}

    def one_domain(held: _Held) -> None:
        held.decoder(0)
        out["decoder_domain_bytes"] = domain_bytes(lib_path, 0)
        held.buffer(TOWER_BYTES, 0)
        out["one_domain_bytes"] = domain_bytes(lib_path, 0)

    out["int8_one_domain"] = _attempt(lib, one_domain)
    out["fp16_one_domain"] = _attempt(lib, lambda h: (h.buffer(FP16_GRAPHS_BYTES, 0), h.buffer(TOWER_BYTES, 0)))
    out["live_after"] = list(live(lib_path))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    args = ap.parse_args()
    print(json.dumps({"bitwise": bitwise(args.lib), "domains": domains(args.lib)}))


if __name__ == "__main__":
    main()
