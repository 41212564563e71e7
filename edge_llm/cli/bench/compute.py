"""`edge-llm bench compute`: prefill/decode vs the rooflines (tools/bench_compute.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click

from edge_llm.cli.bench.common import bench


def compute_script() -> Path | None:
    """tools/bench_compute.py of the source checkout this package runs from, if any."""
    path = Path(__file__).resolve().parents[3] / "tools" / "bench_compute.py"
    return path if path.is_file() else None


@bench.command("compute", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def compute_cmd(args) -> None:
    """Prefill/decode speed vs roofline: runs tools/bench_compute.py ARGS (source checkout only)."""
    run_compute(list(args))


def run_compute(args: list[str]) -> None:
    script = compute_script()
    if script is None:
        raise click.ClickException("bench compute needs a source checkout (tools/bench_compute.py not found)")
    r = subprocess.run([sys.executable, str(script), *args])
    if r.returncode != 0:
        raise click.ClickException(f"{script.name} exited with code {r.returncode}")


