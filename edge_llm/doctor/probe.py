"""What every `edge-llm doctor` check shares: the statuses, `Check`, the model's sizes, and `Probe`
(the settings and the sysroot the checks read below)."""

from __future__ import annotations

import glob
import logging
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING


from edge_llm.backends.choice import BackendChoice
from edge_llm.footprint import ModelSizes  # noqa: F401  (ModelSizes: the checks' shared record)
from edge_llm.settings import Settings, resolve

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

PASS, WARN, FAIL, NA = "pass", "warn", "fail", "n/a"
SERVICE_USER = "edge-llm"
UNIT_PATH = "etc/systemd/system/edge-llm.service"
LIB_DIRS = ("usr/lib", "usr/lib64", "usr/lib/aarch64-linux-gnu", "usr/local/lib", "lib")
GOOD_FS = ("ext4", "f2fs", "xfs", "btrfs")
NOFILE_NPU = 4096


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # pass | warn | fail | n/a
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


class Probe:
    """The settings the checks judge and the machine they read: every path below `sysroot`
    (default "/"), so tests can fabricate /sys, /proc, /dev and /etc."""

    def __init__(self, settings: Settings, sysroot: str = "/"):
        self.o = resolve(settings)
        self.root = Path(sysroot)
        self.model_dir: Path | None = None  # set by the model check when the model dir is readable
        self._choice: BackendChoice | None = None  # Doctor.choice()
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
