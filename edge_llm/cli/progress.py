"""Progress bars for slow CLI work (the library reports `progress(done, total, what)`)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def progress_bar(label: str) -> Iterator[Callable[[int, int, str], None]]:
    """A rich progress bar on stderr, driven by the library's `progress(done, total, what)` callback."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), transient=False, console=_err()) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total)

        yield update


@contextlib.contextmanager
def step_progress(label: str) -> Iterator[Callable[[str], None]]:
    """A spinner on stderr with the elapsed time, its text the library's latest `progress(message)`
    (work whose size is not known up front: a quantized build, a record measurement)."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=False,
                  console=_err()) as bar:
        task = bar.add_task(label, total=None)
        yield lambda msg: bar.update(task, description=f"{label}: {msg}")


@contextlib.contextmanager
def phase_progress(phases: dict[str, str]) -> Iterator[Callable[[str, int, int], None]]:
    """Progress of work in phases (`phases`: name -> label, in order), driven by the library's
    `progress(phase, done, total)`: on a terminal one rich bar per phase with its count and time; on
    stderr that is not a terminal (a log, a pipe) one line per step, `label: done/total (N s)`, so a
    slow command is never silent there either."""
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = _err()
    if not console.is_terminal:
        t0 = time.monotonic()

        def line(phase: str, done: int, total: int) -> None:
            print(f"{phases.get(phase, phase)}: {done}/{total} ({time.monotonic() - t0:.0f} s)",
                  file=sys.stderr, flush=True)

        yield line
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as bar:
        tasks: dict[str, object] = {}

        def update(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phases.get(phase, phase), total=total)
            bar.update(tasks[phase], completed=done, total=total)

        yield update


def _err():
    from rich.console import Console

    return Console(stderr=True)


@contextlib.contextmanager
def _nullbar() -> Iterator[None]:
    yield None


def resolve_model_with_bar(spec: str) -> Path:
    """Model directory for DIR|default; draws a bar while the default model is imported (first use)."""
    from edge_llm.checkpoints.default import default_model_ready, resolve_model_dir

    importing = spec == "default" and not default_model_ready()
    with progress_bar("importing the default model (first use)") if importing else _nullbar() as cb:
        return resolve_model_dir(spec, progress=cb)


def import_default_model_in_terminal(spec: str) -> None:
    """Before a server starts: a first-use import of the default model shows its bar in a terminal.
    Without a terminal (systemd) the server's loader imports it and reports STATUS= instead."""
    if spec == "default" and sys.stderr.isatty():
        resolve_model_with_bar(spec)
