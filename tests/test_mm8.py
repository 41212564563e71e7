"""The w8a8 matmul path (`edge-llm convert npu-mm`, backends/npu/matmul/decoder.py) on the default model's real
weights, in the host emulation (int8.HostInt8Matmul: exact integer products, so these are the
numbers a board gets): the accuracy targets of docs/npu.md ("The matmul path") against the F32
CPU backend, the chat answer served end to end, restore == recompute bitwise, the manifest
identity, refusals of a bad directory; and the NPU engine (backends/npu/matmul/engine.py) over the fake
librknnrt.so (tests/fake_librknnrt: it stands in for Rockchip's closed library, which needs an
RK3588 NPU) giving bitwise the emulation's logits and answer.
"""

from __future__ import annotations

import ctypes

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from serverutil import ServerProc

from edge_llm.backends.npu.matmul.decoder import MmBackend, MmManifest
from edge_llm.backends.npu.matmul.row_ops import fwht
from edge_llm.convert.hadamard import dense_hadamard
from edge_llm.errors import ConfigError

# issue 36's targets (docs/npu.md, "Accuracy on the default model": at least cpu-q's), met by the
# default conversion with OpenBLAS's SkylakeX and Haswell kernels alike (314 of 319 positions,
# KL 0.00264 / 0.00263); 97.5 % of 319 is 312 positions
TOP1, KL = 0.975, 0.003


@pytest.fixture(scope="module")
def model_dir(default_model_dir) -> Path:
    return default_model_dir


@pytest.fixture(scope="module")
def mm_dir(default_mm) -> Path:
    """The default model converted with the CLI's defaults (numpy only: no toolkit venv; conftest)."""
    return default_mm


@pytest.fixture(scope="module")
def accuracy(mm_dir, model_dir) -> dict:
    """bench accuracy's measures (bench/accuracy.py `compare`, the full 320-token teacher text)."""
    from edge_llm.backends.npu.backend import open_rknn
    from edge_llm.bench.accuracy import compare
    from edge_llm.models.qwen3 import Model
    from edge_llm.tokenizer import Tokenizer

    be = open_rknn(mm_dir, "host", model_dir=model_dir)
    try:
        return compare(Model.load(model_dir), Model.load(model_dir, backend=be), Tokenizer.from_dir(model_dir),
                       greedy_tokens=0)
    finally:
        be.close()


@pytest.mark.timeout(1200)
def test_accuracy_targets_on_real_weights(accuracy):
    """Teacher-forced over the out-of-sample text: KL against F32 and top-1 at least cpu-q's; the
    greedy France answer is the CPU's, token for token. Fails with round-to-nearest weights (97.2 %
    / 0.0055, docs/npu.md), i.e. when GPTQ or a rotation is lost (the V/O rotation's fold:
    test_vo_rotation_keeps_the_attention_output)."""
    t = accuracy["teacher"]
    assert t["tokens"] == 320
    assert t["top1"] >= TOP1 and t["kl"] <= KL, t
    a = accuracy["answer"]
    assert a["same_tokens"] and "Paris" in a["other"], a


@pytest.mark.timeout(900)
def test_conversion_carries_its_accuracy_record(mm_dir, model_dir, accuracy, tmp_path):
    """`convert npu-mm` measured the directory before publishing it (host emulation): record.json keyed
    by the manifest's identity, meeting the bar (docs/quantization.md, "Accuracy record"), its France
    answer F32's, as bench accuracy's; with an RKNPU node (a fake one) auto runs the directory and
    names the record."""
    from edge_llm.backends.choice import choose_backend
    from edge_llm.backends.record import RECORD, judge
    from edge_llm.quality_text import ACCEPTANCE
    from edge_llm.settings import Settings

    rec = json.loads((mm_dir / RECORD).read_text())
    key = MmManifest.read(mm_dir).identity()
    assert rec["key"] == key and [a["prompt"] for a in rec["answers"]] == list(ACCEPTANCE), rec
    passed, why = judge(mm_dir, key)
    assert passed, why
    france = rec["answers"][0]
    assert france["same"] and france["other"].strip() == accuracy["answer"]["other"].strip(), (france, accuracy)
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "rknpu").write_text("")
    c = choose_backend(Settings(backend="auto", rknn_dir=str(mm_dir)), model_dir, sysroot=tmp_path)
    assert c.name == "rknn" and c.reason.endswith(why), (c, why)


@pytest.mark.timeout(900)
def test_served_answer_is_the_cpus(edge_home, mm_dir, accuracy, tmp_path):
    """`serve --backend rknn --rknn-dir OUT --rknn-runner host` over real HTTP: the greedy chat
    answer is the F32 CPU backend's, and the log's start line names the matmul path's numerics."""
    with ServerProc(edge_home, tmp_path, "--model", "default", "--backend", "rknn", "--rknn-dir", str(mm_dir),
                    "--rknn-runner", "host", "--no-disk-kv").start() as srv:
        r = srv.openai().chat.completions.create(
            model="default", messages=[{"role": "user", "content": accuracy["answer"]["question"]}],
            temperature=0, max_tokens=24)
        assert r.choices[0].message.content.strip() == accuracy["answer"]["ref"].strip()
        assert ":host-exact:" in srv.log() and "runtime ready" in srv.log()  # the numerics line


@pytest.mark.timeout(900)
def test_restore_is_a_cold_run(model_dir, mm_dir, tmp_path):
    """tests/test_restore_recompute.py's property on the matmul path: a snapshot of m unaligned
    rows restored in a new process + the tail is bitwise a cold prefill (a row's bits depend on
    that row only: integer products, per-row scales, elementwise float32 around them)."""
    from test_restore_recompute import check_restores

    rows = check_restores(model_dir, tmp_path, (45,), backend="rknn", chunk=32, n=150, rknn_dir=mm_dir,
                          runner="host")
    assert [r["restored"] for r in rows] == [32]


def test_identity_covers_the_numerics(mm_dir):
    """Rotation, down rotation, clip, GPTQ, scale granularity, layout, dtype and the weights'
    digests each change the identity (and so the backend's numerics and the snapshot namespace);
    the build's timings do not."""
    m = MmManifest.read(mm_dir)
    assert (m.rotation, m.down_rotation, m.vo_rotation, m.clip, m.gptq_tokens) == ("hadamard", "hadamard", "hadamard",
                                                                                   "mse", 2048)
    base = m.identity()
    changes = {"rotation": "none", "down_rotation": "none", "vo_rotation": "none", "clip": "none", "gptq_tokens": 0,
               "dtype": "w8a16",
               "scales": "per group of 128", "layout": "native", "weights_sha256": "0" * 64,
               "model": {**m.model, "weights_sha256": "1" * 64}}
    for field, value in changes.items():
        assert dataclasses.replace(m, **{field: value}).identity() != base, field
    assert dataclasses.replace(m, build={"seconds": 1.0}).identity() == base
    from edge_llm.backends.npu.matmul.int8 import HostInt8Matmul

    assert MmBackend(mm_dir, m, HostInt8Matmul()).numerics.startswith(f"rknn-mm:{base}:host-exact:")


def test_bad_directories(mm_dir, model_dir, tiny_synth_dir, tmp_path, edge_home):
    """Clear errors, nothing half-loaded: no manifest, a broken one, another model's, a runner
    of compiled graphs, a missing weights file; and the converter refuses a graph directory."""
    from edge_llm.backends.npu.backend import open_rknn
    from edge_llm.models.qwen3 import Model

    with pytest.raises(ConfigError, match="manifest.json: not found"):
        open_rknn(tmp_path, "host", model_dir=model_dir)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable"):
        open_rknn(tmp_path, "host", model_dir=model_dir)
    with pytest.raises(ConfigError, match="different model config"):
        open_rknn(mm_dir, "host", model_dir=tiny_synth_dir)
    with pytest.raises(ConfigError, match="runner host or librknnrt, not 'sim'"):
        open_rknn(mm_dir, "sim", model_dir=model_dir)
    gone = tmp_path / "gone"
    gone.mkdir()
    (gone / "manifest.json").write_bytes((mm_dir / "manifest.json").read_bytes())
    be = open_rknn(gone, "host", model_dir=model_dir)
    with pytest.raises(ConfigError, match=r"weights\.npz: unreadable"):
        Model.load(model_dir, backend=be)
    graphs = tmp_path / "graphs"
    graphs.mkdir()
    (graphs / "manifest.json").write_text(json.dumps({"format": "edge-llm-graphs/1"}))
    r = subprocess.run([sys.executable, "-m", "edge_llm", "convert", "npu-mm", "default", str(graphs)],
                       env={**os.environ, "EDGE_LLM_HOME": str(edge_home)}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and "holds another conversion" in r.stderr, r.stderr
    assert json.loads((graphs / "manifest.json").read_text()) == {"format": "edge-llm-graphs/1"}


@pytest.mark.parametrize("n", [128, 1536, 576])
def test_online_hadamard_is_the_folded_matrix(n):
    """`fwht` (run time, per row) multiplies by exactly the matrix the converter folds into
    W_down (`dense_hadamard`), an orthogonal one, and a row's bits do not depend on its batch."""
    from edge_llm.convert.npu_mm import down_block

    block = down_block(n)
    h = dense_hadamard(block, n)
    np.testing.assert_allclose(h @ h.T, np.eye(n), atol=1e-9)
    x = np.random.default_rng(n).standard_normal((5, n)).astype(np.float32)
    y = fwht(x, block)
    np.testing.assert_allclose(y, x.astype(np.float64) @ h, atol=2e-5)
    assert np.array_equal(fwht(x[2:3], block)[0], y[2])


def _cut_by_k_or_both(k: int, n: int, parts: int) -> list:
    """A cut `split_weight` would not pick for the default model (its weights split evenly by N):
    by K when K > N, else both ways (halves of N over K's first half, all of N over the rest)."""
    from edge_llm.backends.npu.matmul.engine import Block, split_columns

    if k > n:
        return [Block(k0, k1, 0, n) for k0, k1 in split_columns(k, parts)]
    (h0, h1), (h2, h3) = split_columns(n, 2)
    k1 = k // 64 * 32
    return [Block(0, k1, h0, h1), Block(0, k1, h2, h3), Block(k1, k, 0, n)]


@pytest.mark.timeout(900)
def test_npu_engine_over_the_fake_is_the_emulation(edge_home, model_dir, mm_dir, fake_librknnrt, accuracy,
                                                  tmp_path, monkeypatch):
    """The same directory on `NpuInt8Matmul` (native layout, weights cut over three contexts,
    dynamic M shapes, the round in C) over the fake library: teacher-forced logits bitwise the host
    emulation's, with the cuts `split_weight` picks (by N for every weight of the default model),
    with every weight cut by K or both ways (down_proj by K, the rest both: the partial products
    summed in int32), and on Python's thread pool, with not one call refused by the fake (which
    enforces the vendor demo's call order: tests/test_fake_librknnrt_rules.py); the served answer
    (runner librknnrt) the same tokens."""
    from edge_llm.backends.npu.matmul import engine as npu_engine
    from edge_llm.backends.npu.matmul.int8 import HostInt8Matmul
    from edge_llm.bench.quant import teacher_logits
    from edge_llm.models.qwen3 import Model
    from edge_llm.quality_text import QUALITY_TEXT
    from edge_llm.tokenizer import Tokenizer

    ids = Tokenizer.from_dir(model_dir).encode(QUALITY_TEXT)[:40]
    m = MmManifest.read(mm_dir)

    def logits_of(engine) -> tuple[bytes, dict]:
        """Teacher-forced logits' bits, and which parts of each kind of weight add (a cut of K)."""
        be = MmBackend(mm_dir, m, engine)
        try:
            got = teacher_logits(Model.load(model_dir, backend=be), ids, chunk=16).view(np.uint32).tobytes()
            parts = engine.weights if isinstance(engine, npu_engine.NpuInt8Matmul) else {}
            adds = {n.rsplit(".", 1)[-1]: [p.blk.adds for p in ps] for n, ps in parts.items()}
            return got, adds
        finally:
            be.close()

    fake = ctypes.CDLL(str(fake_librknnrt))
    fake.fake_refusals.restype = ctypes.c_int64
    refused = fake.fake_refusals()
    want, _ = logits_of(HostInt8Matmul())
    got, adds = logits_of(npu_engine.open_npu_matmul(str(fake_librknnrt)))
    assert got == want and adds == {kind: [False] * 3 for kind in ("qkv", "o", "gu", "down", "head")}  # by N
    assert logits_of(npu_engine.open_npu_matmul(str(fake_librknnrt), c_round=False))[0] == want
    monkeypatch.setattr(npu_engine, "split_weight", _cut_by_k_or_both)
    got, adds = logits_of(npu_engine.open_npu_matmul(str(fake_librknnrt)))
    assert got == want and adds == {"qkv": [False, False, True], "o": [False, False, True],
                                    "gu": [False, False, True], "down": [False, True, True],
                                    "head": [False, False, True]}
    assert fake.fake_refusals() == refused
    monkeypatch.undo()
    env = {"EDGE_LLM_LIBRKNNRT": str(fake_librknnrt)}
    with ServerProc(edge_home, tmp_path, "--model", "default", "--backend", "rknn", "--rknn-dir", str(mm_dir),
                    "--rknn-runner", "librknnrt", "--no-disk-kv", env=env).start() as srv:
        r = srv.openai().chat.completions.create(
            model="default", messages=[{"role": "user", "content": accuracy["answer"]["question"]}],
            temperature=0, max_tokens=24)
        assert r.choices[0].message.content.strip() == accuracy["answer"]["other"].strip()
        assert ":librknnrt-" in srv.log() and "runtime ready" in srv.log()
        # the answer its accuracy record measured (host emulation), and no warning: the record passes
        assert r.choices[0].message.content.strip() == json.loads((mm_dir / "record.json").read_text())[
            "answers"][0]["other"].strip()
        assert "runs as asked, but" not in srv.log()


def test_vo_rotation_keeps_the_attention_output(model_dir):
    """The V/O rotation (convert/npu_mm.py `rotate_values`) on the default model's geometry: attention
    over the rotated values (each head's probabilities, GQA's head sharing, a v bias) times the
    rotated W_o is the unrotated output, each head's output the unrotated one times G; with the
    converter's G, o's input rows are spread (one large value per head becomes a flat row)."""
    from edge_llm.config import ModelArgs
    from edge_llm.convert.npu_mm import down_block, rotate_values

    args = ModelArgs.from_dir(model_dir)
    hd, nh, a = args.head_dim, args.q_dim // args.head_dim, args.q_dim + args.kv_dim
    rng = np.random.default_rng(9)
    g = np.linalg.qr(rng.standard_normal((hd, hd)))[0]  # any orthogonal matrix (a Hadamard one is symmetric)
    K, T = args.hidden_size, 7
    w_qkv = rng.standard_normal((K, a + args.kv_dim)).astype(np.float32)
    b_qkv = rng.standard_normal(a + args.kv_dim).astype(np.float32)
    w_o = rng.standard_normal((args.q_dim, K)).astype(np.float32)
    x = rng.standard_normal((T, K))
    probs = rng.dirichlet(np.ones(T), size=(nh, T))  # (head, query row, key row)

    def attend(w, b, o):
        v = (x @ w + b)[:, a:].reshape(T, -1, hd)
        heads = [probs[h] @ v[:, h * v.shape[1] // nh] for h in range(nh)]
        return np.concatenate(heads, axis=1), np.concatenate(heads, axis=1) @ o

    (out, y), (out_r, y_r) = attend(w_qkv, b_qkv, w_o), attend(*rotate_values(args, g, w_qkv, b_qkv, w_o))
    np.testing.assert_allclose(y_r, y, rtol=1e-4, atol=1e-3 * np.abs(y).max())
    np.testing.assert_allclose(out_r, (out.reshape(T, nh, hd) @ g).reshape(T, -1), atol=1e-4 * np.abs(out).max())
    spike = np.zeros((1, args.q_dim))
    spike[0, ::hd] = 1.0
    h = dense_hadamard(down_block(hd), hd)  # the converter's G
    assert np.allclose(np.abs((spike.reshape(1, nh, hd) @ h).ravel()), 1 / np.sqrt(hd))


def test_gptq_lowers_the_output_error():
    """GPTQ's int8 weights (same per-channel scales) give a smaller error of X @ W on inputs
    like its calibration rows than round-to-nearest: correlated inputs, as real activations are."""
    from edge_llm.backends.npu.matmul.int8 import quantize_weight
    from edge_llm.convert.gptq import gptq

    rng = np.random.default_rng(5)
    K, N = 256, 96
    mix = rng.standard_normal((K, K)).astype(np.float32) / np.sqrt(K)
    x = rng.standard_normal((400, K)).astype(np.float32) @ mix
    w = rng.standard_normal((K, N)).astype(np.float32)
    q, s = quantize_weight(w)
    g = gptq(w, x, s)
    assert g.dtype == np.int8 and np.abs(g.astype(np.int16)).max() <= 127
    test = rng.standard_normal((200, K)).astype(np.float32) @ mix
    err = [float(np.square(test @ w - test @ (m * s)).mean()) for m in (q, g)]
    assert err[1] < 0.8 * err[0], err  # 0.68 measured; round to nearest is 1
