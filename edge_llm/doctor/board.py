"""The board's checks: the NPU stack (driver, device, runtime, rknn dir), governors, open files,
eMMC wear and the clock. n/a off an RK3588 where they only make sense there."""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata as md
import os
import re
import resource
import stat
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING



if TYPE_CHECKING:
    pass

from edge_llm.backends.npu.backend import librknnrt_version
from edge_llm.backends.npu.matmul.binding import NPU_DRIVER_DEBUGFS, npu_driver_version
from edge_llm.doctor.probe import FAIL, NA, PASS, WARN, Check, Probe, NOFILE_NPU, LIB_DIRS, SERVICE_USER, UNIT_PATH
# JEDEC eMMC 5.0 EXT_CSD DEVICE_LIFE_TIME_EST_TYP_A/B and PRE_EOL_INFO encodings
_LIFE = {i: f"{(i - 1) * 10}-{i * 10}% of rated erase cycles used" for i in range(1, 11)}
_LIFE[0x0B] = "rated erase cycles exceeded"
_EOL = {1: "normal", 2: "warning (80% of reserved blocks used)", 3: "urgent (90% of reserved blocks used)"}


class BoardChecks(Probe):
    """Checks of the board and its NPU (`Doctor` runs them)."""

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
                ver = librknnrt_version(so.read_bytes())
                return Check("librknnrt", PASS if ver else WARN, f"/{d}/librknnrt.so: {ver or 'unknown version'}")
        return Check("librknnrt", FAIL, "librknnrt.so not found in " + ", ".join("/" + d for d in LIB_DIRS),
                     "copy librknnrt.so from rknn-toolkit2 (rknpu2/runtime/Linux/librknn_api/aarch64) "
                     "to /usr/lib and run ldconfig")

    def npu_driver(self) -> Check:
        text = self._read(NPU_DRIVER_DEBUGFS)
        if not text and self.root == Path("/"):
            try:  # debugfs is root-only; the kernel log names the version at probe time
                text = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
            except (OSError, subprocess.SubprocessError):
                text = ""
        ver = npu_driver_version(text)
        if ver:
            return Check("npu-driver", PASS, f"RKNPU driver {ver}")
        return Check("npu-driver", WARN, "RKNPU driver version unknown (no debugfs version, nothing in dmesg)",
                     "run as root; mount -t debugfs none /sys/kernel/debug; check the kernel has rknpu")

    def npu_selftest(self) -> Check:
        """The NPU matmul path's start-up self-test for the configured npu-mm directory: the cached
        answers for this librknnrt and driver, else the probes run now (docs/npu.md, "The start-up
        self-test"). Off an RK3588 only when $EDGE_LLM_LIBRKNNRT names a library (the tests' fake)."""
        from edge_llm.settings import LIBRKNNRT_ENV

        rknn_dir = self.o.rknn_dir
        if self.o.backend not in ("rknn", "auto") or not rknn_dir:
            return Check("npu-selftest", NA, f"backend {self.o.backend}, no rknn_dir")
        from edge_llm.backends.npu.matmul.decoder import is_mm_dir, matmul_shapes
        from edge_llm.backends.npu.matmul import binding, selftest
        from edge_llm.errors import ConfigError

        if not is_mm_dir(rknn_dir):
            return Check("npu-selftest", NA, f"{rknn_dir} is not an `edge-llm convert npu-mm` directory")
        if not self.rk3588 and not os.environ.get(LIBRKNNRT_ENV):
            return Check("npu-selftest", NA, self.not_rk)
        try:
            lib = binding.load_library(binding.library_path())
            report = selftest.run_self_test(lib, selftest.largest_part(matmul_shapes(rknn_dir)))
        except ConfigError as e:
            return Check("npu-selftest", FAIL, str(e), "install librknnrt.so (see the librknnrt check)")
        detail = report.summary() + ": " + "; ".join(line.removeprefix("NPU self-test: ")
                                                     for line in report.lines()[:-1])
        if report.refused:
            return Check("npu-selftest", FAIL, detail, "serve falls back to cpu-q under backend auto; "
                         "docs/board.md, \"The NPU self-test\", says what each refusal needs")
        return Check("npu-selftest", WARN if report.sync or report.serialize else PASS, detail)

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
        if not self.o.rknn_dir and self.o.backend == "auto" and not self.rk3588:
            return Check("rknn-dir", NA, "backend auto on a machine without an RK3588 NPU")
        if not self.o.rknn_dir:
            return Check("rknn-dir", FAIL if self.o.backend == "rknn" else WARN, "no rknn_dir configured",
                         "edge-llm convert rknn MODEL_DIR OUT_DIR on a host, copy OUT_DIR here, set rknn_dir")
        from edge_llm.backends.graph.manifest import Manifest  # lazy: only for NPU setups
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
