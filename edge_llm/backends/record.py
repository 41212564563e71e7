"""A conversion's accuracy record (`record.json` beside its weights) and the bar it must meet before
`backend = auto` trusts it (docs/quantization.md, "Accuracy record").

The record is measured against the F32 model (`cpu` backend) by edge_llm/qrecord.py when the
weights are built (cpu-q) or converted (`convert npu-mm`), and keyed by the identity of the
weights it measured (the manifest's `identity()`: the source weights' digest and the digest of
every quantized weight file): a record whose key is not the directory's present identity is
refused (treated as missing), never trusted. Reading and judging only here; no model is loaded.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from edge_llm.files import write_atomic
from edge_llm.quality_text import ACCEPTANCE
from edge_llm.safetext import printable

log = logging.getLogger(__name__)

RECORD = "record.json"
FORMAT = 1
# The bar (docs/quantization.md, "Accuracy record"): every acceptance prompt's greedy answer equal
# to F32's for ANSWER_TOKENS tokens or up to its first end token, AND teacher-forced KL(F32 || it)
# per token <= KL_MAX, AND top-1 agreement >= TOP1_MIN over TEACHER_TOKENS tokens of QUALITY_TEXT.
# Measured on the default model over these TEACHER_TOKENS: npu-mm int8 top-1 97.5 %, KL 0.00296,
# answers like F32; cpu-q (GGUF blocks) 97.5 %, KL 0.00299, France answered wrong. The averages
# cannot tell those apart, the answers do; the averages' bars (KL 1.7x the int8 path's, top-1 four
# tokens in 160 below it) catch a broken conversion without failing the int8 path on a near tie.
ANSWER_TOKENS = 16
TEACHER_TOKENS = 160
KL_MAX = 0.005
TOP1_MIN = 0.95


def verdict(rec: dict) -> tuple[bool, str]:
    """(whether the record meets the bar, a one-line reason naming the first miss or the figures)."""
    t = rec["teacher"]
    figures = f"top-1 {t['top1'] * 100:.1f} %, KL {t['kl']:.5f}"
    wrong = [a for a in rec["answers"] if not a["same"]]
    if wrong:
        a = wrong[0]
        return False, (f"{len(wrong)} of {len(rec['answers'])} acceptance answers differ from F32's, e.g. "
                       f"{a['prompt']!r}: {a['other'][:40]!r} instead of {a['ref'][:40]!r}; {figures}")
    if not t["kl"] <= KL_MAX:  # `not <=`: a NaN fails
        return False, f"KL {t['kl']:.5f} > {KL_MAX}; {figures}"
    if not t["top1"] >= TOP1_MIN:
        return False, f"top-1 {t['top1'] * 100:.1f} % < {TOP1_MIN * 100:.0f} %; {figures}"
    return True, f"acceptance answers as F32's, {figures}"


def read_record(root: str | Path, key: str) -> tuple[dict | None, str]:
    """(the record of the weights whose identity is `key`, "") or (None, why there is none): absent,
    unreadable, another format, or measured on other weights (another key)."""
    path = Path(root) / RECORD
    try:
        rec = json.loads(path.read_text())
    except FileNotFoundError:
        return None, "no accuracy record"
    except (OSError, ValueError) as e:
        return None, f"accuracy record unreadable ({printable(str(e))})"
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        return None, "accuracy record of another format"
    if rec.get("key") != key:
        return None, (f"accuracy record is for weights {str(rec.get('key'))[:16]}, these are {key[:16]} "
                      "(changed since it was measured)")
    try:
        verdict(rec)
        measured = ([a["prompt"] for a in rec["answers"]], rec["teacher"]["tokens"], rec["answer_tokens"])
    except (KeyError, TypeError):
        return None, "accuracy record incomplete"
    if measured != (list(ACCEPTANCE), TEACHER_TOKENS, ANSWER_TOKENS):  # another edge-llm's measures
        return None, "accuracy record measured on other prompts or lengths"
    return rec, ""


def judge(root: str | Path, key: str) -> tuple[bool | None, str]:
    """(True/False: the record meets the bar or not, None: no usable record; the reason)."""
    rec, why = read_record(root, key)
    if rec is None:
        return None, why
    ok, why = verdict(rec)
    return ok, f"accuracy record {'passes' if ok else 'fails'}: {why}"


def write_record(root: str | Path, rec: dict) -> None:
    write_atomic(Path(root) / RECORD, json.dumps({"format": FORMAT, **rec}, indent=1) + "\n")
    ok, why = verdict(rec)
    log.info("accuracy record of %s: %s (%s)", printable(str(root)), "passes" if ok else "FAILS", why)
