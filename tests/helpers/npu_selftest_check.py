"""The NPU matmul path's start-up self-test over a librknnrt.so that behaves (the tests' fake's normal
build, tests/fake_librknnrt): every probe answers and passes, and nothing is changed or refused.
Used by tests/test_npu_selftest.py; as a script it prints the report's JSON (the emulated board).

    python npu_selftest_check.py --lib PATH/librknnrt.so --cache PATH.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from edge_llm.backends.npu.matmul import binding as api
from edge_llm.backends.npu.matmul.selftest import SelfTestReport, run_self_test

PROBES = {"driver", "coherency", "products", "concurrency", "domain", "head"}
PART = (576, 16384)  # the default model's largest part: the head (576 x 49152) by N over three cores


def passes_every_probe(lib: str | Path, cache: Path, part: tuple[int, int] = PART) -> SelfTestReport:
    """The report for `lib`; asserts that every probe ran and passed and no reaction was needed."""
    r = run_self_test(api.load_library(str(lib)), part, cache=cache)
    assert set(r.probes) == PROBES, r.probes
    failed = {name: p["text"] for name, p in r.probes.items() if not p["ok"]}
    assert not failed, failed
    assert (r.sync, r.serialize, r.refused) == (False, False, None), r
    assert r.driver_version == "0.9.8" and r.driver_source == "rknn_query", r
    return r


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--cache", required=True)
    a = ap.parse_args()
    print(json.dumps(passes_every_probe(a.lib, Path(a.cache)).to_dict()))
