"""OpenAI-compatible request and response models (pydantic), plus `timings` (docs/api.md).

Requests ignore unknown fields (clients send many optional ones) but reject values we cannot
honour (n > 1, echo, logprobs, penalties, non-text content) with a 400 instead of silently
producing something different from what was asked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from edge_llm.server.errors import NotUnicodeText

Finite = Annotated[float, Field(allow_inf_nan=False)]
StopField = Annotated[str | list[str] | None, Field(default=None, description="Up to 4 stop strings.")]


def _unicode_text(value: object, path: tuple[str, ...] = ()) -> None:
    """Raise NotUnicodeText for the first string JSON let through that is not Unicode text: a lone
    surrogate (`"\\ud800"`) cannot be encoded, tokenized or echoed back. Every string counts: the
    fields', unknown fields' and keys (docs/api.md "Errors")."""
    if isinstance(value, str):
        if value.isascii():  # a flag of the string, no pass over it: a data: URL costs nothing here
            return
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise NotUnicodeText(path, f"not valid Unicode text: lone surrogate {value[e.start]!r} at character {e.start}") from None
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _unicode_text(v, (*path, str(i)))
    elif isinstance(value, dict):
        for k, v in value.items():
            try:
                _unicode_text(k)
            except NotUnicodeText as e:  # the key cannot name itself: its parent is the place
                raise NotUnicodeText(path, f"a field name is {e}") from None
            _unicode_text(v, (*path, str(k)))


class _Request(BaseModel):
    # strict: a boolean is true or false, a number is a JSON number (an integer field refuses 1.0,
    # a float field takes 1), never a string, as OpenAI's API refuses "stream": "yes" (docs/api.md)
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data: object) -> object:
        _unicode_text(data)  # a request body's root: all of it, unknown fields too (ignored, not unchecked)
        return data

    model: str | None = Field(default=None, description="Omit, or the id from /v1/models.")
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    seed: Annotated[int, Field(ge=0, le=2**64 - 1)] | None = None
    stop: StopField
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] | None = Field(default=None, description="Only 1 is supported.")
    presence_penalty: Finite | None = None
    frequency_penalty: Finite | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    prompt_cache_key: str | None = Field(
        default=None, description="A routing hint for a proxy in front of several boards (docs/fleet.md): "
        "requests with the same key go to the same board. This server does not use it.")


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] = Field(
        description="Text, or a list of token ids.")
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(default=None, description="Default 16.")
    echo: bool = Field(default=False, description="Must be false.")
    logprobs: int | None = Field(default=None, description="Not supported: must be omitted.")
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImageURL(_Request):
    url: str = Field(description="data:image/...;base64,... or a file under the server's --image-dir.")
    detail: str | None = Field(default=None, description="Accepted and ignored.")


class ImagePart(_Request):
    type: Literal["image_url"]
    image_url: ImageURL | str


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def image_urls(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [p.image_url if isinstance(p.image_url, str) else p.image_url.url
                for p in self.content if isinstance(p, ImagePart)]

    def text(self, image_placeholder: str = "", wrap: Callable[[str], str] = str) -> str:
        """The content as one string: each text part through `wrap`, each image part becomes
        `image_placeholder`."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return wrap(self.content)
        return "".join(wrap(p.text) if isinstance(p, TextPart) else image_placeholder for p in self.content)


_NOT_HONOURED = "Not honoured: only its default value is accepted (docs/api.md)."


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="Default: the server's default_max_tokens, at most the rest of the "
                                  "context window.")
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = Field(default=None, description=_NOT_HONOURED)
    top_logprobs: int | None = Field(default=None, description=_NOT_HONOURED)
    tools: list[dict] | None = Field(default=None, description=_NOT_HONOURED)
    tool_choice: str | dict | None = Field(default=None, description=_NOT_HONOURED)
    functions: list[dict] | None = Field(default=None, description=_NOT_HONOURED)
    function_call: str | dict | None = Field(default=None, description=_NOT_HONOURED)
    response_format: dict | None = Field(default=None, description=_NOT_HONOURED + " ({'type': 'text'})")
    modalities: list[str] | None = Field(default=None, description=_NOT_HONOURED + " (['text'])")
    audio: dict | None = Field(default=None, description=_NOT_HONOURED)
    prediction: dict | None = Field(default=None, description=_NOT_HONOURED)
    web_search_options: dict | None = Field(default=None, description=_NOT_HONOURED)
    reasoning_effort: str | None = Field(default=None, description=_NOT_HONOURED)


def _off(v: object) -> bool:
    return v is None or v is False or v == 0 or v == [] or v == {} or v == ""


# The one rule for OpenAI request fields this server does not honour: the value that asks for
# nothing (the default) is accepted, any other is a 400 naming the field, never silently ignored.
# Fields that change no output (`user`, `store`, `metadata`, `service_tier`, image `detail`) are
# accepted; fields OpenAI does not define are ignored. (docs/api.md, "Fields not honoured")
_SAMPLING_NOT_HONOURED = {"logit_bias": _off, "presence_penalty": _off, "frequency_penalty": _off}
NOT_HONOURED: dict[str, dict[str, Callable[[object], bool]]] = {
    "completion": {**_SAMPLING_NOT_HONOURED, "echo": _off, "logprobs": lambda v: v is None, "suffix": _off,
                   "best_of": lambda v: v in (None, 1)},
    "chat": {**_SAMPLING_NOT_HONOURED, "logprobs": _off, "top_logprobs": _off, "tools": _off,
             "tool_choice": lambda v: v in (None, "none"), "functions": _off,
             "function_call": lambda v: v in (None, "none"),
             "response_format": lambda v: v is None or v == {"type": "text"},
             "modalities": lambda v: v in (None, ["text"]), "audio": _off, "prediction": _off,
             "web_search_options": _off, "reasoning_effort": _off},
}


# ---- responses -----------------------------------------------------------------------------
class Timings(BaseModel):
    ttft_ms: float
    prefill_tokens: int
    prefill_ms: float
    decode_tokens: int
    decode_ms: float
    cache_source: Literal["none", "ram", "disk", "disk-prefetch"]
    ram_cached_tokens: int
    disk_cached_tokens: int
    restore_ms: float
    restore_bytes: int
    save_wait_ms: float = 0.0
    images: int = Field(default=0, description="Images in the prompt.")
    image_tokens: int = Field(default=0, description="Prompt tokens that are image tokens.")
    images_encoded: int = Field(default=0, description="Images run through the vision encoder "
                                                       "(the others' rows were reused).")
    vision_ms: float = Field(default=0.0, description="Vision encoder time.")
    restore_files: int = Field(default=0, description="Files of the snapshot chain that were read.")
    align_rows: int = Field(default=0, description="Matched rows recomputed so that the tail is batched "
                                                   "as in a cold prefill (docs/store.md).")
    restore_mode: Literal["", "pipelined", "sequential"] = Field(
        default="", description="How the disk rows were read, as it ran (empty: no restore ran).")
    gate: Literal["", "restore", "split", "recompute", "unmeasured"] = Field(
        default="", description="The cost gate's choice for a disk match (docs/store.md).")
    gate_rows_loaded: int = Field(default=0, description="Rows read from disk.")
    gate_rows_recomputed: int = Field(default=0, description="Rows computed, tail included.")
    gate_predicted_ms: float = Field(default=0.0, description="Predicted time to the prompt's logits.")
    gate_actual_ms: float = Field(default=0.0, description="Measured time to the prompt's logits.")
    gate_restore_ms: float = Field(default=0.0, description="Predicted: restore every matched row.")
    gate_recompute_ms: float = Field(default=0.0, description="Predicted: recompute from the RAM prefix.")
    decode_forwards: int = Field(default=0, description="Forwards after the prompt's: one per generated token "
                                                        "without drafts (docs/speculative.md).")
    draft_forwards: int = Field(default=0, description="Of the decode forwards, those that verified a draft.")
    drafted_tokens: int = Field(default=0, description="Draft tokens verified (speculative decoding).")
    accepted_tokens: int = Field(default=0, description="Draft tokens kept: each is one forward saved.")


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


FinishReason = Literal["stop", "length", "cancelled"]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    timings: Timings | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        # OpenAI sends only the fields a delta carries ({"content": "x"}, {} at the end)
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    timings: Timings | None = None


class SamplingDefaultsInfo(BaseModel):
    """What a request gets for omitted temperature / top_p / top_k (top_k 0 = off)."""

    temperature: float
    top_p: float
    top_k: int
    source: str = Field(description="generation_config.json of the model, or openai (fallback).")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "edge-llm"
    sampling_defaults: SamplingDefaultsInfo | None = None
    max_model_len: int | None = Field(default=None, description="Context window: prompt + completion tokens.")
    default_max_tokens: int | None = Field(default=None, description="Completion tokens of a chat request "
                                           "without max_tokens (null: the rest of the context window).")
    backend: str | None = Field(default=None, description="The backend that runs the model (cpu, cpu-q, rknn).")
    backend_reason: str | None = Field(default=None, description="Why: `auto`'s choice and its reason, or "
                                       "where it was named (the command line, the configuration file, the environment).")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class SnapshotSummary(BaseModel):
    enabled: bool
    count: int = 0
    bytes: int = 0
    directory: str | None = None


class Health(BaseModel):
    status: Literal["loading", "ok", "failed", "stopping"]
    version: str
    model: str | None = None
    backend: str
    backend_reason: str | None = Field(default=None, description="e.g. 'backend auto -> cpu-q (no RKNPU "
                                       "device node; onnxruntime 1.22.0 importable)'; null while loading.")
    namespace: str | None = None
    npu_selftest: dict[str, Any] | None = Field(default=None, description="The NPU matmul path's start-up "
                                                "self-test: versions, each probe's answer, the decisions "
                                                "(`sync`, `serialize`, `refused`) and `summary`; null when it did "
                                                "not run (docs/npu.md, \"The start-up self-test\").")
    max_seq: int
    snapshots: SnapshotSummary
    queue_depth: int
    queue_size: int
    busy: bool
    degraded: list[str] = Field(default_factory=list, description="e.g. 'snapshot disk full'.")
    error: str | None = None
    uptime_s: float
    sampling_defaults: SamplingDefaultsInfo | None = None
    prefetch: Literal["off", "pending", "running", "loaded", "joined", "preempted", "failed", "none"] = Field(
        default="off", description="The start-up prefetch (disk_kv_prefetch, docs/store.md): off, pending, running, "
        "loaded (the rows are in RAM), joined (loaded while a request waited for it), preempted, failed, none "
        "(no snapshot).")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
