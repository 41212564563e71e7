"""A conversion's accuracy record (backends/record.py, qrecord.py; docs/quantization.md "Accuracy
record") and `backend = auto`, which takes a quantized backend only when its record meets the bar:
the record refused when the weights change, auto skipping a failing record and saying why (the
real CLI: `generate`, and `serve` + /health over real HTTP), an explicit backend with a failing
record warned about once, and the acceptance prompts answered like F32 on whatever auto picks on
the default model."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from serverutil import ServerProc

from edge_llm.backends.record import ANSWER_TOKENS, RECORD, TEACHER_TOKENS, judge, read_record, write_record
from edge_llm.quality_text import ACCEPTANCE, FACT

TIMEOUT = 900


def record(key: str, same: bool = True, kl: float = 0.001, top1: float = 0.99, prompts=ACCEPTANCE) -> dict:
    return {"key": key, "teacher": {"tokens": TEACHER_TOKENS, "top1": top1, "kl": kl, "ppl": 10.0},
            "answer_tokens": ANSWER_TOKENS,
            "answers": [{"prompt": p, "ref": "The capital of France is Paris.",
                         "other": "The capital of France is Paris." if same or p != FACT else "L'Étoile",
                         "same": same or p != FACT, "tokens": 8} for p in prompts]}


def test_record_is_keyed_by_the_weights_and_judged_by_the_bar(tmp_path: Path) -> None:
    """A record measured on other weights (another key) is refused, never trusted; the bar fails a
    wrong acceptance answer, a KL above it (a NaN too) and a top-1 below it, and names the miss."""
    write_record(tmp_path, record("a" * 16))
    assert judge(tmp_path, "a" * 16)[0] is True
    rec, why = read_record(tmp_path, "b" * 16)
    assert rec is None and "changed since it was measured" in why, why
    assert judge(tmp_path, "b" * 16) == (None, why)
    write_record(tmp_path, record("a" * 16, same=False))
    ok, why = judge(tmp_path, "a" * 16)
    assert ok is False and f"{FACT!r}: \"L'Étoile\" instead of 'The capital of France is Paris.'" in why, why
    for bad, miss in ((dict(kl=0.02), "KL 0.02000 > "), (dict(kl=math.nan), "KL nan > "),
                      (dict(top1=0.5), "top-1 50.0 % < ")):
        write_record(tmp_path, record("a" * 16, **bad))
        ok, why = judge(tmp_path, "a" * 16)
        assert ok is False and miss in why, why
    write_record(tmp_path, record("a" * 16, prompts=("another prompt",)))  # another edge-llm's list
    assert judge(tmp_path, "a" * 16) == (None, "accuracy record measured on other prompts or lengths")
    (tmp_path / RECORD).write_text("{not json")
    assert judge(tmp_path, "a" * 16)[0] is None


def test_auto_takes_cpu_q_only_with_a_passing_record(home: Path, tiny_synth_dir: Path, tmp_path: Path) -> None:
    """choose_backend on real cpu-q weights (a tiny model's, built here): no record -> cpu, cpu-q to be
    measured; a passing record of these weights -> cpu-q; a failing one -> cpu and why; a record of
    other weights -> as if none."""
    from edge_llm.backends.choice import choose_backend
    from edge_llm.backends.cpuq.backend import ensure_quantized, mode
    from edge_llm.settings import Settings

    root, m = ensure_quantized(tiny_synth_dir, mode("q4"), blocks=None)
    auto = Settings(backend="auto")
    c = choose_backend(auto, tiny_synth_dir, sysroot=tmp_path)
    assert (c.name, c.unmeasured) == ("cpu", "cpu-q") and c.reason.endswith("(no accuracy record) not measured yet"), c
    write_record(root, record(m.identity()))
    c = choose_backend(auto, tiny_synth_dir, sysroot=tmp_path)
    assert (c.name, c.unmeasured) == ("cpu-q", None), c
    assert "cpu-q's accuracy record passes: acceptance answers as F32's, top-1 99.0 %, KL 0.00100" in c.reason, c
    write_record(root, record(m.identity(), same=False))
    c = choose_backend(auto, tiny_synth_dir, sysroot=tmp_path)
    assert (c.name, c.unmeasured) == ("cpu", None), c
    assert c.describe().startswith("backend auto -> cpu (no RKNPU device node; cpu-q not taken: its accuracy record "
                                   "fails: 1 of 2 acceptance answers differ from F32's"), c
    write_record(root, record("0" * 16))
    assert choose_backend(auto, tiny_synth_dir, sysroot=tmp_path).unmeasured == "cpu-q"


# ---- the default model through the real CLI --------------------------------------------------------
def cli(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edge_llm", *args], capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "EDGE_LLM_HOME": str(home), **env})


def answer(home: Path, model: Path, prompt: str, backend: str) -> subprocess.CompletedProcess:
    r = cli(home, "generate", "--model", str(model), "--backend", backend, "--temperature", "0", "--no-disk-kv",
            "--max-tokens", "24", "-p", prompt)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def backend_line(stderr: str) -> str:
    lines = [x for x in stderr.splitlines() if x.startswith(("backend auto", "backend cpu", "backend rknn"))
             and " runs as asked, but " not in x]
    assert len(lines) == 1, stderr
    return lines[0]


def quant_root(home: Path, model: Path) -> Path:
    (root,) = [p.parent for p in (home / "quant").glob(f"{model.name}-*-q4/manifest.json")]
    return root


@pytest.fixture(scope="module")
def first_start(home: Path, default_model_dir: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """`generate` with backend auto in a home where cpu-q was never built: it builds cpu-q, measures
    its record, then chooses (the France question, greedy)."""
    r = answer(home, default_model_dir, FACT, "auto")
    return r, json.loads((quant_root(home, default_model_dir) / RECORD).read_text())


@pytest.mark.timeout(TIMEOUT)
def test_auto_answers_the_acceptance_prompts_like_f32(home: Path, default_model_dir: Path, first_start) -> None:
    """The README's France question and the other acceptance prompts, greedy, on whatever auto picks here
    (this machine has no NPU: cpu-q or cpu): the same text as `--backend cpu`, and generate says which
    backend ran and why. auto picks cpu-q exactly when cpu-q's record passes (with the GGUF's own
    4-bit blocks it does not: France flips), and names the record either way."""
    from edge_llm.backends.graph.manifest import Manifest

    r, rec = first_start
    root = quant_root(home, default_model_dir)
    assert rec["key"] == Manifest.read(root).identity() and [a["prompt"] for a in rec["answers"]] == list(ACCEPTANCE)
    passed, why = judge(root, rec["key"])
    line = backend_line(r.stderr)
    if passed:
        assert line.startswith("backend auto -> cpu-q (no RKNPU device node; onnxruntime ") and why in line, line
    else:
        assert line.startswith("backend auto -> cpu (no RKNPU device node; cpu-q not taken: its accuracy record "
                               "fails: "), line
        assert why.removeprefix("accuracy record fails: ") in line, (line, why)
    for prompt in ACCEPTANCE:
        got = r if prompt == FACT else answer(home, default_model_dir, prompt, "auto")
        assert backend_line(got.stderr) == line  # measured once, then read
        assert got.stdout == answer(home, default_model_dir, prompt, "cpu").stdout, (prompt, got.stdout)
    assert "Paris" in r.stdout, r.stdout


def swap_layers(root: Path, a: str = "layer01.step", b: str = "layer02.step") -> None:
    """A deliberately bad cpu-q build: two layers' weight files exchanged (same shapes), the manifest's
    digests of them exchanged too, so it is consistent and only the numbers are wrong."""
    da, db = root / "onnx" / f"{a}.onnx.data", root / "onnx" / f"{b}.onnx.data"
    tmp = da.with_name("swap")
    da.rename(tmp), db.rename(da), tmp.rename(db)
    doc = json.loads((root / "manifest.json").read_text())
    g = {x["name"]: x for x in doc["graphs"]}
    g[a]["input_key"], g[b]["input_key"] = g[b]["input_key"], g[a]["input_key"]
    (root / "manifest.json").write_text(json.dumps(doc))


@pytest.mark.timeout(TIMEOUT)
def test_auto_skips_a_failing_record_and_says_why(home: Path, default_model_dir: Path, first_start,
                                                  tmp_path: Path) -> None:
    """cpu-q's weights changed after its record was measured (two layers exchanged): the old record is
    refused (another key), the new weights are measured at the next start, fail, and auto takes cpu
    and says why in generate's line, the log, and /health over real HTTP. An explicit `--backend
    cpu-q` still runs cpu-q, warned about once."""
    from edge_llm.backends.graph.manifest import Manifest

    root = quant_root(home, default_model_dir)
    before = json.loads((root / RECORD).read_text())
    swap_layers(root)
    key = Manifest.read(root).identity()
    assert key != before["key"] and judge(root, key)[0] is None  # refused: measured on other weights
    r = answer(home, default_model_dir, FACT, "auto")
    rec = json.loads((root / RECORD).read_text())
    assert rec["key"] == key and not rec["answers"][0]["same"], rec  # re-measured: France is wrong
    line = backend_line(r.stderr)
    assert line.startswith("backend auto -> cpu (no RKNPU device node; cpu-q not taken: its accuracy record fails: "
                           f"2 of 2 acceptance answers differ from F32's, e.g. {FACT!r}: "), line
    assert "Paris" in r.stdout, r.stdout
    with ServerProc(home, tmp_path, "--model", str(default_model_dir), "--no-disk-kv",
                    env={"EDGE_LLM_BACKEND": "auto"}).start() as srv:
        health = srv.health().json()
        assert health["backend"] == "cpu" and health["backend_reason"] == line, health
        assert line in srv.log() and "measuring the accuracy record" not in srv.log()  # read, not re-measured
    q = answer(home, default_model_dir, FACT, "cpu-q")
    warning = "backend cpu-q runs as asked, but its accuracy record fails: 2 of 2 acceptance answers differ from F32's"
    assert len(re.findall(re.escape(warning), q.stderr)) == 1, q.stderr  # once: generate shows the log line
    assert "backend cpu-q, set on the command line (--backend)" in q.stderr.splitlines(), q.stderr
    assert "Paris" not in q.stdout, q.stdout  # the bad weights ran, as asked


# ---- npu-mm directories ------------------------------------------------------------------------
def break_head(mm: Path) -> None:
    """A deliberately bad npu-mm conversion: the head's int8 weights negated (every logit's sign
    flipped), weights.npz and the manifest's digest of it rewritten, so only the numbers are wrong."""
    import numpy as np

    from edge_llm.backends.npu.matmul.decoder import MmManifest
    from edge_llm.weights import sha256_file

    with np.load(mm / "weights.npz") as z:
        w = {k: z[k] for k in z.files}
    w["head.w"] = -np.maximum(w["head.w"], -127)
    np.savez(mm / "weights.npz", **w)
    m = MmManifest.read(mm)
    m.weights_sha256 = sha256_file(mm / "weights.npz")
    m.write(mm)


@pytest.mark.timeout(TIMEOUT)
def test_auto_skips_an_npu_mm_directory_without_a_passing_record(home: Path, tiny_synth_dir: Path,
                                                                  tmp_path: Path) -> None:
    """`convert npu-mm` publishes its record (measured in the host emulation); with an RKNPU node (a
    fake one: the driver cannot exist here) auto runs the directory and names the record. Its weights
    changed: the record is refused and auto falls back, saying to convert again; measured again, the
    bad weights fail and auto says so. `--backend rknn` on it runs, warned once."""
    from edge_llm.backends.choice import choose_backend
    from edge_llm.backends.npu.matmul.decoder import MmManifest
    from edge_llm.convert.npu_mm import convert_mm8
    from edge_llm.qrecord import record_mm
    from edge_llm.settings import Settings

    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "rknpu").write_text("")
    mm = tmp_path / "mm"
    convert_mm8(tiny_synth_dir, mm, gptq_tokens=0)
    auto = Settings(backend="auto", rknn_dir=str(mm))
    c = choose_backend(auto, tiny_synth_dir, sysroot=tmp_path)
    assert c.name == "rknn" and "(w8a8 on the matmul API); accuracy record passes: acceptance answers as F32's" \
        in c.reason, c
    assert json.loads((mm / RECORD).read_text())["key"] == MmManifest.read(mm).identity()
    break_head(mm)
    c = choose_backend(auto, tiny_synth_dir, sysroot=tmp_path)
    assert c.name != "rknn" and c.reason.startswith(
        f"NPU at /dev/rknpu and a matching npu-mm manifest.json in {mm} (w8a8 on the matmul API) but its npu-mm "
        "accuracy record is for weights "), c
    assert "(changed since it was measured) (convert it again with this edge-llm)" in c.reason, c
    record_mm(tiny_synth_dir, mm)
    c = choose_backend(auto, tiny_synth_dir, sysroot=tmp_path)
    assert c.name != "rknn" and "(w8a8 on the matmul API) but its accuracy record fails: " in c.reason, c
    r = cli(home, "generate", "--model", str(tiny_synth_dir), "--backend", "rknn", "--rknn-dir", str(mm),
            "--rknn-runner", "host", "--no-disk-kv", "--max-tokens", "2", "-p", FACT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(re.findall(r"backend rknn runs as asked, but its accuracy record fails: ", r.stderr)) == 1, r.stderr
