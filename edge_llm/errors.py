"""Exception hierarchy. Every error a user can cause names what was wrong."""

from __future__ import annotations


class EdgeLLMError(Exception):
    """Base class of all edge-llm errors."""


class ConfigError(EdgeLLMError):
    """config.json is missing, unsupported or inconsistent (the message names the key)."""


class WeightsError(EdgeLLMError):
    """A tensor is missing, misshaped or has an unsupported dtype (the message names it)."""


class TokenizerError(EdgeLLMError):
    """tokenizer.json / chat template missing or unusable."""


class ModelImportError(EdgeLLMError):
    """A GGUF file or packaged model could not be imported."""


class RunnerError(EdgeLLMError):
    """A graph runner or NPU engine failed (inference error, worker died, bad shape, NPU refusal)."""


class RknnMatmulError(RunnerError):
    """librknnrt's matmul API returned an error: `function` is the entry point, `code` its return
    value and `code_name` the name from rknn_api.h's error table; `code` None for a NULL pointer
    (`rknn_create_mem`) (docs/npu.md, "The matmul API binding")."""

    def __init__(self, function: str, code: int | None, code_name: str, detail: str = ""):
        self.function, self.code, self.code_name = function, code, code_name
        what = "NULL" if code is None else f"{code} ({code_name})"
        super().__init__(f"{function} returned {what}" + (f": {detail}" if detail else ""))


class NpuRefused(ConfigError):
    """The NPU matmul path's start-up self-test refused it (a wrong product, a driver too old, an
    unusable IOMMU domain: the message says which); `report` is the `SelfTestReport`. `auto` falls
    back to cpu-q or cpu, an explicit `--backend rknn` stops (docs/npu.md, "The start-up self-test")."""

    def __init__(self, message: str, report: object = None):
        super().__init__(message)
        self.report = report


class KVCacheError(EdgeLLMError):
    """The KV cache cannot be allocated or an operation exceeds its capacity."""


class ContextOverflowError(KVCacheError):
    """prompt + max_tokens does not fit into the context window."""

    def __init__(self, prompt_tokens: int, max_tokens: int, max_seq: int):
        self.prompt_tokens, self.max_tokens, self.max_seq = prompt_tokens, max_tokens, max_seq
        super().__init__(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
            f"{prompt_tokens + max_tokens} exceeds the context window of {max_seq} tokens"
        )


class SnapshotError(EdgeLLMError):
    """A VLKV snapshot file was rejected. `reason` is a short machine-readable tag."""

    reason = "invalid"


class SnapshotTooShort(SnapshotError):
    reason = "short-file"


class SnapshotBadMagic(SnapshotError):
    reason = "bad-magic"


class SnapshotBadVersion(SnapshotError):
    reason = "bad-version"


class SnapshotHeaderCRC(SnapshotError):
    reason = "header-crc"


class SnapshotGeometry(SnapshotError):
    reason = "geometry"


class SnapshotKVDim(SnapshotError):
    reason = "kv-dim"


class SnapshotTokenCount(SnapshotError):
    reason = "n-tokens"


class SnapshotSize(SnapshotError):
    reason = "size"


class SnapshotModelID(SnapshotError):
    reason = "model-id"


class SnapshotTokenHash(SnapshotError):
    reason = "token-hash"


class SnapshotTrailerCRC(SnapshotError):
    reason = "trailer-crc"


class SnapshotBlockCRC(SnapshotError):
    reason = "block-crc"


class SnapshotFlags(SnapshotError):
    reason = "flags"


class SnapshotExtension(SnapshotError):
    reason = "extension"


class SnapshotNotRegular(SnapshotError):
    """A FIFO, device or directory under a snapshot's name: refused unread (files.open_regular)."""

    reason = "not-regular"


class SnapshotChainError(SnapshotError):
    """A delta file is sound on its own but its chain is not (checked by the store, not per file)."""

    reason = "chain"


class SnapshotBaseMissing(SnapshotChainError):
    """A delta file's base (the file named by the FNV of its first base_n token ids) is gone."""

    reason = "base-missing"


class SnapshotBaseMismatch(SnapshotChainError):
    """A delta file's base exists but is not the file the delta was written on (other rows)."""

    reason = "base-mismatch"


class ImageError(EdgeLLMError):
    """An image input was refused (the API answers 400). `reason` is a short machine-readable tag."""

    reason = "invalid-image"


class ImageDecodeError(ImageError):
    """The bytes are not an image, or the image data is truncated or corrupt."""

    reason = "not-an-image"


class ImageFormatError(ImageError):
    """A real image in a format this runtime does not accept (only PNG, JPEG, WebP)."""

    reason = "unsupported-format"


class ImageNotRegular(ImageError):
    """An image path names a FIFO, device or directory: refused unread (files.open_regular)."""

    reason = "not-a-regular-file"


class ImageTooLarge(ImageError):
    """Too many bytes or pixels (decompression bombs included)."""

    reason = "too-large"


class VisionUnsupported(ImageError):
    """An image was sent to a model without a vision encoder."""

    reason = "no-vision"
