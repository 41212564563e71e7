"""Build the fake librknnrt.so (fake_rknnrt.c beside this file) for the host or for the arm64 board.

The fake stands in for Rockchip's closed librknnrt, which cannot exist without an RK3588 NPU
(what it implements and refuses: the comment at the top of fake_rknnrt.c). Builds are cached by
the hash of the source, the compiler and its flags, in the directory the caller gives (the tests
pass pytest's cache directory), so a test session compiles each target once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_rknnrt.c")
COMPILERS = {"host": "cc", "aarch64": "aarch64-linux-gnu-gcc"}
FLAGS = ["-O2", "-shared", "-fPIC", "-pthread", "-Wall", "-Werror"]


def compiler(target: str) -> str | None:
    """The compiler for `target` ("host" or "aarch64") if it is installed."""
    return shutil.which(COMPILERS[target])


def build_fake(cache_dir: Path, target: str = "host") -> Path:
    """The path of librknnrt.so built from fake_rknnrt.c for `target` (compiled once per source)."""
    cc = compiler(target)
    if cc is None:
        raise FileNotFoundError(f"no {COMPILERS[target]} to build the fake librknnrt for {target}")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *FLAGS]).encode()).hexdigest()[:16]
    out = cache_dir / f"{target}-{key}" / "librknnrt.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".librknnrt.so.{os.getpid()}")
        subprocess.run([cc, *FLAGS, "-o", str(tmp), str(SOURCE)], check=True, capture_output=True, text=True,
                       timeout=120)
        tmp.replace(out)
    return out


if __name__ == "__main__":  # python tests/fake_librknnrt/build.py [DIR] [host|aarch64]: prints the path
    import sys

    default = Path(__file__).resolve().parents[2] / ".pytest_cache" / "d" / "fake_librknnrt"  # pytest's own
    where = Path(sys.argv[1]) if len(sys.argv) > 1 else default
    print(build_fake(where, sys.argv[2] if len(sys.argv) > 2 else "host"))
