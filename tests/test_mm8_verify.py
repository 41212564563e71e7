"""An `edge-llm convert npu-mm` directory is verified before it is trusted (docs/npu.md,
"Publication" and "Verification at load"): the conversion publishes its directory atomically (a
real subprocess killed with SIGKILL at each step leaves the old directory or none, never a mix),
and at load weights.npz must have the manifest's digest, its scales must be finite and non-zero
and its rotations finite and orthogonal, and the snapshot namespace follows the verified bytes.
The default model's real weights (round-to-nearest conversion) for the load checks; the tiny
synthetic model for the kills (a conversion in under a second)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from serverutil import free_port

from edge_llm.backends.npu.backend import open_rknn
from edge_llm.backends.npu.matmul.decoder import MANIFEST, WEIGHTS, MmManifest
from edge_llm.backends.record import RECORD
from edge_llm.convert.npu_mm import convert_mm8
from edge_llm.errors import ConfigError
from edge_llm.models.qwen3 import Model
from edge_llm.snapshot.identity import Identity
from edge_llm.weights import sha256_file

HELPER = Path(__file__).parent / "helpers" / "killed_convert.py"
MISMATCH = "is not the manifest.json's weights_sha256"


def load(d: Path, model_dir: Path) -> Model:
    return Model.load(model_dir, backend=open_rknn(d, "host", model_dir=model_dir))


def refusal(d: Path, model_dir: Path) -> str:
    be = open_rknn(d, "host", model_dir=model_dir)
    with pytest.raises(ConfigError) as e:
        Model.load(model_dir, backend=be)
    return str(e.value)


def rewrite(src: Path, dst: Path, change: Callable[[dict], None], digest: bool = True) -> Path:
    """src's arrays changed by `change` saved into dst; the manifest's digest rewritten to match
    (digest=True: only the values are wrong) or src's manifest kept as it is."""
    with np.load(src / WEIGHTS) as z:
        arrays = {k: z[k] for k in z.files}
    change(arrays)
    dst.mkdir()
    np.savez(dst / WEIGHTS, **arrays)
    if digest:
        dataclasses.replace(MmManifest.read(src), weights_sha256=sha256_file(dst / WEIGHTS)).write(dst)
    else:
        shutil.copy(src / MANIFEST, dst / MANIFEST)
    return dst


def namespace(model: Model, model_dir: Path) -> str:
    return Identity.for_model(model_dir, model.args, model.numerics).namespace


def test_changed_byte_is_refused_and_the_server_says_so(default_mm_rtn, default_model_dir, edge_home, tmp_path):
    """One flipped bit in the middle of weights.npz: the load names the file, the actual and the
    manifest's digest prefixes; `serve --backend rknn` exits 1 with that message (no fallback)."""
    d = tmp_path / "mm"
    shutil.copytree(default_mm_rtn, d)
    with open(d / WEIGHTS, "r+b") as f:
        f.seek(os.path.getsize(d / WEIGHTS) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))
    claimed, actual = MmManifest.read(d).weights_sha256, sha256_file(d / WEIGHTS)
    msg = refusal(d, default_model_dir)
    assert f"{d / WEIGHTS}: sha256 {actual[:16]}" in msg and f"{MISMATCH} {claimed[:16]}" in msg, msg
    r = subprocess.run([sys.executable, "-m", "edge_llm", "serve", "--model", "default", "--backend", "rknn",
                        "--rknn-dir", str(d), "--rknn-runner", "host", "--no-disk-kv", "--port", str(free_port()),
                        "--log-file", "off"], env={**os.environ, "EDGE_LLM_HOME": str(edge_home)},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and f"sha256 {actual[:16]}" in r.stderr, r.stderr[-3000:]


def test_truncated_weights_are_refused(default_mm_rtn, default_model_dir, tmp_path):
    d = tmp_path / "mm"
    shutil.copytree(default_mm_rtn, d)
    size = os.path.getsize(d / WEIGHTS)
    os.truncate(d / WEIGHTS, size - 4096)
    msg = refusal(d, default_model_dir)
    assert f"{d / WEIGHTS}: sha256" in msg and f"({size - 4096} bytes) {MISMATCH}" in msg, msg


def test_half_written_directory_is_refused(default_mm_rtn, default_model_dir, tmp_path):
    """What an older converter left when killed between its two files: the weights of a new
    conversion (other options) under the old conversion's manifest."""
    new = tmp_path / "new"
    convert_mm8(default_model_dir, new, gptq_tokens=0, rotation="none", clip="none")
    d = tmp_path / "mixed"
    d.mkdir()
    shutil.copy(default_mm_rtn / MANIFEST, d / MANIFEST)
    shutil.copy(new / WEIGHTS, d / WEIGHTS)
    assert MISMATCH in refusal(d, default_model_dir)
    load(new, default_model_dir).backend.close()  # the new conversion itself is sound


def test_swapped_layers_are_refused_or_get_their_own_namespace(default_mm_rtn, default_model_dir, tmp_path):
    """Layers 3 and 4 exchanged: under the genuine manifest refused; with the manifest's digest
    rewritten to match, loaded, but in another snapshot namespace than the genuine directory's
    (so it never restores the genuine server's snapshots)."""
    def swap(a: dict) -> None:
        for k in [k for k in a if k.startswith("layer.3.")]:
            other = "layer.4." + k[len("layer.3."):]
            a[k], a[other] = a[other], a[k]

    kept = rewrite(default_mm_rtn, tmp_path / "kept", swap, digest=False)
    assert MISMATCH in refusal(kept, default_model_dir)
    genuine = load(default_mm_rtn, default_model_dir)
    swapped = load(rewrite(default_mm_rtn, tmp_path / "swapped", swap), default_model_dir)
    try:
        assert namespace(swapped, default_model_dir) != namespace(genuine, default_model_dir)
        assert swapped.numerics != genuine.numerics
    finally:
        genuine.backend.close()
        swapped.backend.close()


def _set(key: str, index: tuple, value: float) -> Callable[[dict], None]:
    def change(a: dict) -> None:
        a[key] = np.array(a[key])
        a[key][index] = value
    return change


def _scale(key: str, factor: float) -> Callable[[dict], None]:
    def change(a: dict) -> None:
        a[key] = a[key] * np.float32(factor)
    return change


@pytest.mark.parametrize("change, expect", [
    (_set("head.s", (5,), np.nan), "scale 'head.s' of shape (49152,) has 1 NaN value (first at index 5)"),
    (_set("layer.2.o.s", (7,), np.inf), "scale 'layer.2.o.s' of shape (576,) has 1 Inf value (first at index 7)"),
    (_set("layer.0.qkv.s", (3,), 0.0), "scale 'layer.0.qkv.s' of shape (960,) has 1 zero value (first at index 3)"),
    (_set("rotation_scale", (0,), 0.0), "scale 'rotation_scale' of shape (576,) has 1 zero value (first at index 0)"),
    (_set("rotation", (2, 9), np.nan), "rotation 'rotation' of shape (576, 576) has 1 NaN value (first at index 1161)"),
    (_scale("down_block", 1.5), "rotation 'down_block' is not orthogonal"),
], ids=["nan-scale", "inf-scale", "zero-scale", "zero-rotation-scale", "nan-rotation", "skewed-rotation"])
def test_bad_values_are_refused(default_mm_rtn, default_model_dir, tmp_path, change, expect):
    """With the digest matching (the values themselves wrong), the tensor is named and what is
    wrong with it; an Inf scale used to answer "tttt..." with /health ok."""
    d = rewrite(default_mm_rtn, tmp_path / "bad", change)
    msg = refusal(d, default_model_dir)
    assert f"{d / WEIGHTS}: {expect}" in msg, msg



def test_matching_digest_over_a_broken_archive_is_unreadable(default_mm_rtn, default_model_dir, tmp_path):
    """A weights.npz that is not an npz archive, under a manifest whose digest names exactly those
    bytes: refused as unreadable (a ConfigError naming the file), not a raw zipfile error."""
    d = tmp_path / "mm"
    d.mkdir()
    (d / WEIGHTS).write_bytes(b"PK\x03\x04" + b"not an npz archive" * 100)  # a zip's magic, then junk
    dataclasses.replace(MmManifest.read(default_mm_rtn), weights_sha256=sha256_file(d / WEIGHTS)).write(d)
    assert f"{d / WEIGHTS}: unreadable (" in refusal(d, default_model_dir)

# ---- publication -------------------------------------------------------------------------------
def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("point, left", [("weights", "old"), ("swap", "old"), ("aside", "none"), ("old", "new")])
def test_killed_conversion_leaves_old_or_none(tiny_synth_dir, tmp_path, point, left):
    """`convert npu-mm` over an earlier conversion, killed (SIGKILL, a real subprocess) at each
    step of the publication: OUT_DIR is the old directory (it loads), none (refused: no manifest)
    or, once the rename is done, the new one, never a mix; the next conversion removes the
    killed one's leftovers and publishes."""
    out = tmp_path / "mm"
    convert_mm8(tiny_synth_dir, out, gptq_tokens=0, clip="none")
    old = _files(out)
    options = ["--gptq-tokens", "0", "--rotation", "none"]  # another conversion than the old one
    r = subprocess.run([sys.executable, str(HELPER), point, str(tiny_synth_dir), str(out), *options],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-3000:])
    if left == "none":
        assert not out.exists()
        with pytest.raises(ConfigError, match="manifest.json: not found"):
            open_rknn(out, "host", model_dir=tiny_synth_dir)
    else:
        assert (_files(out) == old) == (left == "old")
        assert MmManifest.read(out).rotation == ("hadamard" if left == "old" else "none")
        load(out, tiny_synth_dir).backend.close()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-mm-")]  # the killed run's, ignored above
    convert_mm8(tiny_synth_dir, out, gptq_tokens=0, rotation="none")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []
    assert MmManifest.read(out).rotation == "none" and sorted(os.listdir(out)) == sorted([MANIFEST, RECORD, WEIGHTS])
    load(out, tiny_synth_dir).backend.close()


def test_conversion_refuses_a_directory_with_other_files(tiny_synth_dir, tmp_path):
    """Publication replaces OUT_DIR as a whole: a directory holding anything but a conversion's
    files is refused before any work, and keeps its files."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds 1 file\(s\) that are not an npu-mm conversion's \(notes.txt"):
        convert_mm8(tiny_synth_dir, out, gptq_tokens=0)
    assert os.listdir(out) == ["notes.txt"]

