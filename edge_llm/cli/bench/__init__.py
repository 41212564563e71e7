"""`edge-llm bench restore|recovery|split|vision|compute|quant|quant-memory|npu|accuracy|fleet|all`: measured
against this machine's own limits or a peer measured in the same run.

Results go to a new dated folder `<out>/<UTC>-<kind>/` (JSON + Markdown, + PNG for recovery).
One module per benchmark family; `all` (what `make bench` runs) lives here.
"""

from __future__ import annotations

import click

from edge_llm.cli.bench import accuracy, board, compute, decode, fleet, npu, quant, recovery, restore, vision  # noqa: F401 (register commands)
from edge_llm.cli.bench.common import bench, console, int_list, out_option
from edge_llm.cli.bench.compute import compute_script, run_compute
from edge_llm.cli.bench.quant import QUANT_LENGTHS, run_quant, run_quant_memory
from edge_llm.cli.bench.recovery import run_recovery
from edge_llm.cli.bench.restore import TTFT, run_restore

__all__ = ["bench"]


@bench.command("all")
@click.option("--synth-layers", type=click.IntRange(1), default=None,
              help="Recovery on the synthetic qwen3-vl-2b geometry with N layers (contexts 2048,8192).")
@click.option("--contexts", default=None, help="Recovery contexts.  [default: 512,2048; 2048,8192 with "
              "--synth-layers]")
@out_option
def all_cmd(synth_layers, contexts, out) -> None:
    """What `make bench` runs: restore (2K, 8K), recovery (default model, small contexts), compute."""
    ctx = int_list(contexts) if contexts else ([2048, 8192] if synth_layers else [512, 2048])
    run_restore(None, [2048, 8192], out=out, ttft=TTFT(["synth"]))
    run_recovery("default", synth_layers, ctx, out=out)
    if compute_script() is not None:
        run_compute(["--layers", str(synth_layers or 4)])
    else:
        console.print("bench compute skipped: tools/bench_compute.py needs a source checkout")
    from edge_llm.bench.quant import peer_python

    if peer_python() is not None:
        run_quant(list(QUANT_LENGTHS), out=out)
        run_quant_memory(out=out)
    else:
        console.print("bench quant skipped: no llama.cpp venv (tools/setup-bench-llamacpp.sh; `make bench` runs it)")


