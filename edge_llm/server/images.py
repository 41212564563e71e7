"""Image parts of chat messages -> image bytes: `data:` URLs, or files under the operator's
--image-dir. Nothing is ever fetched over the network. Every refusal is an APIError 400 that
names the problem (the decoder's own refusals come from `edge_llm.vision.preprocess`)."""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from edge_llm.engine import Engine
from edge_llm.errors import ImageError, ImageNotRegular
from edge_llm.files import open_regular
from edge_llm.server.budget import Budget, encode_within
from edge_llm.server.errors import APIError, bad_request
from edge_llm.server.schemas import ChatMessage
from edge_llm.tokenizer import plain
from edge_llm.vision.preprocess import ImageHeader, PreparedImage

PARAM = "messages"


def _image_error(message: str, code: str) -> APIError:
    return bad_request(message, PARAM, code)


def read_image_url(url: str, image_dir: str | None, max_bytes: int) -> bytes:
    """The bytes an image_url names (see module docstring)."""
    if url.startswith("data:"):
        return _data_url(url, max_bytes)
    scheme = urlparse(url).scheme.lower()
    if scheme in ("http", "https", "ftp"):
        raise _image_error("remote image URLs are not fetched: send the image as a data: URL "
                           "(or a file under the server's --image-dir)", "image_url_remote")
    if scheme not in ("", "file"):
        raise _image_error(f"unsupported image URL scheme {scheme!r} (use data: or a local file)",
                           "image_url_scheme")
    return _local_file(unquote(urlparse(url).path) if scheme == "file" else url, image_dir, max_bytes)


def _data_url(url: str, max_bytes: int) -> bytes:
    head, sep, payload = url[5:].partition(",")
    if not sep:
        raise _image_error("malformed data: URL (no ',')", "image_data_url")
    parts = head.split(";")
    media = parts[0].strip().lower()
    if "base64" not in parts[1:]:
        raise _image_error("data: URL images must be base64 encoded (data:image/png;base64,...)",
                           "image_data_url")
    if media and not media.startswith("image/"):
        raise _image_error(f"data: URL media type {media!r} is not an image", "not-an-image")
    if len(payload) * 3 // 4 > max_bytes + 3:  # refuse before decoding
        raise _image_error(f"image is larger than the limit of {max_bytes} bytes", "too-large")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _image_error(f"data: URL is not valid base64 ({e})", "image_data_url") from None


def _local_file(path: str, image_dir: str | None, max_bytes: int) -> bytes:
    if not image_dir:
        raise _image_error("local image files are disabled on this server (the operator can allow a "
                           "directory with --image-dir); send a data: URL", "image_dir_disabled")
    if "\0" in path:
        raise _image_error("image path contains a NUL character", "image_path")
    root = Path(os.path.realpath(image_dir))
    target = Path(os.path.realpath(root / path))  # an absolute path replaces root: checked below
    if target != root and root not in target.parents:
        raise _image_error("image path is outside the server's image directory", "image_path")
    try:
        # a FIFO or device in the directory is refused unread: a plain open() of a FIFO blocks
        # the thread for good (docs/api.md, "Images")
        with open_regular(target, ImageNotRegular) as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise _image_error(f"image file is {size} bytes, more than the limit of {max_bytes}",
                                   "too-large")
            return f.read(max_bytes + 1)
    except ImageNotRegular:
        raise _image_error("image path is not a regular file (a FIFO, device or directory) in the server's "
                           "image directory", "image_path") from None
    except (FileNotFoundError, NotADirectoryError):
        raise _image_error("image file not found in the server's image directory", "image_path") from None
    except PermissionError:
        raise _image_error("image file is not readable by the server", "image_path") from None
    except OSError as e:  # e.g. a name longer than the file system allows
        raise _image_error(f"image file cannot be opened: {e.strerror or e}", "image_path") from None


@dataclass(frozen=True)
class ChatOptions:
    """The operator's settings the chat path reads (see edge_llm/settings.py)."""

    image_dir: str | None
    max_image_bytes: int
    max_images: int
    special_tokens: bool = False


@dataclass
class ChatPrompt:
    """A rendered chat prompt whose images are sized from their headers but not decoded yet."""

    tokens: list[int]  # prompt ids, one image placeholder per image
    sources: list[bytes] = field(default_factory=list)  # each image's encoded bytes
    headers: list[ImageHeader] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        """Prompt tokens once every placeholder is its image's run of pad tokens."""
        return len(self.tokens) - len(self.headers) + sum(h.n_tokens for h in self.headers)


def render_chat(engine: Engine, messages: list[ChatMessage], opts: ChatOptions, budget: Budget) -> ChatPrompt:
    """Chat messages (pydantic) -> prompt ids and image headers, within `budget`.

    Runs in the thread pool. Before any pixel is decoded: the image count is capped, each image's
    tokens come from its header (the resize rule), and the request is refused as soon as its
    images, then its text's byte length, then its exact text tokens leave no room in the context
    window. Image problems are 400s naming the problem; template problems raise the tokenizer's
    EdgeLLMError."""
    urls = [u for m in messages for u in m.image_urls()]
    vision = engine.vision
    if urls and vision is None:
        raise bad_request("this model has no vision encoder: it cannot take images", PARAM, "no-vision")
    if len(urls) > opts.max_images:
        raise bad_request(f"the request has {len(urls)} images; this server accepts at most {opts.max_images} "
                          f"per request (max_images)", PARAM, "too-many-images")
    prompt = ChatPrompt([])
    image_tokens = 0
    for i, url in enumerate(urls):
        assert vision is not None
        data = read_image_url(url, opts.image_dir, opts.max_image_bytes)
        try:
            header = vision.header(data)
        except ImageError as e:
            raise bad_request(f"image {i + 1}: {e}", PARAM, e.reason) from None
        prompt.sources.append(data)
        prompt.headers.append(header)
        image_tokens += header.n_tokens
        budget.check(image_tokens, at_least=True)  # refused before the next image is even read
    placeholder = vision.placeholder(engine.tokenizer.id_to_token) if urls and vision else ""
    # OpenAI's newer "developer" role is what chat templates call "system"
    # the text parts are plain text (special-token strings stay text) unless the operator trusts
    # the clients; the image placeholders between them are the real control tokens
    wrap = str if opts.special_tokens else plain
    rendered = [{"role": "system" if m.role == "developer" else m.role, "content": m.text(placeholder, wrap),
                 **({"name": m.name} if m.name else {})} for m in messages]
    text = engine.tokenizer.apply_chat_template(rendered, True, plain_text=False)
    assert isinstance(text, str)
    # each placeholder becomes its image's run: the text's own count holds it once per image
    prompt.tokens = encode_within(engine.tokenizer, text, budget, image_tokens - len(urls))
    return prompt


def decode_images(engine: Engine, prompt: ChatPrompt) -> tuple[list[int], list[PreparedImage]]:
    """Decode and preprocess a sized prompt's images -> (ids with each image's pad run, images).

    Runs in the thread pool, under the server's decode gate (`max_image_decodes`)."""
    vision = engine.vision
    images: list[PreparedImage] = []
    tokens = prompt.tokens
    try:
        if prompt.headers:
            assert vision is not None
            for i, data in enumerate(prompt.sources):
                try:
                    images.append(vision.prepare(data))
                except ImageError as e:
                    raise bad_request(f"image {i + 1}: {e}", PARAM, e.reason) from None
            tokens = vision.expand(tokens, images)
        engine.plan(tokens, images)  # the same check the engine does, before the request queues
    except ImageError as e:
        raise bad_request(str(e), PARAM, e.reason) from None
    return tokens, images
