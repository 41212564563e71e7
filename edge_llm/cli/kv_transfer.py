"""`edge-llm kv export` / `kv import`: a namespace's snapshots as one archive, so a conversation's
KV can move to another board of the same identity (docs/fleet.md, "Replacing a board").

The work is `edge_llm/snapshot/transfer.py`; this module parses arguments and prints.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from edge_llm.cli import kv as kv_cli
from edge_llm.cli.kv import human, kv, kv_dir_option, namespaces, resolve_kv_dir
from edge_llm.files import atomic_file
from edge_llm.settings import DEFAULTS
from edge_llm.snapshot import transfer
from edge_llm.snapshot.identity import NAMESPACE_RE
from edge_llm.snapshot.writer import Modes


@kv.command("export")
@kv_dir_option
@click.option("--namespace", default=None, help="The namespace (16 hex digits); needed when the kv dir "
              "holds more than one.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, allow_dash=True, path_type=Path),
              help="The archive to write (a tar file), or - for stdout.")
@click.argument("names", nargs=-1)
def export_cmd(kv_dir: Path | None, namespace: str | None, output: Path, names: tuple[str, ...]) -> None:
    """Write a namespace's snapshots (all, or NAMEs with the bases of their chains) into one
    archive, each file verified first (every block CRC)."""
    found = namespaces(resolve_kv_dir(kv_dir), namespace)
    if len(found) != 1:
        raise click.ClickException(f"{len(found)} namespaces here: name one with --namespace "
                                   f"({', '.join(p.name for p in found) or 'none'})")
    ns, to_stdout = found[0], str(output) == "-"
    try:
        if to_stdout:
            entries = transfer.export(ns, list(names) or None, sys.stdout.buffer)
        else:
            with atomic_file(output, mode=0o600) as f:  # whole or absent; it holds conversations
                entries = transfer.export(ns, list(names) or None, f)
    except transfer.TransferError as e:
        raise click.ClickException(str(e)) from None
    msg = (f"exported {len(entries)} snapshot(s), {human(sum(e.size for e in entries))}, of namespace "
           f"{ns.name} -> {output}")
    if to_stdout:  # stdout is the archive
        click.echo(msg, err=True)
    else:
        kv_cli.out.print(msg, markup=False)  # a path is no markup


@kv.command("import")
@kv_dir_option
@click.option("--namespace", default=None, help="Refuse the archive unless it holds this namespace (16 hex "
              "digits: the receiving board's, from `kv ls` or /health).")
@click.option("--group-read", is_flag=True, default=DEFAULTS.disk_kv_group_read,
              help="Files readable by the service's group (as disk_kv_group_read = true).")
@click.option("--max-bytes", default=None, type=kv_cli.Bytes(), help="Refuse an archive whose snapshots "
              "declare more than this in total (e.g. 2G); the free space of the kv dir's filesystem, less "
              "5% of its size, is a cap anyway.")
@click.argument("archive", type=click.Path(dir_okay=False, allow_dash=True, path_type=Path))
def import_cmd(kv_dir: Path | None, namespace: str | None, group_read: bool, max_bytes: int | None,
               archive: Path) -> None:
    """Verify an archive's snapshots fully and publish them into the kv dir, bases first, each
    file whole or not at all; a bad file or a broken chain imports nothing."""
    if namespace is not None and not NAMESPACE_RE.match(namespace):
        raise click.BadParameter(f"{namespace!r} is not a namespace (16 hex digits)", param_hint="--namespace")
    root = resolve_kv_dir(kv_dir)
    try:
        if str(archive) == "-":
            res = transfer.import_archive(sys.stdin.buffer, root, namespace, Modes(group_read), max_bytes)
        else:
            with open(archive, "rb") as f:
                res = transfer.import_archive(f, root, namespace, Modes(group_read), max_bytes)
    except (transfer.TransferError, OSError) as e:
        raise click.ClickException(str(e)) from None
    for name in res.published:
        kv_cli.out.print(f"imported {res.namespace}/{name}")
    for name in res.kept:
        kv_cli.out.print(f"kept {res.namespace}/{name} (already here)")
    kv_cli.out.print(f"{len(res.published)} snapshot(s) imported into {root / res.namespace}; a running server "
                     f"indexes them at its next lookup that finds no prefix (docs/fleet.md)", markup=False)
