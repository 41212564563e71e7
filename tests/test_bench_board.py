"""`edge-llm bench board`: the one report a board owner sends back, run as a user runs it (the real
CLI in a subprocess, --quick sizes, a tiny model), over the tests' fake librknnrt and without any
library; a section that fails is reported and the others still run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from edge_llm.backends.npu.backend import npu_present
from edge_llm.bench.board import read_report
from edge_llm.settings import LIBRKNNRT_ENV

SECTIONS = {"machine", "self_test", "conversion", "accuracy", "matmul", "prediction", "disk", "restore", "decode"}


def board(model: Path, tmp: Path, *extra: str, lib: Path | None = None) -> tuple[subprocess.CompletedProcess, str]:
    env = {k: v for k, v in os.environ.items() if k != LIBRKNNRT_ENV}
    env["EDGE_LLM_HOME"] = str(tmp / "home")
    out = tmp / "report.md"
    r = subprocess.run([sys.executable, "-m", "edge_llm", "bench", "board", "--model", str(model), "--quick",
                        "--out", str(out), *(("--lib", str(lib)) if lib else ()), *extra],
                       capture_output=True, text=True, timeout=600, env=env, cwd=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    assert str(out) in r.stdout and "issue tracker" in r.stdout
    return r, out.read_text()


def check_cpu_sections(s: dict, model: Path) -> None:
    """The sections that run on any machine hold their numbers."""
    from edge_llm.bench.npu.a76 import CPU_Q_BYTES_PER_WEIGHT, a76_bandwidth, weights
    from edge_llm.config import ModelArgs

    args = ModelArgs.from_dir(model)
    m = s["machine"]
    assert m["cpu"] and m["isa"] and m["kernel"] and m["edge_llm"]
    a = s["accuracy"]
    assert 0.99 < a["min_cosine"] <= 1.0 and 0.0 <= a["teacher"]["top1"] <= 1.0 and a["teacher"]["tokens"] == 32
    p = s["prediction"]
    assert p["layers"] == args.num_hidden_layers and all(d["tok_s"] > 0 for d in p["decode"])
    # cpu-q on the A76: the model's 4-bit bytes per token over the bandwidth derived from Gemma3-1B
    assert p["cpu_q"]["bytes_per_token"] == weights(args) * CPU_Q_BYTES_PER_WEIGHT
    assert p["cpu_q"]["tok_s"] == pytest.approx(a76_bandwidth() / p["cpu_q"]["bytes_per_token"])
    r = s["restore"]
    assert [c["tokens"] for c in r["contexts"]] == [2048, 8192]
    assert all(c["restored_bitwise_equal"] and c["restore"]["mb_s"] > 0 for c in r["contexts"])
    assert r["geometry"]["n_layers"] == args.num_hidden_layers


def test_over_the_fake_library(tiny_synth_dir, fake_librknnrt, tmp_path):
    r, md = board(tiny_synth_dir, tmp_path, lib=fake_librknnrt)
    first = md.splitlines()[:3]
    assert any("ran over a fake librknnrt" in line and "numbers are not a board's" in line for line in first), first
    res = read_report(md)
    s = res["sections"]
    assert res["fake_library"] is True and set(s) == SECTIONS
    assert {k for k, v in s.items() if v["status"] != "ok"} == set(), {k: v.get("reason") for k, v in s.items()}
    # the self-test ran every probe for this report (no answer kept by a server is reused)
    st = s["self_test"]
    assert st["cached"] is False and st["refused"] is None and st["seconds"] > 0, st
    assert st["probes"] and all(p["ok"] for p in st["probes"].values()), st["probes"]
    assert min(st["part"]) > 0 and st["domain"] == 0, st
    assert "## NPU self-test\n" in md and '"probes"' in md
    check_cpu_sections(s, tiny_synth_dir)
    assert s["accuracy"]["runner"] == "librknnrt" and "librknnrt" in s["accuracy"]["numerics"]
    m = s["matmul"]
    assert m["run_us"] > 0 and set(m["gbps"]["2048x6144"]) == {"1 core", "3 cores"}
    measured = s["prediction"]["at_rates"]["measured"]
    assert measured["rates"]["bw_core_gbs"] == m["gbps"]["2048x6144"]["1 core"]
    assert s["disk"]["write"]["mb_s"] > 0 and s["disk"]["read"]["nbytes"] == 8 << 20
    rows = s["decode"]["rows"]
    assert {row["backend"] for row in rows} == {"cpu-q", "rknn"}
    assert all(row["plain"]["decode_tps"] > 0 and row["spec"]["decode_tps"] > 0 for row in rows)
    assert s["machine"]["librknnrt"] == str(fake_librknnrt)


@pytest.mark.skipif(npu_present() is not None, reason="this machine has an NPU")
def test_without_a_library_the_npu_sections_say_why(tiny_synth_dir, tmp_path):
    r, md = board(tiny_synth_dir, tmp_path)
    assert "no NPU and no librknnrt on this machine" in "\n".join(md.splitlines()[:3])
    res = read_report(md)
    s = res["sections"]
    assert res["fake_library"] is False
    assert s["matmul"]["status"] == "not run" and "no librknnrt" in s["matmul"]["reason"]
    assert s["self_test"]["status"] == "not run" and "no librknnrt" in s["self_test"]["reason"]
    assert "## Matmul rates\n\nnot run: no librknnrt" in md
    check_cpu_sections(s, tiny_synth_dir)
    assert s["accuracy"]["runner"] == "host" and "at_rates" not in s["prediction"]
    assert {row["backend"] for row in s["decode"]["rows"]} == {"cpu-q"}


def test_a_failing_section_is_reported_and_the_others_run(tiny_synth_dir, fake_librknnrt, tmp_path):
    """The store directory is a regular file: the disk and restore sections cannot write there."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    r, md = board(tiny_synth_dir, tmp_path, "--store-dir", str(blocker), lib=fake_librknnrt)
    s = read_report(md)["sections"]
    failed = {k for k, v in s.items() if v["status"] != "ok"}
    assert failed == {"disk", "restore"}, {k: v.get("reason") for k, v in s.items()}
    for name in ("disk", "restore"):
        assert "not-a-dir" in s[name]["reason"]
    assert "## Store disk (raw)\n\nnot run: " in md and "## Snapshot save and restore\n\nnot run: " in md
    assert "not run: disk, restore" in " ".join(r.stdout.split())
    assert s["decode"]["rows"] and s["matmul"]["run_us"] > 0 and blocker.read_text() == "x"


def test_machine_facts_from_a_boards_files(tmp_path):
    """The board model from the device tree, the driver's version from debugfs and the library's
    from its bytes, as a board shows them (here under a sysroot)."""
    from edge_llm.bench.board import Where, machine_facts

    (tmp_path / "proc/device-tree").mkdir(parents=True)
    (tmp_path / "proc/device-tree/model").write_bytes(b"Radxa ROCK 5B\0")
    (tmp_path / "sys/kernel/debug/rknpu").mkdir(parents=True)
    (tmp_path / "sys/kernel/debug/rknpu/version").write_text("RKNPU driver: v0.9.8\n")
    lib = tmp_path / "librknnrt.so"
    lib.write_bytes(b"\x7fELF\0junk\0librknnrt version: 2.3.2 (429f97ae6b@2025-04-09T09:09:27)\0more")
    f = machine_facts(Where(str(lib), "/dev/rknpu"), sysroot=str(tmp_path))
    assert f["board"] == "Radxa ROCK 5B" and f["npu_driver"] == "0.9.8" and f["npu"] == "/dev/rknpu"
    assert f["librknnrt_version"] == "2.3.2 (429f97ae6b@2025-04-09T09:09:27)"
    bare = machine_facts(Where(None, None), sysroot=str(tmp_path / "none"))
    assert bare["board"] is None and bare["npu_driver"] is None and bare["librknnrt_version"] is None
