"""`edge-llm bench board`: one report a board owner sends back (docs/board.md, "The board report")."""

from __future__ import annotations

import os
from pathlib import Path

import click

from edge_llm.cli.bench.common import bench, console, spinner


@bench.command("board")
@click.option("--model", default="default", show_default=True, help="Model directory, or `default`.")
@click.option("--mm-dir", default=None, metavar="DIR",
              help="An `edge-llm convert npu-mm` directory of --model.  [default: one converted for the report, "
                   "round to nearest]")
@click.option("--lib", default=None, metavar="PATH",
              help="The librknnrt.so the NPU sections load.  [default: $EDGE_LLM_LIBRKNNRT, else librknnrt.so when "
                   "this machine has an NPU, else none: the NPU sections are not run]")
@click.option("--store-dir", default=None, metavar="DIR",
              help="Where the disk and restore sections write (removed after).  [default: the snapshot directory "
                   "(disk_kv), else $EDGE_LLM_HOME/bench]")
@click.option("--quick", is_flag=True, help="Small sizes (seconds): checks the report, measures nothing useful.")
@click.option("--out", "out", default=None, metavar="FILE",
              help="The report (Markdown, the JSON at its end).  [default: ./edge-llm-board-<UTC time>.md]")
def board_cmd(model, mm_dir, lib, store_dir, quick, out) -> None:
    """Everything a board owner can send back, in one file: the machine, the matmul path's accuracy,
    the matmul rates and the prediction at them (with cpu-q's decode on the A76 cores), the store
    disk's write and read, snapshot restore at 2K and 8K, decode plain and with drafting. A section
    that fails says why; the others still run. Attach the file to an issue in the project's issue
    tracker (docs/board.md)."""
    from edge_llm.backends.npu.backend import npu_present
    from edge_llm.bench import board as B
    from edge_llm.bench.disk import utc_stamp
    from edge_llm.settings import LIBRKNNRT_ENV, LIBRKNNRT_NAME, Settings, home_dir, resolve

    npu = npu_present()
    lib = lib or os.environ.get(LIBRKNNRT_ENV) or (LIBRKNNRT_NAME if npu else None)
    if lib is not None:
        os.environ[LIBRKNNRT_ENV] = lib  # the runtime's engines load the same library as the micro-benchmark
    if store_dir is None:
        kv = resolve(Settings()).disk_kv
        store_dir = kv if kv is not None else home_dir() / "bench"
    path = Path(out) if out else Path.cwd() / f"edge-llm-board-{utc_stamp()}.md"
    if path.is_dir():
        raise click.ClickException(f"--out {path}: a directory; name the report's file")
    with spinner() as prog:
        task = prog.add_task("board report", total=None)
        res = B.run(model, mm_dir, B.Where(lib, npu), Path(store_dir), B.QUICK if quick else B.FULL,
                    step=lambda msg: prog.update(task, description=msg))
    md = B.markdown(res)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(md)
    failed = [k for k, v in res["sections"].items() if v["status"] != "ok"]
    console.print(res["headline"])
    console.print(f"not run: {', '.join(failed)}" if failed else "every section ran")
    click.echo(f"report: {path}\nAttach it to an issue in the project's issue tracker (docs/board.md).")
