"""`edge-llm doctor`: the real CLI on this machine, and the RK3588 branch on a fabricated sysroot.

The RK3588 tests build a fake /proc, /sys, /dev and /etc under tmp_path: they test our parsing
of what the rknpu driver, devfreq, cpufreq and the eMMC expose, since none of that hardware
exists on this machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import psutil
import pytest

from edge_llm.doctor import FAIL, NA, PASS, WARN, run_checks
from edge_llm.settings import Settings

REPO = Path(__file__).resolve().parents[1]
NPU_ITEMS = ("board", "rknn-toolkit-lite2", "librknnrt", "npu-driver", "npu-device",
             "npu-governor", "ddr-governor")
IS_RK3588 = "rockchip,rk3588" in (Path("/proc/device-tree/compatible").read_bytes().decode(errors="replace")
                                  if Path("/proc/device-tree/compatible").exists() else "")


def by_name(checks) -> dict:
    return {c.name: c for c in checks}


def gib(detail: str, label: str) -> float:
    return float(re.search(label + r" (\d+\.\d\d) GiB", detail).group(1))


def tiny_model(d: Path, layers: int = 2) -> Path:
    """A minimal qwen3 checkpoint: config.json, one safetensors file, tokenizer.json."""
    from safetensors.numpy import save_file

    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}))
    save_file({"model.embed_tokens.weight": np.zeros((64, 32), np.float16),
               "model.norm.weight": np.ones(32, np.float32)}, str(d / "model.safetensors"))
    (d / "tokenizer.json").write_text("{}")
    return d


@pytest.mark.skipif(IS_RK3588, reason="checks the non-RK3588 path")
def test_cli_json_on_this_machine(tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    env = {**os.environ, "EDGE_LLM_HOME": str(tmp_path / "home")}
    # the free space of tmp_path's file system, sampled before, during and after the doctor's run:
    # another writer on the disk (a busy machine, a download) moves it while the doctor reads it
    free, done = [shutil.disk_usage(tmp_path).free], threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            free.append(shutil.disk_usage(tmp_path).free)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        res = subprocess.run([sys.executable, "-m", "edge_llm", "doctor", "--json", "--model", "default",
                              "--disk-kv", str(kv), "--max-seq", "4096"],
                             capture_output=True, text=True, timeout=300, env=env)
    finally:
        done.set()
        sampler.join()
    free.append(shutil.disk_usage(tmp_path).free)
    doc = json.loads(res.stdout)
    assert res.returncode == (0 if doc["ok"] else 1), res.stderr
    checks = doc["checks"]
    assert len({c["name"] for c in checks}) == len(checks)
    for c in checks:
        assert set(c) == {"name", "status", "detail", "fix"}
        assert c["status"] in (PASS, WARN, FAIL, NA)
        assert c["status"] in (PASS, NA) or c["fix"], c  # every problem names its fix
    c = {x["name"]: x for x in checks}
    for name in NPU_ITEMS:
        assert c[name]["status"] == NA and c[name]["detail"].startswith("not an RK3588 (machine: ")

    # memory: computed from psutil and the default model's real geometry
    # (SmolLM2-135M: 30 layers x 3 KV heads x 64 dims, F32 K and V)
    mem = c["memory"]["detail"]
    assert gib(mem, "KV") == round(4096 * 2 * 30 * 3 * 64 * 4 / 2**30, 2)
    assert float(re.search(r"(\d+\.\d\d) GiB total", mem).group(1)) == round(psutil.virtual_memory().total / 2**30, 2)
    # free space: statvfs of the nearest existing parent of the kv dir
    du = shutil.disk_usage(tmp_path)
    space = c["kv-space"]["detail"]
    assert float(re.search(r"free of (\d+\.\d\d) GiB", space).group(1)) == round(du.total / 2**30, 2)
    # within what was sampled around its reading, give or take its rounding and what a writer can
    # change between two samples
    reported = float(re.search(r"^(\d+\.\d\d) GiB free", space).group(1))
    assert min(free) / 2**30 - 0.25 <= reported <= max(free) / 2**30 + 0.25, (reported, min(free), max(free))
    assert c["kv-filesystem"]["detail"].startswith(str(kv))


def test_cli_table_and_exit_code(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{ not json")
    res = subprocess.run([sys.executable, "-m", "edge_llm", "doctor", "--model", str(bad),
                          "--disk-kv", str(tmp_path / "kv")],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "COLUMNS": "200", "EDGE_LLM_HOME": str(tmp_path)})
    assert res.returncode == 1
    assert re.search(r"fail\s+│ model\s+│", res.stdout), res.stdout
    assert "invalid JSON" in res.stdout and re.search(r"\d+ pass, \d+ warn, 1 fail, \d+ n/a", res.stdout)


def test_hf_model_sizes_and_identity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path / "home"))  # weight-digest cache
    model = tiny_model(tmp_path / "m")
    from edge_llm.config import ModelArgs
    from edge_llm.snapshot.identity import Identity

    from edge_llm.backends.cpu.backend import cpu_numerics

    ns = Identity.for_model(model, ModelArgs.from_dir(model), cpu_numerics()).namespace
    (tmp_path / "kv" / ns).mkdir(parents=True)
    (tmp_path / "kv" / ns / "kv_0000000000000001.kv").write_bytes(b"x")
    c = by_name(run_checks(Settings(model=str(model), disk_kv=str(tmp_path / "kv"), max_seq=1 << 20,
                                    disk_kv_max_bytes=5 << 30, backend="cpu")))
    assert c["model"].status == PASS and f"model_id {ns} (1 snapshot(s)" in c["model"].detail
    # weights as F32: (64*32 + 32) * 4 bytes; KV: 2**20 tokens * 2 layers * 2 * 16 dims * 4 B = 0.25 GiB
    assert gib(c["memory"].detail, "KV") == 0.25
    assert c["kv-space"].detail.endswith("snapshot cap 5.00 GiB (disk_kv_max_bytes)") or "does not fit" in c["kv-space"].detail
    os.chmod(tmp_path / "kv" / ns / "kv_0000000000000001.kv", 0o644)  # as a umask-022 process would leave it
    c = by_name(run_checks(Settings(model=str(model), disk_kv=str(tmp_path / "kv"))))
    assert c["kv-private"].status == WARN and "kv_0000000000000001.kv (644)" in c["kv-private"].detail
    for q in [tmp_path / "kv", *(tmp_path / "kv").rglob("*")]:
        os.chmod(q, 0o700 if q.is_dir() else 0o600)
    assert by_name(run_checks(Settings(model=str(model), disk_kv=str(tmp_path / "kv"))))["kv-private"].status == PASS
    # a kv dir not created yet: its parents' modes are not reported (they are the user's home)
    (tmp_path / "home").mkdir(mode=0o755, exist_ok=True)
    c = by_name(run_checks(Settings(model=str(model), disk_kv=str(tmp_path / "home" / "kv"))))["kv-private"]
    assert c.status == NA and "not created yet" in c.detail

    # another backend's namespace is named by numerics only it knows once loaded: the doctor names
    # the namespaces this model has (any backend) instead of a wrong one
    from edge_llm.snapshot.identity import ensure_namespace

    ident = Identity.for_model(model, ModelArgs.from_dir(model), "cpu-q:q4:0123456789abcdef:onnxruntime-x-q4-t2")
    ensure_namespace(tmp_path / "kv", ident)
    ensure_namespace(tmp_path / "kv", Identity.for_model(model, ModelArgs.from_dir(model), cpu_numerics()))  # the cpu one's
    c = by_name(run_checks(Settings(model=str(model), disk_kv=str(tmp_path / "kv"), backend="cpu-q")))
    assert c["model"].status == PASS, c["model"].detail
    assert f"{ident.namespace} (cpu-q:q4:0123456789abcdef:onnxruntime-x-q4-t2, 0 snapshot(s))" in c["model"].detail
    assert f"{ns} ({cpu_numerics()}, 1 snapshot(s))" in c["model"].detail
    assert f"model_id {ns}" not in c["model"].detail
    # the decode graph's session holds a second prepacked copy of the q4 weights
    from edge_llm.doctor import Doctor, ModelSizes

    sizes = {}
    for flag in (True, False):
        d = Doctor(Settings(model=str(model), disk_kv=None, backend="cpu-q", max_seq=16, decode_graph=flag))
        two_b = ModelSizes.of_params("2B", 2 << 30, 0, 28)  # 8 GiB of F32 weights
        sizes[flag] = float(re.search(r"q4 weights[^:+]* (\d+\.\d\d) GiB", d.memory(two_b).detail).group(1))
    assert sizes == {True: 3.0, False: 1.5}

    (model / "tokenizer.json").unlink()
    c = by_name(run_checks(Settings(model=str(model), disk_kv=str(tmp_path / "kv"))))
    assert c["model"].status == FAIL and "tokenizer.json missing" in c["model"].detail
    c = by_name(run_checks(Settings(model="", disk_kv=None)))
    assert c["model"].status == WARN and c["memory"].status == NA and c["kv-space"].status == NA


# ---- RK3588 branch on a fabricated sysroot --------------------------------------------------
def fake_board(root: Path, kv: Path, *, in_group: bool = True, node: str = "renderD129",
               eol: str = "0x01", life: str = "0x01 0x02", mount_opts: str = "rw,noatime") -> Path:
    def w(rel: str, text: str | bytes) -> Path:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        return p

    w("proc/device-tree/compatible", b"radxa,rock-5b\0rockchip,rk3588\0")
    w("proc/device-tree/model", b"Radxa ROCK 5B\0")
    w("sys/kernel/debug/rknpu/version", "RKNPU driver: v0.9.8\n")
    w(f"sys/class/drm/{node}/device/uevent", "DRIVER=RKNPU\nOF_NAME=npu\n")
    if node != "renderD128":
        w("sys/class/drm/renderD128/device/uevent", "DRIVER=panfrost\n")
    dev = w(f"dev/dri/{node}", "")
    dev.chmod(0o660)
    w("etc/passwd", "root:x:0:0::/root:/bin/bash\nedge-llm:x:999:999::/var/lib/edge-llm:/usr/sbin/nologin\n")
    w("etc/group", f"edge-llm:x:999:\nrender:x:{dev.stat().st_gid}:{'edge-llm' if in_group else ''}\n")
    w("etc/systemd/system/edge-llm.service", (REPO / "systemd/edge-llm.service").read_text())
    w("usr/lib/librknnrt.so", b"\x7fELF\0\0junk\0librknnrt version: 2.3.2 (429f97ae6b@2025-04-09T09:09:27)\0more")
    w("sys/class/devfreq/fdab0000.npu/governor", "rknpu_ondemand\n")
    w("sys/class/devfreq/dmc/governor", "performance\n")
    w("sys/devices/system/cpu/cpufreq/policy0/scaling_governor", "schedutil\n")
    w("sys/devices/system/cpu/cpufreq/policy4/scaling_governor", "performance\n")
    mmc = "sys/class/mmc_host/mmc0/mmc0:0001/"
    w(mmc + "type", "MMC\n"), w(mmc + "name", "BJTD4R\n")
    w(mmc + "life_time", life + "\n"), w(mmc + "pre_eol_info", eol + "\n")
    w("sys/class/mmc_host/mmc1/mmc1:aaaa/type", "SD\n")
    w("proc/self/mounts", f"/dev/mmcblk0p2 / ext4 rw 0 0\n/dev/mmcblk0p6 {kv.parent} ext4 {mount_opts} 0 0\n")
    w("run/systemd/timesync/synchronized", "")
    return root


def rk_checks(tmp_path: Path, **kw) -> dict:
    kv = tmp_path / "data" / "kv"
    kv.parent.mkdir(exist_ok=True)
    root = fake_board(tmp_path / "sysroot", kv, **kw)
    return by_name(run_checks(Settings(model="", disk_kv=str(kv)), sysroot=str(root)))


def test_rk3588_healthy_board(tmp_path: Path) -> None:
    c = rk_checks(tmp_path)
    assert c["board"].status == PASS and "Radxa ROCK 5B" in c["board"].detail
    assert c["librknnrt"].status == PASS and "2.3.2 (429f97ae6b@2025-04-09T09:09:27)" in c["librknnrt"].detail
    assert c["npu-driver"].status == PASS and "0.9.8" in c["npu-driver"].detail
    assert c["npu-device"].status == PASS and "/dev/dri/renderD129 crw" not in c["npu-device"].detail
    assert "/dev/dri/renderD129 -rw-rw----" in c["npu-device"].detail  # a plain file stands in for the node
    assert c["cpu-governor"].status == PASS and "policy0: schedutil" in c["cpu-governor"].detail
    assert c["npu-governor"].status == WARN and "echo performance > /sys/class/devfreq/fdab0000.npu/governor" in c["npu-governor"].fix
    assert c["ddr-governor"].status == PASS
    assert c["emmc-life"].status == PASS
    assert "type A 0-10% of rated erase cycles used, type B 10-20%" in c["emmc-life"].detail
    assert "mmc1" not in c["emmc-life"].detail  # SD cards report no wear counters
    assert c["kv-filesystem"].status == PASS and "/dev/mmcblk0p6" in c["kv-filesystem"].detail
    assert c["clock"].status == PASS
    if importlib_missing("rknnlite"):
        assert c["rknn-toolkit-lite2"].status == FAIL and c["rknn-toolkit-lite2"].fix


def importlib_missing(mod: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(mod) is None


def test_rk3588_problems_are_reported(tmp_path: Path) -> None:
    c = rk_checks(tmp_path, in_group=False, eol="0x03", life="0x0b 0x09", mount_opts="rw,sync,data=journal")
    assert c["npu-device"].status == FAIL and "edge-llm cannot open /dev/dri/renderD129" in c["npu-device"].detail
    assert c["emmc-life"].status == FAIL and "urgent" in c["emmc-life"].detail
    assert "rated erase cycles exceeded" in c["emmc-life"].detail
    assert c["kv-filesystem"].status == WARN and "'sync'" in c["kv-filesystem"].detail
    assert "data=journal" in c["kv-filesystem"].detail


def test_rk3588_npu_node_not_in_unit(tmp_path: Path) -> None:
    # the NPU came up as renderD128 (no GPU driver loaded): the unit's DeviceAllow misses it
    c = rk_checks(tmp_path, node="renderD128")
    assert c["npu-device"].status == FAIL and "no DeviceAllow=/dev/dri/renderD128" in c["npu-device"].detail


def test_rk3588_emmc_warning_level(tmp_path: Path) -> None:
    c = rk_checks(tmp_path, eol="0x02", life="0x08 0x03")
    assert c["emmc-life"].status == WARN and "70-80%" in c["emmc-life"].detail


def test_read_only_kv_mount_fails(tmp_path: Path) -> None:
    c = rk_checks(tmp_path, mount_opts="ro,noatime")
    assert c["kv-filesystem"].status == FAIL


def test_gguf_header_walk_matches_gguf_reader(tmp_path: Path) -> None:
    """Our header walk (used for the not-yet-imported default model) against gguf's own reader."""
    import gguf

    from edge_llm.checkpoints.gguf_header import gguf_sizes

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(3)
    w.add_embedding_length(48)
    w.add_head_count(6)
    w.add_head_count_kv(2)
    w.add_token_list([f"tok{i}" for i in range(50)])  # string array, skipped element by element
    w.add_token_scores([0.0] * 50)  # numeric array, skipped in one step
    w.add_tensor("token_embd.weight", np.zeros((50, 48), np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((48, 48), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(str(path))
    params, bpt = gguf_sizes(path)
    assert params == sum(int(t.n_elements) for t in reader.tensors) == 50 * 48 + 48 * 48
    assert bpt == 2 * 3 * 2 * (48 // 6) * 4


def test_npu_backend_checks_rknn_dir_and_open_files(tmp_path: Path, monkeypatch) -> None:
    import resource

    root = tmp_path / "root"
    root.mkdir()
    c = by_name(run_checks(Settings(model="", disk_kv=None, backend="rknn"), sysroot=str(root)))
    assert c["rknn-dir"].status == FAIL and "no rknn_dir" in c["rknn-dir"].detail
    d = tmp_path / "rknn"
    d.mkdir()
    c = by_name(run_checks(Settings(model="", disk_kv=None, backend="rknn", rknn_dir=str(d)), sysroot=str(root)))
    assert c["rknn-dir"].status == FAIL and "manifest.json: not found" in c["rknn-dir"].detail
    assert by_name(run_checks(Settings(model="", disk_kv=None), sysroot=str(root)))["rknn-dir"].status == NA
    monkeypatch.setattr(resource, "getrlimit", lambda what: (1024, 4096))
    c = by_name(run_checks(Settings(model="", disk_kv=None, backend="rknn"), sysroot=str(root)))
    assert c["open-files"].status == WARN and "ulimit -n 1024" in c["open-files"].detail
    unit = root / "etc/systemd/system/edge-llm.service"
    unit.parent.mkdir(parents=True)
    shutil.copy(REPO / "systemd/edge-llm.service", unit)
    c = by_name(run_checks(Settings(model="", disk_kv=None, backend="rknn"), sysroot=str(root)))
    assert c["open-files"].status == PASS and "LimitNOFILE=65536" in c["open-files"].detail


def test_table_shows_bracketed_text_as_written(tmp_path: Path) -> None:
    """The table prints each check's texts as they are: `'edge-llm[quant]'` in a fix or a detail and
    a path with brackets are not rich markup (the table once printed `pip install 'edge-llm'`).
    This machine without onnxruntime (blocked in the child) makes `auto` pick cpu, whose detail
    and fix name the extras."""
    bad = tmp_path / "m[quant]"
    bad.mkdir()
    (bad / "config.json").write_text("{ not json")
    code = ("import runpy, sys; sys.modules['onnxruntime'] = None; "
            f"sys.argv = ['edge-llm', 'doctor', '--model', {str(bad)!r}, '--backend', 'auto', "
            f"'--disk-kv', {str(tmp_path / 'kv')!r}]; runpy.run_module('edge_llm', run_name='__main__')")
    env = {**os.environ, "COLUMNS": "400", "EDGE_LLM_HOME": str(tmp_path), "EDGE_LLM_RKNN_DIR": str(tmp_path / "r")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 1, res.stderr  # the model check fails
    table = res.stdout
    assert re.search(r"warn\s+│ backend\s+│ backend auto -> cpu .*pip install 'edge-llm\[quant\]'", table), table
    assert "pip install 'edge-llm[board,quant]' in the service venv" in table, table
    assert f"{bad}/config.json: invalid JSON" in table, table


def test_piped_table_keeps_each_check_on_one_line(tmp_path: Path) -> None:
    """Piped (not a terminal) and without $COLUMNS, the table is not folded to 80 columns: one line
    per check, each text whole, so `doctor | grep` finds a check with its detail. $COLUMNS, when
    set, still bounds it."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["EDGE_LLM_HOME"] = str(tmp_path)
    args = [sys.executable, "-m", "edge_llm", "doctor", "--model", "default", "--disk-kv", str(tmp_path / "kv")]
    res = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    doc = json.loads(subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=300, env=env).stdout)
    rows = [ln for ln in res.stdout.splitlines() if ln.startswith("│")]
    assert len(rows) == len(doc["checks"]), res.stdout

    def text(t: str) -> str:  # the text whole, its figures (free memory, free space) as any number
        return r"[\d.]+".join(re.escape(part) for part in re.split(r"\d+(?:\.\d+)?", t))

    for check, row in zip(doc["checks"], rows):
        assert re.match(rf"│ {text(check['status'])}\s+│ {text(check['name'])}\s+│ "
                        rf"{text(check['detail'])}\s+│ {text(check['fix'])}\s+│$", row), (check, row)
    assert max(len(ln) for ln in res.stdout.splitlines()) > 120  # the memory line alone is longer
    narrow = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**env, "COLUMNS": "100"})
    assert max(len(ln) for ln in narrow.stdout.splitlines()) <= 100, narrow.stdout


def test_missing_cpu_q_is_a_warning_only_when_auto_was_asked_for(tmp_path: Path) -> None:
    """In a venv without the quant extra (onnx, onnxruntime unimportable, as `make serve` builds
    it): a named `cpu` passes and says cpu-q is not installed, as information; the default `auto`
    that nobody set passes with auto's reason (it names the extra); `auto` set by a flag, the
    environment or the configuration warns, with the fix."""
    from helpers.runtime_deps import runtime_only_env

    env = runtime_only_env(EDGE_LLM_HOME=str(tmp_path))
    env.pop("EDGE_LLM_BACKEND", None)  # the suite's own
    conf = tmp_path / "edge-llm.toml"
    conf.write_text('backend = "auto"\n')

    def backend(*argv: str, **extra: str) -> dict:
        r = subprocess.run([sys.executable, "-m", "edge_llm", "doctor", "--json", "--model", "",
                            "--disk-kv", str(tmp_path / "kv"), *argv], capture_output=True, text=True, timeout=300,
                           env={**env, **extra})
        assert r.stdout, r.stderr
        return {c["name"]: c for c in json.loads(r.stdout)["checks"]}["backend"]

    named = backend("--backend", "cpu")
    assert named["status"] == PASS and named["fix"] == "", named
    assert named["detail"] == ("backend cpu, set on the command line (--backend); cpu-q is not installed here "
                               "(onnxruntime not importable), not needed for backend cpu"), named
    default = backend()
    assert default["status"] == PASS and default["detail"].startswith("backend auto -> cpu ("), default
    assert "pip install 'edge-llm[quant]'" in default["detail"], default
    for asked in (backend("--backend", "auto"), backend(EDGE_LLM_BACKEND="auto"), backend("--config", str(conf))):
        assert asked["status"] == WARN and "edge-llm[board,quant]" in asked["fix"], asked
