#!/usr/bin/env python3
"""An emulated RK3588 board: arm64 Debian bookworm with systemd as PID 1, under qemu-user.

    tests/board/board_emu.py rootfs            # build (or find) the cached rootfs tarball, print its path
    tests/board/board_emu.py shell             # boot, install edge-llm as docs/board.md says, open a shell
    tests/board/board_emu.py run -- CMD...     # boot, install, run CMD inside, shut down

The image (rootfs tarball, aarch64 wheelhouse) is tests/board/board_image.py, the booted board
tests/board/board_container.py; this file installs the product as docs/board.md says. The tests in
tests/test_board_emulated.py drive the same code. Standard library (and pip) only.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from board_container import Board  # noqa: E402
from board_image import (  # noqa: E402
    PACKAGES,
    REPO,
    log,
    prefetch_wheels,
    rootfs_tarball,
    unavailable_reason,
)

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
