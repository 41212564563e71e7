"""One booted emulated board: systemd as PID 1 in systemd-nspawn, commands through nsenter.

- boot: the rootfs tarball is unpacked into a fresh temporary directory and booted with
  `systemd-nspawn -q --register=no --keep-unit -D ROOT -b` under `timeout -k` (the container
  shares the host network, so the service's port is reachable from here). Commands run inside
  through `nsenter` into the container's PID 1 namespaces (machinectl needs --register=yes,
  which fails without a system bus on the host).
- emulation-only adjustments live in files this harness writes into the rootfs, never in the
  shipped unit: `QEMU_CPU=cortex-a76` for PID 1, every unit (a system.conf.d drop-in) and every
  command run inside, the host's CA bundle (this sandbox intercepts TLS), a pip.conf pointing at
  the wheelhouse.
- teardown: `systemctl poweroff`, then nspawn's immediate termination, then SIGKILL; the last
  process of the board's pid namespace is gone before the directory is removed; a run that was
  killed outright leaves a directory that the next run removes (its owner pid is recorded).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from board_image import CONSTRAINTS_FILE, EMULATION_CONSTRAINTS, QEMU_CPU, REPO, WHEELHOUSE, log, wheelhouse_dir

INNER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DIR_PREFIX = "edge-llm-board-"


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


def mounts_under(path: Path) -> list[str]:
    out = []
    prefix = str(path).rstrip("/") + "/"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].replace("\\040", " ")
        if mp == str(path) or mp.startswith(prefix):
            out.append(mp)
    return out


def _remove_tree(path: Path) -> None:
    mounts = mounts_under(path)
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
        if owner and _pid_alive(owner) or any(str(d) in c for c in cmdlines()):
            continue  # its test run is alive, or its nspawn is still stopping (timeout -k)
        log(f"removing the leftover board directory {d} (owner pid {owner} is gone)")
        _remove_tree(d)


def cmdlines() -> list[str]:
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
        # and keeps to the emulation-only pins (board_image.EMULATION_CONSTRAINTS)
        self.write(CONSTRAINTS_FILE, "".join(c + "\n" for c in EMULATION_CONSTRAINTS))
        self.write("/etc/pip.conf", f"# board_emu.py: aarch64 wheels prefetched on the host\n"
                   f"[global]\nfind-links = {WHEELHOUSE}\nconstraint = {CONSTRAINTS_FILE}\n")
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
        t0 = deadline = time.monotonic()
        deadline += timeout_s
        while (left := self._members()):
            if time.monotonic() > deadline:
                for pid in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
            time.sleep(0.2)
        if time.monotonic() - t0 > 1:
            log(f"the board's last processes ended {time.monotonic() - t0:.1f} s after nspawn")
        self.pidns = ""

    def destroy(self) -> None:
        try:
            self.shutdown()
        finally:
            if self.dir is not None:
                t0 = time.monotonic()
                for _ in range(3):
                    _remove_tree(self.dir)
                    if not self.dir.exists():
                        break
                    time.sleep(1)
                else:
                    log(f"could not remove {self.dir}")
                log(f"removed the board's tree in {time.monotonic() - t0:.1f} s")
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
