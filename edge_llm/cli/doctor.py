"""`edge-llm doctor`: board readiness checklist (pass / warn / fail / n/a with a fix for each)."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import click

SERVICE_CONFIG = Path("/etc/edge-llm/edge-llm.toml")
_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "n/a": "dim"}


@click.command("doctor")
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help=f"serve settings TOML to check (default: {SERVICE_CONFIG} if it exists)")
@click.option("--model", help='HF model directory, or "default" for the embedded model')
@click.option("--kv-dir", help="snapshot directory (disk_kv)")
@click.option("--max-seq", type=click.IntRange(min=1), help="context window in tokens")
@click.option("--max-bytes", type=click.IntRange(min=1), help="snapshot byte cap (disk_kv_max_bytes)")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--sysroot", default="/", hidden=True, type=click.Path(file_okay=False),
              help="read /sys, /proc, /dev, /etc below this directory (tests)")
def doctor(config_file: str | None, model: str | None, kv_dir: str | None, max_seq: int | None,
           max_bytes: int | None, as_json: bool, sysroot: str) -> None:
    """Check this machine for running the edge-llm service; exit 1 if any check fails.

    Settings come from the same sources as `edge-llm serve` (flag > EDGE_LLM_* > TOML > default).
    """
    from edge_llm.doctor import DoctorOptions, run_checks
    from edge_llm.errors import EdgeLLMError
    from edge_llm.settings import load_settings

    if config_file is None and SERVICE_CONFIG.is_file():
        config_file = str(SERVICE_CONFIG)
    flags = {"model": model, "disk_kv": kv_dir, "max_seq": max_seq, "disk_kv_max_bytes": max_bytes}
    try:
        s = load_settings(flags, config_file=config_file)
    except EdgeLLMError as e:
        raise click.ClickException(str(e)) from None
    opts = DoctorOptions(model=s.model, kv_dir=s.disk_kv or None, max_seq=s.max_seq,
                         max_bytes=s.disk_kv_max_bytes, max_files=s.disk_kv_max_files,
                         max_tokens=s.disk_kv_max_tokens, backend=s.backend, rknn_dir=s.rknn_dir,
                         sysroot=sysroot)
    checks = run_checks(opts)
    failed = [c for c in checks if c.status == "fail"]
    if as_json:
        doc = {"ok": not failed, "machine": platform.machine(), "config": config_file,
               "settings": {"model": opts.model, "kv_dir": opts.kv_dir, "max_seq": opts.max_seq,
                            "max_bytes": opts.max_bytes, "backend": opts.backend},
               "checks": [c.to_dict() for c in checks]}
        click.echo(json.dumps(doc, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"edge-llm doctor ({config_file or 'no config file'})", show_lines=False)
        for col in ("status", "check", "detail", "fix"):
            table.add_column(col, overflow="fold")
        for c in checks:
            table.add_row(f"[{_STYLE[c.status]}]{c.status}[/]", c.name, c.detail, c.fix)
        console = Console()
        console.print(table)
        counts = {k: sum(c.status == k for c in checks) for k in _STYLE}
        console.print(", ".join(f"{n} {k}" for k, n in counts.items()))
    if failed:
        raise SystemExit(1)
