"""The emulated board's image: host prerequisites, the arm64 Debian rootfs and the aarch64 wheels.

- rootfs: `mmdebstrap --arch=arm64 --variant=minbase` of bookworm with the packages of a plain
  board image (python3-venv, systemd, dbus, sudo, curl, logrotate), from the Debian mirrors this
  host's apt is configured with (read at run time, never stored). Packed as a zstd tarball in
  `$XDG_CACHE_HOME/edge-llm-board/` (or `~/.cache/...`), keyed by suite + package list, so only
  the first run pays the minutes.
- wheels: the board's aarch64 wheels are downloaded natively on the host into a wheelhouse
  beside it, which the board's pip reads first (the emulated pip is slow).

Standard library (and pip) only: it runs with the host's python3 before any venv exists.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # tests/board/ -> the checkout
SUITE = "bookworm"
ARCH = "arm64"
# what a plain Debian board image has: python3-venv for install.sh, systemd + dbus as init,
# sudo/curl for the docs' commands, logrotate for the shipped rule
PACKAGES = ("python3", "python3-venv", "python3-pip", "ca-certificates", "systemd", "systemd-sysv",
            "dbus", "sudo", "curl", "logrotate")
# RK3588's big cores; with qemu's default CPU OpenBLAS picks SVE kernels ~20x slower still
QEMU_CPU = "cortex-a76"
HOST_DEBS = ("qemu-user-static", "binfmt-support", "mmdebstrap", "systemd-container", "zstd")
HOST_TOOLS = ("mmdebstrap", "systemd-nspawn", "nsenter", "zstd", "update-binfmts", "timeout")


def log(msg: str) -> None:
    print(f"board-emu: {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "edge-llm-board"


# ---- host prerequisites ---------------------------------------------------------------------
def unavailable_reason() -> str | None:
    """Why the emulated board cannot run here, or None."""
    if sys.platform != "linux":
        return "needs Linux"
    if os.geteuid() != 0:
        return "needs root (systemd-nspawn, binfmt_misc)"
    missing = [t for t in HOST_TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing host tools {missing} (`make board-deps` as root installs {' '.join(HOST_DEBS)})"
    if not Path("/usr/libexec/qemu-binfmt/aarch64-binfmt-P").exists() and not shutil.which("qemu-aarch64-static"):
        return "qemu-user-static is not installed"
    reg = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    if not reg.exists():
        subprocess.run(["update-binfmts", "--enable", "qemu-aarch64"], capture_output=True)
    if not reg.exists() or not reg.read_text().startswith("enabled"):
        return "binfmt_misc has no enabled qemu-aarch64 entry (`update-binfmts --enable qemu-aarch64`)"
    if "F" not in _binfmt_flags(reg):
        return "the qemu-aarch64 binfmt entry lacks the F (fix-binary) flag needed inside containers"
    return None


def _binfmt_flags(reg: Path) -> str:
    m = re.search(r"^flags: (\S*)", reg.read_text(), re.M)
    return m.group(1) if m else ""


# ---- the rootfs tarball -----------------------------------------------------------------------
def host_sources(suite: str = SUITE) -> list[str]:
    """One-line sources.list entries for `suite` (+ -updates, -security) from this host's apt
    configuration: the Debian mirrors the host already uses, with their signed-by keyring."""
    wanted = {suite, f"{suite}-updates", f"{suite}-security"}
    out: list[str] = []
    for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
        with contextlib.suppress(OSError):
            for line in Path(path).read_text().splitlines():
                m = re.match(r"^\s*deb\s+(\[[^\]]*\]\s+)?(\S+)\s+(\S+)\s+(.*)$", line)
                if m and m.group(3) in wanted and "main" in m.group(4).split():
                    out.append(f"deb {m.group(1) or ''}{m.group(2)} {m.group(3)} main")
    for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
        with contextlib.suppress(OSError):
            for stanza in re.split(r"\n\s*\n", Path(path).read_text()):
                f = _deb822(stanza)
                if "deb" not in f.get("types", "").split() or f.get("enabled", "yes") == "no":
                    continue
                if "main" not in f.get("components", "").split():
                    continue
                opt = f"[signed-by={f['signed-by']}] " if f.get("signed-by", "").startswith("/") else ""
                for uri in f.get("uris", "").split():
                    for s in f.get("suites", "").split():
                        if s in wanted:
                            out.append(f"deb {opt}{uri} {s} main")
    return out


def _deb822(stanza: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    key = None
    for line in stanza.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        if line[0].isspace() and key:
            fields[key] += " " + line.strip()
            continue
        k, _, v = line.partition(":")
        key = k.strip().lower()
        fields[key] = v.strip()
    return fields


def rootfs_key() -> str:
    return hashlib.sha256(f"{SUITE} {ARCH} minbase {' '.join(sorted(PACKAGES))}".encode()).hexdigest()[:12]


def rootfs_tarball(rebuild: bool = False) -> Path:
    """The cached rootfs tarball, built with mmdebstrap if missing (one builder at a time)."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / f"rootfs-{SUITE}-{ARCH}-{rootfs_key()}.tar.zst"
    with open(cache / "rootfs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent run waits for the builder, then reuses
        if tarball.exists() and not rebuild:
            return tarball
        sources = host_sources()
        if not sources:
            raise RuntimeError(f"no Debian {SUITE} 'main' entry in this host's apt sources")
        with tempfile.TemporaryDirectory(prefix="edge-llm-mmdebstrap-") as tmp:
            src = Path(tmp) / "sources.list"
            src.write_text("\n".join(sources) + "\n")
            part = cache / (tarball.name + ".part.tar.zst")
            cmd = ["mmdebstrap", "--mode=root", f"--arch={ARCH}", "--variant=minbase",
                   f"--include={','.join(PACKAGES)}", "--aptopt=Acquire::Retries \"3\"",
                   SUITE, str(part), str(src)]
            log(f"building the {SUITE} {ARCH} rootfs (~7 min, once): {' '.join(cmd[:-3])} ...")
            t0 = time.monotonic()
            subprocess.run(cmd, check=True, timeout=3600)
            os.replace(part, tarball)
            for old in cache.glob(f"rootfs-{SUITE}-{ARCH}-*.tar.zst"):
                if old != tarball:
                    old.unlink()
            log(f"rootfs built in {time.monotonic() - t0:.0f} s: {tarball} "
                f"({tarball.stat().st_size / 2**20:.0f} MiB)")
    return tarball


# ---- aarch64 wheels for the board's pip ----------------------------------------------------------
BOARD_PYTHON = "3.11"  # bookworm's python3
WHEELHOUSE = "/var/cache/edge-llm-wheels"  # where the board sees cache_dir()/wheels-...
# Emulation-only pins (a pip constraints file on the emulated board, never in the product's
# requirements): onnxruntime's aarch64 wheels from 1.25 on die with SIGSEGV at `import
# onnxruntime` under qemu-user (1.24.x import and run there; a real board has no qemu).
EMULATION_CONSTRAINTS = ("onnxruntime<1.25",)
CONSTRAINTS_FILE = "/etc/pip-constraints-board-emu.txt"


def wheelhouse_dir() -> Path:
    return cache_dir() / f"wheels-aarch64-cp{BOARD_PYTHON.replace('.', '')}"


def board_requirements(repo: Path = REPO) -> list[str]:
    """What `pip install '<checkout>[board,quant]'` (board/install.sh) pulls in on the board: the
    project's dependencies and those extras (markers evaluated for aarch64 + the board's Python)
    and its build requirements."""
    import tomllib
    from pip._vendor.packaging.requirements import Requirement

    proj = tomllib.loads((repo / "pyproject.toml").read_text())
    env = {"platform_machine": "aarch64", "sys_platform": "linux", "platform_system": "Linux",
           "os_name": "posix", "python_version": BOARD_PYTHON, "python_full_version": BOARD_PYTHON + ".2",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    out = []
    extras = proj["project"]["optional-dependencies"]
    for line in [*proj["project"]["dependencies"], *extras["board"], *extras["quant"]]:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            req.marker = None
            out.append(str(req))
    return out + list(proj["build-system"]["requires"])


def prefetch_wheels() -> Path:
    """Download the board's aarch64 wheels natively on this host (seconds) into the cache, so the
    emulated pip (slow: every byte it handles goes through qemu) finds them locally. The board's
    pip still resolves against the index; the wheelhouse only supplies files it already has.
    pip's own HTTP cache cannot do this here: this sandbox's proxy strips caching headers."""
    dest = wheelhouse_dir()
    dest.mkdir(parents=True, exist_ok=True)
    platforms = ["manylinux2014_aarch64", *(f"manylinux_2_{v}_aarch64" for v in range(17, 37)), "linux_aarch64"]
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary=:all:",
           "--python-version", BOARD_PYTHON, "--implementation", "cp", "--abi", "cp" + BOARD_PYTHON.replace(".", ""),
           *(f"--platform={p}" for p in platforms), "-d", str(dest), *board_requirements(), *EMULATION_CONSTRAINTS]
    cafile = os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt"
    if Path(cafile).is_file():
        cmd[4:4] = ["--cert", cafile]
    # PyPI only, as the board sees it: not this host's pip configuration or local indexes
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if res.returncode != 0:  # not fatal: the board's pip downloads what it misses
        log(f"wheel prefetch failed (the board will download): {res.stderr.strip()[-800:]}")
        return dest
    keep = set(re.findall(r"(?:Saved|File was already downloaded) (?:\S*/)?([^/\s]+\.whl)", res.stdout))
    for old in dest.glob("*.whl"):
        if keep and old.name not in keep:
            old.unlink()  # an older version nothing asks for any more
    log(f"{len(keep)} aarch64 wheels ready in {time.monotonic() - t0:.0f} s: {dest}")
    return dest
