"""Multi-picture JPEGs (MPO, as phone cameras write: the photo, then a preview or depth picture)
are taken as their first picture, through the server's own path (header, then decode), made by
Pillow here as a camera would write one (docs/vision.md)."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
from PIL import Image
from serverutil import ServerProc

from edge_llm.vision.preprocess import PreprocessConfig, prepare_image, read_header

_y, _x = np.mgrid[0:192, 0:256]
PHOTO = Image.fromarray(np.stack([_x, _y * 255 // 191, (_x + _y) * 3 % 256], -1).astype(np.uint8))
PREVIEW = Image.new("RGB", (64, 48), (250, 10, 10))  # another size and colour: must not be what is used


def encoded(fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    PHOTO.save(buf, fmt, quality=90, **kw)
    return buf.getvalue()


MPO = encoded("MPO", save_all=True, append_images=[PREVIEW])
JPEG = encoded("JPEG")


def test_mpo_is_its_first_picture():
    with Image.open(io.BytesIO(MPO)) as im:  # a real two-picture MPO
        assert im.format == "MPO" and getattr(im, "n_frames", 1) == 2
    cfg = PreprocessConfig()
    h = read_header(MPO, cfg)
    assert (h.format, h.width, h.height) == ("MPO", 256, 192)
    assert h.n_tokens == read_header(JPEG, cfg).n_tokens
    got, ref = prepare_image(MPO, cfg), prepare_image(JPEG, cfg)
    assert got.grid_thw == ref.grid_thw and got.digest == ref.digest  # the same pixels, bit for bit
    assert got.source == "MPO 256x192"


def test_mpo_through_the_server(tiny_synth_dir, edge_home, tmp_path):
    url = "data:image/jpeg;base64," + base64.b64encode(MPO).decode()
    with ServerProc(edge_home, tmp_path, "--model", str(tiny_synth_dir), "--max-seq", "1024").start() as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=300, json={"max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is this?"}]}]})
        assert r.status_code == 200, r.text
        t = r.json()["timings"]
        assert t["images"] == 1 and t["images_encoded"] == 1
        assert t["image_tokens"] == read_header(JPEG, PreprocessConfig()).n_tokens
