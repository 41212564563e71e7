"""The `bench` group and what its commands share: results folders, progress, int lists."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

console = Console()
# every benchmark writes a dated results folder under this parent
out_option = click.option("--out", default="benchmarks/results", show_default=True,
                          help="Parent folder of the dated results folder.")


def int_list(value: str) -> list[int]:
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not out or min(out) < 1:
        raise click.BadParameter("need at least one positive integer")
    return out


def spinner() -> Progress:
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                    transient=False)


def show_results(res_dir: Path, md: str) -> None:
    click.echo(md)  # the Markdown source: its tables stay readable in any terminal width
    click.echo(f"results: {res_dir}")


def save_results(res_dir: Path, stem: str, res: dict, md: str) -> None:
    """`<stem>.json` + `<stem>.md` in the results folder, then the Markdown on stdout."""
    (res_dir / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n")
    (res_dir / f"{stem}.md").write_text(md)
    show_results(res_dir, md)


@click.group("bench")
def bench() -> None:
    """Benchmarks: snapshot save/restore vs raw disk, restart recovery, prefill/decode compute."""


