"""Summary of a recovery-evidence run: verdict, per-repeat checks, medians; JSON + Markdown files."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import recovery_checks as C

MIN_REPEATS = 3
CHECK_NAMES = ("cold_baseline", "write_before_restart", "same_process_ram_hit", "restarted",
               "restored_from_disk", "same_text", "restarted_2", "follow_up_tail_only")


def _t(rec: dict, phase: str, key: str):
    return (rec.get(phase) or {}).get("timings", {}).get(key)


def medians(repeats: list[dict]) -> dict:
    def med(fn):
        vals = []
        for rec in repeats:
            try:
                vals.append(fn(rec))
            except (KeyError, TypeError, ZeroDivisionError):
                pass
        return C.median(vals)

    return {
        "prompt_tokens": med(lambda r: r["cold"]["prompt_tokens"]),
        "cold_ttft_ms": med(lambda r: _t(r, "cold", "ttft_ms")),
        "same_process_ttft_ms": med(lambda r: _t(r, "warm", "ttft_ms")),
        "restored_ttft_ms": med(lambda r: _t(r, "restored", "ttft_ms")),
        "speedup_ttft": med(lambda r: _t(r, "cold", "ttft_ms") / _t(r, "restored", "ttft_ms")),
        "cold_prefill_tokens": med(lambda r: _t(r, "cold", "prefill_tokens")),
        "restored_prefill_tokens": med(lambda r: _t(r, "restored", "prefill_tokens")),
        "restored_cached_tokens": med(lambda r: r["restored"]["cached_tokens"]),
        "restore_ms": med(lambda r: _t(r, "restored", "restore_ms")),
        "restore_bytes": med(lambda r: _t(r, "restored", "restore_bytes")),
        "restore_mb_s": med(lambda r: _t(r, "restored", "restore_bytes") / 1e3 / _t(r, "restored", "restore_ms")),
        "save_ms": med(lambda r: r["saved"]["ms"]),
        "snapshot_bytes": med(lambda r: r["saved"]["bytes"]),
        "follow_up_ttft_ms": med(lambda r: _t(r, "follow_up", "ttft_ms")),
        "follow_up_prefill_tokens": med(lambda r: _t(r, "follow_up", "prefill_tokens")),
        "ready_after_restart_s": med(lambda r: max(r["ready_s"])),
    }


def summarize(a, repeats: list[dict], fatal: list[str], kv_listing: list[dict], seconds: float,
              argv: list[str]) -> dict:
    failures = list(fatal)
    if len(repeats) < MIN_REPEATS:
        failures.append(f"only {len(repeats)} completed repeat(s); the protocol requires >= {MIN_REPEATS}")
    for rec in repeats:
        for name in CHECK_NAMES:
            failures += [f"repeat {rec['repeat']}: {name}: {msg}" for msg in rec["checks"].get(name, [])]
    mode = "board" if a.base_url and not a.start_cmd else "local"
    return {
        "pass": not failures, "failures": failures, "mode": mode,
        "command": " ".join(shlex.quote(x) for x in argv),
        "config": {k: v for k, v in vars(a).items() if k != "api_key_file"},
        "seconds": round(seconds, 1), "repeats": repeats, "medians": medians(repeats),
        "kv_dir_listing": kv_listing,
    }


def verdict_line(summary: dict, res: Path) -> str:
    n = len(summary["failures"])
    return f"{'PASS' if summary['pass'] else 'FAIL'}: {n} failure(s); evidence in {res}"


def markdown(s: dict) -> str:
    out = [f"# Restart-recovery evidence: {'PASS' if s['pass'] else 'FAIL'}", "",
           f"Mode: {s['mode']}; {len(s['repeats'])} repeat(s); {s['seconds']} s.", "",
           f"Command: `{s['command']}`", "", "## Checks", "",
           "| check | " + " | ".join(f"repeat {r['repeat']}" for r in s["repeats"]) + " |",
           "|---|" + "---|" * len(s["repeats"])]
    for name in CHECK_NAMES:
        out.append(f"| {name} | " + " | ".join("PASS" if not r["checks"].get(name) else "FAIL"
                                                for r in s["repeats"]) + " |")
    out += ["", "## Medians", "", "| metric | median |", "|---|---:|"]
    for k, v in s["medians"].items():
        out.append(f"| {k} | {'n/a' if v is None else (f'{v:.2f}' if isinstance(v, float) else v)} |")
    out += ["", "## Failures", ""] + ([f"- {f}" for f in s["failures"]] or ["none"])
    out += ["", "Log excerpts per phase (only lines appended after that phase's byte-offset marker) are in "
            "`excerpts/`; `failures.txt` lists every failure, one per line (empty on PASS)."]
    return "\n".join(out) + "\n"


def write(res: Path, summary: dict) -> None:
    (res / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (res / "summary.md").write_text(markdown(summary))
    (res / "failures.txt").write_text("".join(f + "\n" for f in summary["failures"]))
