"""`convert rknn` publishes OUT_DIR whole (docs/npu.md, "Publication"): a conversion SIGKILLed while
it builds leaves the old directory, loadable, or none; the next conversion reuses the old
directory's verified builds; a directory that is not a conversion's is refused before any work.
Real conversions (rknn-toolkit2 in the converter venv) of a tiny model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edge_llm.backends.npu.graphs.sim import converter_python
from edge_llm.errors import ConfigError

try:
    converter_python()
except ConfigError as e:  # `make test` builds it; a bare pytest run may not have it
    pytestmark = pytest.mark.skip(reason=f"converter venv missing ({e}); run tools/setup-converter.sh")

HANG = 600  # a bound on a hang, not a speed target


def convert(model: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "edge_llm", "convert", "rknn", str(model), str(out),
                             "--vision-grids", "none", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_while_building(proc: subprocess.Popen, out: Path) -> None:
    """SIGKILL `proc` once it has written the new manifest.json (the graphs are exported and
    range-checked, the toolkit builds them now): in the new directory beside `out`, or in `out`
    itself (where a conversion that wrote in place would have put it)."""
    def stamp() -> int | None:
        try:
            return (out / "manifest.json").stat().st_mtime_ns
        except FileNotFoundError:
            return None

    old = stamp()
    deadline = time.monotonic() + HANG
    while time.monotonic() < deadline:
        if any(out.parent.glob(f".tmp-{out.name}-*/manifest.json")) or stamp() != old:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return
        assert proc.poll() is None, f"the conversion ended before it was killed: {proc.communicate()[1][-2000:]}"
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("no new directory with a manifest appeared")


def finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=HANG)
    assert proc.returncode == 0, err[-3000:]
    return out


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def decode_once(model: Path, out: Path) -> np.ndarray:
    """The directory loads (its files verified against its manifest) and runs one token."""
    from edge_llm.backends.npu.backend import open_rknn
    from edge_llm.models.qwen3 import Model

    be = open_rknn(out, "onnxruntime", model_dir=model)
    try:
        m = Model.load(model, backend=be)
        cache = m.new_cache(8, check_memory=False)
        return m.forward([1, 2, 3], cache)
    finally:
        be.close()


@pytest.mark.timeout(1800)
def test_a_killed_conversion_leaves_the_old_directory_or_none(tiny_synth_dir, tmp_path):
    import json

    out = tmp_path / "out"
    kill_while_building(convert(tiny_synth_dir, out), out)
    assert not out.exists()  # a first conversion killed: none

    finish(convert(tiny_synth_dir, out))  # the stale new directory of the killed one is removed first
    assert not list(tmp_path.glob(".tmp-out-*"))
    before = tree(out)
    logits = decode_once(tiny_synth_dir, out)

    kill_while_building(convert(tiny_synth_dir, out, "--chunks", "1,32"), out)  # other shapes: new builds
    assert tree(out) == before  # the old directory, whole
    assert np.array_equal(decode_once(tiny_synth_dir, out), logits)

    finish(convert(tiny_synth_dir, out))  # the same options again: every build reused from the old directory
    m = json.loads((out / "manifest.json").read_text())
    assert m["build"]["built"] == 0 and m["build"]["reused"] == len(m["graphs"])
    assert {k: v for k, v in tree(out).items() if k.startswith("rknn/")} == \
        {k: v for k, v in before.items() if k.startswith("rknn/")}
    assert not list(tmp_path.glob(".tmp-out-*"))


def test_a_directory_that_is_not_a_conversion_is_refused(tiny_synth_dir, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    proc = convert(tiny_synth_dir, out)
    _, err = proc.communicate(timeout=HANG)
    assert proc.returncode != 0 and "not an earlier `convert rknn` output" in err and "replaced as a whole" in err
    assert (out / "notes.txt").read_text() == "keep me" and os.listdir(out) == ["notes.txt"]
