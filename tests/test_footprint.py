"""Backend choice and memory admission (edge_llm/footprint.py): `auto`'s order and reasons, the
cgroup limits read from /proc and /sys (fabricated trees for v1 and v2), the estimate against the
measured peak RSS of the default model, and a real server refused inside a real cgroup v1
memory limit smaller than its estimate (exit 78, the unit's RestartPreventExitStatus)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_llm import footprint as fp
from edge_llm.backends.choice import choose_backend
from edge_llm.settings import Settings
from serverutil import free_port

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30


def write(root: Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


# ---- backend choice ------------------------------------------------------------------------------
@pytest.fixture()
def no_quant_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty EDGE_LLM_HOME: no cpu-q weights, so no accuracy record, whatever the user's home holds."""
    monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path / "empty-home"))


def test_auto_considers_cpu_q_when_onnxruntime_is_installed(tmp_path: Path, no_quant_built: None) -> None:
    """onnxruntime here but no cpu-q weights built (so no accuracy record): cpu for now, cpu-q named as
    the candidate to build and measure (the runtime does, tests/test_quant_record.py)."""
    c = choose_backend(Settings(backend="auto"), tmp_path, sysroot=tmp_path)
    assert (c.name, c.auto, c.unmeasured) == ("cpu", True, "cpu-q")
    assert c.describe().startswith("backend auto -> cpu (no RKNPU device node; cpu-q ("), c
    assert c.describe().endswith(") not measured yet)"), c
    explicit = choose_backend(Settings(backend="cpu"), tmp_path, sysroot=tmp_path)
    assert (explicit.name, explicit.auto, explicit.reason) == ("cpu", False, "set by the program that loaded it")


def test_auto_with_an_npu_node_but_no_manifest_says_why(tmp_path: Path, no_quant_built: None) -> None:
    """A fake RKNPU node (the driver cannot exist here): no rknn_dir, then an rknn_dir without a
    manifest; both fall back (to cpu-q, here to be measured first) and name the reason."""
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "rknpu").write_text("")
    c = choose_backend(Settings(backend="auto"), tmp_path, sysroot=tmp_path)
    assert c.unmeasured == "cpu-q" and c.reason.startswith("NPU at /dev/rknpu but no rknn_dir configured"), c
    empty = tmp_path / "rknn"
    empty.mkdir()
    c = choose_backend(Settings(backend="auto", rknn_dir=str(empty)), tmp_path, sysroot=tmp_path)
    assert c.unmeasured == "cpu-q" and f"but no manifest.json in {empty}" in c.reason, c


def test_auto_with_an_npu_node_runs_what_rknn_dir_holds(tmp_path: Path, tiny_synth_dir: Path, no_quant_built: None) -> None:
    """A fake RKNPU node (the driver cannot exist here): an `edge-llm convert npu-mm` directory of
    this model -> rknn, on the matmul path, and the reason says so; the same directory for another
    model -> cpu-q and why; a graph directory goes through the graph checks (one exported without
    the fp16 range check is refused, as before)."""
    from edge_llm.backends.graph.onnx_export import export_graph_set
    from edge_llm.convert.npu_mm import convert_mm8

    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "rknpu").write_text("")
    mm = tmp_path / "mm"
    convert_mm8(tiny_synth_dir, mm)
    c = choose_backend(Settings(backend="auto", rknn_dir=str(mm)), tiny_synth_dir, sysroot=tmp_path)
    assert (c.name, c.auto) == ("rknn", True), c
    assert c.reason.startswith(f"NPU at /dev/rknpu and a matching npu-mm manifest.json in {mm} (w8a8 on the matmul "
                               "API); accuracy record passes: acceptance answers as F32's, top-1 "), c
    other = tmp_path / "other"
    other.mkdir()
    for f in tiny_synth_dir.iterdir():
        if f.is_file():
            (other / f.name).write_bytes(f.read_bytes())
    (other / "config.json").write_text((tiny_synth_dir / "config.json").read_text().replace(
        '"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    c = choose_backend(Settings(backend="auto", rknn_dir=str(mm)), other, sysroot=tmp_path)
    assert c.unmeasured == "cpu-q" and "does not match the model: npu-mm weights were converted from a different " \
        "model config" in c.reason, c
    graphs = tmp_path / "graphs"
    export_graph_set(tiny_synth_dir, graphs, layers=1)
    c = choose_backend(Settings(backend="auto", rknn_dir=str(graphs)), tiny_synth_dir, sysroot=tmp_path)
    assert c.unmeasured == "cpu-q" and "without the fp16 range check" in c.reason, c


def test_auto_without_onnxruntime_is_cpu_and_names_the_extra(tmp_path: Path) -> None:
    """onnxruntime hidden from a fresh interpreter (a meta-path finder that refuses it, as on an
    install without the quant extra)."""
    code = ("import sys, importlib.abc\n"
            "class Hide(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('onnx', 'onnxruntime'): raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, Hide())\n"
            "from edge_llm.backends.choice import choose_backend\nfrom edge_llm.settings import Settings\n"
            f"print(choose_backend(Settings(backend='auto'), '.', sysroot={str(tmp_path)!r}).describe())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ("backend auto -> cpu (no RKNPU device node; onnxruntime not importable "
                           "(pip install 'edge-llm[quant]' for the 4-bit backend))"), out


# ---- what is available ---------------------------------------------------------------------------
def test_cgroup_v1_limit_counts_reclaimable_cache_as_free(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "4:memory:/system.slice/edge-llm.service\n1:cpu:/\n")
    cg = "sys/fs/cgroup/memory/system.slice/edge-llm.service"
    write(tmp_path, f"{cg}/memory.limit_in_bytes", str(2 * GiB))
    write(tmp_path, f"{cg}/memory.usage_in_bytes", str(GiB))
    write(tmp_path, f"{cg}/memory.stat", f"cache 1\ntotal_inactive_file {GiB // 2}\n")
    write(tmp_path, "sys/fs/cgroup/memory/system.slice/memory.limit_in_bytes", str(9223372036854771712))
    room, what = fp.cgroup_room(tmp_path)
    assert room == 2 * GiB - GiB // 2
    assert what == "cgroup memory.limit_in_bytes 2.00 GiB at /system.slice/edge-llm.service"


def test_cgroup_v2_takes_the_tightest_ancestor(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "0::/system.slice/edge-llm.service\n")
    base = "sys/fs/cgroup/system.slice"
    write(tmp_path, f"{base}/edge-llm.service/memory.max", "max")
    write(tmp_path, f"{base}/memory.max", str(3 * GiB))
    write(tmp_path, f"{base}/memory.current", str(GiB))
    write(tmp_path, f"{base}/memory.stat", "anon 5\ninactive_file 0\n")
    room, what = fp.cgroup_room(tmp_path)
    assert room == 2 * GiB and what == "cgroup memory.max 3.00 GiB at /system.slice"
    import psutil

    rss = psutil.Process().memory_info().rss  # held already: counted in the estimate's runtime part
    avail = fp.available_memory(tmp_path, mem_available=8 * GiB)
    assert (avail.mem_available, avail.cgroup_room, avail.source) == (8 * GiB, 2 * GiB, what)
    assert 2 * GiB + rss - (16 << 20) <= avail.bytes <= 2 * GiB + rss + (16 << 20)
    assert fp.available_memory(tmp_path, mem_available=GiB).source == "MemAvailable"  # the machine is tighter


def test_no_cgroup_limit(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "0::/\n")
    write(tmp_path, "sys/fs/cgroup/memory.max", "max\n")
    assert fp.cgroup_room(tmp_path) is None


def test_refusal_names_estimate_available_and_fixes() -> None:
    sizes = fp.ModelSizes("2B", matmul_f32=6 * GiB, embed_f32=GiB // 2, other_f32=0, vision_file=0,
                          kv_bytes_per_token=224 << 10, kv_bytes_per_layer_token=8 << 10, tied=True)
    est = fp.estimate_memory(Settings(backend="cpu", max_seq=8192, disk_kv=None), "cpu", sizes)
    avail = fp.Available(4 * GiB, "MemAvailable", 4 * GiB, None)
    line = fp.refusal(est, avail)
    assert line is not None and "\n" not in line
    assert re.search(r"estimated backend cpu, max_seq 8192: F32 weights 6\.50 GiB \+ KV 1\.75 GiB \+ runtime "
                     r"0\.16 GiB = 8\.41 GiB, but only 4\.00 GiB available \(MemAvailable\)", line), line
    assert "a smaller max_seq" in line and 'backend = "cpu-q"' in line and "edge-llm convert rknn" in line
    q = fp.estimate_memory(Settings(backend="cpu-q", max_seq=8192, disk_kv=None), "cpu-q", sizes)
    assert q.total < 0.6 * est.total and fp.refusal(q, fp.Available(6 * GiB, "MemAvailable", 6 * GiB, None)) is None


# ---- the estimate against the real process -------------------------------------------------------
def _build_q4(model: str) -> None:
    from edge_llm.backends.cpuq.backend import ensure_quantized, mode
    from edge_llm.checkpoints.default import resolve_model_dir
    from edge_llm.checkpoints.gguf_blocks import gguf_blocks

    d = resolve_model_dir(model)
    ensure_quantized(d, mode("q4"), blocks=gguf_blocks(d))


def _peak(model: str, backend: str, max_seq: int) -> dict:
    """In a fresh process: load as the server does, fill every KV row, decode; peak RSS + estimate."""
    import numpy as np

    from edge_llm.bench.procstat import proc_status
    from edge_llm.runtime import load_runtime

    s = Settings(model=model, backend=backend, max_seq=max_seq, disk_kv=None)
    eng = load_runtime(s)
    ids = np.random.default_rng(0).integers(0, eng.model.args.vocab_size, max_seq - 8)
    logits = eng.model.prefill(ids, eng.cache)
    for _ in range(4):
        logits = eng.model.forward([int(np.argmax(logits))], eng.cache)
    est = fp.estimate_memory(s, backend, fp.ModelSizes.of_dir(eng.model_dir), eng.model_dir)
    return {"peak": proc_status()["VmHWM"], "estimate": est.total, "what": est.describe()}


@pytest.mark.parametrize("backend", ["cpu", "cpu-q"])
def test_estimate_is_within_the_stated_margin_of_the_measured_peak(edge_home: Path, backend: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/board.md, Memory: the estimate is at least the measured peak RSS and at most 1.3x it,
    for the default model with every KV row written (a 1016-token prefill + decode steps)."""
    from edge_llm.bench.procstat import in_child

    monkeypatch.setenv("EDGE_LLM_HOME", str(edge_home))
    if backend == "cpu-q":  # the one-time build has its own peak (docs/board.md): not this one's
        in_child(_build_q4, "default")
    r = in_child(_peak, "default", backend, 1024)
    ratio = r["estimate"] / r["peak"]
    print(f"\n{backend}: peak RSS {r['peak'] / 2**20:.0f} MiB, {r['what']}: ratio {ratio:.2f}")
    assert 1.0 <= ratio <= fp.ESTIMATE_MARGIN, r


# ---- a real cgroup -------------------------------------------------------------------------------
def _cgroup_v1_reason() -> str | None:
    base = Path("/sys/fs/cgroup/memory")
    if os.geteuid() != 0:
        return "needs root to create a memory cgroup"
    if not (base / "memory.limit_in_bytes").is_file():
        return "no cgroup v1 memory controller mounted at /sys/fs/cgroup/memory"
    if not os.access(base, os.W_OK):
        return "/sys/fs/cgroup/memory is read-only here"
    return None


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    """A fresh cgroup v1 memory group limited to `limit` bytes, removed afterwards."""
    cg = Path("/sys/fs/cgroup/memory") / f"edge-llm-test-{uuid.uuid4().hex[:8]}"
    cg.mkdir()
    try:
        (cg / "memory.limit_in_bytes").write_text(str(limit))
        yield cg
    finally:
        for _ in range(50):  # the group's last process may still be exiting
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


@pytest.mark.skipif(_cgroup_v1_reason() is not None, reason=str(_cgroup_v1_reason()))
def test_server_in_a_cgroup_smaller_than_its_estimate_refuses_cleanly(edge_home: Path, tmp_path: Path) -> None:
    """The server runs inside a real cgroup v1 memory limit of 400 MiB; its estimate (default
    model, F32, 4096 rows) is ~0.8 GiB. It must exit 78 with the one refusal line, before loading
    the weights: the cgroup never reached its limit (failcnt 0: no OOM kill, no reclaim storm)."""
    with memory_cgroup(400 << 20) as cg:
        log = tmp_path / "edge-llm.log"
        cmd = [sys.executable, "-m", "edge_llm", "serve", "--model", "default", "--backend", "cpu",
               "--max-seq", "4096", "--port", str(free_port()), "--log-file", str(log), "--disk-kv", str(tmp_path / "kv")]
        t0 = time.monotonic()
        r = subprocess.run(["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh", *cmd],
                           env={**os.environ, "EDGE_LLM_HOME": str(edge_home)}, capture_output=True,
                           text=True, timeout=300)
        took = time.monotonic() - t0
        text = log.read_text()
        assert r.returncode == fp.EXIT_REFUSED, (r.returncode, r.stderr[-3000:], text[-3000:])
        lines = [ln for ln in text.splitlines() if "memory: refusing to start" in ln]
        assert len(lines) == 2, text  # the error line and the exit line carry the same sentence
        assert re.search(r"estimated backend cpu, max_seq 4096: F32 weights 0\.50 GiB \+ KV 0\.18 GiB .*"
                         r"but only 0\.\d\d GiB available \(cgroup memory\.limit_in_bytes 0\.39 GiB at /edge-llm-test-",
                         lines[0]), lines[0]
        assert "fix: a smaller max_seq, or backend = \"cpu-q\"" in lines[0]
        assert re.search(r"=== edge-llm exit pid=\d+ reason=memory: refusing to start.* code=78", text), text[-2000:]
        assert "loading weights" not in text and "runtime ready" not in text
        assert int((cg / "memory.failcnt").read_text()) == 0
        peak = int((cg / "memory.max_usage_in_bytes").read_text())
        assert peak < 300 << 20, peak  # the interpreter and imports, not the 0.5 GiB of weights
        print(f"\nrefused in {took:.1f} s; the cgroup's peak usage {peak / 2**20:.0f} MiB")


@pytest.mark.skipif(_cgroup_v1_reason() is not None, reason=str(_cgroup_v1_reason()))
def test_auto_does_not_measure_cpu_q_where_the_measurement_cannot_fit(edge_home: Path, tmp_path: Path) -> None:
    """Inside a real cgroup v1 limit of 900 MiB, a fresh home without cpu-q's record: the F32 default
    model fits (0.68 GiB estimated at 512 rows), measuring cpu-q's record does not (the F32 model
    beside cpu-q, 1.1 GiB). `auto` must not build or measure cpu-q there: it runs cpu, says why and
    what to do, and the cgroup is never pushed to its limit."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(edge_home / "models")  # the imported default model, no quant/
    with memory_cgroup(900 << 20) as cg:
        cmd = [sys.executable, "-m", "edge_llm", "generate", "--model", "default", "--backend", "auto",
               "--max-seq", "512", "--no-disk-kv", "--temperature", "0", "--max-tokens", "8",
               "-p", "What is the capital of France?"]
        r = subprocess.run(["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh", *cmd],
                           env={**os.environ, "EDGE_LLM_HOME": str(home)}, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "Paris" in r.stdout, r.stdout
        line = next(ln for ln in r.stderr.splitlines() if "backend auto ->" in ln)
        assert line.startswith("backend auto -> cpu ("), line
        assert re.search(r"cpu-q's accuracy record cannot be measured here \(estimated backend cpu-q record, "
                         r"max_seq 512: F32 reference F32 weights 0\.50 GiB .* = 1\.1\d GiB, but only 0\.9\d GiB available", line), line
        assert "edge-llm model info MODEL --quant q4" in line and 'backend = "cpu-q"' in line
        assert not (home / "quant").exists() or not any((home / "quant").iterdir())  # nothing built
        assert int((cg / "memory.failcnt").read_text()) == 0


def test_the_unit_does_not_restart_a_refused_start() -> None:
    unit = (REPO / "systemd" / "edge-llm.service").read_text()
    values = re.findall(r"^RestartPreventExitStatus=(.*)$", unit, re.M)
    assert values and str(fp.EXIT_REFUSED) in values[0].split(), values
    assert re.search(r"^Restart=on-failure$", unit, re.M)


def test_bench_quant_memory_prints_the_estimate_next_to_the_peak(tiny_synth_dir: Path, tmp_path: Path) -> None:
    """`edge-llm bench quant-memory --backend cpu` (the F32 path) on the tiny model: the table has
    the measured peak and the start-up estimate with its ratio."""
    r = subprocess.run([sys.executable, "-m", "edge_llm", "bench", "quant-memory", "--model", str(tiny_synth_dir),
                        "--max-seq", "512", "--backend", "cpu", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "EDGE_LLM_HOME": str(tmp_path / "h")})
    assert r.returncode == 0, r.stderr[-3000:]
    md = next(tmp_path.rglob("quant-memory.md")).read_text()
    assert "# cpu memory: tiny-qwen3vl" in md and "weights as F32" in md, md
    m = re.search(r"\| start-up estimate \(edge_llm/footprint\.py\) \| (\d+\.\d\d) GiB = (\d+\.\d\d)x the peak "
                  r"\(backend cpu, max_seq 512: F32 weights", md)
    assert m and float(m.group(2)) > 0, md
