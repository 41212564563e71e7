"""Image bytes -> `PreparedImage` (pixel_values + grid_thw + digest), exactly as transformers'
Qwen2-VL/Qwen3-VL image processor (PIL backend) computes them.

Steps: decode with Pillow (PNG, JPEG, WebP only; byte and pixel limits are checked before the
pixels are decoded, so a decompression bomb is refused from its header), EXIF orientation,
alpha composited onto white, resize with the "smart resize" rule (sides multiples of
patch_size x merge_size, total pixels within [min_pixels, max_pixels]) using PIL bicubic, rescale
by 1/255 in float64 then float32, normalise with the model's mean/std, and patchify in
merge-block order with the temporal patch size. docs/vision.md explains each rule.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from edge_llm.config import VisionArgs
from edge_llm.errors import (
    ConfigError,
    ImageDecodeError,
    ImageError,
    ImageFormatError,
    ImageTooLarge,
)

log = logging.getLogger(__name__)

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "MPO")  # MPO: a JPEG with more pictures behind it (below)
PREPROCESSOR_FILE = "preprocessor_config.json"
MAX_ASPECT_RATIO = 200  # the reference resize rule refuses more elongated images


@dataclass(frozen=True)
class PreprocessConfig:
    """preprocessor_config.json fields; the defaults are the published Qwen3-VL ones."""

    min_pixels: int = 256 * 256
    max_pixels: int = 4096 * 4096
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @classmethod
    def from_dir(cls, model_dir: str | Path, vision: VisionArgs) -> "PreprocessConfig":
        """Read `preprocessor_config.json` if present; patch geometry defaults to the vision config."""
        path = Path(model_dir) / PREPROCESSOR_FILE
        cfg: dict = {}
        if path.is_file():
            try:
                cfg = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ConfigError(f"{path}: {e}") from None
        size = cfg.get("size") if isinstance(cfg.get("size"), dict) else {}
        d = cls()
        out = cls(
            min_pixels=int(size.get("shortest_edge", cfg.get("min_pixels", d.min_pixels))),
            max_pixels=int(size.get("longest_edge", cfg.get("max_pixels", d.max_pixels))),
            patch_size=int(cfg.get("patch_size", vision.patch_size)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", vision.temporal_patch_size)),
            merge_size=int(cfg.get("merge_size", vision.spatial_merge_size)),
            image_mean=tuple(float(x) for x in cfg.get("image_mean", d.image_mean)),
            image_std=tuple(float(x) for x in cfg.get("image_std", d.image_std)),
            rescale_factor=float(cfg.get("rescale_factor", d.rescale_factor)),
        )
        if (out.patch_size, out.temporal_patch_size, out.merge_size) != (
                vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size):
            raise ConfigError(f"{path}: patch/temporal/merge sizes disagree with config.json's vision_config")
        if not 0 < out.min_pixels <= out.max_pixels:
            raise ConfigError(f"{path}: need 0 < min_pixels <= max_pixels")
        return out

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class ImageLimits:
    """What the runtime accepts before any pixel is decoded (operator-configurable)."""

    max_bytes: int = 20 * 1024 * 1024
    max_source_pixels: int = 64 * 1024 * 1024  # width x height of the encoded image


@dataclass(frozen=True)
class PreparedImage:
    """One preprocessed image: what the vision encoder consumes, and its identity."""

    pixel_values: np.ndarray  # (grid_t * grid_h * grid_w, patch_dim) float32, merge-block order
    grid_thw: tuple[int, int, int]  # patch grid
    digest: bytes  # sha256 over the encoder tag, grid and pixel_values: the image's cache identity
    merge_size: int
    source: str = ""  # "PNG 640x480" (for logs)

    @property
    def llm_grid(self) -> tuple[int, int, int]:
        """(t, h, w) of the tokens the decoder sees: the patch grid after the 2x2 merge."""
        t, h, w = self.grid_thw
        return t, h // self.merge_size, w // self.merge_size

    @property
    def n_tokens(self) -> int:
        t, h, w = self.llm_grid
        return t * h * w


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The reference rule: sides rounded to multiples of `factor`, area within the pixel bounds."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"image aspect ratio {max(height, width) / min(height, width):.0f}:1 exceeds "
                         f"{MAX_ASPECT_RATIO}:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# Pillow warns (once per process, into the logs) about images over its own pixel threshold before
# we can refuse them: `decode_image` checks `max_source_pixels` right after the header, so the
# warning says nothing the clean refusal does not. (Its DecompressionBombError is still caught.)
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


@dataclass(frozen=True)
class ImageHeader:
    """What an image's header says, read without decoding a pixel: enough to size its tokens."""

    format: str
    width: int
    height: int
    n_tokens: int  # decoder tokens after the resize rule (`image_tokens`)

    @property
    def source(self) -> str:
        return f"{self.format} {self.width}x{self.height}"


def image_tokens(height: int, width: int, cfg: PreprocessConfig) -> int:
    """Decoder tokens of an image of this size: the resize rule's patch grid after the merge.

    `smart_resize` is the one rule; `preprocess` derives the grid (and `PreparedImage.n_tokens`)
    from it the same way. The rule is symmetric in height and width, so an EXIF rotation (applied
    at decode, after the header is read) does not change the count."""
    rh, rw = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    return (rh // cfg.factor) * (rw // cfg.factor)


def _open_image(data: bytes, limits: ImageLimits) -> Image.Image:
    """Bytes -> a lazy PIL image whose header passed the limits (no pixel decoded yet)."""
    if len(data) > limits.max_bytes:
        raise ImageTooLarge(f"image is {len(data)} bytes, more than the limit of {limits.max_bytes}")
    if not data:
        raise ImageDecodeError("image data is empty")
    try:
        img = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError as e:
        raise ImageTooLarge(f"image declares too many pixels ({e})") from None
    except (Image.UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ImageDecodeError(f"data is not a recognisable image ({type(e).__name__})") from None
    if img.format not in ALLOWED_FORMATS:
        raise ImageFormatError(f"image format {img.format} is not supported (send PNG, JPEG or WebP)")
    if img.format == "MPO":
        # a multi-picture JPEG (phone cameras: a depth or preview picture behind the photo); its first
        # picture is the photo, a plain JPEG stream: that one is sized and decoded (docs/vision.md)
        img.seek(0)
    w, h = img.size
    if w < 1 or h < 1:
        raise ImageDecodeError(f"image has an empty size {w}x{h}")
    if w * h > limits.max_source_pixels:
        raise ImageTooLarge(f"image is {w}x{h} = {w * h} pixels, more than the limit of "
                            f"{limits.max_source_pixels}")
    return img


def read_header(data: bytes, cfg: PreprocessConfig, limits: ImageLimits = ImageLimits()) -> ImageHeader:
    """The image's format, size and token count from its header alone: the limits and the resize
    rule are checked before any pixel is decoded (the server sizes a request with this)."""
    img = _open_image(data, limits)
    w, h = img.size
    return ImageHeader(str(img.format), w, h, image_tokens(h, w, cfg))


def decode_image(data: bytes, limits: ImageLimits = ImageLimits()) -> tuple[Image.Image, str]:
    """Bytes -> (RGB PIL image, format name), EXIF orientation applied, alpha composited onto white.

    Raises ImageTooLarge before decoding pixels when the bytes or the declared size exceed the
    limits, ImageFormatError for real images of other formats, ImageDecodeError otherwise.
    """
    img = _open_image(data, limits)
    fmt = str(img.format)
    try:
        img.load()  # decodes: a truncated or corrupt stream fails here
        img = ImageOps.exif_transpose(img)
        has_alpha = "A" in img.getbands() or img.info.get("transparency") is not None
        if has_alpha:  # as transformers' convert_to_rgb: composite onto white
            rgba = img.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            img = Image.alpha_composite(white, rgba).convert("RGB")
        else:
            img = img.convert("RGB")
    except Image.DecompressionBombError as e:
        raise ImageTooLarge(f"image declares too many pixels ({e})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageDecodeError(f"{fmt} image data is truncated or corrupt ({e})") from None
    return img, fmt


def preprocess(img: Image.Image, cfg: PreprocessConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """RGB image -> (pixel_values (N, C*T*P*P) float32, grid (1, gh, gw)) as the reference does."""
    height, width = img.height, img.width
    rh, rw = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    if (rh, rw) != (height, width):
        img = img.resize((rw, rh), resample=Image.Resampling.BICUBIC)
    x = np.asarray(img, dtype=np.uint8)  # (H, W, C)
    # reference: astype(float64) * scale, then float32; normalise in float32
    x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    x = (x - np.asarray(cfg.image_mean, np.float32)) / np.asarray(cfg.image_std, np.float32)
    x = x.transpose(2, 0, 1)  # (C, H, W)
    p, m, T = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    C = x.shape[0]
    gh, gw = rh // p, rw // p
    patches = x.reshape(C, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    # (gh/m, gw/m, m, m, C, p, p): one image is one frame, repeated over the temporal patch
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], T, p, p))
    return np.ascontiguousarray(patches.reshape(gh * gw, C * T * p * p), dtype=np.float32), (1, gh, gw)


def image_digest(tag: bytes, grid: tuple[int, int, int], pixel_values: np.ndarray) -> bytes:
    """sha256 of (encoder tag, grid, pixel bytes): equal digests mean equal encoder input."""
    h = hashlib.sha256(tag)
    h.update(np.asarray(grid, dtype="<u4").tobytes())
    h.update(memoryview(np.ascontiguousarray(pixel_values, dtype="<f4")).cast("B"))
    return h.digest()


def prepare_image(data: bytes, cfg: PreprocessConfig, limits: ImageLimits = ImageLimits(),
                  tag: bytes = b"") -> PreparedImage:
    """Decode + preprocess + digest one image. `tag` identifies the encoder (see VisionModel)."""
    img, fmt = decode_image(data, limits)
    source = f"{fmt} {img.width}x{img.height}"
    pixels, grid = preprocess(img, cfg)
    return PreparedImage(pixels, grid, image_digest(tag, grid, pixels), cfg.merge_size, source)
