"""board/install.sh and uninstall.sh in --root mode: a staging tree in tmp_path, nothing on the host.

The venv/pip step is skipped (--no-venv) to stay offline and fast; everything else runs for
real: the user goes into <root>/etc/passwd via systemd-sysusers, `systemctl --root` enables
the unit, files get their modes and numeric ownership from the staging tree's databases.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INSTALL = REPO / "board" / "install.sh"
UNINSTALL = REPO / "board" / "uninstall.sh"
pytestmark = pytest.mark.skipif(
    shutil.which("systemd-sysusers") is None or shutil.which("systemctl") is None,
    reason="needs systemd-sysusers and systemctl (`make test-deps` installs Debian's systemd)")

IS_ROOT = os.geteuid() == 0
FILES = {  # path -> mode
    "etc/systemd/system/edge-llm.service": 0o644,
    "etc/systemd/journald.conf.d/edge-llm.conf": 0o644,
    "etc/logrotate.d/edge-llm": 0o644,
    "etc/edge-llm/edge-llm.toml": 0o640,
    "etc/edge-llm/edge-llm.toml.example": 0o640,
    "opt/edge-llm/share/doc/board.md": 0o644,
}
DIRS = {"etc/edge-llm": 0o750, "var/lib/edge-llm": 0o750, "var/lib/edge-llm/kv": 0o700,
        "var/log/edge-llm": 0o750, "opt/edge-llm/models": 0o755}
WANTS = "etc/systemd/system/multi-user.target.wants/edge-llm.service"


def run(script: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=120)
    if ok:
        assert res.returncode == 0, res.stdout + res.stderr
    return res


def tree(root: Path) -> dict[str, tuple]:
    """Every path under root -> (mode, uid, gid, content digest or link target)."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode):
            what = os.readlink(p)
        elif stat.S_ISREG(st.st_mode):
            what = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            what = "dir"
        out[str(p.relative_to(root))] = (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, what)
    return out


def ids(root: Path, db: str) -> dict[str, int]:
    return {f[0]: int(f[2]) for f in (l.split(":") for l in (root / "etc" / db).read_text().splitlines())}


def test_scripts_are_strict_bash() -> None:
    for script in (INSTALL, UNINSTALL):
        text = script.read_text()
        assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
        assert os.access(script, os.X_OK)
        subprocess.run(["bash", "-n", str(script)], check=True)


def test_install_twice_then_uninstall_then_purge(tmp_path: Path) -> None:
    root = tmp_path / "root"
    out = run(INSTALL, "--root", str(root), "--no-venv").stdout
    # host-changing commands are reported, not run
    for cmd in ("systemctl daemon-reload", "systemctl enable edge-llm.service",
                "systemctl restart edge-llm.service"):
        assert f"skip (--root): {cmd}" in out

    users, groups = ids(root, "passwd"), ids(root, "group")
    assert "edge-llm" in users and "edge-llm" in groups
    entry = next(l for l in (root / "etc/passwd").read_text().splitlines() if l.startswith("edge-llm:"))
    assert entry.endswith(":/var/lib/edge-llm:/usr/sbin/nologin")
    uid, gid = users["edge-llm"], groups["edge-llm"]

    for rel, mode in {**FILES, **DIRS}.items():
        st = (root / rel).stat()
        assert stat.S_IMODE(st.st_mode) == mode, (rel, oct(st.st_mode))
    for rel in FILES:
        if not rel.startswith("etc/edge-llm"):
            assert (root / rel).read_bytes() == (REPO / _source(rel)).read_bytes()
    assert os.readlink(root / WANTS) == "/etc/systemd/system/edge-llm.service"
    if IS_ROOT:  # ownership from the staging tree's own passwd/group, not the host's
        assert ((root / "etc/edge-llm/edge-llm.toml").stat().st_uid,
                (root / "etc/edge-llm/edge-llm.toml").stat().st_gid) == (0, gid)
        for rel in ("var/lib/edge-llm", "var/lib/edge-llm/kv", "var/log/edge-llm"):
            assert ((root / rel).stat().st_uid, (root / rel).stat().st_gid) == (uid, gid)
        assert (root / "etc/systemd/system/edge-llm.service").stat().st_uid == 0

    # idempotent: a second run changes nothing
    before = tree(root)
    run(INSTALL, "--root", str(root), "--no-venv")
    assert tree(root) == before

    # a user edit of the config survives a re-install (the example is refreshed)
    conf = root / "etc/edge-llm/edge-llm.toml"
    conf.write_text(conf.read_text().replace("port = 8080", "port = 9000"))
    (root / "etc/edge-llm/edge-llm.toml.example").write_text("stale\n")
    out = run(INSTALL, "--root", str(root), "--no-venv").stdout
    assert "keeping existing /etc/edge-llm/edge-llm.toml" in out
    assert "port = 9000" in conf.read_text()
    assert (root / "etc/edge-llm/edge-llm.toml.example").read_bytes() == (
        REPO / "board/edge-llm.toml.example").read_bytes()

    # uninstall keeps snapshots, logs, config and the user
    snap = root / "var/lib/edge-llm/kv/0123456789abcdef/kv_00000000000000aa.kv"
    snap.parent.mkdir(parents=True)
    snap.write_bytes(b"snapshot")
    for _ in range(2):  # idempotent
        out = run(UNINSTALL, "--root", str(root)).stdout
    for rel in ("etc/systemd/system/edge-llm.service", "etc/systemd/journald.conf.d/edge-llm.conf",
                "etc/logrotate.d/edge-llm", "etc/edge-llm/edge-llm.toml.example", "opt/edge-llm/share"):
        assert not (root / rel).exists(), rel
    assert not (root / WANTS).is_symlink()
    assert snap.read_bytes() == b"snapshot" and "port = 9000" in conf.read_text()
    assert (root / "var/log/edge-llm").is_dir() and "edge-llm" in ids(root, "passwd")

    run(UNINSTALL, "--root", str(root), "--purge")
    for rel in ("var/lib/edge-llm", "var/log/edge-llm", "etc/edge-llm", "opt/edge-llm"):
        assert not (root / rel).exists(), rel
    assert "edge-llm" not in ids(root, "passwd") and "edge-llm" not in ids(root, "group")


def _source(rel: str) -> str:
    return {"etc/systemd/system/edge-llm.service": "systemd/edge-llm.service",
            "etc/systemd/journald.conf.d/edge-llm.conf": "board/journald-edge-llm.conf",
            "etc/logrotate.d/edge-llm": "board/logrotate-edge-llm",
            "opt/edge-llm/share/doc/board.md": "docs/board.md"}[rel]


def test_model_option_writes_config(tmp_path: Path) -> None:
    from edge_llm.settings import read_toml

    root = tmp_path / "root"
    model = root / "opt/edge-llm/models/Qwen3-VL-2B-Instruct"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    run(INSTALL, "--root", str(root), "--no-venv", "--model", "/opt/edge-llm/models/Qwen3-VL-2B-Instruct")
    conf = read_toml(root / "etc/edge-llm/edge-llm.toml")
    assert conf["model"] == "/opt/edge-llm/models/Qwen3-VL-2B-Instruct"

    res = run(INSTALL, "--root", str(tmp_path / "other"), "--no-venv", "--model", "/nope", ok=False)
    assert res.returncode != 0 and "no config.json" in res.stderr


def test_render_group_membership(tmp_path: Path) -> None:
    # the NPU render node is group-owned; the service user joins the group when it exists
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/group").write_text("render:x:992:\n")
    run(INSTALL, "--root", str(root), "--no-venv", "--no-start")
    render = next(l for l in (root / "etc/group").read_text().splitlines() if l.startswith("render:"))
    assert render.split(":")[3].split(",") == ["edge-llm"]


def test_example_config_documents_every_setting() -> None:
    """The example holds exactly the serve settings (parsed by the server's own reader)."""
    from edge_llm.settings import FIELDS, read_toml

    example = REPO / "board" / "edge-llm.toml.example"
    parsed = read_toml(example)
    text = example.read_text()
    for f in FIELDS.values():
        # every key appears (set, or commented out when it has no default value) with a comment
        lines = text.splitlines()
        idx = next((i for i, l in enumerate(lines) if l.lstrip("# ").startswith(f"{f.name} =")), None)
        assert idx is not None, f"{f.name} missing from the example"
        assert lines[idx - 1].startswith("#"), f"{f.name} has no comment"
    assert parsed["disk_kv"] == "/var/lib/edge-llm/kv"
