"""RKNNLiteRunner against a fake `RKNNLite` (the NPU driver cannot exist on this machine).

The fake has rknn-toolkit-lite2 2.5.0's API (load_rknn / init_runtime(core_mask=) / inference /
get_sdk_version / release, `rknn_data` holding the file bytes after load_rknn) and asserts how
the runner calls it: core masks per graph, float32 (rows, width) inputs of a static shape, the
host copy dropped after init_runtime, None from inference turned into a clear error, release on
close. It computes outputs with the CPU backend so the engine runs end to end through it."""

from __future__ import annotations

import numpy as np
import pytest

from edge_llm.backends.cpu.backend import CPUBackend
from edge_llm.backends.graph.backend import GraphBackend
from edge_llm.backends.graph.schema import graph_specs
from edge_llm.backends.npu.graphs.rknnlite import (
    NPU_CORE_0,
    NPU_CORE_0_1_2,
    NPU_CORE_1,
    NPU_CORE_2,
    RKNNLiteRunner,
)
from edge_llm.backends.graph.runners import RunnerError
from edge_llm.config import ModelArgs
from edge_llm.models.qwen3 import Model
from edge_llm.weights import load_weights


class FakeRKNNLite:
    instances: list["FakeRKNNLite"] = []
    fail_init: set[str] = set()
    fail_inference_after: int | None = None
    cpu: CPUBackend | None = None
    specs: dict = {}
    tower = None  # vision graphs: a runner of the same graph in F32 (onnxruntime)

    def __init__(self, verbose=False, verbose_file=None):
        self.path = None
        self.rknn_data = None
        self.mask = None
        self.released = False
        self.calls = 0
        FakeRKNNLite.instances.append(self)

    def load_rknn(self, path, key_path=None):
        assert self.path is None, "load_rknn called twice"
        self.path = path
        with open(path, "rb") as f:
            self.rknn_data = f.read()
        return 0

    def init_runtime(self, target=None, device_id=None, async_mode=False, core_mask=0):
        assert self.rknn_data is not None and target is None
        assert core_mask in (NPU_CORE_0, NPU_CORE_1, NPU_CORE_2, NPU_CORE_0_1_2)
        self.mask = core_mask
        return -1 if self.name in self.fail_init else 0

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1].removesuffix(".rknn")

    def inference(self, inputs, data_type=None, data_format=None, inputs_pass_through=None, get_frame_id=False):
        assert self.mask is not None and not self.released
        assert self.rknn_data is None, "the runner must drop the host copy after init_runtime"
        spec = self.specs[self.name]
        rows = inputs[0].shape[0]
        assert rows in spec.rows
        for x, (_, width) in zip(inputs, spec.inputs, strict=True):
            assert x.dtype == np.float32 and x.shape == (rows, width) and x.flags.c_contiguous
        self.calls += 1
        if self.fail_inference_after is not None and self.calls > self.fail_inference_after:
            return None  # what RKNNLite does on a runtime error
        cpu, i = self.cpu, spec.index
        if spec.kind == "vision":
            out = self.tower.run(spec, inputs)
        elif spec.kind == "qkv":
            out = [cpu.qkv_fused(i, inputs[0])]
        elif spec.kind == "post":
            out = list(cpu.post_deltas(i, *inputs))
        else:
            lo, hi = spec.vocab
            out = [cpu.logits(inputs[0])[:, lo:hi]]
        # the NPU hands back fp16-rounded values as float32 arrays, in NCHW-ish 4-D shape
        return [o.astype(np.float16).astype(np.float32).reshape(1, rows, -1, 1) for o in out]

    def get_sdk_version(self):
        return "rknn runtime version: 2.5.0 (fake)\ndriver version: 0.9.8"

    def release(self):
        self.released = True


@pytest.fixture()
def fake(tiny_model_dir, tmp_path):
    path = tiny_model_dir("qwen3", tied=False)
    args = ModelArgs.from_dir(path)
    cpu = CPUBackend()
    cpu.load(args, load_weights(path, args))
    specs = graph_specs(args, head_split=2)
    files = {}
    for s in specs:
        files[s.name] = tmp_path / f"{s.name}.rknn"
        files[s.name].write_bytes(b"RKNN" + s.name.encode() * 100)
    FakeRKNNLite.instances, FakeRKNNLite.fail_init, FakeRKNNLite.fail_inference_after = [], set(), None
    FakeRKNNLite.cpu, FakeRKNNLite.specs = cpu, {s.name: s for s in specs}
    return path, specs, files


def test_core_masks_host_copy_and_release(fake):
    path, specs, files = fake
    runner = RKNNLiteRunner(specs, files, lite_cls=FakeRKNNLite)
    masks = {f.name: f.mask for f in FakeRKNNLite.instances}
    assert masks == {"layer00.qkv": NPU_CORE_0, "layer00.post": NPU_CORE_0, "layer01.qkv": NPU_CORE_1,
                     "layer01.post": NPU_CORE_1, "head.0": NPU_CORE_0_1_2, "head.1": NPU_CORE_0_1_2}
    assert all(f.rknn_data is None for f in FakeRKNNLite.instances)
    assert "2.5.0 (fake)" in runner.numerics and "cores1,2,4" in runner.numerics
    runner.close()
    assert all(f.released for f in FakeRKNNLite.instances)


def test_engine_runs_through_the_runner(fake):
    path, specs, files = fake
    runner = RKNNLiteRunner(specs, files, lite_cls=FakeRKNNLite)
    npu = Model.load(path, backend=GraphBackend("rknn", specs, runner, "rknn:test:" + runner.numerics))
    cpu = Model.load(path)
    ids = np.arange(40) % 200
    a = npu.prefill(ids, npu.new_cache(64, check_memory=False))
    b = cpu.prefill(ids, cpu.new_cache(64, check_memory=False))
    assert int(np.argmax(a)) == int(np.argmax(b))
    assert np.abs(a - b).max() / np.abs(b).max() < 1e-2  # fp16-rounded outputs, F32 residual stream
    assert sum(f.calls for f in FakeRKNNLite.instances) > 0


def test_inference_none_becomes_a_clear_error(fake):
    path, specs, files = fake
    runner = RKNNLiteRunner(specs, files, lite_cls=FakeRKNNLite)
    FakeRKNNLite.fail_inference_after = 0
    x = np.zeros((32, specs[0].inputs[0][1]), np.float32)
    with pytest.raises(RunnerError, match=r"NPU inference of layer00.qkv at 32 rows failed"):
        runner.run(specs[0], [x])
    with pytest.raises(RunnerError, match="not a static shape"):
        runner.run(specs[0], [np.zeros((5, x.shape[1]), np.float32)])
    with pytest.raises(RunnerError, match="expected float32"):
        runner.run(specs[0], [x.astype(np.float64)])


def test_init_failure_releases_what_was_loaded(fake):
    path, specs, files = fake
    FakeRKNNLite.fail_init = {"layer01.qkv"}
    with pytest.raises(RunnerError, match=r"layer01.qkv: init_runtime\(core_mask=2\) failed"):
        RKNNLiteRunner(specs, files, lite_cls=FakeRKNNLite)
    assert all(f.released for f in FakeRKNNLite.instances)


def test_missing_toolkit_lite_says_how_to_install(fake):
    path, specs, files = fake
    with pytest.raises(RunnerError, match=r"edge-llm\[board\]"):
        RKNNLiteRunner(specs, files)


def test_vision_tower_on_the_board_runner(tiny_synth_dir, tmp_path):
    """The tower's `.rknn` through RKNNLiteRunner (the fake computes the graph in F32 with
    onnxruntime and rounds to fp16, as the NPU hands back): all three cores, a static shape per
    image (an image of 80 patches padded to 256), features close to the numpy tower's."""
    from edge_llm.backends.graph.schema import vision_spec
    from edge_llm.backends.graph.runners import OrtRunner
    from edge_llm.backends.tower.export import export_tower
    from edge_llm.backends.tower.graph import TowerGraph
    from edge_llm.convert.vision import sample_image
    from edge_llm.vision.model import VisionModel

    args = ModelArgs.from_dir(tiny_synth_dir)
    (e,) = export_tower(tiny_synth_dir, tmp_path / "onnx", rows=(256, 784))
    spec = e.spec
    assert spec == vision_spec(VisionModel.load(tiny_synth_dir, args).args, (256, 784))
    path = tmp_path / "vision.rknn"
    path.write_bytes(b"RKNN vision")
    FakeRKNNLite.instances, FakeRKNNLite.fail_init, FakeRKNNLite.fail_inference_after = [], set(), None
    FakeRKNNLite.specs, FakeRKNNLite.tower = {"vision": spec}, OrtRunner({"vision": e.onnx}, threads=2)
    runner = RKNNLiteRunner([spec], {"vision": path}, lite_cls=FakeRKNNLite)
    assert [f.mask for f in FakeRKNNLite.instances] == [NPU_CORE_0_1_2]
    npu = VisionModel.load(tiny_synth_dir, args, graph=TowerGraph([spec], runner, "rknn-tower:test"))
    ref = VisionModel.load(tiny_synth_dir, args)
    img = npu.prepare(sample_image(320, 256, seed=2))
    assert img.grid_thw == (1, 16, 20)
    got, want = npu.encode(img), ref.encoder.encode(img.pixel_values, img.grid_thw)
    for a, b in zip([got.embeds, *got.deepstack], [want.embeds, *want.deepstack]):
        assert a.shape == b.shape and np.abs(a - b).max() / np.abs(b).max() < 3e-3
    assert FakeRKNNLite.instances[0].calls == 1  # one call per image
    runner.close()
