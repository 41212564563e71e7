"""The systemd unit: `systemd-analyze verify`, the `security` exposure score, and the values the
server's lifecycle depends on (Type=notify, SIGTERM path, stop timeout vs snapshot flush).

`systemd-analyze` runs here without a running systemd: `verify` loads the unit into a private
manager and `security --offline=yes` (systemd >= 252) scores a unit file directly.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
UNIT = REPO / "systemd" / "edge-llm.service"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze missing (`make test-deps` installs Debian's systemd)")
EXPOSURE_MAX = 3.0


def unit_values(text: str) -> dict[str, list[str]]:
    """key -> every value assigned to it (systemd allows repeated keys)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z]+)=(.*)$", line.strip())
        if m:
            out.setdefault(m.group(1), []).append(m.group(2))
    return out


def runnable_copy(tmp_path: Path, text: str) -> Path:
    """The unit with ExecStart pointing at an executable that exists on this machine.

    verify checks that ExecStart's binary exists; /opt/edge-llm/venv is only there on a board.
    """
    exe = shutil.which("true")
    out = tmp_path / "edge-llm.service"
    out.write_text(re.sub(r"^ExecStart=\S+", f"ExecStart={exe}", text, flags=re.M))
    return out


def exposure(unit_file: Path) -> float:
    res = subprocess.run([ANALYZE, "security", "--offline=yes", "--no-pager", str(unit_file)],
                         capture_output=True, text=True, timeout=120)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", res.stdout)
    assert m, f"no exposure line in systemd-analyze output:\n{res.stdout}\n{res.stderr}"
    return float(m.group(1))


@needs_analyze
def test_verify_clean(tmp_path: Path) -> None:
    res = subprocess.run([ANALYZE, "verify", str(runnable_copy(tmp_path, UNIT.read_text()))],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "edge-llm.service" not in res.stderr, res.stderr  # no warnings about our unit


@needs_analyze
def test_verify_reports_missing_binary(tmp_path: Path) -> None:
    # the unmodified unit points at the board's venv; verify must notice it is absent here
    if Path("/opt/edge-llm/venv/bin/edge-llm").exists():
        pytest.skip("edge-llm is installed on this machine")
    copy = tmp_path / "edge-llm.service"
    copy.write_text(UNIT.read_text())
    res = subprocess.run([ANALYZE, "verify", str(copy)], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "/opt/edge-llm/venv/bin/edge-llm" in res.stderr


@needs_analyze
def test_security_exposure_at_most_3(tmp_path: Path) -> None:
    score = exposure(runnable_copy(tmp_path, UNIT.read_text()))
    assert score <= EXPOSURE_MAX, f"exposure {score} > {EXPOSURE_MAX}"


@needs_analyze
def test_security_score_detects_weak_unit(tmp_path: Path) -> None:
    # the same unit without its [Service] sandbox lines scores far worse: the parser and the
    # threshold separate a hardened unit from a plain one
    text = UNIT.read_text()
    service = text.split("[Service]")[1].split("# ---- device access")[0]
    weak = "[Unit]\nDescription=x\n[Service]\n" + service + "\n[Install]\nWantedBy=multi-user.target\n"
    assert exposure(runnable_copy(tmp_path, weak)) > EXPOSURE_MAX


def test_lifecycle_settings() -> None:
    v = unit_values(UNIT.read_text())
    assert v["Type"] == ["notify"] and v["NotifyAccess"] == ["main"]
    assert v["ExecStart"] == ["/opt/edge-llm/venv/bin/edge-llm serve --config /etc/edge-llm/edge-llm.toml"]
    assert v["User"] == ["edge-llm"]
    for key in ("StateDirectory", "LogsDirectory", "ConfigurationDirectory"):
        assert v[key] == ["edge-llm"]
    assert v["Restart"] == ["on-failure"] and "RestartSec" in v
    # systemd counts manual starts too: the lab's restarts must fit (tests/test_board_emulated.py
    # makes 6 in a few minutes), a crash loop must not
    assert int(v["StartLimitIntervalSec"][0]) >= 300 and 8 <= int(v["StartLimitBurst"][0]) <= 20
    assert v["KillMode"] == ["mixed"] and v["KillSignal"] == ["SIGTERM"]
    assert v["DevicePolicy"] == ["closed"]
    assert "/dev/dri/renderD129 rw" in v["DeviceAllow"]
    assert int(v["WatchdogSec"][0]) >= 10
    assert int(v["TimeoutStartSec"][0]) >= 300  # GBs of weights from eMMC + index scan


def test_stop_timeout_covers_grace_and_snapshot_flush() -> None:
    """TimeoutStopSec >= request grace period + writing the largest snapshot at 40 MB/s."""
    from edge_llm.settings import Settings

    s = Settings()
    # Qwen3-VL-2B: 28 layers, 8 KV heads x 128; VLKV size for disk_kv_max_tokens tokens
    n, layers, kv_dim = s.disk_kv_max_tokens, 28, 8 * 128
    blocks = -(-n // s.kv_bs)
    size = 64 + 4 * n + 2 * layers * n * kv_dim * 4 + 8 * layers * blocks
    assert size > 1.87e9
    flush_s = size / 40e6  # worst-case eMMC sequential write
    stop = int(unit_values(UNIT.read_text())["TimeoutStopSec"][0])
    from edge_llm.cli.serve import (
        RESPONSE_DRAIN_S,  # the cancelled request's answer, after the grace
    )

    assert stop >= s.grace_seconds + RESPONSE_DRAIN_S + flush_s, (stop, s.grace_seconds, flush_s)


def test_relaxed_settings_are_explained() -> None:
    lines = UNIT.read_text().splitlines()
    relaxed = ("PrivateDevices=no", "PrivateUsers=no", "ProcSubset=all")
    for setting in relaxed:
        i = lines.index(setting)
        block = []
        for prev in reversed(lines[:i]):  # the comment block right above the setting
            if not prev.startswith("#"):
                break
            block.append(prev)
        assert any("Relaxed" in c for c in block), f"{setting} has no 'Relaxed:' comment"


def test_journald_dropin_and_logrotate() -> None:
    j = unit_values((REPO / "board" / "journald-edge-llm.conf").read_text())
    assert j["Storage"] == ["persistent"]
    assert "SystemMaxUse" in j and "SystemKeepFree" in j and "MaxRetentionSec" in j
    rot = (REPO / "board" / "logrotate-edge-llm").read_text()
    assert "copytruncate" not in [w.strip() for w in rot.splitlines()]  # server reopens on SIGHUP
    assert re.search(r"systemctl kill --kill-who=main --signal=HUP edge-llm", rot)
