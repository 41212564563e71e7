"""The vision tower as one graph (backends/tower/export.py, tower/graph.py; docs/vision.md):
onnxruntime's tower against the numpy tower on the tiny synthetic Qwen3-VL (no real Qwen3-VL
tower exists on this machine; the synthetic one keeps the published patch and merge geometry),
padding with masked patches, the fallback, the tower path in the image keys, and the grid rule
an NPU tower imposes (resize onto the largest shape, pad up to the smallest that holds it,
never crop). The simulator's tower is tested in tests/test_rknn_sim.py."""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest
from PIL import Image

from edge_llm.backends.tower.graph import TowerGraph, held_shape, open_ort_tower
from edge_llm.config import ModelArgs
from edge_llm.convert.vision import sample_image
from edge_llm.engine import Engine, GenerationRequest
from edge_llm.kvcache import KVCache
from edge_llm.models.qwen3 import Model
from edge_llm.sampling import SamplingParams
from edge_llm.tokenizer import Tokenizer
from edge_llm.vision.model import VisionModel, fit_to_graph
from edge_llm.vision.preprocess import smart_resize

# measured on the tiny tower: 6.9e-07 (224x224 .. 448x320); F32 rounding of a different summation
# order (BLAS blocking, softmax over the whole row), not a different computation
F32_REL = 1e-5


@pytest.fixture(scope="module")
def towers(tiny_synth_dir, home):
    """(numpy VisionModel, VisionModel with onnxruntime's tower graph)."""
    args = ModelArgs.from_dir(tiny_synth_dir)
    graph = open_ort_tower(tiny_synth_dir, threads=2)
    assert graph is not None and graph.rows == () and len(graph.specs) == 1  # the tiny tower: 2 blocks
    return VisionModel.load(tiny_synth_dir, args), VisionModel.load(tiny_synth_dir, args, graph=graph)


def _features(vm: VisionModel, data: bytes):
    img = vm.prepare(data)
    f = vm.encoder.encode(img.pixel_values, img.grid_thw)
    return img, np.concatenate([f.embeds, *f.deepstack], axis=1)


def _max_rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("size", [(224, 224), (448, 448), (448, 320), (256, 640)])
def test_onnxruntime_tower_equals_numpy_within_f32_rounding(towers, size, record_property):
    ref_vm, ort_vm = towers
    data = sample_image(*size, seed=sum(size))
    _, want = _features(ref_vm, data)
    img, got = _features(ort_vm, data)
    rel = _max_rel(got, want)
    record_property("max_rel", rel)
    print(f"{size[0]}x{size[1]} (grid {img.grid_thw}): onnxruntime vs numpy max rel {rel:.2e}")
    assert got.shape == want.shape and rel <= F32_REL


def test_padded_patches_are_masked_out(towers):
    """Rows of real patches do not change when the call is padded with masked patches (the NPU's
    static shapes rely on this), while the same padding without the mask changes them."""
    _, ort_vm = towers
    enc = ort_vm.encoder
    img = ort_vm.prepare(sample_image(256, 320, seed=3))
    _, gh, gw = img.grid_thw
    plain = enc.encode_graph(img.pixel_values, gh, gw, gh * gw)
    padded = enc.encode_graph(img.pixel_values, gh, gw, gh * gw + 64)
    for a, b in zip([plain.embeds, *plain.deepstack], [padded.embeds, *padded.deepstack]):
        assert a.shape == b.shape and _max_rel(b, a) <= F32_REL
    # without the key bias the padding patches are attended to: the features move
    import edge_llm.vision.encoder as encoder_mod

    mp = pytest.MonkeyPatch()
    mp.setattr(encoder_mod, "KEY_PAD", 0.0)
    try:
        unmasked = enc.encode_graph(img.pixel_values, gh, gw, gh * gw + 64)
    finally:
        mp.undo()
    assert _max_rel(unmasked.embeds, plain.embeds) > 1e-3


@pytest.fixture(scope="module")
def deep_tower(tmp_path_factory):
    """A tiny Qwen3-VL whose tower has 5 blocks, DeepStack after blocks 1 and 3: cut one block a
    segment it has first, middle (h in, h out), DeepStack and last segments."""
    from edge_llm.checkpoints import synth

    mp = pytest.MonkeyPatch()
    mp.setitem(synth.TINY_VISION_OVERRIDES, "depth", 5)
    mp.setitem(synth.TINY_VISION_OVERRIDES, "deepstack_visual_indexes", [1, 3])
    try:
        return synth.synth_checkpoint(tmp_path_factory.mktemp("deep") / "tiny-vl5", preset="tiny", durable=False)
    finally:
        mp.undo()


def test_tower_in_segments_equals_one_graph_and_reports_each(deep_tower, tmp_path):
    """onnxruntime runs the tower in segments (progress and the watchdog between them): one block
    a segment gives the one graph's features, and each segment is reported."""
    from edge_llm.backends.graph.runners import OrtRunner
    from edge_llm.backends.tower.export import export_tower
    from edge_llm.progress import Work

    args = ModelArgs.from_dir(deep_tower)
    (one,) = export_tower(deep_tower, tmp_path / "one")
    done = export_tower(deep_tower, tmp_path / "seg", blocks=1)
    assert [e.spec.name for e in done] == [f"vision.{i:02d}-{i + 1:02d}" for i in range(5)]
    assert [[n for n, _ in e.spec.outputs] for e in done] == [
        ["h_out"], ["h_out", "features"], ["h_out"], ["h_out", "features"], ["features"]]
    assert [n for n, _ in done[2].spec.inputs][0] == "h"
    whole_vm = VisionModel.load(deep_tower, args, graph=TowerGraph(
        [one.spec], OrtRunner({one.spec.name: one.onnx}, threads=2), "one"))
    seg_vm = VisionModel.load(deep_tower, args, graph=TowerGraph(
        [e.spec for e in done], OrtRunner({e.spec.name: e.onnx for e in done}, threads=2), "segments"))
    img = seg_vm.prepare(sample_image(320, 256, seed=4))
    _, gh, gw = img.grid_thw
    whole = whole_vm.encoder.encode_graph(img.pixel_values, gh, gw, gh * gw)
    seen = []
    parts = seg_vm.encoder.encode_graph(img.pixel_values, gh, gw, gh * gw, Work(on_progress=lambda *a: seen.append(a)))
    ref = VisionModel.load(deep_tower, args).encoder.encode(img.pixel_values, img.grid_thw)
    assert len(parts.deepstack) == len(whole.deepstack) == 2
    for a, b, c in zip([parts.embeds, *parts.deepstack], [whole.embeds, *whole.deepstack], [ref.embeds, *ref.deepstack]):
        assert a.shape == b.shape and _max_rel(a, b) <= F32_REL and _max_rel(a, c) <= F32_REL
    assert seen == [("vision", i, 5) for i in range(6)]


def test_tower_path_is_in_the_image_keys(towers):
    """The same image under the numpy and the onnxruntime tower gets other digests, so rows
    encoded by one never serve the other (docs/vision.md, "Tower paths")."""
    ref_vm, ort_vm = towers
    data = sample_image(256, 256)
    assert ref_vm.prepare(data).digest != ort_vm.prepare(data).digest
    assert ort_vm.prepare(data).digest == ort_vm.prepare(data).digest


def test_images_beyond_the_graph_fall_back_to_numpy(towers, caplog):
    ref_vm, ort_vm = towers
    small = TowerGraph(ort_vm.encoder.graph.specs, ort_vm.encoder.graph.runner, "test", max_patches=256)
    enc = ort_vm.encoder
    mp = pytest.MonkeyPatch()
    mp.setattr(enc, "graph", small)
    try:
        img = ort_vm.prepare(sample_image(448, 448))
        with caplog.at_level(logging.INFO, logger="edge_llm.vision.encoder"):
            got = enc.encode(img.pixel_values, img.grid_thw)
    finally:
        mp.undo()
    want = ref_vm.encoder.encode(img.pixel_values, img.grid_thw)
    assert np.array_equal(got.embeds, want.embeds)  # the numpy tower itself
    assert "no graph shape" in caplog.text and "numpy tower" in caplog.text


def _greedy_text(model_dir, vision: VisionModel, data: bytes, steps: int = 8) -> list[int]:
    model = Model.load(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    img = vision.prepare(data)
    va = vision.args
    ids = tok.encode("Describe the picture:") + [va.vision_start_token_id, va.image_token_id, va.vision_end_token_id]
    ids = vision.expand(ids + tok.encode(" It shows"), [img])
    eng = Engine(model, tok, KVCache(model.args.geometry, max_seq=512), vision=vision)
    req = GenerationRequest(ids, max_tokens=steps, sampling=SamplingParams(temperature=0.0), images=[img])
    events = list(eng.generate(req))
    assert events[-1].timings.images_encoded == 1
    return events[-1].completion_ids


def test_same_greedy_text_with_either_tower(tiny_synth_dir, towers):
    ref_vm, ort_vm = towers
    data = sample_image(320, 256, seed=7)
    a, b = _greedy_text(tiny_synth_dir, ref_vm, data), _greedy_text(tiny_synth_dir, ort_vm, data)
    print(f"greedy ids numpy tower {a}, onnxruntime tower {b}")
    assert len(a) == 8 and a == b


# ---- the grid rule of a tower with static shapes (the NPU) ----------------------------------------
@pytest.mark.parametrize("w,h", [(448, 448), (4032, 3024), (3024, 4032), (1920, 1080), (1080, 1920),
                                 (640, 480), (100, 100), (300, 2000), (5000, 200)])
def test_grid_rule_resizes_onto_the_held_shapes_and_never_crops(towers, w, h):
    ref_vm, _ = towers
    pre = fit_to_graph(ref_vm.pre, (256, 784))
    assert pre.max_pixels == 784 * 16 * 16
    rh, rw = smart_resize(h, w, pre.factor, pre.min_pixels, pre.max_pixels)
    patches = (rh // 16) * (rw // 16)
    assert patches <= 784 and held_shape((256, 784), patches) == (256 if patches <= 256 else 784)
    # the whole image is kept: the aspect ratio survives the resize up to the 32-pixel rounding
    assert abs(rw / rh - w / h) <= (w / h) * (32 / min(rh, rw) + 32 / max(rh, rw)) + 1e-9


def test_images_differing_outside_a_crop_never_share_a_key(towers):
    """A crop to a held grid would drop the border of a 16:9 image; the rule resizes instead, so
    two images that differ only there get different digests (and prefix keys)."""
    ref_vm, _ = towers
    vm = VisionModel(ref_vm.args, ref_vm.encoder, fit_to_graph(ref_vm.pre, (256, 784)), ref_vm.limits)
    base = np.asarray(Image.open(io.BytesIO(sample_image(1280, 720, seed=5))))
    other = base.copy()
    other[:, :160] = 255 - other[:, :160]  # the left eighth: what a centre crop to 4:3 would cut

    def png(a):
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, "PNG")
        return buf.getvalue()

    a, b = vm.prepare(png(base)), vm.prepare(png(other))
    assert a.grid_thw == b.grid_thw and a.grid_thw[1] * a.grid_thw[2] <= 784
    assert a.digest != b.digest
    keys_a = vm.plan([1, vm.args.vision_start_token_id, *[vm.args.image_token_id] * a.n_tokens], [a]).keys
    keys_b = vm.plan([1, vm.args.vision_start_token_id, *[vm.args.image_token_id] * b.n_tokens], [b]).keys
    assert list(keys_a[:2]) == list(keys_b[:2]) and list(keys_a[2:]) != list(keys_b[2:])


def test_runtime_picks_the_tower_path_of_its_backend(tiny_synth_dir, home):
    """cpu-q loads onnxruntime's tower graph, `vision_graph = false` and cpu keep numpy; the
    memory estimate counts the graph's mapped F32 weights."""
    from edge_llm.footprint import ModelSizes, estimate_memory
    from edge_llm.runtime import load_runtime
    from edge_llm.settings import Settings

    def graph_of(**kw):
        eng = load_runtime(Settings(model=str(tiny_synth_dir), disk_kv=None, max_seq=256, **kw))
        return eng.vision.encoder.graph

    g = graph_of(backend="cpu-q")
    assert g is not None and g.runner.name == "onnxruntime" and g.numerics.startswith("ort-tower:f32:")
    assert graph_of(backend="cpu-q", vision_graph=False) is None
    assert graph_of(backend="cpu") is None
    sizes = ModelSizes.of_dir(tiny_synth_dir)
    parts = dict(estimate_memory(Settings(max_seq=256), "cpu-q", sizes, tiny_synth_dir).parts)
    assert parts["vision tower graph (mapped F32)"] == sizes.vision_f32 == 2 * sizes.vision_file  # BF16 file
    off = dict(estimate_memory(Settings(max_seq=256, vision_graph=False), "cpu-q", sizes, tiny_synth_dir).parts)
    assert "vision tower graph (mapped F32)" not in off


# ---- the fp16-safe LayerNorm of the NPU tower -----------------------------------------------------
def _ln_graph(tmp_path, norm, n: int):
    from edge_llm.backends.graph.schema import GraphSpec
    from edge_llm.backends.graph.onnx_export import GraphBuilder

    rng = np.random.default_rng(0)
    w, b = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32), (0.1 * rng.standard_normal(n)).astype(np.float32)
    spec = GraphSpec("ln", "vision", 0, (), (("x", n),), (("y", n),))
    path = tmp_path / f"{norm.__name__}.onnx"
    g = GraphBuilder("ln", tmp_path / f"{norm.__name__}.onnx.data")
    g.op("Identity", [norm(g, "x", w, b)], out="y")
    g.finish(spec, path)
    return spec, path, w, b


@pytest.mark.parametrize("big", [3000.0, 0.0])
def test_fp16_safe_layer_norm(tmp_path, big):
    """A row with one channel at 3000 (ViT residual streams carry such channels): the plain
    LayerNorm squares it past fp16's 65,504, the fp16-safe form keeps every tensor within the
    input's range and gives torch's LayerNorm within F32 rounding, zero (padding) row included."""
    import onnxruntime as ort

    from edge_llm.backends.cpu.tower import layer_norm
    from edge_llm.backends.tower.export import layer_norm_f32, layer_norm_fp16
    from edge_llm.convert.calibration import FP16_MAX, tensor_ranges, worst_tensor

    n = 1024
    x = np.random.default_rng(1).standard_normal((4, n)).astype(np.float32)
    x[0, 7] = big
    x[2] *= 1e-4
    x[3] = 0
    for norm in (layer_norm_f32, layer_norm_fp16):
        spec, path, w, b = _ln_graph(tmp_path, norm, n)
        _, v = worst_tensor(tensor_ranges(path, spec, [x]))
        (y,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
        ref = layer_norm(x, w, b)
        assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
        if norm is layer_norm_fp16:
            # nothing beyond the input, or the bounded sum of squares (sum(d^2) < 4n) and the output
            assert v <= max(np.abs(x).max() * (1 + 1e-4), 4 * n, 2 * np.abs(y).max())
        elif big:
            assert v > FP16_MAX  # the square of the 3000 channel's deviation


def test_an_npu_tower_that_does_not_load_leaves_the_numpy_tower(tiny_synth_dir, tmp_path, monkeypatch, caplog):
    """On a board the tower's init_runtime can be refused (the NPU's 4 GiB window full with an fp16
    decoder): the service logs why and serves images on the numpy tower instead of failing."""
    import edge_llm.backends.tower.graph as vg
    from edge_llm.backends.graph.runners import RunnerError
    from edge_llm.backends.choice import BackendChoice
    from edge_llm.runtime import make_tower_graph
    from edge_llm.settings import Settings

    def refused(*a, **k):
        raise RunnerError("vision: init_runtime(core_mask=7) failed (NPU memory full?)")

    monkeypatch.setattr(vg, "open_rknn_tower", refused)
    s = Settings(model=str(tiny_synth_dir), backend="rknn", rknn_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="edge_llm.runtime"):
        assert make_tower_graph(s, BackendChoice("rknn", "test", False), tiny_synth_dir, lambda _t: None) is None
    assert "the NPU tower did not load" in caplog.text and "numpy tower" in caplog.text


def test_tower_conversion_skips_a_text_only_export(tmp_path):
    """A qwen3_vl checkpoint whose config declares a tower but whose weights have none (a
    text-only export, `model synth --no-vision`) converts its decoder and no tower: `convert rknn`
    said so only after the decoder's build, as an error, before."""
    from edge_llm.checkpoints.synth import synth_checkpoint
    from edge_llm.convert.vision import convert_tower

    model = synth_checkpoint(tmp_path / "m", preset="tiny", vision=False, durable=False)
    assert convert_tower(model, tmp_path / "out") is None
    assert not (tmp_path / "out").exists()
