"""One request's link to whoever runs it: progress reports and cancellation.

Long work reports each step it completes through `Work.report` (a prefill chunk, a restored
layer, a layer a pending snapshot save has written while we wait for it, a block of the vision
tower, a decode step), and each decoder layer of the forward in flight through `Work.layer` (a
part of the step it belongs to: a prefill chunk of any length, the last prompt token, a decode
step). The server's worker turns reports into systemd `WATCHDOG=1` pings and `STATUS=` lines
(a layer only pings), so a pinged watchdog means real progress, two pings are at most one
layer's work apart, and a stuck process is still killed. Cancellation (a client that hung up,
SIGTERM's grace period running out) is honoured at the same points: `report`, `layer` and
`check` raise `Cancelled` once the event is set. A cancel inside a forward leaves its rows
unwritten as far as the cache is concerned: the model declares a forward's rows valid only after
its last layer (docs/board.md, "Long requests and the stop budget").
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

# stages of `report`
PREFILL, RESTORE, SAVE_WAIT, DECODE, VISION = "prefill", "restore", "save-wait", "decode", "vision"
# the stage `layer` reports to on_progress: a part of the step in flight, not a step
LAYER = "layer"

OnProgress = Callable[[str, int, int], None]  # (stage, done, total)


class Cancelled(Exception):
    """Raised at a step (or layer) boundary after the request's cancel event was set; a cancel
    inside a step names the last step completed (what the cache holds), e.g. the prefill rows."""

    def __init__(self, stage: str, done: int, total: int):
        super().__init__(f"cancelled during {stage} at {done}/{total}")
        self.stage, self.done, self.total = stage, done, total


@dataclass
class Work:
    cancel: threading.Event | None = None
    on_progress: OnProgress | None = None
    step: tuple[str, int, int] | None = field(default=None, repr=False)  # the last `report` (with a cancel)

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def report(self, stage: str, done: int, total: int) -> None:
        """A step of `stage` completed (`done` of `total`); raise Cancelled if cancelled."""
        if self.on_progress is not None:
            self.on_progress(stage, done, total)
        if self.cancel is not None:
            self.step = (stage, done, total)
            if self.cancel.is_set():
                raise Cancelled(stage, done, total)

    def layer(self, done: int, total: int) -> None:
        """Decoder layer `done` of `total` of the forward in flight finished (a part of a step:
        on_progress gets stage LAYER); raise Cancelled, naming the last step reported, if cancelled."""
        if self.on_progress is not None:
            self.on_progress(LAYER, done, total)
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled(*(self.step or (LAYER, done, total)))

    def check(self, stage: str, done: int = 0, total: int = 0) -> None:
        """Honour a cancel without reporting progress (e.g. while waiting for something else)."""
        if self.cancelled:
            raise Cancelled(stage, done, total)


NO_WORK = Work()  # nothing listens, nothing cancels
