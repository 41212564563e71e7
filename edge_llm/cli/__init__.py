"""`edge-llm` command line. Each command group lives in its own module of this package."""

from __future__ import annotations

import click

from edge_llm import __version__
from edge_llm.cli import bench, convert, doctor, generate, kv, kv_transfer, model, serve  # noqa: F401 (kv_transfer: kv export/import)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="edge-llm")
def cli() -> None:
    """edge-llm: LLM runtime for RK3588 boards with bit-exact disk KV snapshots."""


cli.add_command(generate.generate)
cli.add_command(model.model)
cli.add_command(kv.kv)
cli.add_command(serve.serve)
cli.add_command(bench.bench)
cli.add_command(doctor.doctor)
cli.add_command(convert.convert)


def main() -> None:
    cli(prog_name="edge-llm")
