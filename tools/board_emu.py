#!/usr/bin/env python3
"""An emulated RK3588 board: arm64 Debian bookworm with systemd as PID 1, under qemu-user.

    tools/board_emu.py rootfs            # build (or find) the cached rootfs tarball, print its path
    tools/board_emu.py shell             # boot, install edge-llm as docs/board.md says, open a shell
    tools/board_emu.py run -- CMD...     # boot, install, run CMD inside, shut down

What it does (the tests in tests/test_board_emulated.py drive the same class):
- rootfs: `mmdebstrap --arch=arm64 --variant=minbase` of bookworm with the packages of a plain
  board image (python3-venv, systemd, dbus, sudo, curl, logrotate), from the Debian mirrors this
  host's apt is configured with (read at run time, never stored). Packed as a zstd tarball in
  `$XDG_CACHE_HOME/edge-llm-board/` (or `~/.cache/...`), keyed by suite + package list, so only
  the first run pays the minutes. The board's aarch64 wheels are downloaded natively on the host
  into a wheelhouse beside it, which the board's pip reads first (the emulated pip is slow).
- boot: the tarball is unpacked into a fresh temporary directory and booted with
  `systemd-nspawn -q --register=no --keep-unit -D ROOT -b` under `timeout -k` (the container
  shares the host network, so the service's port is reachable from here). Commands run inside
  through `nsenter` into the container's PID 1 namespaces (machinectl needs --register=yes,
  which fails without a system bus on the host).
- emulation-only adjustments live in files this harness writes into the rootfs, never in the
  shipped unit: `QEMU_CPU=cortex-a76` for PID 1, every unit (a system.conf.d drop-in) and every
  command run inside, and the host's CA bundle (this sandbox intercepts TLS).
- teardown: poweroff, then SIGKILL after a timeout, then the directory is removed; a run that
  was killed outright leaves a directory that the next run removes (its owner pid is recorded).

Standard library (and pip) only: it runs with the host's python3 before any venv exists.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import glob
import hashlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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
INNER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DIR_PREFIX = "edge-llm-board-"


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


def wheelhouse_dir() -> Path:
    return cache_dir() / f"wheels-aarch64-cp{BOARD_PYTHON.replace('.', '')}"


def board_requirements(repo: Path = REPO) -> list[str]:
    """What `pip install '<checkout>[board]'` pulls in on the board: the project's dependencies and
    `board` extra (markers evaluated for aarch64 + the board's Python) and its build requirements."""
    import tomllib

    from pip._vendor.packaging.requirements import Requirement

    proj = tomllib.loads((repo / "pyproject.toml").read_text())
    env = {"platform_machine": "aarch64", "sys_platform": "linux", "platform_system": "Linux",
           "os_name": "posix", "python_version": BOARD_PYTHON, "python_full_version": BOARD_PYTHON + ".2",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    out = []
    for line in [*proj["project"]["dependencies"], *proj["project"]["optional-dependencies"]["board"]]:
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
           *(f"--platform={p}" for p in platforms), "-d", str(dest), *board_requirements()]
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


# ---- a booted board ----------------------------------------------------------------------------
def _die_with_parent() -> None:
    """preexec: if the test process dies (even by SIGKILL), `timeout` gets SIGTERM and stops
    the container, instead of a board running on for its whole time limit."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mounts_under(path: Path) -> list[str]:
    out = []
    prefix = str(path).rstrip("/") + "/"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].replace("\\040", " ")
        if mp == str(path) or mp.startswith(prefix):
            out.append(mp)
    return out


def _remove_tree(path: Path) -> None:
    mounts = _mounts_under(path)
    for mp in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], capture_output=True)
    shutil.rmtree(path, ignore_errors=True)


def sweep_stale(base: Path) -> None:
    """Remove board directories whose owner process is gone (a run killed outright)."""
    for d in base.glob(DIR_PREFIX + "*"):
        try:
            owner = int((d / "owner.pid").read_text())
        except (OSError, ValueError):
            owner = 0
        if owner and _pid_alive(owner) or any(str(d) in c for c in _cmdlines()):
            continue  # its test run is alive, or its nspawn is still stopping (timeout -k)
        log(f"removing the leftover board directory {d} (owner pid {owner} is gone)")
        _remove_tree(d)


def _cmdlines() -> list[str]:
    out = []
    for p in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            out.append(p.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
    return out


def checkout_files(repo: Path = REPO) -> list[str]:
    """The checkout as `git clone` would give it, plus uncommitted and new (not ignored) files."""
    res = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "-co", "--exclude-standard"],
                         capture_output=True, check=True)
    return [f for f in res.stdout.decode().split("\0") if f and (repo / f).is_file()]


class Board:
    """One booted emulated board; a context manager that always shuts it down and deletes it.

    Inside, the checkout is at /root/edge-llm (where `git clone` in docs/board.md puts it);
    `run()` executes a command in the board's namespaces as root, with QEMU_CPU set."""

    CHECKOUT = "/root/edge-llm"

    def __init__(self, tarball: Path, lifetime_s: int = 3600, base: Path | None = None):
        self.tarball = tarball
        self.lifetime_s = lifetime_s
        self.base = base or Path(tempfile.gettempdir())
        self.dir: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.init_pid: int | None = None
        self.pidns = ""  # the board's pid namespace (readlink of /proc/PID/ns/pid)

    @property
    def root(self) -> Path:
        assert self.dir is not None
        return self.dir / "root"

    @property
    def console_log(self) -> Path:
        assert self.dir is not None
        return self.dir / "console.log"

    def path(self, inner: str) -> Path:
        """Host path of a file inside the board (readable while it runs)."""
        return self.root / inner.lstrip("/")

    # ---- setup ------------------------------------------------------------------------
    def __enter__(self) -> "Board":
        try:
            self.create()
            self.boot()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def create(self) -> None:
        sweep_stale(self.base)
        self.dir = Path(tempfile.mkdtemp(prefix=DIR_PREFIX, dir=self.base))
        (self.dir / "owner.pid").write_text(str(os.getpid()))
        self.root.mkdir()
        t0 = time.monotonic()
        subprocess.run(["tar", "--zstd", "-xpf", str(self.tarball), "-C", str(self.root), "--numeric-owner"],
                       check=True, timeout=600)
        log(f"unpacked the rootfs in {time.monotonic() - t0:.1f} s")
        self._emulation_files()
        dest = self.path(self.CHECKOUT)
        for rel in checkout_files():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel, follow_symlinks=False)

    def _emulation_files(self) -> None:
        """What this harness adds to a stock rootfs; none of it is part of the product."""
        cafile = os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt"
        if Path(cafile).is_file():  # this sandbox intercepts TLS: trust what the host trusts
            shutil.copyfile(cafile, self.path("/etc/ssl/certs/ca-certificates.crt"))
        self.write("/etc/machine-id", hashlib.md5(os.urandom(16)).hexdigest() + "\n")
        self.write("/etc/hostname", "edge-llm-board\n")
        self.write("/etc/systemd/system.conf.d/50-board-emu.conf",
                   "# board_emu.py: every unit runs under qemu-user; cortex-a76 = RK3588's big cores\n"
                   f"[Manager]\nDefaultEnvironment=QEMU_CPU={QEMU_CPU}\n")
        # every pip on the board (sudo resets the environment) looks in the wheelhouse first
        self.write("/etc/pip.conf", f"# board_emu.py: aarch64 wheels prefetched on the host\n"
                   f"[global]\nfind-links = {WHEELHOUSE}\n")
        wheelhouse_dir().mkdir(parents=True, exist_ok=True)

    def write(self, inner: str, text: str, mode: int = 0o644) -> None:
        p = self.path(inner)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        p.chmod(mode)

    def copy_in(self, src: Path, inner: str) -> None:
        dest = self.path(inner)
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(src, dest)

    # ---- boot / shutdown ------------------------------------------------------------------
    def boot(self, timeout_s: float = 300) -> None:
        cmd = ["timeout", "-k", "20", str(self.lifetime_s),
               "systemd-nspawn", "-q", "--register=no", "--keep-unit", "-D", str(self.root), "-b",
               "--console=read-only", f"--setenv=QEMU_CPU={QEMU_CPU}",
               f"--bind-ro={wheelhouse_dir()}:{WHEELHOUSE}"]
        t0 = time.monotonic()
        with open(self.console_log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        deadline = t0 + timeout_s
        while self.init_pid is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"systemd-nspawn exited with {self.proc.returncode}:\n{self.console()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no container init after {timeout_s} s:\n{self.console()}")
            self.init_pid = self._find_init()
            time.sleep(0.2)
        self.pidns = os.readlink(f"/proc/{self.init_pid}/ns/pid")
        # systemd answers once it is up; "degraded" is fine (units nspawn cannot run, see docs)
        left = max(10.0, deadline - time.monotonic())
        while True:
            r = self.run(["systemctl", "is-system-running", "--wait"], check=False, timeout=left)
            state = r.stdout.strip()
            if state in ("running", "degraded"):
                break
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise TimeoutError(f"board did not boot (state {state!r}):\n{self.console()}")
            time.sleep(1)
        self.boot_s = time.monotonic() - t0
        log(f"booted in {self.boot_s:.1f} s (system state: {state})")

    def _find_init(self) -> int | None:
        """Host pid of the container's PID 1: a descendant of our nspawn whose innermost pid is 1."""
        assert self.proc is not None
        ours = {self.proc.pid}
        for _ in range(3):  # timeout -> nspawn -> (outer child ->) init
            for st in Path("/proc").glob("[0-9]*/status"):
                with contextlib.suppress(OSError):
                    text = st.read_text()
                    ppid = int(re.search(r"^PPid:\s+(\d+)", text, re.M).group(1))
                    if ppid not in ours:
                        continue
                    pid = int(st.parent.name)
                    ours.add(pid)
                    nspid = re.search(r"^NSpid:\s+(.*)$", text, re.M).group(1).split()
                    if len(nspid) > 1 and nspid[-1] == "1":
                        return pid
        return None

    def console(self, tail: int = 4000) -> str:
        try:
            return self.console_log.read_bytes()[-tail:].decode(errors="replace")
        except OSError:
            return ""

    def shutdown(self, timeout_s: float = 120) -> int | None:
        """`systemctl poweroff` inside, then nspawn's immediate termination, then SIGKILL.

        Not SIGTERM first: nspawn forwards it as SIGRTMIN+3 (halt), and qemu-user remaps
        real-time signals, so the board's systemd receives another one and enters rescue mode."""
        if self.proc is None:
            return None
        t0 = time.monotonic()
        if self.proc.poll() is None and self.init_pid is not None:
            try:  # straight to the target: no logind, no inhibitors
                r = self.run(["systemctl", "start", "--no-block", "--job-mode=replace-irreversibly",
                              "poweroff.target"], check=False, timeout=60)
                if r.returncode:
                    log(f"poweroff request failed ({r.returncode}): {r.stderr.strip()}")
            except (subprocess.SubprocessError, OSError) as e:
                log(f"poweroff request failed: {e}")
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
            log(f"powered off in {time.monotonic() - t0:.1f} s" if self.proc.poll() is not None
                else f"no poweroff after {time.monotonic() - t0:.0f} s:\n{self.console(1500)}")
        for sig in (signal.SIGTERM, signal.SIGTERM):  # nspawn: a second SIGTERM terminates at once
            if self.proc.poll() is None:
                log(f"board still running: sending {sig.name} to systemd-nspawn")
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(sig)  # timeout forwards it to nspawn
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(15)
        if self.proc.poll() is None:
            log("board did not stop: killing it")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.init_pid = None
        self._reap_namespace()
        return self.proc.returncode

    def reboot(self, timeout_s: float = 300) -> None:
        """Power off and boot the same tree again (the journal, snapshots and logs stay)."""
        self.shutdown()
        self.boot(timeout_s)

    def _members(self) -> list[int]:
        """Host pids still in the board's pid namespace (nsenter'd commands included)."""
        out = []
        for ns in Path("/proc").glob("[0-9]*/ns/pid"):
            with contextlib.suppress(OSError):
                if os.readlink(ns) == self.pidns:
                    out.append(int(ns.parent.parent.name))
        return out

    def _reap_namespace(self, timeout_s: float = 30) -> None:
        """Wait until the last process of the board is gone (SIGKILL after `timeout_s`), so no
        late writer (journald's final flush) recreates files while the tree is removed."""
        if not self.pidns:
            return
        deadline = time.monotonic() + timeout_s
        while (left := self._members()):
            if time.monotonic() > deadline:
                for pid in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
            time.sleep(0.2)
        self.pidns = ""

    def destroy(self) -> None:
        try:
            self.shutdown()
        finally:
            if self.dir is not None:
                for _ in range(3):
                    _remove_tree(self.dir)
                    if not self.dir.exists():
                        break
                    time.sleep(1)
                else:
                    log(f"could not remove {self.dir}")
                self.dir = None

    # ---- commands inside ------------------------------------------------------------------
    def run(self, cmd: list[str] | str, check: bool = True, timeout: float = 600, input: str | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run `cmd` (argv list, or a bash script string) as root inside the board."""
        argv = ["bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        full = self.inside(argv, env)
        res = subprocess.run(full, capture_output=True, text=True, timeout=timeout, input=input,
                             stdin=None if input is not None else subprocess.DEVNULL)
        if check and res.returncode != 0:
            raise subprocess.CalledProcessError(res.returncode, argv, res.stdout, res.stderr)
        return res

    def inside(self, argv: list[str], env: dict[str, str] | None = None) -> list[str]:
        """Host argv that runs `argv` in the board's namespaces and root, with a clean environment."""
        if self.init_pid is None:
            raise RuntimeError("the board is not running")
        inner_env = {"PATH": INNER_PATH, "HOME": "/root", "USER": "root", "LANG": "C.UTF-8",
                     "QEMU_CPU": QEMU_CPU, "TERM": "dumb", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0",
                     **(env or {})}
        return ["nsenter", f"--target={self.init_pid}", "--mount", "--uts", "--ipc", "--net", "--pid",
                "--root", "--wd", "env", "-i", "--chdir=/root", *(f"{k}={v}" for k, v in inner_env.items()),
                *argv]

    def sh(self, script: str, **kw) -> subprocess.CompletedProcess:
        return self.run("set -euo pipefail\n" + script, **kw)


# ---- the product, installed as docs/board.md says ---------------------------------------------
BOARD_DOC = REPO / "docs" / "board.md"
DOC_MODEL = "Qwen3-VL-2B-Instruct"  # the model name the install block uses


def install_block() -> list[str]:
    """The command lines of the first ```sh block of docs/board.md's "Install" section."""
    text = BOARD_DOC.read_text()
    section = text[text.index("## 1. Install"):]
    block = re.search(r"^```sh\n(.*?)^```", section, re.S | re.M)
    if block is None:
        raise RuntimeError("docs/board.md: no ```sh block in section 1")
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def install_script(model_name: str, checkout: str = Board.CHECKOUT) -> str:
    """docs/board.md's install commands for a model copied to ~/<model_name> of root.

    Two lines are replaced with what they achieve here: the board image already has the
    packages of the apt-get line (checked), and the checkout is copied to `checkout` instead
    of cloned. Every other line runs verbatim, with the model's name substituted."""
    out = ["set -euo pipefail", "set -x"]
    for line in install_block():
        if line.startswith("sudo apt-get install"):
            wanted = set(line.split()[4:]) - {"git"}
            missing = wanted - set(PACKAGES)
            if missing:
                raise RuntimeError(f"docs/board.md installs {missing}: add them to PACKAGES")
            continue
        if line.startswith("git clone"):
            if not line.endswith("&& cd edge-llm"):
                raise RuntimeError(f"docs/board.md: unexpected clone line {line!r}")
            out.append(f"cd {checkout}")
            continue
        out.append(line.replace(DOC_MODEL, model_name))
    return "\n".join(out) + "\n"


def make_tiny_model(dest: Path, edge_llm: str | None = None) -> Path:
    """`edge-llm model synth --preset tiny DEST` with the host's edge-llm (fast, native)."""
    exe = edge_llm or shutil.which("edge-llm") or str(REPO / ".venv" / "bin" / "edge-llm")
    subprocess.run([exe, "model", "synth", "--preset", "tiny", str(dest)], check=True, timeout=600,
                   stdout=subprocess.DEVNULL)
    return dest


def install_product(board: Board, model_dir: Path, port: int, timeout: float = 3600) -> subprocess.CompletedProcess:
    """Copy the model to root's home and run the documented install; the service ends up running."""
    name = model_dir.name
    board.copy_in(model_dir, f"/root/{name}")
    # a board owner's port override (documented in docs/board.md): keeps clear of 8080 here
    board.write("/etc/default/edge-llm", f"EDGE_LLM_PORT={port}\n")
    prefetch_wheels()
    return board.run(install_script(name), timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="board_emu.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rootfs", help="build or find the cached rootfs tarball; print its path")
    r.add_argument("--rebuild", action="store_true")
    for name, what in (("shell", "open a shell inside"), ("run", "run CMD inside, then shut down")):
        p = sub.add_parser(name, help=f"boot, install edge-llm as docs/board.md says, {what}")
        p.add_argument("--model", type=Path, help="HF model dir to install (default: a tiny synthetic one)")
        p.add_argument("--port", type=int, default=8080, help="EDGE_LLM_PORT of the board's service")
        p.add_argument("--no-install", action="store_true", help="boot the plain Debian image only")
        if name == "run":
            p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    args = ap.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        log(f"cannot run: {reason}")
        return 2
    tarball = rootfs_tarball(rebuild=getattr(args, "rebuild", False))
    if args.cmd == "rootfs":
        print(tarball)
        return 0
    with Board(tarball) as board, tempfile.TemporaryDirectory(prefix="edge-llm-model-") as tmp:
        if not args.no_install:
            model = args.model or make_tiny_model(Path(tmp) / "tiny-qwen3vl")
            t0 = time.monotonic()
            res = install_product(board, model.resolve(), args.port, timeout=3600)
            sys.stderr.write(res.stdout[-3000:])
            log(f"installed in {time.monotonic() - t0:.0f} s")
        if args.cmd == "run":
            cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
            res = board.run(cmd or ["true"], check=False, timeout=24 * 3600)
            sys.stdout.write(res.stdout)
            sys.stderr.write(res.stderr)
            return res.returncode
        return subprocess.call(board.inside(["bash", "-l"], {"TERM": os.environ.get("TERM", "dumb")}))

if __name__ == "__main__":
    sys.exit(main())
