"""Calls in a thread, judged on a busy machine: whether a call blocks, or finishes (docs/architecture.md,
"Tests on a busy machine"). Shared by the KV cache's and the store's tests."""

from __future__ import annotations

import threading


def blocked(fn, *args, wait=0.2) -> threading.Thread | None:
    """Run fn(*args) in a thread; the thread if still running after `wait` s, else None. Only for
    a call that must block: on a busy machine a call that should have returned may still be running
    after `wait` (use `finishes` for those), but one that blocks is always still running."""
    th = threading.Thread(target=fn, args=args, daemon=True)
    th.start()
    th.join(wait)
    return th if th.is_alive() else None


def finishes(fn, *args, deadline=30.0) -> bool:
    """Run fn(*args) in a thread; True if it returned (its exception is raised here). For a call
    that must not block: judged by finishing, the deadline only bounds a hang (never a speed)."""
    err: list[BaseException] = []

    def run():
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            err.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(deadline)
    if err:
        raise err[0]
    return not th.is_alive()


class LookedAt(threading.Event):
    """An event that tells when it was first looked at (`asked`): a cancel flag handed to a writer
    that checks it in its wait loop, so a test knows the writer is waiting before it goes on."""

    def __init__(self):
        super().__init__()
        self.asked = threading.Event()

    def is_set(self):
        self.asked.set()
        return super().is_set()
