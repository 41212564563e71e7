"""Compute or load? The cost gate that decides how much of a disk prefix to restore.

One place holds this machine's running estimates: the kv disk's read bandwidth (from restores)
and the backend's prefill rate (from requests' prefills); the metrics read them from here too.
`decide` compares the predicted time to the first token of the candidates:

- recompute: prefill rows [m_ram, n) (rows already in RAM are free);
- restore k rows from disk, k = m (everything the snapshot matches) or, in split mode, any
  block boundary k in [min_lcp, m] (Cake-style: the front is loaded while the rest is computed).

A pipelined restore overlaps reading with the first prefill chunk, layer by layer, so its cost is
max(read(k), first chunk) + the remaining chunks; a sequential restore costs read(k) + prefill.
Prefill time is modelled as rows / rate (linear: attention makes long prefixes somewhat slower
per row, which only favours loading). Without both estimates the gate restores (the first
request measures them). The estimates persist in the snapshot namespace (`gate.json`), so the
first request after a restart — the case restores exist for — is already decided on this
machine's numbers. See docs/store.md.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from edge_llm.files import read_regular, write_atomic
from edge_llm.safetext import printable

log = logging.getLogger(__name__)

EWMA = 0.3  # weight of the newest measurement
GATE_FILE = "gate.json"  # the estimates, in the snapshot namespace (same disk, same backend numerics)
SAVE_CHANGE = 0.1  # relative change of an estimate that is worth rewriting gate.json for
MIN_PREFILL_ROWS = 16  # shorter prefills are dominated by per-call overhead: not a rate sample
PIPELINED, SEQUENTIAL, SPLIT = "pipelined", "sequential", "split"


@dataclass(frozen=True)
class Decision:
    action: str  # "restore" | "split" | "recompute" | "unmeasured" (restore, no estimates yet)
    load_rows: int  # rows read from disk (0: recompute)
    recompute_rows: int  # rows prefilled, tail included
    predicted_ms: float  # predicted time to the first token's logits of this choice
    restore_ms: float  # predicted: restoring all m rows
    recompute_ms: float  # predicted: recomputing from the RAM prefix

    def to_dict(self) -> dict:
        return asdict(self)


class CostGate:
    """Running estimates + the restore decision; thread-safe (the metrics read it any time)."""

    def __init__(self, bytes_per_token: int, mode: str = PIPELINED, chunk: int = 128,
                 read_bps: float | None = None, prefill_tps: float | None = None,
                 state_dir: Path | None = None, file_mode: int = 0o600):
        if mode not in (PIPELINED, SEQUENTIAL, SPLIT):
            raise ValueError(f"unknown restore mode {mode!r}")
        self.bytes_per_token, self.mode, self.chunk = bytes_per_token, mode, chunk
        self.read_bps, self.prefill_tps = read_bps, prefill_tps
        self._lock = threading.Lock()
        self.counts = {"restore": 0, "split": 0, "recompute": 0, "unmeasured": 0}
        # the estimates persist in the snapshot namespace (same disk, same backend numerics)
        self.state_file = None if state_dir is None else Path(state_dir) / GATE_FILE
        self.file_mode = file_mode
        if self.state_file is not None and read_bps is None and prefill_tps is None:
            self._load(self.state_file)
        self._saved = (self.read_bps, self.prefill_tps)  # what gate.json holds (or was given)

    # ---- persistence (the namespace's gate.json) -------------------------------------------------
    def _load(self, path: Path) -> None:
        try:
            doc = json.loads(read_regular(path, ValueError))  # a FIFO: refused unread (a ValueError)
            rb, tps = doc.get("read_bytes_per_s"), doc.get("prefill_rows_per_s")
        except FileNotFoundError:
            return
        except (OSError, ValueError, AttributeError) as e:
            log.warning("cost gate: ignoring %s (%s)", printable(path), e)
            return
        ok = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e15  # noqa: E731
        self.read_bps = float(rb) if ok(rb) else None
        self.prefill_tps = float(tps) if ok(tps) else None
        log.info("cost gate: estimates from the last run: read %s, prefill %s",
                 f"{self.read_bps / 1e6:.0f} MB/s" if self.read_bps else "not measured yet",
                 f"{self.prefill_tps:.1f} rows/s" if self.prefill_tps else "not measured yet")

    def persist(self) -> None:
        """Write the estimates to `state_file` (atomically, with `file_mode`) when they moved by
        more than SAVE_CHANGE since they were last written. Called after a request, not on its
        way to the first token; the running estimates converge, so writes get rare. Best
        effort: a failure is logged, never raised."""
        if self.state_file is None:
            return
        with self._lock:
            now = (self.read_bps, self.prefill_tps)
            if all(_close(a, b) for a, b in zip(now, self._saved)):
                return
            self._saved = now
        doc = json.dumps({"read_bytes_per_s": now[0], "prefill_rows_per_s": now[1]}) + "\n"
        try:
            write_atomic(self.state_file, doc, mode=self.file_mode)
        except OSError as e:
            log.warning("cost gate: could not write %s: %s", printable(self.state_file), e)

    # ---- estimates ----------------------------------------------------------------------------
    def observe_read(self, nbytes: int, seconds: float) -> None:
        """A restore read `nbytes` in `seconds` (waits for other work excluded)."""
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self.read_bps = _ewma(self.read_bps, nbytes / seconds)

    def observe_prefill(self, rows: int, seconds: float) -> None:
        """A request prefilled `rows` rows in `seconds` (waits for disk or saves excluded)."""
        if rows >= MIN_PREFILL_ROWS and seconds > 0:
            with self._lock:
                self.prefill_tps = _ewma(self.prefill_tps, rows / seconds)

    def stats(self) -> dict:
        with self._lock:
            return {"est_read_bytes_per_s": self.read_bps or 0.0, "est_prefill_rows_per_s": self.prefill_tps or 0.0,
                    **{f"gate_{k}_decisions": v for k, v in self.counts.items()}}

    # ---- the decision ---------------------------------------------------------------------------
    def cost_ms(self, load: int, n: int, m_ram: int, read_bps: float, tps: float,
                mode: str | None = None) -> float:
        """Predicted ms until the last prompt row is computed, loading rows [0, load) from disk
        (0: recompute from the RAM prefix)."""
        mode = mode or self.mode
        if load <= m_ram:
            return (n - m_ram) / tps * 1e3
        read = load * self.bytes_per_token / read_bps
        rest = n - load
        if mode == SEQUENTIAL:
            return (read + rest / tps) * 1e3
        first = min(rest, self.chunk) / tps
        return (max(read, first) + (rest - min(rest, self.chunk)) / tps) * 1e3

    def decide(self, n: int, m_ram: int, m_disk: int, block: int, min_rows: int) -> Decision:
        """How many of the m_disk rows a snapshot matches to load for an n-row prompt. m_ram and
        m_disk are reuse points the engine already aligned to the prefill chunk; split candidates
        are multiples of the chunk too (and of the block), so every row after them is recomputed
        in the chunks a cold run uses and its cost is what is predicted."""
        with self._lock:
            bw, tps = self.read_bps, self.prefill_tps
        if not bw or not tps:
            d = Decision("unmeasured", m_disk, n - m_disk, 0.0, 0.0, 0.0)
        else:
            full = self.cost_ms(m_disk, n, m_ram, bw, tps)
            comp = self.cost_ms(0, n, m_ram, bw, tps)
            best, best_ms = (m_disk, full) if full < comp else (m_ram, comp)
            if self.mode == SPLIT:  # any aligned block boundary is a candidate (whole blocks are read)
                step = math.lcm(block, self.chunk)
                for k in range(max(min_rows, m_ram + 1), m_disk, step):
                    k = k // step * step
                    if k > m_ram and (ms := self.cost_ms(k, n, m_ram, bw, tps)) < best_ms:
                        best, best_ms = k, ms
            action = "recompute" if best <= m_ram else ("restore" if best == m_disk else "split")
            d = Decision(action, best if best > m_ram else 0, n - max(best, m_ram), best_ms, full, comp)
        with self._lock:
            self.counts[d.action] += 1
        return d


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= SAVE_CHANGE * abs(b)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new
