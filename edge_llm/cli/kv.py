"""`edge-llm kv`: list, dissect, verify, remove and garbage-collect disk KV snapshots.

Works offline on a kv dir (`<kv-dir>/<model_id hex>/kv_<hash>.kv`); no model is loaded. `rm`/`gc`
may run while a service uses the kv dir: the service notices the removed files, counts them no
more and writes a removed conversation again at its next save (docs/store.md, "Files that vanish").
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from edge_llm.errors import SnapshotError, SnapshotNotRegular
from edge_llm.files import open_regular
from edge_llm.safetext import printable
from edge_llm.settings import DEFAULTS, parse_size
from edge_llm.snapshot import format as fmt
from edge_llm.snapshot import maintenance
from edge_llm.snapshot.catalog import QUARANTINE, IOStats
from edge_llm.snapshot.identity import NAMESPACE_RE, read_identity
from edge_llm.snapshot.inspect import describe as inspect_file
from edge_llm.snapshot.maintenance import snapshot_files

out = Console(highlight=False, soft_wrap=True)


class Bytes(click.ParamType):
    """A size as the settings spell one (settings.parse_size: 4294967296, 512M, 4GiB)."""

    name = "bytes"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


def namespaces(kv_dir: Path, only: str | None = None) -> list[Path]:
    if only is not None and not NAMESPACE_RE.match(only):
        raise click.BadParameter(f"{only!r} is not a namespace (16 hex digits)", param_hint="--namespace")
    if not kv_dir.exists():  # a fresh home: `serve` creates it at its first start; nothing stored yet
        return []
    if not kv_dir.is_dir():
        raise click.ClickException(f"{printable(str(kv_dir))}: not a directory")
    return maintenance.namespace_dirs(kv_dir, only)


def ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.1f}{unit} ago"
    return f"{s:.0f}s ago"


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _shown(value: object) -> str:
    """A value read from a file (identity.json, a name on disk) as text for the console: escaped
    (edge_llm/safetext.py) and never taken as markup."""
    return escape(printable(str(value)))


def private_warnings(paths: list[Path]) -> list[str]:
    """A warning per directory that others may read or enter (snapshots hold conversations)."""
    return [f"[yellow]warning[/yellow]: {p} is readable by others (mode {p.stat().st_mode & 0o777:o}): "
            f"chmod o-rwx {p}" for p in paths if p.is_dir() and p.stat().st_mode & 0o005]


@click.group("kv")
def kv() -> None:
    """Disk KV snapshots: ls, inspect, verify, rm, gc, export, import."""
    global out  # bind to this invocation's stdout and terminal width (COLUMNS)
    out = Console(highlight=False, soft_wrap=True)


kv_dir_option = click.option("--kv-dir", default=None, type=click.Path(file_okay=False, path_type=Path),
                             help="Snapshot directory. Default: the service's disk_kv as the settings "
                                  "resolve it (EDGE_LLM_DISK_KV, EDGE_LLM_CONFIG, else $EDGE_LLM_HOME/kv), "
                                  "as `serve` does.")


def resolve_kv_dir(kv_dir: Path | None) -> Path:
    """--kv-dir, else the location `serve` would use with the same environment."""
    if kv_dir is not None:
        return kv_dir
    from edge_llm.errors import ConfigError
    from edge_llm.settings import load_settings

    try:
        disk_kv = load_settings({}).disk_kv
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    if disk_kv is None:
        raise click.ClickException("disk KV is off in the settings (disk_kv = off): give --kv-dir DIR")
    return Path(disk_kv)


def find_snapshot(name: str, kv_dir: Path | None) -> Path:
    """A path, or a bare file name as `kv ls` prints it, looked up in the kv dir's namespaces."""
    p = Path(name)
    if p.exists() or "/" in name:
        if not p.exists():
            raise click.BadParameter(f"{name}: no such file", param_hint="FILE")
        if not p.is_file():  # a FIFO or device is never opened (inspect checks again as it opens)
            raise click.BadParameter(f"{name}: not a regular file", param_hint="FILE")
        return p
    root = resolve_kv_dir(kv_dir)
    hits = [ns / name for ns in namespaces(root) if (ns / name).is_file()]
    if not hits:
        raise click.BadParameter(f"{name}: not a file, and no namespace of {root} holds it", param_hint="FILE")
    return hits[0]


@kv.command("ls")
@kv_dir_option
def ls(kv_dir: Path | None) -> None:
    """Namespaces (with their identity) and their snapshots: tokens, bytes, rows held, last use.

    Last use is the file's mtime, which the store moves on every save and restore (its LRU
    order survives restarts that way); a file's creation time is not shown: Python's os.stat
    has no birth time on Linux."""
    kv_dir = resolve_kv_dir(kv_dir)
    out.print(f"kv dir {_shown(kv_dir)}")
    if not kv_dir.exists():  # a fresh home: `serve` creates the directory when it starts
        out.print(f"no snapshots yet in {_shown(kv_dir)} (it does not exist yet: `edge-llm serve` creates it)")
        return
    spaces = namespaces(kv_dir)
    if not spaces:
        out.print(f"no namespaces in {_shown(kv_dir)}")
        return
    for ns in spaces:
        ident = read_identity(ns) or {}
        cfg = ident.get("config", {})
        out.print(f"[bold]namespace {ns.name}[/bold]  model_type={_shown(cfg.get('model_type', '?'))} "
                  f"layers={_shown(cfg.get('num_hidden_layers', '?'))} "
                  f"kv_heads={_shown(cfg.get('num_key_value_heads', '?'))} "
                  f"head_dim={_shown(cfg.get('head_dim', '?'))} backend={_shown(ident.get('backend_numerics', '?'))} "
                  f"weights={_shown(str(ident.get('weights_sha256', '?'))[:12])} {_shown(ident.get('model_dir', ''))}")
        for w in private_warnings([kv_dir, ns]):
            out.print(w)
        table = Table(show_edge=False)
        for col in ("file", "tokens", "bytes", "rows held", "last use", "status"):
            # the file name is what `kv inspect` / `kv rm` take: never cut it
            table.add_column(col, justify="right" if col in ("tokens", "bytes") else "left",
                             no_wrap=col == "file", min_width=len("kv_0123456789abcdef.kv") if col == "file" else None)
        total = 0
        for path in snapshot_files(ns):
            st = path.stat()
            total += st.st_size
            held = "-"
            try:
                with open_regular(path, SnapshotNotRegular, buffering=0) as f:
                    hdr, _ = fmt.read_header(f, None, int(ns.name, 16), None, st.st_size)
                tokens, status = str(hdr.n_tokens), "ok"
                held = f"[0, {hdr.n_tokens})" if hdr.base is None else (
                    f"[{hdr.row0}, {hdr.n_tokens}) delta on {hdr.base.name}")
            except (SnapshotError, OSError) as e:
                tokens, status = "?", f"[red]{getattr(e, 'reason', 'io-error')}[/red]"
            if st.st_mode & 0o004:
                status += " [yellow]readable by others[/yellow]"
            table.add_row(path.name, tokens, f"{st.st_size:,}", held, ago(st.st_mtime), status)
        out.print(table)
        io = IOStats.load(ns)
        if io.bytes_written:
            out.print(f"  written to this namespace: {io.bytes_written:,} bytes for {io.new_kv_bytes:,} bytes of "
                      f"new KV rows (x{io.bytes_written / max(io.new_kv_bytes, 1):.3f}; compactions included)")
        q = ns / QUARANTINE
        n_q = sum(1 for p in q.iterdir() if not p.name.endswith(".reason")) if q.is_dir() else 0
        out.print(f"  {len(snapshot_files(ns))} snapshot(s), {total:,} bytes ({human(total)})"
                  + (f", {n_q} quarantined" if n_q else ""))


@kv.command("inspect")
@click.argument("file")
@kv_dir_option
@click.option("--tokenizer", "tokenizer_dir", default=None,
              help="Model directory whose tokenizer.json decodes the token ids, or 'default'.")
@click.option("--tokens", "n_show", default=16, show_default=True, type=click.IntRange(0),
              help="How many token ids to show.")
@click.option("--blocks", "n_blocks", default=8, show_default=True, type=click.IntRange(0),
              help="How many block-map entries to show.")
def inspect(file: str, kv_dir: Path | None, tokenizer_dir: str | None, n_show: int, n_blocks: int) -> None:
    """Dissect one snapshot FILE, byte by byte (a walkthrough of the VLKV v1 layout). FILE is a
    path or a name as `kv ls` prints it (found in the kv dir's namespaces)."""
    file = find_snapshot(file, kv_dir)
    try:
        d = inspect_file(file, max_blocks=n_blocks)
    except SnapshotNotRegular as e:  # replaced by a FIFO or device since find_snapshot looked
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(f"{file}: {e.strerror or e}") from None
    out.print(f"[bold]{_shown(file)}[/bold]  {d['file_size']:,} bytes")
    if d["header"]:
        t = Table(title="header (64 bytes, little-endian)", show_edge=False)
        for col in ("offset", "size", "field", "raw bytes", "value"):
            t.add_column(col)
        for h in d["header"]:
            t.add_row(str(h["offset"]), str(h["size"]), h["name"], h["hex"], _field_value(h, d))
        out.print(t)
    if d["size_formula"]:
        s = d["size_formula"]
        verdict = "[green]matches[/green]" if s["expected"] == s["actual"] else "[red]MISMATCH[/red]"
        out.print(f"size formula: {s['formula']} with n={s['n']}, L={s['L']}, kv_dim={s['kv_dim']}, "
                  f"kv_bs={s['kv_bs']}, B={s['B']}" + (f", r={s['r']}" if 'r' in s else ""))
        out.print(f"  = {' + '.join(f'{x:,}' for x in s['terms'])} = {s['expected']:,} bytes; "
                  f"actual {s['actual']:,} bytes: {verdict}")
    if d["sections"]:
        t = Table(title="sections", show_edge=False)
        for col in ("section", "offset", "size", "end"):
            t.add_column(col)
        for sec in d["sections"]:
            t.add_row(sec["name"], f"{sec['offset']:,}", f"{sec['size']:,}", f"{sec['offset'] + sec['size']:,}")
        out.print(t)
    if d["tokens"] is not None and n_show:
        _print_tokens(d["tokens"], n_show, tokenizer_dir)
    if d.get("base"):
        b = d["base"]
        out.print(f"delta: holds rows [{b['rows_held'][0]}, {b['rows_held'][1]}); rows [0, {b['n_tokens']}) are in "
                  f"its base {b['name']} (trailer CRC {b['trailer_crc']:08x})")
    if d.get("images"):
        t = Table(title="image runs (extension section)", show_edge=False)
        for col in ("rows", "grid t x h x w", "MRoPE pos0", "next pos", "digest"):
            t.add_column(col)
        for im in d["images"]:
            t.add_row(f"[{im['rows'][0]}, {im['rows'][1]})", "x".join(map(str, im["grid"])), str(im["pos0"]),
                      str(im["next_pos"]), im["digest"][:16] + "...")
        out.print(t)
    if d["blocks"]:
        t = Table(title=f"block map (first {len(d['blocks'])} of {d['n_blocks_total']})", show_edge=False)
        for col in ("layer", "block", "K/V", "rows", "offset", "bytes", "CRC32C", "trailer @"):
            t.add_column(col)
        for b in d["blocks"]:
            crc = "-" if b["crc_stored"] is None else f"{b['crc_stored']:08x}"
            t.add_row(str(b["layer"]), str(b["block"]), b["kv"], f"[{b['rows'][0]}, {b['rows'][1]})",
                      f"{b['offset']:,}", f"{b['size']:,}", crc, f"{b['trailer_offset']:,}")
        out.print(t)
    if d["error"]:
        out.print(f"[red]INVALID[/red]: {d['error']['reason']}: {d['error']['message']}")
    else:
        out.print("[green]header, token hash and trailer CRC valid[/green] (run `kv verify` to check every block)")


def _field_value(h: dict, d: dict) -> str:
    v, name = h["value"], h["name"]
    if name == "magic":
        return f"{v:#010x} ({'VLKV' if v == fmt.MAGIC else 'not VLKV'})"
    if name in ("tokens_fnv", "model_id"):
        return f"{v:016x}"
    if name == "header_crc":
        ok = v == d.get("header_crc_actual")
        return f"{v:08x} ({'ok' if ok else 'computed %08x' % d.get('header_crc_actual', 0)})"
    if name == "trailer_crc":
        return f"{v:08x}"
    if name == "flags":
        return f"{v:#x}" + (" (trailer present)" if v & fmt.FLAG_TRAILER else "") + (
            " (extension section)" if v & fmt.FLAG_EXTENSION else "")
    if name == "reserved" and d["header"] and any(
            h["name"] == "flags" and h["value"] & fmt.FLAG_EXTENSION for h in d["header"]):
        return f"{v} (extension section bytes)"
    return str(v)


def _print_tokens(tokens: list[int], n_show: int, tokenizer_dir: str | None) -> None:
    tok = None
    if tokenizer_dir is not None:  # lazy: only inspect --tokenizer needs these
        from edge_llm.checkpoints.default import resolve_model_dir
        from edge_llm.errors import EdgeLLMError
        from edge_llm.tokenizer import Tokenizer

        try:
            tok = Tokenizer.from_dir(resolve_model_dir(tokenizer_dir))
        except EdgeLLMError as e:
            raise click.ClickException(f"--tokenizer {tokenizer_dir}: {e}") from None
    t = Table(title=f"token ids (first {min(n_show, len(tokens))} of {len(tokens)}, u32 at offset 64)",
              show_edge=False)
    for col in ("#", "offset", "raw bytes", "id") + (("text",) if tok else ()):
        t.add_column(col)
    for i, tid in enumerate(tokens[:n_show]):
        row = [str(i), str(fmt.HEADER.size + 4 * i), np.uint32(tid).astype("<u4").tobytes().hex(" "), str(tid)]
        if tok is not None:
            row.append(repr(tok.decode([tid])))
        t.add_row(*row)
    out.print(t)
    if tok is not None:
        out.print(f"text of the first {min(n_show, len(tokens))} tokens: {tok.decode(tokens[:n_show])!r}")


@kv.command("verify")
@click.option("--kv-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Verify every snapshot of every namespace in this directory.")
@click.argument("files", nargs=-1, type=click.Path(exists=True, dir_okay=False, path_type=Path))
def verify(kv_dir: Path | None, files: tuple[Path, ...]) -> None:
    """Check every field and every block CRC; exit status 1 if any file is bad. Without FILEs:
    every snapshot of the kv dir (--kv-dir, default the settings' disk_kv)."""
    if kv_dir is not None and files:
        raise click.UsageError("give either --kv-dir DIR or FILE..., not both")
    paths = list(files) if files else [p for ns in namespaces(resolve_kv_dir(kv_dir)) for p in snapshot_files(ns)]
    bad = 0
    for path in paths:
        # a file inside a namespace must carry that namespace's model_id
        mid = int(path.parent.name, 16) if NAMESPACE_RE.match(path.parent.name) else None
        t0 = time.monotonic()
        try:
            hdr = fmt.verify_file(path, None, mid, None)
        except (SnapshotError, OSError) as e:
            bad += 1
            out.print(f"[red]BAD[/red] {_shown(path)}: {getattr(e, 'reason', 'io-error')}: {_shown(e)}")
            continue
        secs = time.monotonic() - t0
        out.print(f"[green]OK[/green]  {_shown(path)} ({hdr.n_tokens} tokens, {hdr.file_size:,} bytes, "
                  f"{2 * hdr.n_layers * hdr.n_blocks} blocks, {hdr.file_size / 1e6 / max(secs, 1e-9):.0f} MB/s)")
    out.print(f"{len(paths)} file(s), {bad} bad")
    if bad:
        sys.exit(1)


@kv.command("rm")
@kv_dir_option
@click.option("--namespace", default=None, help="Only this namespace (16 hex digits).")
@click.option("--all", "all_", is_flag=True, help="Remove every snapshot (and quarantined file).")
@click.argument("names", nargs=-1)
def rm(kv_dir: Path | None, namespace: str | None, all_: bool, names: tuple[str, ...]) -> None:
    """Remove snapshots by name (kv_<hash>.kv), or --all. identity.json is kept.

    Removing a file also removes the deltas written on it (they cannot be restored without it),
    deltas first."""
    if all_ == bool(names):
        raise click.UsageError("give either --all or snapshot NAME...")
    for n in names:  # names are matched, never used as paths
        if not fmt.is_snapshot_name(n):
            raise click.BadParameter(f"{n!r} is not a snapshot name (kv_<16 hex>.kv)", param_hint="NAME")
    removed, wanted = 0, set(names)
    for ns in namespaces(resolve_kv_dir(kv_dir), namespace):
        for r in maintenance.remove(ns, None if all_ else set(names)):
            wanted.discard(r.path.name)
            why = " (a delta resting on a removed snapshot)" if r.dependent else ""
            out.print(f"removed {ns.name}/{_shown(r.path.relative_to(ns))}{why}")  # --all: any name
            removed += 1
    if wanted:
        raise click.ClickException(f"not found: {', '.join(sorted(wanted))}")
    out.print(f"{removed} file(s) removed")


@kv.command("gc")
@kv_dir_option
@click.option("--namespace", default=None, help="Only this namespace (16 hex digits).")
@click.option("--max-files", default=DEFAULTS.disk_kv_max_files, show_default=True, type=click.IntRange(1),
              help="Conversations (a snapshot and its deltas) per namespace.")
@click.option("--max-bytes", default=None, type=Bytes(), help="Bytes per namespace (e.g. 4G).")
@click.option("--dry-run", is_flag=True, help="Only show what would be removed.")
def gc(kv_dir: Path | None, namespace: str | None, max_files: int, max_bytes: int | None, dry_run: bool) -> None:
    """Apply the caps: remove least recently used conversations until each namespace fits.

    A delta chain is one unit, as in the server's own eviction (docs/store.md): it goes as a
    whole, deltas before their base, so no delta is ever left without its base."""
    total = 0
    for ns in namespaces(resolve_kv_dir(kv_dir), namespace):
        for e, reason in maintenance.evict(ns, max_files, max_bytes, dry_run):
            out.print(f"{'would evict' if dry_run else 'evicted'} {ns.name}/{e.name} ({reason})")
            total += 1
    out.print(f"{total} snapshot(s) {'to evict' if dry_run else 'evicted'}")
