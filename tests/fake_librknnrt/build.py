"""Build the fake librknnrt.so (the C files beside this file) for the host or for the arm64 board.

The fake stands in for Rockchip's closed librknnrt, which cannot exist without an RK3588 NPU
(what it implements and refuses: the comments at the top of fake_rknnrt.c and fake_iommu.c).
Builds are cached by the hash of the sources, the compiler and its flags, in the directory the
caller gives (the tests pass pytest's cache directory), so a test session compiles each target once.
`misbehave` picks a build that fails one start-up self-test probe (MISBEHAVE: the define each
compiles in, fake_misbehave.c says what it does); each is cached in its own directory.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = [HERE / n for n in ("fake_rknnrt.c", "fake_iommu.c", "fake_matmul.c", "fake_misbehave.c")]
HEADERS = [HERE / n for n in ("fake_iommu.h", "fake_matmul.h", "fake_misbehave.h")]
MISBEHAVE = {"stale-cache": "FAKE_STALE_CACHE", "racing": "FAKE_RACING", "wrong-product": "FAKE_WRONG_PRODUCT",
             "old-driver": "FAKE_OLD_DRIVER", "domain-switch": "FAKE_SWITCH_FAILS"}
COMPILERS = {"host": "cc", "aarch64": "aarch64-linux-gnu-gcc"}
FLAGS = ["-O2", "-shared", "-fPIC", "-pthread", "-Wall", "-Werror"]


def compiler(target: str) -> str | None:
    """The compiler for `target` ("host" or "aarch64") if it is installed."""
    return shutil.which(COMPILERS[target])


def build_fake(cache_dir: Path, target: str = "host", misbehave: str | None = None) -> Path:
    """The path of librknnrt.so built from the fake's sources for `target` (compiled once per source);
    `misbehave`: one of MISBEHAVE's builds instead of the library that behaves."""
    cc = compiler(target)
    if cc is None:
        raise FileNotFoundError(f"no {COMPILERS[target]} to build the fake librknnrt for {target}")
    if misbehave is not None and misbehave not in MISBEHAVE:
        raise ValueError(f"misbehave {misbehave!r}: one of {', '.join(MISBEHAVE)}")
    flags = FLAGS + ([f"-D{MISBEHAVE[misbehave]}"] if misbehave else [])
    text = b"".join(f.read_bytes() for f in [*SOURCES, *HEADERS])
    key = hashlib.sha256(text + " ".join([cc, *flags]).encode()).hexdigest()[:16]
    out = cache_dir / f"{target}-{misbehave or 'normal'}-{key}" / "librknnrt.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".librknnrt.so.{os.getpid()}")
        subprocess.run([cc, *flags, "-o", str(tmp), *map(str, SOURCES)], check=True, capture_output=True,
                       text=True, timeout=120)
        tmp.replace(out)
    return out


if __name__ == "__main__":  # python tests/fake_librknnrt/build.py [DIR] [host|aarch64]: prints the path
    import sys

    default = Path(__file__).resolve().parents[2] / ".pytest_cache" / "d" / "fake_librknnrt"  # pytest's own
    where = Path(sys.argv[1]) if len(sys.argv) > 1 else default
    print(build_fake(where, sys.argv[2] if len(sys.argv) > 2 else "host"))
