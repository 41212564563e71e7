"""Progress inside a step (edge_llm/progress.py): a prefill chunk of any length reports each
decoder layer on every backend path (cpu, cpu-q's fused post + next qkv graphs, the rknn graph
backend on onnxruntime: the NPU itself cannot exist here), a restore reports each layer, the
vision tower each block; a cancel lands within one layer and never leaves a row of the
interrupted chunk counted as valid. The server-level watchdog test is in test_server_longwork.py."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
from PIL import Image

from edge_llm.backends.cpuq import backend as cpuq
from edge_llm.backends.graph.onnx_export import export_graph_set
from edge_llm.backends.npu.backend import open_rknn
from edge_llm.engine import GenerationRequest
from edge_llm.models.qwen3 import Model
from edge_llm.progress import LAYER, PREFILL, RESTORE, VISION, Cancelled, Work
from edge_llm.runtime import load_runtime
from edge_llm.settings import Settings

LAYERS = 4


@pytest.fixture(scope="module")
def vl4(tmp_path_factory):
    """The tiny random Qwen3-VL (vision tower included) with 4 decoder layers."""
    from edge_llm.checkpoints.synth import synth_checkpoint

    d = tmp_path_factory.mktemp("vl4") / "model"
    synth_checkpoint(d, preset="tiny", layers=LAYERS, seed=3)
    return d


class Recorder:
    """A Work whose on_progress records every report; cancels once `cancel_at(event)` is true."""

    def __init__(self, cancel_at=None):
        self.seen: list[tuple[str, int, int]] = []
        self.cancel, self.cancel_at = threading.Event(), cancel_at
        self.work = Work(self.cancel, self._on)

    def _on(self, stage: str, done: int, total: int) -> None:
        self.seen.append((stage, done, total))
        if self.cancel_at is not None and self.cancel_at(self.seen[-1]):
            self.cancel.set()


def _layers(n: int = LAYERS) -> list[tuple[str, int, int]]:
    return [(LAYER, i, n) for i in range(1, n + 1)]


@pytest.fixture(scope="module", params=["cpu", "cpu-q", "rknn-graphs"])
def model(request, vl4, home, tmp_path_factory):
    if request.param == "cpu":
        yield Model.load(vl4)
        return
    if request.param == "cpu-q":  # as built: layer00.qkv, then post graphs that return the next qkv
        be = cpuq.open_cpu_q(vl4, "q4", threads=2, blocks=None)  # synthetic: no GGUF blocks
    else:
        out = tmp_path_factory.mktemp("graphs")
        export_graph_set(vl4, out)
        be = open_rknn(out, "onnxruntime", model_dir=vl4)
    m = Model.load(vl4, be)
    yield m
    m.close()


def test_one_chunk_reports_every_layer_on_each_backend(model, request):
    T = model.chunk_size(64)  # a static-shape backend's nearest chunk
    assert T > 1
    ids = list(range(1000, 1000 + T))
    posts = []
    real_post = model.backend.post

    def post(*a, **kw):  # did this layer's call also compute the next layer's qkv (a fused graph)?
        out = real_post(*a, **kw)
        posts.append(out[1] is not None)
        return out

    model.backend.post = post
    try:
        rec = Recorder()
        cache = model.new_cache(4 * T, check_memory=False)
        model.prefill(ids, cache, chunk=T, work=rec.work, logits=False)
        assert rec.seen == _layers() + [(PREFILL, T, T)]  # one chunk: each layer, then the chunk
        # the next row (a decode step) is a forward of its own: its layers again, or one call of
        # cpu-q's one-row decode graph (a step; nothing between layers to report)
        rec.seen.clear()
        model.forward([5], cache, work=rec.work)
        step = model.backend.row_step is not None
        assert rec.seen == ([] if step else _layers()) and cache.length == T + 1
    finally:
        del model.backend.post
    if request.node.callspec.params["model"] == "cpu-q":
        assert any(posts), "cpu-q's fused post + next qkv path was not taken"


def test_a_cancel_lands_within_a_layer_and_keeps_only_complete_chunks(vl4):
    m = Model.load(vl4)
    ids = list(range(1000, 1100))
    cold = m.prefill(ids, m.new_cache(128, check_memory=False), chunk=32)
    # cancel after layer 2 of the second chunk: the first chunk stays, nothing of the second
    rec = Recorder(cancel_at=lambda e: rec.seen.count((PREFILL, 32, 100)) and e == (LAYER, 2, LAYERS))
    cache = m.new_cache(128, check_memory=False)
    with pytest.raises(Cancelled) as c:
        m.prefill(ids, cache, chunk=32, work=rec.work)
    assert rec.seen == _layers() + [(PREFILL, 32, 100)] + _layers()[:2]
    assert (c.value.stage, c.value.done, c.value.total) == (PREFILL, 32, 100)  # names what the cache holds
    assert cache.length == 32 and cache.tokens == ids[:32]
    # the half-written rows of the cancelled chunk are beyond `length`: a resumed prefill
    # overwrites them and ends bitwise where a cold prefill does
    resumed = m.prefill(ids[32:], cache, chunk=32)
    assert np.array_equal(resumed.view(np.uint32), cold.view(np.uint32))
    # inside the first chunk no step has been reported yet: the cancel names the layer
    first = Recorder(cancel_at=lambda e: e == (LAYER, 1, LAYERS))
    cache = m.new_cache(128, check_memory=False)
    with pytest.raises(Cancelled) as c:
        m.prefill(ids, cache, chunk=32, work=first.work)
    assert (c.value.stage, c.value.done, cache.length) == (LAYER, 1, 0)


@pytest.mark.parametrize("mode", ["sequential", "pipelined"])
def test_a_restore_reports_each_layer(vl4, tmp_path, mode):
    """A restarted engine restores 64 rows from disk and prefills the rest: sequential reads
    report each layer read, then the tail reports its layers; pipelined, the tail's layers (and
    its waits for layers still being read) are the progress: each layer is reported."""
    prompt = list(range(1000, 1080))
    first = load_runtime(Settings(model=str(vl4), backend="cpu", disk_kv=str(tmp_path), max_seq=256, prefill_chunk=32))
    list(first.generate(GenerationRequest(prompt, max_tokens=2)))
    first.store.close()
    eng = load_runtime(Settings(model=str(vl4), backend="cpu", disk_kv=str(tmp_path), max_seq=256, prefill_chunk=32,
                                disk_kv_restore=mode))
    rec = Recorder()
    _, t = eng.prefill_prompt(prompt + [7, 8, 9], work=rec.work)
    assert t.cache_source == "disk" and t.disk_cached_tokens == 64 and t.restore_mode == mode
    # the tail is rows 64..82: one chunk (rows 64..81), then the last prompt token alone
    before = rec.seen[:rec.seen.index((PREFILL, 83, 83))]
    restored = [e for e in before if e[0] == RESTORE]
    if mode == "sequential":  # every layer is read before anything computes
        assert restored == [(RESTORE, i, LAYERS) for i in range(1, LAYERS + 1)] == before[:LAYERS]
    else:  # reported by the tail's waits for layers still being read: in order, never repeated
        assert [e[1] for e in restored] == sorted({e[1] for e in restored})
    assert [e for e in before if e[0] != RESTORE] == _layers() + [(PREFILL, 82, 82)] + _layers()


def _png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_the_vision_tower_reports_each_block_and_a_cancel_there_writes_no_row(vl4):
    eng = load_runtime(Settings(model=str(vl4), backend="cpu", disk_kv=None, max_seq=256))
    img = eng.vision.prepare(_png())
    va, depth = eng.vision.args, eng.vision.args.depth
    ids = [1000, 2000, va.vision_start_token_id, *[va.image_token_id] * img.n_tokens, va.vision_end_token_id, 3000]
    rec = Recorder()
    eng.prefill_prompt(ids, work=rec.work, images=[img])
    blocks = [(VISION, i, depth) for i in range(1, depth + 1)]
    assert rec.seen[:depth] == blocks and rec.seen[depth:depth + LAYERS] == _layers()
    # cancelled in the tower: no row was written, no image span recorded
    eng.cache.reset()
    stop = Recorder(cancel_at=lambda e: e == (VISION, 1, depth))
    with pytest.raises(Cancelled) as c:
        eng.prefill_prompt(ids, work=stop.work, images=[img])
    assert (c.value.stage, c.value.done, c.value.total) == (VISION, 1, depth)
    assert eng.cache.length == 0 and eng.cache.spans == []
