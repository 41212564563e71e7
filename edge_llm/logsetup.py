"""Process logging: stderr (journald) plus an append-only log file that survives restarts.

The file handler flushes every line (a SIGKILL loses nothing already logged) and reopens its path
after SIGHUP, so logrotate can rename the file and signal us. The signal handler only sets a flag:
the reopen happens in the next `emit`, under the handler lock, never inside signal context.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

from edge_llm import __version__
from edge_llm.safetext import one_line

log = logging.getLogger("edge_llm.lifecycle")

LINE_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%dT%H:%M:%S"


class ReopenableFileHandler(logging.StreamHandler):
    """Append-only file handler whose stream is reopened after `request_reopen()` (SIGHUP)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(self._open())
        self._reopen = False

    def _open(self):
        # line buffering + explicit flush per record: each line reaches the kernel when logged
        return open(self.path, "a", encoding="utf-8", buffering=1)

    def request_reopen(self) -> None:
        """Async-signal-safe: only sets a flag."""
        self._reopen = True

    def emit(self, record: logging.LogRecord) -> None:
        if self.stream is None or self.stream.closed:
            # closed by logging.shutdown() at exit while a daemon thread still logs (the model
            # loader, when the server exits early: its port taken). The record has no file left;
            # logging's "--- Logging error ---" traceback on stderr would bury why the server exited.
            return
        if self._reopen:
            self.acquire()
            try:
                if self._reopen:
                    self._reopen = False
                    old, self.stream = self.stream, self._open()
                    try:
                        old.close()
                    except OSError:
                        pass
                    self.stream.write(self.format(logging.LogRecord(
                        "edge_llm.lifecycle", logging.INFO, __file__, 0,
                        "log file reopened (SIGHUP)", None, None)) + self.terminator)
            except OSError:
                self.handleError(record)
            finally:
                self.release()
        super().emit(record)  # StreamHandler.emit flushes after each record

    def close(self) -> None:
        self.acquire()
        try:
            if self.stream and not self.stream.closed:
                self.stream.close()
        finally:
            self.release()
        super().close()


class OneLineFormatter(logging.Formatter):
    """Each record's message as one line with nothing a terminal interprets: whatever a call site
    passed in (a file name, a path, a library's own text), control characters are escaped
    (`safetext.one_line`; call sites escape the untrusted strings they know of with
    `safetext.printable`, docs/logs.md "Untrusted text"). A traceback keeps its lines, each
    escaped the same way (an exception's text may quote a client's path)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = one_line(record.message)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:
        return "\n".join(map(one_line, super().formatException(ei).split("\n")))

    def formatStack(self, stack_info: str) -> str:
        return "\n".join(map(one_line, super().formatStack(stack_info).split("\n")))


class LogSetup:
    """What `setup_logging` installed: the file handler (if any) for SIGHUP and the exit line."""

    def __init__(self, file_handler: ReopenableFileHandler | None):
        self.file_handler = file_handler
        self.started = time.monotonic()

    def reopen(self, *_args) -> None:
        if self.file_handler is not None:
            self.file_handler.request_reopen()

    def install_sighup(self) -> None:
        """Reopen the log file on SIGHUP (logrotate's `postrotate kill -HUP`)."""
        signal.signal(signal.SIGHUP, self.reopen)


def setup_logging(log_file: str | Path | None, level: int = logging.INFO) -> LogSetup:
    """Configure the root logger: stderr + (optional) append-only file. Idempotent per process."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        if getattr(h, "_edge_llm", False):  # close only what we opened
            h.close()
    fmt = OneLineFormatter(LINE_FORMAT, DATE_FORMAT)
    fmt.converter = time.gmtime  # UTC: log files compared across boots and time zones
    err = logging.StreamHandler(sys.stderr)
    # journald adds its own timestamp; keep stderr lines short
    err.setFormatter(OneLineFormatter("%(levelname)s %(name)s: %(message)s"))
    err._edge_llm = True
    root.addHandler(err)
    fh = None
    if log_file:
        fh = ReopenableFileHandler(log_file)
        fh.setFormatter(fmt)
        fh._edge_llm = True
        root.addHandler(fh)
    root.setLevel(level)
    # uvicorn's own loggers propagate to ours instead of printing with their own handlers
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
    if not any(isinstance(f, _ListeningLine) for f in logging.getLogger("uvicorn.error").filters):
        logging.getLogger("uvicorn.error").addFilter(_ListeningLine())
    return LogSetup(fh)


class _ListeningLine(logging.Filter):
    """uvicorn's "Uvicorn running on URL" comes before the model is loaded: say what it means
    (the ready line, with the URL, follows once requests are served)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Uvicorn running on"):
            record.msg = "listening on %s://%s:%d: loading the model (requests get 503 until the ready line)"
            record.args = record.args[:3] if isinstance(record.args, tuple) else record.args
        return True


def setup_cli_logging(level: int = logging.WARNING, fmt: str = "%(message)s") -> None:
    """A command's logging (generate, model, convert): stderr only, one line per message
    (`OneLineFormatter`), as `logging.basicConfig` would otherwise set it up."""
    err = logging.StreamHandler(sys.stderr)
    err.setFormatter(OneLineFormatter(fmt))
    logging.basicConfig(level=level, handlers=[err])


def boot_id() -> str:
    """The kernel's boot id: tells log readers whether two runs were in the same boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def log_banner(**fields: object) -> None:
    """One start-up line: pid, version, boot id and the given fields (model, backend, ...)."""
    extra = " ".join(f"{k}={v}" for k, v in fields.items())
    log.info("=== edge-llm %s start pid=%d boot_id=%s %s ===", __version__, os.getpid(), boot_id(), extra)


def log_exit(reason: str, setup: LogSetup | None = None, code: int = 0) -> None:
    """The clean-exit line; its absence before the next banner means the process died."""
    up = time.monotonic() - setup.started if setup else 0.0
    log.info("=== edge-llm exit pid=%d reason=%s code=%d uptime=%.1fs ===", os.getpid(), reason, code, up)
