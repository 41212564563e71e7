"""Image input through cpu-q's fused graphs (backends/graph/backend.py, models/qwen3.py; docs/quantization.md).

cpu-q's `step` graph is layer l's post and layer l+1's qkv in one call; Qwen3-VL adds DeepStack
features to the image rows of h after its first layers, so a qkv fused into those steps would be
of the old h. The model says so explicitly (`post(..., fuse_next=False)`), and the backend then
hands back no qkv. Checked on a tiny random 4-layer Qwen3-VL (the synth preset: DeepStack after
layers 0 and 1, layer 2's step fused; the default model has no vision tower and no local model
with one is small enough for a test) against:
- the F32 CPU backend, loosely (cpu-q re-quantizes these BF16 weights to 4 bits);
- graphs that fuse every layer's qkv into the previous step (and also have layers 1 and 2's qkv
  graphs): bitwise the cpu-q graph set, which cannot fuse there. Fusing across the DeepStack add
  breaks this equality (and the loose check: cosine 0.965 measured).
"""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from edge_llm.backends.cpuq import backend as cpuq
from edge_llm.backends.graph.backend import GraphBackend
from edge_llm.backends.graph.schema import QKV
from edge_llm.backends.graph.manifest import Manifest
from edge_llm.backends.graph.onnx_export import export_graph_set, rms_norm_op
from edge_llm.backends.cpuq.nbits_export import QuantLinear
from edge_llm.backends.graph.runners import OrtRunner
from edge_llm.config import ModelArgs
from edge_llm.errors import ConfigError
from edge_llm.models.qwen3 import Model
from edge_llm.vision.model import VisionModel

# measured: cosine 0.994 of all rows' logits, cpu-q vs cpu (0.965 with a qkv fused across the
# DeepStack add, 0.63 without DeepStack at all)
COSINE = 0.985


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("vl") / "tiny-vl4"
    r = subprocess.run([sys.executable, "-m", "edge_llm", "model", "synth", "--preset", "tiny", "--layers", "4",
                        str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def models(vl_dir, home, tmp_path_factory):
    """cpu: F32; cpuq: the cpu-q backend as built; fused: every step fused, plus layers 1 and 2's
    qkv graphs of cpu-q's set; fused_only: every step fused and no qkv graph after layer 0."""
    cpu = Model.load(vl_dir)
    cpuq_model = Model.load(vl_dir, cpuq.open_cpu_q(vl_dir, "q4", threads=2, blocks=None))  # synthetic: no GGUF
    root, built = cpuq.ensure_quantized(vl_dir, cpuq.mode("q4"), blocks=None)
    args, out = ModelArgs.from_dir(vl_dir), tmp_path_factory.mktemp("fused")
    fused = export_graph_set(vl_dir, out, chunks=None, linear=QuantLinear(args, None, 4, cpuq.BLOCK, cpuq.mode("q4").accuracy_level),
                             norm=rms_norm_op, fused=True, unfused=0)
    assert Manifest.read(out).identity() != built.identity()
    extra = [s for s in built.specs() if s.kind == QKV and s.index > 0]
    assert [s.name for s in extra] == ["layer01.qkv", "layer02.qkv"]

    def graph_model(specs, files):
        runner = OrtRunner(files, threads=2, kind="q4", config=cpuq.SESSION_CONFIG, shared_arena=True)
        be = GraphBackend("cpu-q", specs, runner, "test", mapped_embedding=True, max_rows=cpuq.MLAS_STRIDE_M)
        return Model.load(vl_dir, be)

    files = fused.onnx_files(out)
    extra_files = {s.name: built.onnx_files(root)[s.name] for s in extra}
    return {"cpu": cpu, "cpuq": cpuq_model, "fused": graph_model(fused.specs() + extra, {**files, **extra_files}),
            "fused_only": graph_model(fused.specs(), files)}


@pytest.fixture(scope="module")
def image_prompt(vl_dir, models):
    """(plan, vision): 3 text tokens, one 96x64 image (70 rows), 3 text tokens."""
    vision = VisionModel.load(vl_dir, models["cpu"].args)
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    prepared = vision.prepare(buf.getvalue())
    va = vision.args
    ids = [1000, 2000, 3000, va.vision_start_token_id, *[va.image_token_id] * prepared.n_tokens,
           va.vision_end_token_id, 4000, 5000, 6000]
    plan = vision.plan(ids, [prepared])
    assert plan.image_tokens == 70
    return plan, vision


def _image_logits(model, image_prompt, chunk=None):
    """All rows' logits of the image prompt in one forward, or the last row's after a prefill in
    `chunk`-row chunks and one-row steps of fixed text tokens (the same inputs for every backend)."""
    plan, vision = image_prompt
    vis, _, _ = vision.visual_rows(plan, 0, plan.n)
    cache = model.new_cache(128, check_memory=False)
    if chunk is None:
        return model.forward(plan.keys, cache, all_logits=True, positions=plan.positions, visual=vis)
    logits = model.prefill(plan.keys, cache, chunk=chunk, positions=plan.positions, visual=vis)
    pos = int(plan.positions[0, -1]) + 1
    for i, tok in enumerate((77, 3000, 151000)):
        logits = model.forward([tok], cache, positions=np.full((3, 1), pos + i))
    return logits.copy()


def test_image_through_cpu_q_agrees_with_cpu(models, image_prompt, record_property):
    want = _image_logits(models["cpu"], image_prompt)
    got = _image_logits(models["cpuq"], image_prompt)
    c = _cos(got, want)
    record_property("cosine", c)
    print(f"image prompt, cpu-q vs cpu: cosine {c:.4f} over all rows' logits")
    assert c >= COSINE
    # prefill in chunks + one-row steps (cpu-q's decode graph)
    c = _cos(_image_logits(models["cpuq"], image_prompt, chunk=8), _image_logits(models["cpu"], image_prompt, chunk=8))
    print(f"... in 8-row chunks + 3 one-row steps: cosine {c:.4f} of the last row's logits")
    assert c >= COSINE


@pytest.mark.parametrize("chunk", [None, 8])
def test_no_fused_qkv_across_a_deepstack_add(models, image_prompt, chunk):
    fused_be = models["fused"].backend
    fused_be.calls.clear()
    got = _image_logits(models["fused"], image_prompt, chunk)
    # the image rows made layers 1 and 2 take their own qkv graphs, not the steps' fused outputs
    assert {g for g, _ in fused_be.calls} >= {"layer01.qkv", "layer02.qkv"}
    if chunk is None:  # one forward: the fused set is bitwise the unfusable one
        assert np.array_equal(_bits(got), _bits(_image_logits(models["cpuq"], image_prompt)))
    else:  # + decode steps: cpu-q's run on its decode graph, so compare without the row step
        ref = models["cpuq"].backend
        step, ref.row_step = ref.row_step, None
        try:
            want = _image_logits(models["cpuq"], image_prompt, chunk)
        finally:
            ref.row_step = step
        assert np.array_equal(_bits(got), _bits(want))


def test_text_rows_keep_the_fused_call(models):
    """A prompt without image rows runs every layer's qkv inside the previous step."""
    be = models["fused"].backend
    be.calls.clear()
    models["fused"].prefill(list(range(1000, 1040)), models["fused"].new_cache(64, check_memory=False), chunk=16)
    assert {g for g, _ in be.calls if g.endswith(".qkv")} == {"layer00.qkv"}


def test_graphs_fused_across_deepstack_refuse_an_image(models, image_prompt):
    model = models["fused_only"]
    model.prefill(list(range(1000, 1040)), model.new_cache(64, check_memory=False), chunk=16)  # text: fine
    with pytest.raises(ConfigError, match="layer 1's qkv is computed only inside layer00.step"):
        _image_logits(model, image_prompt)
