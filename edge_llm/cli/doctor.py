"""`edge-llm doctor`: board readiness checklist (pass / warn / fail / n/a with a fix for each)."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import click

from edge_llm.cli.options import settings_options
from edge_llm.settings import Settings

SERVICE_CONFIG = Path("/etc/edge-llm/edge-llm.toml")
_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "n/a": "dim"}


@click.command("doctor")
@settings_options("doctor", default_config=SERVICE_CONFIG)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--sysroot", default="/", hidden=True, type=click.Path(file_okay=False),
              help="read /sys, /proc, /dev, /etc below this directory (tests)")
def doctor(settings: Settings, as_json: bool, sysroot: str) -> None:
    """Check this machine for running the edge-llm service; exit 1 if any check fails.

    Settings come from the same sources as `edge-llm serve` (flag > EDGE_LLM_* > TOML > default);
    without --config the service's config file is read if it exists.
    """
    from edge_llm.doctor import run_checks

    checks = run_checks(settings, sysroot)
    failed = [c for c in checks if c.status == "fail"]
    if as_json:
        doc = {"ok": not failed, "machine": platform.machine(),
               "settings": {k: getattr(settings, k) for k in ("model", "backend", "max_seq", "disk_kv",
                                                              "disk_kv_max_bytes", "disk_kv_max_files",
                                                              "disk_kv_max_tokens")},
               "checks": [c.to_dict() for c in checks]}
        click.echo(json.dumps(doc, indent=2))
    else:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        table = Table(title="edge-llm doctor", show_lines=False)
        for col in ("status", "check", "detail", "fix"):
            table.add_column(col, overflow="fold")
        for c in checks:
            # the texts are plain: a path or `pip install 'edge-llm[quant]'` is not markup
            table.add_row(f"[{_STYLE[c.status]}]{c.status}[/]", escape(c.name), escape(c.detail), escape(c.fix))
        console = Console()
        if not console.is_terminal and "COLUMNS" not in os.environ:
            # piped or redirected: each row on one line, as wide as its longest text (rich would
            # fold every cell to fit 80 columns; docs/board.md, "Troubleshooting")
            console = Console(width=max(80, Console(width=100_000).measure(table).maximum))
            table.title_justify = "left"
        console.print(table)
        counts = {k: sum(c.status == k for c in checks) for k in _STYLE}
        console.print(", ".join(f"{n} {k}" for k, n in counts.items()))
    if failed:
        raise SystemExit(1)
