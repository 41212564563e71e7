"""The board as it ships, on an emulated arm64 Debian bookworm with systemd as PID 1.

`tests/board/board_emu.py` boots the rootfs under qemu-user with systemd-nspawn and installs the
checkout with board/install.sh exactly as docs/board.md says, with a tiny synthetic Qwen3-VL
model (emulated numpy is ~500x slower than native). The service is then driven only through
`systemctl`, `journalctl` and HTTP (the board shares this host's network; its port is set in
/etc/default/edge-llm as a board owner would). What the emulation cannot show (the NPU, eMMC
speed and wear, thermals, seccomp filters) is listed in docs/board.md, "Tested on".

One board serves the whole module; the tests run in file order and the later ones see the
history of the earlier ones (snapshots, log lines), as a board in use would.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edge_llm.bench.client import (
    LOADED_RE,
    SAVED_RE,
    http_json,
    log_offset,
    read_since,
    wait_for_line,
    wait_ready,
)
from edge_llm.snapshot.layout import SNAPSHOT_GLOB, SNAPSHOT_NAME

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "board"))
import board_container  # noqa: E402
import board_emu  # noqa: E402
import board_image  # noqa: E402
from serverutil import ServerProc, free_port  # noqa: E402

REASON = board_image.unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=f"emulated board: {REASON}")]

LOG = "/var/log/edge-llm/edge-llm.log"
VENV = "/opt/edge-llm/venv/bin"
MODEL_NAME = "tiny-qwen3vl"
MODEL = f"/opt/edge-llm/models/{MODEL_NAME}"
START_RE = re.compile(r"=== edge-llm \S+ start pid=(\d+)")
EXIT_RE = re.compile(r"=== edge-llm exit pid=(\d+) reason=(\S+) code=(-?\d+)")
# not the lab's prompts: the lab (last test) must start from unrelated snapshots
PROMPT = "Inventory log of the north warehouse.\n" + "".join(
    f"Shelf {i}: {i * 7 % 13} blue jars, {i * 5 % 11} red boxes, checked by {('Ana', 'Ben', 'Chloe')[i % 3]}.\n"
    for i in range(30)) + "Question: which shelf holds the most blue jars?\nAnswer:"
GREEDY = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
# a seeded sample reads the logits themselves (the tiny random model's greedy text repeats one token)
SAMPLED = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 11}
REFERENCE: dict[str, str] = {}  # the texts before any restart (set by the lifecycle test)


@pytest.fixture(scope="module")
def board(tmp_path_factory):
    t0 = time.monotonic()
    tarball = board_image.rootfs_tarball()  # built once (minutes), then cached
    rootfs_s = time.monotonic() - t0
    model = board_emu.make_tiny_model(tmp_path_factory.mktemp("board-model") / MODEL_NAME,
                                      str(Path(sys.executable).parent / "edge-llm"))
    with board_container.Board(tarball) as b:
        b.port = free_port()
        b.url = f"http://127.0.0.1:{b.port}"
        t1 = time.monotonic()
        try:
            res = board_emu.install_product(b, model, b.port)
        except Exception as e:
            out = getattr(e, "stdout", "") + getattr(e, "stderr", "")
            pytest.fail(f"install failed: {e}\n{out[-6000:]}\n{journal(b, '-n', '60')}")
        b.install_out = res.stdout + res.stderr
        print(f"\nboard: rootfs {rootfs_s:.0f} s, boot {b.boot_s:.1f} s, install {time.monotonic() - t1:.0f} s")
        yield b


# ---- helpers -------------------------------------------------------------------------------------
def ctl(b, *args: str, check: bool = True, timeout: float = 900) -> str:
    try:
        return b.run(["systemctl", *args], check=check, timeout=timeout).stdout.strip()
    except subprocess.SubprocessError as e:  # failed or hung: show what the service said
        if args[:1] in (("start",), ("restart",)) and silent_start(b):
            # qemu-user, rarely (one start in ~40 here; once in CI): the new process never ran a
            # line of Python (no banner) and ignored SIGTERM until SIGKILL: an emulator deadlock
            # before our code runs, not a start-up fault of ours (that would log). Try once more.
            print(f"\nemulator: systemctl {' '.join(args)} hung before the banner; starting again")
            ctl(b, "reset-failed", "edge-llm", check=False)
            return ctl(b, "start", *args[1:], check=check, timeout=timeout)
        out = (getattr(e, "stdout", "") or "") + (getattr(e, "stderr", "") or "")
        pytest.fail(f"systemctl {' '.join(args)}: {e}\n{out}\n--- journal:\n"
                    f"{b.run(['journalctl', '-n', '80', '--no-pager'], check=False).stdout}")


def silent_start(b) -> bool:
    """Whether the unit's last start attempt timed out without its process logging anything."""
    lines = journal(b, "-n", "400").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Starting edge-llm.service")]
    if not starts:
        return False
    after = lines[starts[-1] + 1:]
    return (any("start operation timed out" in line for line in after)
            and not any(" start pid=" in line for line in after))


def prop(b, name: str) -> str:
    return ctl(b, "show", "-p", name, "--value", "edge-llm")


def journal(b, *args: str) -> str:
    return b.run(["journalctl", "-u", "edge-llm", "--no-pager", "-o", "cat", *args], check=False).stdout


def complete(b, body: dict) -> dict:
    status, doc = http_json("POST", b.url + "/v1/completions", body, timeout=900)
    assert status == 200, (status, doc, journal(b, "-n", "40"))
    return doc


@contextlib.contextmanager
def dropin(b, name: str, service_lines: str, after: str = "restart"):
    """A unit drop-in for the duration of a test (as a board owner would add with `systemctl edit`),
    then removed; `after`: what to do with the service once it is gone ("restart", "start",
    "stop" or "as-before": start it again only if it was active)."""
    was_active = ctl(b, "is-active", "edge-llm", check=False) == "active"
    path = f"/etc/systemd/system/edge-llm.service.d/{name}.conf"
    b.write(path, "[Service]\n" + service_lines)
    try:
        ctl(b, "daemon-reload")
        yield
    finally:
        b.run(["rm", "-f", path])
        ctl(b, "daemon-reload")
        ctl(b, "reset-failed", "edge-llm", check=False)
        if after == "as-before":
            after = "start" if was_active else ""
        if after:
            ctl(b, after, "edge-llm")


def wait_save(b, mark: int) -> None:
    """The background writer has handled the request's snapshot (written, or already stored)."""
    done = re.compile(r"\[KV-DISK\] (saved|skipped) ")
    assert wait_for_line(b.path(LOG), mark, done, timeout=300), read_since(b.path(LOG), mark)[-3000:]


# ---- tests ---------------------------------------------------------------------------------------
def test_installed_as_documented(board):
    b = board
    assert "install: done" in b.install_out
    assert ctl(b, "is-active", "edge-llm") == "active"
    assert ctl(b, "is-enabled", "edge-llm") == "enabled"
    assert prop(b, "Type") == "notify" and prop(b, "WatchdogUSec") == "1min"
    # the unit in /etc is the shipped file; the harness added nothing to it (no drop-ins)
    assert b.path("/etc/systemd/system/edge-llm.service").read_bytes() == (
        REPO / "systemd/edge-llm.service").read_bytes()
    assert prop(b, "DropInPaths") == ""
    conf = b.path("/etc/edge-llm/edge-llm.toml").read_text()
    assert f'model = "{MODEL}"' in conf
    assert b.path("/etc/systemd/journald.conf.d/edge-llm.conf").is_file()
    assert b.path("/etc/logrotate.d/edge-llm").is_file()
    # journald picked up the drop-in: persistent journal under /var/log/journal
    assert list(b.path("/var/log/journal").glob("*/system.journal"))
    # user and ownership come from the board's own databases
    passwd = b.run(["getent", "passwd", "edge-llm"]).stdout
    assert passwd.strip().endswith(":/var/lib/edge-llm:/usr/sbin/nologin")
    # snapshots hold the conversations: owner-only unless the operator sets disk_kv_group_read
    assert b.run(["stat", "-c", "%U:%G %a", "/var/lib/edge-llm/kv"]).stdout.split() == ["edge-llm:edge-llm", "700"]
    # every emulated process runs with the RK3588 big-core CPU model (system.conf.d drop-in)
    pid = prop(b, "MainPID")
    env = b.run(["cat", f"/proc/{pid}/environ"]).stdout.split("\0")
    assert f"QEMU_CPU={board_image.QEMU_CPU}" in env and "WATCHDOG_USEC=60000000" in env
    assert b.run([f"{VENV}/python", "-c", "import platform; print(platform.machine())"]).stdout.strip() == "aarch64"
    status, health = http_json("GET", b.url + "/health", timeout=30)
    assert status == 200 and health["model"] == MODEL_NAME, health
    # backend = auto (the default) chose cpu-q: install.sh installed the quant extra; the board
    # image has no C compiler, so cpu-q runs without its attention operator and says so
    assert health["backend"] == "cpu-q", health
    assert re.match(r"backend auto -> cpu-q \(no RKNPU device node; onnxruntime \d+\.\d+", health["backend_reason"]), health
    started = journal(b)
    assert health["backend_reason"] in started and "the attention operator (_attn.c) was not built" in started, started[-3000:]
    status, models = http_json("GET", b.url + "/v1/models", timeout=30)
    assert models["data"][0]["backend"] == "cpu-q" and models["data"][0]["backend_reason"] == health["backend_reason"]
    # units nspawn cannot run (systemd-sysusers, -tmpfiles-setup: 243/CREDENTIALS) may have
    # failed; install.sh created the user itself and the unit's directories come from systemd
    assert "edge-llm" not in ctl(b, "list-units", "--state=failed", "--plain", "--no-legend")


def test_restarts_restore_snapshots_and_keep_logs(board):
    """start, a request, kill -9 + start, restart, stop: every restart restores the snapshot
    (log line after the marker, cached_tokens, same text); the log file and the journal keep
    the lines of every run; the watchdog never fired."""
    b, log = board, board.path(LOG)
    pids = [int(prop(b, "MainPID"))]
    mark = log_offset(log)
    cold = complete(b, GREEDY)
    assert cold["timings"]["cache_source"] == "none" and cold["usage"]["prompt_tokens"] > 300
    wait_save(b, mark)
    assert SAVED_RE.search(read_since(log, mark))
    sampled = complete(b, SAMPLED)  # same prompt: a RAM hit, then its own snapshot
    wait_save(b, mark)
    cold_text, sampled_text = cold["choices"][0]["text"], sampled["choices"][0]["text"]
    REFERENCE.update(greedy=cold_text, sampled=sampled_text)

    for how in ("kill", "restart"):
        mark = log_offset(log)
        if how == "kill":  # a crash: no goodbye, no flush
            ctl(b, "kill", "-s", "KILL", "edge-llm")
            ctl(b, "start", "edge-llm")  # waits for READY=1 (after the unit's RestartSec)
        else:
            ctl(b, "restart", "edge-llm")
        assert ctl(b, "is-active", "edge-llm") == "active"
        pids.append(int(prop(b, "MainPID")))
        assert pids[-1] != pids[-2]
        wait_ready(b.url, timeout=300)  # bounds a hang: the emulated board on a busy host is slow
        r = complete(b, GREEDY)
        since = read_since(log, mark)
        loaded = LOADED_RE.search(since)
        t = r["timings"]
        assert loaded, f"{how}: no [KV-DISK] loaded line after the marker:\n{since[-3000:]}"
        assert t["cache_source"] == "disk" and r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, (how, t)
        assert int(loaded[1]) == t["disk_cached_tokens"] == r["usage"]["prompt_tokens"] - t["prefill_tokens"]
        assert f"start pid={pids[-1]} " in since  # the new process wrote the line
        assert r["choices"][0]["text"] == cold_text, how
        assert complete(b, SAMPLED)["choices"][0]["text"] == sampled_text, how
        wait_save(b, mark)

    mark = log_offset(log)
    ctl(b, "stop", "edge-llm")
    assert ctl(b, "is-active", "edge-llm", check=False) == "inactive"
    ex = EXIT_RE.search(read_since(log, mark))
    assert ex and int(ex[1]) == pids[-1] and ex[3] == "0", read_since(log, mark)[-2000:]
    assert prop(b, "Result") == "success"

    # every run's start banner, in order, in the file and in the journal
    text = log.read_text()
    assert [int(p) for p in START_RE.findall(text)][-3:] == pids, (pids, START_RE.findall(text))
    jtext = journal(b)
    assert [int(p) for p in START_RE.findall(jtext)][-3:] == pids
    assert len(SAVED_RE.findall(jtext)) >= 2 and len(LOADED_RE.findall(jtext)) >= 2
    full = b.run(["journalctl", "-u", "edge-llm", "--no-pager"]).stdout
    assert "Main process exited, code=killed, status=9/KILL" in full
    assert "atchdog" not in full.replace("WATCHDOG", ""), [l for l in full.splitlines() if "atchdog" in l]


def test_logrotate_reopens_the_log(board):
    """The shipped logrotate rule rotates the file and SIGHUPs the server, which reopens it."""
    b = board
    ctl(b, "start", "edge-llm")
    pid = prop(b, "MainPID")
    b.run(["logrotate", "-f", "/etc/logrotate.d/edge-llm"])
    rotated = sorted(p.name for p in b.path("/var/log/edge-llm").iterdir())
    assert any(n.startswith("edge-llm.log-") for n in rotated), rotated
    assert prop(b, "MainPID") == pid  # reopened, not restarted
    complete(b, {"prompt": "After rotation:", "max_tokens": 2, "temperature": 0})
    fresh = b.path(LOG).read_text()
    assert "/v1/completions" in fresh or "PREFILL-TIMING" in fresh, fresh


def test_doctor_on_aarch64_without_npu(board):
    b = board
    res = b.run([f"{VENV}/edge-llm", "doctor", "--json"], check=False)
    doc = json.loads(res.stdout)
    assert res.returncode == (0 if doc["ok"] else 1), res.stderr
    assert doc["machine"] == "aarch64" and doc["settings"]["model"] == MODEL
    c = {x["name"]: x for x in doc["checks"]}
    assert not [x for x in doc["checks"] if "crashed" in x["detail"]], doc
    for name in ("board", "librknnrt", "npu-driver", "npu-device", "npu-governor", "ddr-governor"):
        assert c[name]["status"] == "n/a" and c[name]["detail"] == "not an RK3588 (machine: aarch64)"
    # the board extra's package is there and imports; doctor says why it cannot be used
    lite = c["rknn-toolkit-lite2"]
    assert lite["status"] == "pass" and re.match(r"rknnlite 2\.\d", lite["detail"]) and "no NPU" in lite["detail"]
    assert c["packages"]["status"] == "pass" and c["python"]["status"] == "pass"
    status, health = http_json("GET", board.url + "/health", timeout=30)
    assert c["model"]["status"] == "pass" and health["namespace"] in c["model"]["detail"], (c["model"], health)
    assert c["kv-filesystem"]["status"] in ("pass", "warn") and c["memory"]["status"] == "pass"
    table = b.run([f"{VENV}/edge-llm", "doctor"], check=False)
    assert "Traceback" not in table.stdout + table.stderr and "rknn-toolkit-lite2" in table.stdout

    # an RK3588 without its NPU pieces (device tree says rk3588; no driver, node or librknnrt):
    # every NPU item fails or warns with the reason and the fix, none crashes
    fake = "/root/fake-rk3588"
    b.sh(f"mkdir -p {fake}/proc/device-tree {fake}/etc && printf 'radxa,rock-5b\\0rockchip,rk3588\\0' "
         f"> {fake}/proc/device-tree/compatible && cp /etc/passwd /etc/group {fake}/etc/")
    doc = json.loads(b.run([f"{VENV}/edge-llm", "doctor", "--json", "--sysroot", fake], check=False).stdout)
    c = {x["name"]: x for x in doc["checks"]}
    assert not doc["ok"] and not [x for x in doc["checks"] if "crashed" in x["detail"]]
    assert c["board"]["status"] == "pass" and c["rknn-toolkit-lite2"]["status"] == "pass"
    for name in ("librknnrt", "npu-device"):
        assert c[name]["status"] == "fail" and c[name]["fix"], c[name]
    for name in ("npu-driver", "npu-governor", "ddr-governor"):
        assert c[name]["status"] == "warn" and c[name]["fix"], c[name]


def test_rknnlite_imports_and_fails_clearly_without_npu(board):
    """The board binding: rknn-toolkit-lite2 (installed by the `board` extra on aarch64) imports;
    without an NPU, init_runtime returns an error code and says why (it does not raise)."""
    script = (
        "import importlib.metadata as md\n"
        "from rknnlite.api import RKNNLite\n"
        "print('version', md.version('rknn-toolkit-lite2'))\n"
        "open('/root/junk.rknn', 'wb').write(bytes(4096))\n"
        "r = RKNNLite(verbose=False)\n"
        "print('load', r.load_rknn('/root/junk.rknn'))\n"
        "print('init', r.init_runtime())\n")
    res = board.run([f"{VENV}/python", "-c", script], check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert re.search(r"^version 2\.\d", res.stdout, re.M) and "init -1" in res.stdout, out
    assert "Please specify the target" in out or "Can not find dynamic library" in out, out


def test_npu_backend_without_npu(board, tmp_path):
    """`--backend rknn` on a board without an NPU refuses to start and says why; `--backend auto`
    with a fake NPU node but no NPU graphs falls back to cpu-q and logs the reason. The graph set is a real export of the installed model
    (ONNX + manifest, made on this host); the NPU is what cannot exist here."""
    from edge_llm.backends.graph.onnx_export import export_graph_set

    b = board
    export_graph_set(b.path(MODEL), tmp_path / "graphs")
    b.copy_in(tmp_path / "graphs", "/opt/edge-llm/models/tiny-rknn")
    port = free_port()
    serve = [f"{VENV}/edge-llm", "serve", "--model", MODEL, "--rknn-dir", "/opt/edge-llm/models/tiny-rknn",
             "--port", str(port), "--disk-kv", "off", "--log-file", "off"]
    res = b.run(["timeout", "600", *serve, "--backend", "rknn"], check=False, timeout=700)
    out = res.stdout + res.stderr
    assert res.returncode not in (0, 124), out  # exited by itself, with an error
    assert "no RKNPU device on this machine" in out and "Traceback" not in out, out[-3000:]

    # auto with a fake NPU node (the RKNPU driver cannot exist here) and no rknn_dir: cpu-q, and why
    b.run(["touch", "/dev/rknpu"])
    auto_cmd = [a for a in serve if a not in ("--rknn-dir", "/opt/edge-llm/models/tiny-rknn")]
    auto = b.run(f"({shlex.join([*auto_cmd, '--backend', 'auto'])}) > /root/auto.log 2>&1 & echo $!").stdout.strip()
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout=300)
        status, health = http_json("GET", f"http://127.0.0.1:{port}/health", timeout=30)
        assert status == 200 and health["backend"] == "cpu-q", health
    finally:
        b.run(["kill", auto], check=False)
        b.run(["rm", "-f", "/dev/rknpu"])
    logged = b.path("/root/auto.log").read_text()
    assert "backend auto -> cpu-q (NPU at /dev/rknpu but no rknn_dir configured; onnxruntime " in logged, logged[-3000:]
    assert health["backend_reason"] in logged


def test_a_read_only_kv_dir_starts_degraded(board):
    """The kv dir made read-only by the unit (a drop-in's ReadOnlyPaths=, a real read-only bind
    mount): the service starts and serves without snapshots, /health says why; no crash loop."""
    b = board
    was_active = ctl(b, "is-active", "edge-llm", check=False) == "active"
    with dropin(b, "readonly", "ReadOnlyPaths=/var/lib/edge-llm/kv\n", after="restart" if was_active else "stop"):
        mark = log_offset(b.path(LOG))
        ctl(b, "restart", "edge-llm")
        assert ctl(b, "is-active", "edge-llm") == "active"
        wait_ready(b.url, timeout=300)
        status, health = http_json("GET", b.url + "/health", timeout=30)
        assert status == 200 and not health["snapshots"]["enabled"], health
        assert any("disk KV unavailable: /var/lib/edge-llm/kv" in d and "Read-only file system" in d
                   for d in health["degraded"]), health
        assert complete(b, {"prompt": "Hello", "max_tokens": 2, "temperature": 0})["choices"]
        assert "[KV-DISK] disk KV unavailable: /var/lib/edge-llm/kv" in read_since(b.path(LOG), mark)


def test_a_start_that_cannot_fit_is_refused_and_not_restarted(board):
    """A start whose estimate exceeds what the service may use refuses with one line and exit 78,
    and systemd leaves it failed (RestartPreventExitStatus=78) instead of looping. The limit here
    is MemAvailable against a context window whose KV cache cannot fit (a drop-in's
    EDGE_LLM_MAX_SEQ), not MemoryMax=: the container's systemd on this cgroup-v1 host did not
    enforce it (a tiny cpu-q service started under MemoryMax=200M), so the cgroup limit is tested
    in a real v1 memory cgroup by tests/test_footprint.py."""
    b = board
    with dropin(b, "memory", "Environment=EDGE_LLM_MAX_SEQ=100000000\n", after="as-before"):
        restarts = int(prop(b, "NRestarts"))
        mark = log_offset(b.path(LOG))
        res = b.run(["systemctl", "restart", "edge-llm"], check=False, timeout=900)
        assert res.returncode != 0
        time.sleep(12)  # > RestartSec=5s: a restart would have begun
        assert ctl(b, "is-active", "edge-llm", check=False) == "failed"
        assert prop(b, "ExecMainStatus") == "78" and int(prop(b, "NRestarts")) == restarts
        since = read_since(b.path(LOG), mark)
        refused = [ln for ln in since.splitlines() if "memory: refusing to start: estimated backend cpu-q" in ln]
        assert refused, since[-3000:]
        assert "max_seq 100000000" in refused[0] and "available (MemAvailable)" in refused[0], refused[0]
        assert "fix: a smaller max_seq" in refused[0] and "loading weights" not in since
        print(f"\nrefused: {refused[0][-300:]}")


@pytest.mark.parametrize("x", ["ext", "partial"])
def test_restore_is_bitwise_on_aarch64(board, x):
    """tests/helpers/engine_session.py with the installed venv, two processes on the board: the
    restored continuation (KV rows, logits, greedy tokens) equals the RAM continuation bitwise."""
    from edge_llm.tokenizer import Tokenizer

    b, work = board, f"/root/bitexact-{x}"
    tok = Tokenizer.from_dir(b.path(MODEL))
    ids = tok.encode(" ".join(f"Fact {i}: box {i} holds {i * 7 % 13} red apples." for i in range(40)))[:200]
    b.write(f"{work}/state.json", json.dumps({"prompt": ids}))
    out = {}
    for mode in ("warm", "restored"):
        b.run([f"{VENV}/python", f"{b.CHECKOUT}/tests/helpers/engine_session.py", "--model", MODEL,
               "--kv-dir", f"{work}/kv", "--mode", mode, "--x", x, "--state", f"{work}/state.json",
               "--out", f"{work}/{mode}.npz"], timeout=900)
        out[mode] = dict(np.load(b.path(f"{work}/{mode}.npz")))
    warm, restored = out["warm"], out["restored"]
    assert str(warm["source"]) == "ram" and str(restored["source"]) == "disk"
    m = int(restored["cached"])
    assert m == int(warm["cached"]) >= 16 and int(restored["prefill_tokens"]) == int(restored["n"]) - m
    for key in ("k", "v", "logits", "last_logits"):
        assert np.array_equal(restored[key].view(np.uint32), warm[key].view(np.uint32)), key
    assert restored["tokens"].tolist() == warm["tokens"].tolist()


def test_restore_is_a_cold_run_on_aarch64(board):
    """tests/test_restore_recompute.py's property with the installed venv (arm64 numpy, NEON
    kernels): a snapshot of m unaligned rows restored in a new process + the tail is bitwise a
    cold prefill of the whole prompt in a third."""
    from edge_llm.tokenizer import Tokenizer

    b, work = board, "/root/restore-cold"
    tok = Tokenizer.from_dir(b.path(MODEL))
    ids = tok.encode(" ".join(f"Line {i}: crate {i * 11 % 97} holds {i * 7 % 13} pears." for i in range(40)))[:150]
    b.write(f"{work}/prompt.json", json.dumps({"prompt": ids}))

    def run(mode: str, m: int = 0) -> dict | None:
        out = f"{work}/{mode}{m}.npz"
        b.run([f"{VENV}/python", f"{b.CHECKOUT}/tests/helpers/engine_session.py", "--model", MODEL, "--mode", mode,
               "--x", "whole", "--state", f"{work}/prompt.json", "--chunk", "32", "--m", str(m),
               "--kv-dir", f"{work}/kv{m}", "--out", out, "--steps", "4"], timeout=900)
        return None if mode == "save" else dict(np.load(b.path(out)))

    cold = run("oneshot")
    for m in (45, 100):
        run("save", m)
        got = run("restored", m)
        assert str(got["source"]) == "disk" and int(got["disk"]) == m // 32 * 32 and int(got["align"]) == m % 32
        assert np.array_equal(got["logits"].view(np.uint32), cold["logits"].view(np.uint32)), m
        assert got["tokens"].tolist() == cold["tokens"].tolist(), m


def test_npu_matmul_engine_on_aarch64(board, tmp_path):
    """engine.NpuInt8Matmul in the installed venv (arm64 Python and numpy) over the fake
    librknnrt.so built with the aarch64 cross compiler (tests/fake_librknnrt: it stands in for
    Rockchip's closed library, which cannot exist without an NPU): results bitwise the host
    emulation's on the board, and Qwen3-VL-2B's int8 decoder and the vision tower's 0.85 GB in IOMMU
    domain 0 (tests/helpers/npu_matmul_check.py; small shapes: qemu is slow)."""
    from fake_librknnrt.build import build_fake

    so = build_fake(tmp_path, "aarch64")
    board.copy_in(so.parent, "/root/fake-rknnrt")
    res = board.run([f"{VENV}/python", f"{board.CHECKOUT}/tests/helpers/npu_matmul_check.py",
                     "--lib", "/root/fake-rknnrt/librknnrt.so"], check=False, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    bits, dom = doc["bitwise"], doc["domains"]
    assert bits["checked"] == 8 and bits["mismatches"] == [] and bits["live_after"] == [0, 0], bits
    assert bits["parts"]["w64x224"] == [[0, 0, 64, 0, 96], [1, 0, 64, 96, 160], [2, 0, 64, 160, 224]], bits
    assert bits["parts"]["w128x128"] == [[0, 0, 96, 0, 64], [1, 0, 96, 64, 128], [2, 96, 128, 0, 128]], bits
    assert bits["parts"]["w192x64"] == [[0, 0, 64, 0, 64], [1, 64, 128, 0, 64], [2, 128, 192, 0, 64]], bits
    assert bits["masks_domains"] == [[1, 0], [2, 0], [4, 0]], bits
    assert dom["int8_one_domain"] is None, dom
    assert dom["fp16_one_domain"].startswith("rknn_create_mem returned NULL") and dom["live_after"] == [0, 0], dom


@pytest.mark.timeout(2400)
def test_auto_serves_the_default_model_on_the_npu_matmul_path(board, tmp_path, edge_home, default_model_dir,
                                                              default_mm):
    """docs/npu.md "Backend choice" on an arm64 board: `--backend auto` with an RKNPU node and an
    `edge-llm convert npu-mm` rknn_dir serves the default model (real weights, converted on this
    host and copied in, as docs/npu.md says) on the matmul path: w8a8 through librknnrt's matmul
    API, here the fake built for aarch64 (tests/fake_librknnrt stands in for Rockchip's closed
    library and an empty /dev/rknpu for the driver: neither can exist without an NPU). Its greedy
    answer is the answer of the same directory in the exact host emulation on x86 (the int8
    products are exact; the CPU side is another ISA's float32, so the text is compared, not bits).
    The conversion's defaults (GPTQ): auto takes an npu-mm directory only with a passing accuracy
    record, and round-to-nearest's fails it (KL 0.0061, docs/npu.md "Accuracy record")."""
    from edge_llm.bench.accuracy import FACT
    from fake_librknnrt.build import build_fake

    b = board
    chat = {"model": "default", "messages": [{"role": "user", "content": FACT}], "temperature": 0, "max_tokens": 12}
    with ServerProc(edge_home, tmp_path, "--model", "default", "--backend", "rknn", "--rknn-dir", str(default_mm),
                    "--rknn-runner", "host", "--no-disk-kv").start() as srv:
        status, ref = http_json("POST", srv.url + "/v1/chat/completions", chat, timeout=300)
    assert status == 200, ref
    answer = ref["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer

    so = build_fake(tmp_path / "fake", "aarch64")
    b.copy_in(so.parent, "/root/fake-rknnrt")
    model = f"/root/{default_model_dir.name}"
    b.copy_in(default_model_dir, model)
    b.copy_in(default_mm, "/root/default-mm")
    port = free_port()
    serve = [f"{VENV}/edge-llm", "serve", "--model", model, "--backend", "auto",
             "--rknn-dir", "/root/default-mm", "--port", str(port), "--disk-kv", "off", "--log-file", "off"]
    b.run(["touch", "/dev/rknpu"])
    pid = b.run(f"(EDGE_LLM_LIBRKNNRT=/root/fake-rknnrt/librknnrt.so {shlex.join(serve)}) > /root/mm.log 2>&1 "
                "& echo $!").stdout.strip()
    try:
        waited = wait_ready(f"http://127.0.0.1:{port}", timeout=900)
        status, health = http_json("GET", f"http://127.0.0.1:{port}/health", timeout=30)
        assert status == 200 and health["backend"] == "rknn", health
        # the start-up self-test ran over the aarch64 fake and accepted the path (docs/npu.md, "The start-up self-test")
        assert health["npu_selftest"]["summary"].startswith("passed, driver 0.9.8: no rknn_mem_sync"), health
        status, got = http_json("POST", f"http://127.0.0.1:{port}/v1/chat/completions",
                                {**chat, "model": default_model_dir.name}, timeout=900)
        assert status == 200, got
        print(f"\nnpu-mm on the board: ready in {waited:.0f} s, {got['usage']} in {got['timings']}")
    finally:
        b.run(["kill", pid], check=False)
        b.run(["rm", "-f", "/dev/rknpu"])
    logged = b.path("/root/mm.log").read_text()
    assert ("backend auto -> rknn (NPU at /dev/rknpu and a matching npu-mm manifest.json in /root/default-mm "
            "(w8a8 on the matmul API); accuracy record passes: acceptance answers as F32's") in logged, logged[-3000:]
    ready = rf"runtime ready: model {default_model_dir.name} \(rknn-mm:[0-9a-f]{{16}}:librknnrt-[0-9a-f]+-cores0,1,2:"
    assert re.search(ready, logged), logged[-3000:]
    assert re.search(r"NPU self-test: librknnrt [0-9a-f]{12} \(api 2\.3\.2 \(fake librknnrt\)\), driver 0\.9\.8 "
                     r"\(from rknn_query\); probes ran in", logged), logged[-3000:]
    assert "NPU self-test: largest part: 576x16384 in one context: bitwise the host's" in logged, logged[-3000:]
    assert logged.index("NPU self-test: matmul path accepted") < logged.index("runtime ready"), logged[-3000:]
    assert got["choices"][0]["message"]["content"] == answer, (got, answer)


def test_reboot_starts_the_service_and_restores(board):
    """A power cycle: the enabled service starts at boot (before `is-system-running` returns),
    restores from the snapshots on disk, and the journal still has the previous boot."""
    b = board
    assert REFERENCE, "needs the texts of test_restarts_restore_snapshots_and_keep_logs"
    before = [int(p) for p in START_RE.findall(journal(b, "-b", "0"))]
    mark = log_offset(b.path(LOG))
    b.reboot()
    assert ctl(b, "is-active", "edge-llm") == "active"
    wait_ready(b.url, timeout=300)  # bounds a hang: the emulated board on a busy host is slow
    r = complete(b, GREEDY)
    assert r["timings"]["cache_source"] == "disk" and r["choices"][0]["text"] == REFERENCE["greedy"]
    assert LOADED_RE.search(read_since(b.path(LOG), mark))
    assert complete(b, SAMPLED)["choices"][0]["text"] == REFERENCE["sampled"]
    previous = [int(p) for p in START_RE.findall(journal(b, "-b", "-1"))]
    assert before and previous == before  # `journalctl -u edge-llm -b -1`, as docs/board.md says
    assert len(START_RE.findall(journal(b, "-b", "0"))) == 1


LAB_DOC = REPO / "docs" / "lab-a.md"
LAB_BLOCK_RE = re.compile(r"^```bash (lab|board)\n(.*?)^```", re.S | re.M)


def board_walkthrough() -> list[str]:
    """The lab as a board user runs it: each *board* block replaces the block before it."""
    out: list[tuple[str, str]] = []
    for kind, text in LAB_BLOCK_RE.findall(LAB_DOC.read_text()):
        if kind == "board":
            assert out and out[-1][0] == "lab", "a board block must follow the block it replaces"
            out[-1] = (kind, text)
        else:
            out.append((kind, text))
    return [text for _, text in out]


def test_lab_board_blocks_run_on_the_board(board):
    """docs/lab-a.md's board walkthrough, on a board that already holds other snapshots and log
    lines (the tests above). It runs as root: sudo cannot gain root under qemu-user (binfmt
    without the C flag ignores setuid), so the lab's other way, a user in the service's group,
    is checked for what it promises (reading the log and the snapshots) without sudo."""
    b = board
    b.sh("useradd -m -s /bin/bash student && usermod -aG edge-llm student")  # the lab's instruction
    # the lab's operator lets the group read the snapshots (docs/lab-a.md): new ones are written
    # 0640 in 0750 directories, the ones already there are opened with chmod
    conf = b.path("/etc/edge-llm/edge-llm.toml")
    conf.write_text(conf.read_text().replace("disk_kv_group_read = false", "disk_kv_group_read = true"))
    b.sh("chmod -R g+rX /var/lib/edge-llm/kv")
    denied = b.run(["runuser", "-u", "student", "--", "bash", "-c", "touch /var/lib/edge-llm/kv/x"], check=False)
    assert denied.returncode != 0  # read, never write
    reader = b.run(["runuser", "-u", "student", "--", "bash", "-c",
                    "tail -n 2 /var/log/edge-llm/edge-llm.log && "
                    f"{VENV}/edge-llm kv inspect \"$(ls /var/lib/edge-llm/kv/*/{SNAPSHOT_GLOB} | head -n 1)\" --blocks 1"],
                   check=False)
    assert reader.returncode == 0 and "trailer CRC valid" in reader.stdout, reader.stdout + reader.stderr
    script = f"set -euo pipefail\ncd {b.CHECKOUT}\n" + "\n".join(board_walkthrough())
    res = b.run(["bash", "-c", script], env={"PORT": str(b.port)}, check=False, timeout=1500)
    out = res.stdout
    assert res.returncode == 0, f"{out[-4000:]}\n{res.stderr[-3000:]}"
    assert "S1 prompt" in out and "cache none" in out, out
    saved = SAVED_RE.search(out)
    loaded = LOADED_RE.search(out)
    assert saved and loaded and saved[2] == loaded[2], out  # S2 read the file S1 wrote
    inspected = re.search(rf"({SNAPSHOT_NAME})\s+[\d,]+ bytes", out)  # kv inspect's title line
    assert inspected and inspected[1] == saved[2], out  # step 2 looked at that same file
    assert re.search(r"\[KV-DISK\] index: \d+ checkpoint\(s\)", out)
    n = int(re.search(r"\[PREFILL-TIMING\] n=(\d+)", out)[1])
    m = re.search(r"S2 prompt (\d+) tokens, cached (\d+) from disk \| prefilled (\d+)", out)
    assert m, out
    assert int(m[3]) == n == int(m[1]) - int(m[2]) and int(m[2]) == int(loaded[1])
    assert n < 40  # only the follow-up tail
    assert re.search(r"speed-up \d+\.\dx", out)
    assert "exit pid=" in out  # the last block stopped the service cleanly
    assert ctl(b, "is-active", "edge-llm", check=False) == "inactive"


def test_teardown_leaves_nothing_behind(board):
    """A second board, failing on purpose inside its `with`: no process, mount or directory stays."""
    with pytest.raises(RuntimeError, match="on purpose"):
        with board_container.Board(board.tarball) as other:
            nspawn, where = other.proc.pid, other.dir
            other.run("sleep 600 >/dev/null 2>&1 &")
            raise RuntimeError("on purpose")
    assert not where.exists()
    assert not board_container.mounts_under(where)
    assert not Path(f"/proc/{nspawn}").exists()
    assert not [c for c in board_container.cmdlines() if str(where) in c]
