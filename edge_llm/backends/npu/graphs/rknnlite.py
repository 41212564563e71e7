"""`RKNNLiteRunner`: the compiled `.rknn` graphs on the RK3588 NPU through rknn-toolkit-lite2.

This is the only runner that does not run on the x86 development machine (no NPU, and the
package ships aarch64 wheels only). `tests/test_rknnlite_runner.py` drives it with a fake class
of the same API that asserts every call (core masks, shapes, dtypes, the None-return path);
what only a board can show is listed in docs/npu.md.

Per graph one `RKNNLite` context: `load_rknn` -> `init_runtime(core_mask=...)` -> drop the host
copy of the file (`rknn_data`, which RKNNLite keeps after loading it into NPU memory) ->
`inference` per call -> `release`. `inference` returns None on error instead of raising: every
call is checked and turned into a `RunnerError` that names the graph and shape.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from edge_llm.backends.graph.schema import HEAD, HEAD_N, VISION, GraphSpec
from edge_llm.backends.graph.runners import RunnerError, check_inputs

log = logging.getLogger(__name__)

# RKNNLite's core mask values (rknnlite.api.RKNNLite.NPU_CORE_*)
NPU_CORE_0, NPU_CORE_1, NPU_CORE_2, NPU_CORE_0_1_2 = 1, 2, 4, 7
LAYER_CORES = (NPU_CORE_0, NPU_CORE_1, NPU_CORE_2)


def core_mask_for(spec: GraphSpec, layer_masks: Sequence[int] = LAYER_CORES) -> int:
    """Layers round-robin over the given cores (each core holds a third of the weights);
    the head (the largest matmul, T = 1) and the vision tower (one call per image, as
    Rockchip's own multimodal demo runs it) on all three."""
    if spec.kind in (HEAD, HEAD_N, VISION):
        return NPU_CORE_0_1_2
    return layer_masks[spec.index % len(layer_masks)]


def _lite_class():
    try:
        from rknnlite.api import RKNNLite
    except Exception as e:  # ImportError, or librknnrt.so missing / wrong version
        raise RunnerError(f"rknn-toolkit-lite2 is not usable here ({e}): on an RK3588 board, "
                          "pip install 'edge-llm[board]' and install librknnrt.so (see `edge-llm doctor`)") from None
    return RKNNLite


class RKNNLiteRunner:
    """`.rknn` graphs on the NPU, one RKNNLite context per graph."""

    name = "rknnlite"
    act_dtype = np.float16

    def __init__(self, specs: Sequence[GraphSpec], rknn_files: Mapping[str, Path],
                 layer_masks: Sequence[int] = LAYER_CORES, lite_cls=None, progress=None):
        cls = lite_cls or _lite_class()
        self.ctx = {}
        try:
            for spec in specs:
                if progress:
                    progress(spec)
                path = rknn_files[spec.name]
                lite = cls(verbose=False)
                if lite.load_rknn(str(path)) != 0:
                    raise RunnerError(f"{spec.name}: load_rknn({path}) failed")
                mask = core_mask_for(spec, layer_masks)
                if lite.init_runtime(core_mask=mask) != 0:
                    lite.release()
                    raise RunnerError(f"{spec.name}: init_runtime(core_mask={mask}) failed "
                                      "(NPU memory full? driver too old? see `edge-llm doctor`)")
                # the file's bytes are in NPU memory now; RKNNLite would keep a host copy for
                # the process lifetime (3.4 GB for Qwen3-VL-2B)
                lite.rknn_data = None
                self.ctx[spec.name] = lite
            first = next(iter(self.ctx.values()), None)
            sdk = first.get_sdk_version() if first is not None else None
        except BaseException:
            self.close()
            raise
        self.sdk_version = " ".join(str(sdk).split()) if sdk else "unknown"
        masks = ",".join(str(m) for m in layer_masks)
        self.numerics = f"rknnlite-[{self.sdk_version}]-cores{masks}"

    def run(self, spec: GraphSpec, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        rows = check_inputs(spec, inputs)
        out = self.ctx[spec.name].inference(inputs=list(inputs))
        if out is None:
            raise RunnerError(f"NPU inference of {spec.name} at {rows} rows failed (RKNNLite returned "
                              "None; the reason is in its log above)")
        if len(out) != len(spec.outputs):
            raise RunnerError(f"{spec.name}: NPU returned {len(out)} outputs, expected {len(spec.outputs)}")
        res = []
        for o, (name, width) in zip(out, spec.outputs):
            o = np.asarray(o)
            if o.size != rows * width:
                raise RunnerError(f"{spec.name}: output {name} has shape {o.shape}, expected ({rows}, {width})")
            res.append(np.ascontiguousarray(o.reshape(rows, width), dtype=np.float32))
        return res

    def close(self) -> None:
        for lite in self.ctx.values():
            lite.release()
        self.ctx.clear()
