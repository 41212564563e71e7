"""The graph path on onnxruntime (F32): exported ONNX graphs against the CPU backend, per layer
and end to end; static shapes and padding; manifest checks; snapshot namespaces per numerics."""

from __future__ import annotations

import numpy as np
import pytest
from modelutil import greedy_run

from edge_llm.backends.cpu.backend import CPUBackend
from edge_llm.backends.graph.schema import (
    DEFAULT_CHUNKS,
    check_chunks,
    graph_specs,
    head_ranges,
    row_plan,
    sample_inputs,
)
from edge_llm.backends.graph.onnx_export import export_graph_set
from edge_llm.backends.npu.backend import npu_usable, open_rknn
from edge_llm.backends.graph.runners import OrtRunner, RunnerError
from edge_llm.config import ModelArgs
from edge_llm.errors import ConfigError
from edge_llm.models.qwen3 import Model
from edge_llm.weights import load_weights

REL = 1e-5


def _rel(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def tiny_qwen3(tiny_model_dir):
    return tiny_model_dir("qwen3", tied=False)


@pytest.fixture(scope="module")
def default_dir(edge_home):
    return next(edge_home.glob("models/*/config.json")).parent


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    made = {}

    def make(model_dir, head_split=1):
        key = (str(model_dir), head_split)
        if key not in made:
            out = tmp_path_factory.mktemp("graphs")
            export_graph_set(model_dir, out, head_split=head_split)
            made[key] = out
        return made[key]

    return make


def _cpu(model_dir) -> CPUBackend:
    args = ModelArgs.from_dir(model_dir)
    be = CPUBackend()
    be.load(args, load_weights(model_dir, args))
    return be


@pytest.mark.parametrize("which", ["tiny_qwen3", "default_dir"])
def test_graphs_match_cpu_backend_per_layer(which, request, graphs, record_property):
    model_dir = request.getfixturevalue(which)
    root = graphs(model_dir, head_split=2 if which == "tiny_qwen3" else 1)
    be = open_rknn(root, "onnxruntime", model_dir=model_dir)
    cpu = _cpu(model_dir)
    worst = 0.0
    for spec in be.specs:
        for rows in spec.rows:
            xs = sample_inputs(spec, rows, seed=7)
            got = be.runner.run(spec, xs)
            if spec.kind == "qkv":
                want = [cpu.qkv_fused(spec.index, xs[0])]
            elif spec.kind == "post":
                want = list(cpu.post_deltas(spec.index, *xs))
            else:
                lo, hi = spec.vocab
                want = [cpu.logits(xs[0])[:, lo:hi]]
            for g, w in zip(got, want):
                assert g.shape == w.shape and g.dtype == np.float32
                worst = max(worst, _rel(g, w))
    record_property("max_rel", worst)
    print(f"{which}: {len(be.specs)} graphs, worst relative difference vs CPU backend {worst:.2e}")
    assert worst <= REL
    be.close()


@pytest.mark.parametrize("which", ["tiny_qwen3", "default_dir"])
def test_greedy_20_steps_identical_to_cpu(which, request, graphs):
    model_dir = request.getfixturevalue(which)
    ort_model = Model.load(model_dir, backend=open_rknn(graphs(model_dir), "onnxruntime", model_dir=model_dir))
    cpu_model = Model.load(model_dir)
    prompt = (np.arange(40) * 37 + 11) % min(ort_model.args.vocab_size, 5000)
    (s0, a), (s1, b) = (greedy_run(m, prompt, 20, 128, chunk=32) for m in (ort_model, cpu_model))
    seqs = [s0, s1]
    cosine = float((a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b)))
    print(f"{which}: greedy tokens {seqs[0][:8]}..., logit cosine {cosine:.9f}, max rel {_rel(a, b):.2e}")
    assert seqs[0] == seqs[1]
    assert _rel(a, b) <= 1e-4


def test_row_plan_and_chunks():
    assert row_plan(1, DEFAULT_CHUNKS) == [(0, 1, 1)]
    assert row_plan(5, DEFAULT_CHUNKS) == [(0, 5, 32)]
    assert row_plan(32, DEFAULT_CHUNKS) == [(0, 32, 32)]
    assert row_plan(33, DEFAULT_CHUNKS) == [(0, 33, 128)]
    assert row_plan(300, DEFAULT_CHUNKS) == [(0, 128, 128), (128, 256, 128), (256, 300, 128)]
    assert row_plan(300, ()) == [(0, 300, 300)]  # dynamic: one call, or calls of at most `cap` rows
    assert row_plan(257, (), cap=128) == [(0, 128, 128), (128, 256, 128), (256, 257, 1)]
    assert check_chunks([128, 1, 32, 32]) == (1, 32, 128)
    with pytest.raises(ConfigError, match="include 1"):
        check_chunks([32, 128])
    assert head_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]


def test_padding_rows_do_not_change_real_rows(tiny_qwen3, graphs):
    """A padded call: the real rows are bitwise the same whatever the padding rows hold."""
    be = open_rknn(graphs(tiny_qwen3), "onnxruntime", model_dir=tiny_qwen3)
    rng = np.random.default_rng(3)
    for spec in be.specs[:2]:
        real = sample_inputs(spec, 5, seed=1)
        zeros = [np.concatenate([x, np.zeros((27, x.shape[1]), np.float32)]) for x in real]
        noise = [np.concatenate([x, 100 * rng.standard_normal((27, x.shape[1]), dtype=np.float32)]) for x in real]
        for a, b in zip(be.runner.run(spec, zeros), be.runner.run(spec, noise)):
            assert np.array_equal(a[:5], b[:5])
    with pytest.raises(RunnerError, match="not a static shape"):
        be.runner.run(be.specs[0], sample_inputs(be.specs[0], 5))
    # through the backend: 5 rows are padded to 32 and come back as 5
    model = Model.load(tiny_qwen3, backend=be)
    model.prefill(np.arange(5), model.new_cache(16, check_memory=False))
    assert be.calls[("layer00.qkv", 32)] == 1 and ("layer00.qkv", 5) not in be.calls


def test_manifest_checks_the_model(tiny_qwen3, tiny_model_dir, graphs):
    other = tiny_model_dir("qwen3", tied=False, seed=5)  # same config, other weights
    with pytest.raises(ConfigError, match="other weights"):
        open_rknn(graphs(tiny_qwen3), "onnxruntime", model_dir=other)
    with pytest.raises(ConfigError, match="different model config"):
        open_rknn(graphs(tiny_qwen3), "onnxruntime", model_dir=tiny_model_dir("qwen3_vl"))
    with pytest.raises(ConfigError, match="manifest.json: not found"):
        open_rknn(tiny_qwen3, "onnxruntime")
    with pytest.raises(ConfigError, match="no RKNPU device"):
        open_rknn(graphs(tiny_qwen3), "auto")
    with pytest.raises(ConfigError, match="no .rknn build"):
        open_rknn(graphs(tiny_qwen3), "rknnlite")
    # an export without the converter's fp16 range check never runs in fp16 (no worker started)
    with pytest.raises(ConfigError, match="without the fp16 range check"):
        open_rknn(graphs(tiny_qwen3), "sim")
    assert npu_usable(graphs(tiny_qwen3), tiny_qwen3) == (False, "no RKNPU device node")


def test_partial_layer_graphs_cannot_serve(tiny_qwen3, tmp_path):
    export_graph_set(tiny_qwen3, tmp_path, layers=1)
    with pytest.raises(ConfigError, match="covers layers|cover layers"):
        Model.load(tiny_qwen3, backend=open_rknn(tmp_path, "onnxruntime"))


def test_graph_specs_shapes(tiny_qwen3):
    args = ModelArgs.from_dir(tiny_qwen3)
    specs = graph_specs(args, head_split=3)
    assert [s.name for s in specs[:2]] == ["layer00.qkv", "layer00.post"]
    assert specs[0].outputs == (("qkv", args.q_dim + 2 * args.kv_dim),)
    assert [s.vocab for s in specs[-3:]] == head_ranges(args.vocab_size, 3)
    assert all(s.rows == (1, 32) for s in specs[-3:])  # one row, and a verify forward's 32 (head_rows)


def test_snapshot_namespaces_are_per_numerics(tiny_synth_dir, tmp_path):
    """Snapshots made under the graph backend are never restored by the cpu backend and vice
    versa; the same backend finds its own again."""
    from edge_llm.engine import GenerationRequest
    from edge_llm.runtime import load_runtime
    from edge_llm.settings import Settings

    gdir = tmp_path / "g"
    export_graph_set(tiny_synth_dir, gdir)
    kv = tmp_path / "kv"
    prompt = list(range(100, 140))

    def engine(backend):
        return load_runtime(Settings(model=str(tiny_synth_dir), backend=backend, rknn_dir=str(gdir),
                                           rknn_runner="onnxruntime", disk_kv=str(kv), max_seq=256, kv_bs=16))

    ort = engine("rknn")
    list(ort.generate(GenerationRequest(prompt, max_tokens=2)))
    ort.store.flush()
    cpu = engine("cpu")
    assert cpu.store.ns != ort.store.ns
    assert cpu.store.lookup(prompt + [1]) is None
    other = list(range(500, 540))
    list(cpu.generate(GenerationRequest(other, max_tokens=2)))
    cpu.store.flush()
    assert cpu.store.lookup(other + [1]).m == 40
    again = engine("rknn")
    assert again.store.ns == ort.store.ns
    assert again.store.lookup(prompt + [1]).m == 40  # its own snapshot comes back
    assert again.store.lookup(other + [1]) is None  # the cpu one does not
    for e in (ort, cpu, again):
        e.store.close()
    assert OrtRunner.name in ort.model.numerics and cpu.model.numerics.startswith("cpu-f32:numpy-")


def test_convert_without_the_convert_extra_says_which_extra(tiny_qwen3, tmp_path):
    """A real `edge-llm convert rknn` process with onnx made unimportable (as without the extra)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['onnx'] = None; from edge_llm.cli import main; "
            f"sys.argv = ['edge-llm', 'convert', 'rknn', {str(tiny_qwen3)!r}, {str(tmp_path / 'out')!r}]; main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "needs the Python package onnx" in r.stderr and "edge-llm[convert]" in r.stderr
    assert not (tmp_path / "out").exists()


def test_changed_graph_files_are_refused(tiny_qwen3, graphs, tmp_path):
    """docs/npu.md "Verification at load": a graph's .onnx.data with one byte changed, or
    truncated, is refused before a runner starts, naming the files and both digests; so is a
    `.rknn` whose bytes are not the manifest's `rknn_sha256` (checked before the board runner is
    imported)."""
    import json
    import os
    import shutil

    from edge_llm.backends.graph.manifest import Manifest, sha256_files

    d = tmp_path / "graphs"
    shutil.copytree(graphs(tiny_qwen3), d)
    m = Manifest.read(d)
    g = m.graphs[1]
    data = d / (g.onnx + ".data")
    with open(data, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    actual = sha256_files(d / g.onnx, data)
    want = f"{d / g.onnx} + {data}: sha256 {actual[:16]}... is not the manifest.json's input_key {g.input_key[:16]}"
    with pytest.raises(ConfigError) as e:
        open_rknn(d, "onnxruntime", model_dir=tiny_qwen3)
    assert want in str(e.value) and f"of graph {g.name}" in str(e.value), e.value
    os.truncate(data, 100)
    with pytest.raises(ConfigError, match=f"of graph {g.name}"):
        open_rknn(d, "onnxruntime", model_dir=tiny_qwen3)
    # .rknn builds recorded in the manifest (as the converter does), one of them changed afterwards
    shutil.rmtree(d)
    shutil.copytree(graphs(tiny_qwen3), d)
    doc = json.loads((d / "manifest.json").read_text())
    (d / "rknn").mkdir()
    for i, entry in enumerate(doc["graphs"]):
        rel = f"rknn/{entry['name']}.rknn"
        (d / rel).write_bytes(bytes([i]) * 64)
        entry["rknn"], entry["rknn_sha256"] = rel, sha256_files(d / rel)
    doc["calibration"] = {"source": "test", "tokens": 1, "fp16_max": 65504.0, "headroom": 2.0}
    (d / "manifest.json").write_text(json.dumps(doc))
    bad = d / doc["graphs"][2]["rknn"]
    bad.write_bytes(b"\x00" * 63)
    with pytest.raises(ConfigError, match=rf"{bad}: sha256 [0-9a-f]{{16}}\.\.\. is not the manifest.json's "
                                          rf"rknn_sha256 {doc['graphs'][2]['rknn_sha256'][:16]}"):
        open_rknn(d, "rknnlite", model_dir=tiny_qwen3)
