"""Images through the real server process (tiny synthetic Qwen3-VL with a vision tower):
every bad image input is a 400 naming the problem and the server keeps serving; an image
conversation survives SIGKILL + restart (image rows restored from disk, tail-only prefill, text
bitwise equal to a server that never restarted); a different image with the same text never
reuses the first image's rows, in RAM or from disk."""

from __future__ import annotations

import base64
import io
import re
import shutil

import httpx
import numpy as np
import pytest
from PIL import Image
from edge_llm.costgate import GATE_FILE
from serverutil import ServerProc, wait_for

SYSTEM = {"role": "system", "content": "You are a careful assistant who describes pictures in detail."}


def png(w: int, h: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    arr = np.stack([x * 255 // w, y * 255 // h, (x ^ y) & 255], -1) + rng.integers(0, 30, (h, w, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def user(text: str, *urls: str) -> dict:
    return {"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                        {"type": "text", "text": text}]}


def post(srv: ServerProc, messages: list[dict], max_tokens: int = 8) -> httpx.Response:
    return httpx.post(srv.url + "/v1/chat/completions", timeout=600,
                      json={"messages": messages, "max_tokens": max_tokens, "temperature": 0})


def ok(srv: ServerProc, messages: list[dict], max_tokens: int = 8) -> dict:
    r = post(srv, messages, max_tokens)
    assert r.status_code == 200, r.text
    return r.json()


PHOTO_A, PHOTO_B = png(256, 256, seed=1), png(256, 256, seed=2)  # 64 image tokens each
QUESTION = "What is shown in this picture? Describe the colours."


def test_bad_image_inputs_are_400_and_the_server_keeps_serving(tiny_synth_dir, edge_home, tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    (images / "a.png").write_bytes(PHOTO_A)
    (tmp_path / "secret.png").write_bytes(PHOTO_A)
    bomb = io.BytesIO()
    Image.new("L", (6000, 6000)).save(bomb, "PNG")  # 36 Mpx in ~35 KB
    pillow_bomb = io.BytesIO()  # over Pillow's own threshold (89 Mpx): its warning must not leak
    Image.new("L", (9600, 9600)).save(pillow_bomb, "PNG")
    noise = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (400, 400, 3)).astype(np.uint8)).save(noise, "PNG")
    cases = {  # name: (url, expected code, a word the message must contain)
        "not an image": (data_url(b"this is plain text, not a picture"), "not-an-image", "not a recognisable image"),
        "truncated": (data_url(PHOTO_A[:2000]), "not-an-image", "truncated"),
        "gif": (data_url(png(64, 64, fmt="GIF"), "image/gif"), "unsupported-format", "GIF"),
        "bmp": (data_url(png(64, 64, fmt="BMP"), "image/bmp"), "unsupported-format", "BMP"),
        "too many bytes": (data_url(noise.getvalue()), "too-large", "bytes"),
        "decompression bomb": (data_url(bomb.getvalue()), "too-large", "pixels"),
        "bomb over Pillow's threshold": (data_url(pillow_bomb.getvalue()), "too-large", "pixels"),
        "bad base64": ("data:image/png;base64,@@@not-base64@@@", "image_data_url", "base64"),
        "not image media": ("data:text/plain;base64," + base64.b64encode(b"hi").decode(), "not-an-image",
                            "not an image"),
        "remote url": ("https://example.invalid/cat.png", "image_url_remote", "not fetched"),
        "outside image dir": (str(tmp_path / "secret.png"), "image_path", "outside"),
        "escape image dir": ("../secret.png", "image_path", "outside"),
        "missing file": ("nothere.png", "image_path", "not found"),
        "NUL in the path": ("a.png\x00.txt", "image_path", "NUL"),
        "name too long": ("x" * 5000 + ".png", "image_path", "cannot be opened"),
    }
    args = ("--model", str(tiny_synth_dir), "--max-seq", "1024", "--image-dir", str(images),
            "--max-image-bytes", "300000", "--max-image-pixels", "20000000")
    with ServerProc(edge_home, tmp_path / "srv", *args).start() as srv:
        for name, (url, code, word) in cases.items():
            r = post(srv, [user(QUESTION, url)])
            assert r.status_code == 400, (name, r.text)
            err = r.json()["error"]
            assert err["code"] == code and word in err["message"], (name, err)
            assert err["param"] == "messages"
        # placeholder tokens typed into a chat message are plain text, not images
        r = post(srv, [{"role": "user", "content": "look: <|vision_start|><|image_pad|><|vision_end|>"}])
        assert r.status_code == 200 and r.json()["timings"]["images"] == 0, r.text
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x <|image_pad|> y", "max_tokens": 2})
        assert r.status_code == 400 and "placeholder" in r.json()["error"]["message"], r.text
        # still serving: an image from the allowed directory and one as a data: URL, two per message
        body = ok(srv, [SYSTEM, user(QUESTION, "a.png", data_url(PHOTO_B))])
        t = body["timings"]
        assert t["images"] == 2 and t["images_encoded"] == 2 and t["image_tokens"] == 128 and t["vision_ms"] > 0
        assert body["usage"]["prompt_tokens"] > 128
        assert srv.health().json()["status"] == "ok"
        assert "DecompressionBombWarning" not in srv.stderr() + srv.log()
    # an image sent to a text-only model
    with ServerProc(edge_home, tmp_path / "srv2", "--model", "default", "--max-seq", "1024").start() as srv:
        r = post(srv, [user(QUESTION, data_url(PHOTO_A))])
        assert r.status_code == 400 and r.json()["error"]["code"] == "no-vision", r.text
        assert ok(srv, [{"role": "user", "content": "Say hi."}], 2)["choices"][0]["finish_reason"]


def image_run_start(body_prompt_tokens: int, timings: dict) -> int:
    return body_prompt_tokens - timings["prefill_tokens"]


@pytest.mark.slow
def test_image_conversation_restored_after_sigkill(tiny_synth_dir, edge_home, tmp_path):
    # a small chunk: the reuse points of these short turns (cut back to chunk multiples) stay past the image
    args = ("--model", str(tiny_synth_dir), "--max-seq", "1024", "--prefill-chunk", "16")
    turn1 = [SYSTEM, user(QUESTION, data_url(PHOTO_A))]

    def turn2(first_answer: str, photo: bytes = PHOTO_A) -> list[dict]:
        return [SYSTEM, user(QUESTION, data_url(photo)), {"role": "assistant", "content": first_answer},
                {"role": "user", "content": "And what is in the top left corner?"}]

    # a server that never restarts: the reference text
    with ServerProc(edge_home, tmp_path / "ref", *args).start() as ref:
        a1 = ok(ref, turn1)
        ref_answer = a1["choices"][0]["message"]["content"]
        ref2 = ok(ref, turn2(ref_answer))
        assert ref2["timings"]["cache_source"] == "ram" and ref2["timings"]["images_encoded"] == 0

    kv, log_file = tmp_path / "kv", tmp_path / "edge-llm.log"

    def server() -> ServerProc:
        return ServerProc(edge_home, tmp_path / "s", *args, kv_dir=kv, log_file=log_file).start()

    srv = server()
    r1 = ok(srv, turn1)
    assert r1["choices"][0]["message"]["content"] == ref_answer
    assert r1["timings"]["images_encoded"] == 1 and r1["timings"]["image_tokens"] == 64
    wait_for(lambda: re.search(r"\[KV-DISK\] saved \d+-token KV", srv.log()), what="snapshot saved")
    srv.kill()  # SIGKILL: nothing runs after this

    srv = server()
    mark = srv.log_size()
    r2 = ok(srv, turn2(ref_answer))
    t2, u2 = r2["timings"], r2["usage"]
    log = srv.log(mark)
    assert t2["cache_source"] == "disk" and "loaded" in log, log
    assert u2["prompt_tokens_details"]["cached_tokens"] == t2["disk_cached_tokens"]
    # the image rows came from disk: nothing was encoded, only the new text was prefilled
    assert t2["images"] == 1 and t2["images_encoded"] == 0 and t2["vision_ms"] == 0
    first_turn_len = r1["usage"]["prompt_tokens"]
    # all of turn 1 but the last prompt token, cut back to a multiple of the prefill chunk (16 here)
    assert t2["disk_cached_tokens"] >= (first_turn_len - 1) // 16 * 16
    assert re.search(rf"\[PREFILL-TIMING\] n={t2['prefill_tokens']} ", log)
    assert t2["prefill_tokens"] == u2["prompt_tokens"] - t2["disk_cached_tokens"] < u2["prompt_tokens"] - 64
    assert r2["choices"][0]["message"]["content"] == ref2["choices"][0]["message"]["content"]

    # a copy of the snapshots as they are now: every one of them holds photo A
    wait_for(lambda: len(re.findall(r"\[KV-DISK\] saved \d+-token KV", srv.log(mark))) == 1,
             what="turn 2 saved")
    shutil.copytree(kv, tmp_path / "kv-a")
    # r4 below is about what the disk holds, not the cost gate: without r2's estimates the gate
    # restores (r2's read of a few KB, timed on a loaded machine, could tip it to recompute)
    for estimates in (tmp_path / "kv-a").rglob(GATE_FILE):
        estimates.unlink()

    # the same text with another image: RAM reuse (and the disk) stop where the image starts
    r3 = ok(srv, turn2(ref_answer, PHOTO_B))
    t3 = r3["timings"]
    assert t3["images_encoded"] == 1 and t3["cache_source"] == "ram"
    run_start = t3["ram_cached_tokens"]  # the image run's start, cut back to a chunk multiple (16)
    assert 16 <= run_start < r1["usage"]["prompt_tokens"] - 64 and run_start % 16 == 0
    srv.kill()

    # ... and from disk alone: a restarted server with only photo A's snapshots
    with ServerProc(edge_home, tmp_path / "s2", *args, kv_dir=tmp_path / "kv-a",
                    log_file=tmp_path / "s2.log").start() as srv:
        r4 = ok(srv, turn2(ref_answer, PHOTO_B))
        t4 = r4["timings"]
        assert t4["images_encoded"] == 1 and t4["cache_source"] == "disk"
        assert t4["disk_cached_tokens"] == run_start
        assert r4["choices"][0]["message"]["content"] == r3["choices"][0]["message"]["content"]


def test_cli_image_prompt_and_errors_name_the_file(tiny_synth_dir, edge_home, tmp_path):
    """`edge-llm generate --image`: the image's 64 rows are in the prompt (its placeholders stay
    control tokens while the typed text is plain text), and a bad file is named in the error."""
    import os
    import subprocess
    import sys

    photo, bad = tmp_path / "photo.png", tmp_path / "notes.png"
    photo.write_bytes(PHOTO_A)
    bad.write_bytes(b"not an image at all")
    env = {**os.environ, "EDGE_LLM_HOME": str(edge_home)}
    base = [sys.executable, "-m", "edge_llm", "generate", "--model", str(tiny_synth_dir), "--no-disk-kv",
            "--max-tokens", "2", "--temperature", "0"]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(base + list(args), capture_output=True, text=True, timeout=600, env=env)

    text_only = run("-p", QUESTION)
    with_image = run("--image", str(photo), "-p", QUESTION)
    assert text_only.returncode == 0 and with_image.returncode == 0, with_image.stderr
    n0, n1 = (int(re.search(r"prefill (\d+) tok", r.stderr)[1]) for r in (text_only, with_image))
    assert n1 - n0 == 64 + 2  # the image's rows + vision_start/vision_end
    r = run("--image", str(bad), "-p", QUESTION)
    assert r.returncode == 1 and f"--image {bad}" in r.stderr and "not a recognisable image" in r.stderr, r.stderr
