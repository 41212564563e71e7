"""Image input against transformers: the preprocessing equals Qwen2VLImageProcessorPil (what
AutoImageProcessor gives a qwen3_vl model without torchvision) on real PNG/JPEG/WebP files, and a
tiny random Qwen3VLForConditionalGeneration with a vision tower, built and saved by transformers,
gives the same logits and greedy tokens with one and two images."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile, ImageOps

from edge_llm.errors import ImageDecodeError, ImageFormatError, ImageTooLarge
from edge_llm.models.qwen3 import Model
from edge_llm.vision.model import VisionModel
from edge_llm.vision.preprocess import (
    ImageLimits,
    PreprocessConfig,
    decode_image,
    prepare_image,
    preprocess,
    read_header,
)

REL_TOL = 1e-4
IMAGE_PAD, VISION_START, VISION_END = 251, 252, 253
# small pixel bounds keep the tiny model's image runs short (6..16 tokens)
TINY_PIXELS = dict(shortest_edge=64 * 64, longest_edge=128 * 128)


def hf_processor(**size):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2,
                                    image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                    size=size or dict(shortest_edge=65536, longest_edge=16777216))


def make_image(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A picture with structure (gradients + shapes + noise) so resampling differences show."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)),
                    ((x // 7 + y // 5) % 2) * 200], axis=-1).astype(np.int64)
    rgb += rng.integers(-20, 21, rgb.shape)
    img = Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB")
    if mode == "RGBA":
        alpha = Image.fromarray(((x + y) % 256).astype(np.uint8), "L")
        img = img.convert("RGBA")
        img.putalpha(alpha)
    elif mode in ("L", "P"):
        img = img.convert(mode)
    return img


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


# (width, height, mode, format, pixel bounds): several sizes and aspect ratios; 100x80 is below
# min_pixels (upscaled), 1400x1000 above the lowered max_pixels (downscaled)
CASES = [
    (640, 480, "RGB", "PNG", None), (100, 80, "RGB", "JPEG", None), (333, 1000, "RGB", "JPEG", None),
    (1000, 90, "RGBA", "PNG", None), (257, 255, "L", "PNG", None), (300, 200, "P", "PNG", None),
    (1400, 1000, "RGB", "JPEG", dict(shortest_edge=65536, longest_edge=200_000)),
    (512, 512, "RGB", "WEBP", None),
]


@pytest.mark.parametrize("w,h,mode,fmt,bounds", CASES, ids=[f"{c[0]}x{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_preprocessing_equals_transformers(tmp_path, w, h, mode, fmt, bounds):
    data = encode(make_image(w, h, mode), fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    path = tmp_path / f"img.{fmt.lower()}"
    path.write_bytes(data)
    size = bounds or dict(shortest_edge=65536, longest_edge=16777216)
    # the processor gets the decoded PIL image as is (EXIF applied, mode kept): it converts
    # RGBA/L/P itself (alpha composited onto white)
    ref = hf_processor(**size)(images=[ImageOps.exif_transpose(Image.open(path))], return_tensors="np")
    cfg = PreprocessConfig(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
    img, got_fmt = decode_image(data)
    pixels, grid = preprocess(img, cfg)
    assert got_fmt == fmt
    assert list(grid) == ref["image_grid_thw"][0].tolist()
    assert pixels.shape == ref["pixel_values"].shape and pixels.dtype == np.float32
    diff = float(np.abs(pixels - ref["pixel_values"]).max())
    print(f"{w}x{h} {mode} {fmt}: grid {grid}, max |diff| {diff:.2e}")
    assert diff <= 1e-6
    area = grid[1] * grid[2] * 256
    assert cfg.min_pixels <= area <= cfg.max_pixels


def test_exif_orientation_is_applied(tmp_path):
    from transformers.image_utils import load_image

    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: rotate 90 degrees clockwise when displayed
    data = encode(make_image(120, 300), "JPEG", exif=exif.tobytes())
    (tmp_path / "r.jpg").write_bytes(data)
    out, _ = decode_image(data)
    assert out.size == (300, 120)
    assert np.array_equal(np.asarray(out), np.asarray(load_image(str(tmp_path / "r.jpg"))))


@pytest.mark.parametrize("data,err", [
    (b"hello, not an image", ImageDecodeError),
    (encode(make_image(64, 64), "PNG")[:300], ImageDecodeError),
    (encode(make_image(64, 64), "GIF"), ImageFormatError),
    (encode(make_image(64, 64), "BMP"), ImageFormatError),
])
def test_bad_images_are_refused(data, err):
    with pytest.raises(err):
        decode_image(data)


def test_limits_apply_before_decoding():
    data = encode(Image.new("L", (5000, 5000)), "PNG")  # ~25 KB of zlib: a decompression bomb
    assert len(data) < 100_000
    with pytest.raises(ImageTooLarge, match="pixels"):
        decode_image(data, ImageLimits(max_source_pixels=10_000_000))
    with pytest.raises(ImageTooLarge, match="bytes"):
        decode_image(data, ImageLimits(max_bytes=1000))


@pytest.mark.parametrize("w,h,mode,fmt,bounds", CASES, ids=[f"{c[0]}x{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_header_token_count_equals_the_decoded_one(w, h, mode, fmt, bounds):
    """The server sizes a request from headers alone: the count must be the decoded image's."""
    size = bounds or dict(shortest_edge=65536, longest_edge=16777216)
    cfg = PreprocessConfig(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
    data = encode(make_image(w, h, mode), fmt)
    head = read_header(data, cfg)
    assert (head.format, head.width, head.height) == (fmt, w, h)
    assert head.n_tokens == prepare_image(data, cfg).n_tokens


def test_header_token_count_under_exif_rotation():
    exif = Image.Exif()
    exif[0x0112] = 6  # decoded as 300x120: the count does not depend on the rotation
    data = encode(make_image(120, 700), "JPEG", exif=exif.tobytes())
    cfg = PreprocessConfig()
    head, img = read_header(data, cfg), prepare_image(data, cfg)
    assert img.grid_thw[1] < img.grid_thw[2] and head.n_tokens == img.n_tokens


def test_header_reads_no_pixels():
    """A 4096x4096 PNG of zeros (a few KB; 402 MB of float32 once preprocessed) is sized, and its
    limits checked, from the header: the image is never decoded."""
    from unittest import mock

    data = encode(Image.new("L", (4096, 4096)), "PNG")
    with mock.patch.object(ImageFile.ImageFile, "load", side_effect=AssertionError("pixels decoded")):
        head = read_header(data, PreprocessConfig())
        with pytest.raises(ImageTooLarge, match="pixels"):
            read_header(data, PreprocessConfig(), ImageLimits(max_source_pixels=10_000_000))
    assert head.n_tokens == 128 * 128  # max_pixels 4096x4096 / (32x32) per token


# ---- the model ------------------------------------------------------------------------------
def build_tiny_vl(path):
    """A tiny random Qwen3-VL with a 3-block vision tower and two DeepStack mergers."""
    import transformers as tf

    torch.manual_seed(0)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512,
                rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=5e6,
                                                        mrope_section=[4, 2, 2], mrope_interleaved=True))
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=[0, 2])
    cfg = tf.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                           image_token_id=IMAGE_PAD, vision_start_token_id=VISION_START,
                           vision_end_token_id=VISION_END, video_token_id=254)
    model = tf.Qwen3VLForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # spread the weights so images and DeepStack visibly move the logits
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_((1.0 if "norm" in name and "weight" in name else 0.0) + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / p[0].numel() ** 0.5))
    model.save_pretrained(path)
    hf_processor(**TINY_PIXELS).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    path = build_tiny_vl(tmp_path_factory.mktemp("tiny-vl"))
    import transformers as tf

    hf = tf.Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    model = Model.load(path)
    vision = VisionModel.load(path, model.args)
    assert vision is not None
    return path, hf, model, vision


PHOTOS = [encode(make_image(96, 64, seed=1), "PNG"), encode(make_image(200, 120, seed=2), "JPEG", quality=85)]


def prompt(images, seed=0):
    """text, <vision_start> pads <vision_end>, text, ... with one pad per image (expanded later)."""
    rng = np.random.default_rng(seed)
    ids = list(rng.integers(0, 240, 7))
    for n in images:
        ids += [VISION_START] + [IMAGE_PAD] * n + [VISION_END] + list(rng.integers(0, 240, 5))
    return ids


def hf_inputs(tiny_vl, photos):
    path, _, _, vision = tiny_vl
    proc = hf_processor(**TINY_PIXELS)
    imgs = [Image.open(io.BytesIO(p)).convert("RGB") for p in photos]
    ref = proc(images=imgs, return_tensors="pt")
    prepared = [vision.prepare(p) for p in photos]
    for i, p in enumerate(prepared):  # our preprocessing is the processor's, bit for bit
        assert list(p.grid_thw) == ref["image_grid_thw"][i].tolist()
    ours_px = np.concatenate([p.pixel_values for p in prepared])
    assert np.array_equal(ours_px, ref["pixel_values"].numpy())
    ids = prompt([p.n_tokens for p in prepared])
    tt = torch.tensor([ids])
    return prepared, ids, dict(input_ids=tt, pixel_values=ref["pixel_values"],
                               image_grid_thw=ref["image_grid_thw"],
                               mm_token_type_ids=(tt == IMAGE_PAD).int(), attention_mask=torch.ones_like(tt))


def ours_logits(model, vision, prepared, ids, deepstack=True):
    plan = vision.plan(ids, prepared)
    vis, _, n_enc = vision.visual_rows(plan, 0, plan.n)
    assert n_enc == len(prepared)
    if not deepstack:
        vis.deepstack = []
    cache = model.new_cache(256, check_memory=False)
    return model.forward(plan.keys, cache, all_logits=True, positions=plan.positions, visual=vis), plan


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("n_images", [1, 2])
def test_logits_and_greedy_match_transformers(tiny_vl, n_images, record_property):
    _, hf, model, vision = tiny_vl
    prepared, ids, inputs = hf_inputs(tiny_vl, PHOTOS[:n_images])
    with torch.no_grad():
        ref = hf(**inputs).logits[0].numpy()
    ours, plan = ours_logits(model, vision, prepared, ids)
    r = rel(ours, ref)
    record_property("max_rel_diff", r)
    print(f"{n_images} image(s), {plan.image_tokens} image tokens of {plan.n}: logits rel diff {r:.2e}")
    assert r <= REL_TOL
    # HF's position bookkeeping agrees with ours
    pos_ref, _ = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    assert np.array_equal(plan.positions, pos_ref[:, 0].numpy())

    # 20 greedy steps: HF generate vs prefill (chunks smaller than an image run) + decode steps
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref_tokens = out[0, len(ids):].tolist()
    vis, _, _ = vision.visual_rows(plan, 0, plan.n)
    cache = model.new_cache(256, check_memory=False)
    logits = model.prefill(plan.keys, cache, chunk=5, positions=plan.positions, visual=vis)
    tokens, pos = [], plan.positions[0, -1] + 1
    for _ in range(20):
        tokens.append(int(np.argmax(logits)))
        logits = model.forward([tokens[-1]], cache, positions=np.full((3, 1), pos))
        pos += 1
    assert tokens == ref_tokens


def test_deepstack_changes_the_output(tiny_vl):
    _, _, model, vision = tiny_vl
    prepared = [vision.prepare(PHOTOS[0])]
    ids = prompt([prepared[0].n_tokens])
    with_ds, _ = ours_logits(model, vision, prepared, ids)
    without, _ = ours_logits(model, vision, prepared, ids, deepstack=False)
    r = rel(without, with_ds)
    print(f"logits without DeepStack differ by rel {r:.2e}")
    assert r > 1e-2


def test_preprocessor_config_is_read(tiny_vl):
    path, _, _, vision = tiny_vl
    cfg = json.loads((path / "preprocessor_config.json").read_text())
    assert vision.pre.min_pixels == cfg["size"]["shortest_edge"] == TINY_PIXELS["shortest_edge"]
    assert vision.pre.max_pixels == TINY_PIXELS["longest_edge"]
