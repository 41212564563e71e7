"""One request's link to whoever runs it: progress reports and cancellation.

Long work reports each step it completes through `Work.report` (a prefill chunk, a restored
layer, a layer a pending snapshot save has written while we wait for it, a decode step). The
server's worker turns reports into systemd `WATCHDOG=1` pings and `STATUS=` lines, so a pinged
watchdog means real progress and a stuck process is still killed. Cancellation (a client that
hung up, SIGTERM's grace period running out) is honoured at the same points: `report` and
`check` raise `Cancelled` once the event is set.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

# stages of `report`
PREFILL, RESTORE, SAVE_WAIT, DECODE = "prefill", "restore", "save-wait", "decode"

OnProgress = Callable[[str, int, int], None]  # (stage, done, total)


class Cancelled(Exception):
    """Raised at a step boundary after the request's cancel event was set."""

    def __init__(self, stage: str, done: int, total: int):
        super().__init__(f"cancelled during {stage} at {done}/{total}")
        self.stage, self.done, self.total = stage, done, total


@dataclass
class Work:
    cancel: threading.Event | None = None
    on_progress: OnProgress | None = None

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def report(self, stage: str, done: int, total: int) -> None:
        """A step of `stage` completed (`done` of `total`); raise Cancelled if cancelled."""
        if self.on_progress is not None:
            self.on_progress(stage, done, total)
        if self.cancelled:
            raise Cancelled(stage, done, total)

    def check(self, stage: str, done: int = 0, total: int = 0) -> None:
        """Honour a cancel without reporting progress (e.g. while waiting for something else)."""
        if self.cancelled:
            raise Cancelled(stage, done, total)


NO_WORK = Work()  # nothing listens, nothing cancels
