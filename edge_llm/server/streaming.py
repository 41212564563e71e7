"""Relay a worker job's events to the client: one JSON response, or SSE chunks ending in [DONE].

The last chunk of a stream carries `timings`; with `stream_options.include_usage` a final chunk
with empty `choices` carries `usage` (as OpenAI does). Leaving early (client gone) cancels the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from edge_llm.errors import EdgeLLMError
from edge_llm.server import schemas as S
from edge_llm.server.errors import APIError, bad_request, error_body, unavailable
from edge_llm.server.worker import Job, ShuttingDown

log = logging.getLogger(__name__)


def _usage(u: Any) -> S.Usage:
    return S.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                   total_tokens=u.prompt_tokens + u.completion_tokens,
                   prompt_tokens_details=S.PromptTokensDetails(cached_tokens=u.cached_tokens))


def _timings(t: Any) -> S.Timings:
    return S.Timings(**{k: getattr(t, k) for k in S.Timings.model_fields if hasattr(t, k)})


def _as_api_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, ShuttingDown):
        return unavailable("server is shutting down", "shutting_down")
    if isinstance(e, (ValueError, EdgeLLMError)):
        return bad_request(str(e))
    return APIError(500, f"internal error: {type(e).__name__}", "server_error")


async def _stop(job: Job, watcher: asyncio.Task, reason: str) -> None:
    job.cancel_with(reason)  # no-op once the job finished
    watcher.cancel()


async def collect(job: Job, watcher: asyncio.Task, meta: dict[str, Any], chat: bool):
    """Wait for the whole generation; return the OpenAI response object."""
    parts: list[str] = []
    last = None
    try:
        async for ev in job.events():
            parts.append(ev.text)
            last = ev
    except Exception as e:
        raise _as_api_error(e) from None
    finally:
        # CancelledError here means the request task itself was cancelled (shutdown past grace)
        await _stop(job, watcher, "request ended")
    if last is None or last.finish_reason is None:
        raise APIError(500, "generation ended without a result", "server_error")
    text, created = "".join(parts), int(time.time())
    usage, timings = _usage(last.usage), _timings(last.timings)
    if chat:
        return S.ChatCompletionResponse(
            **meta, created=created, usage=usage, timings=timings,
            choices=[S.ChatChoice(message=S.AssistantMessage(content=text), finish_reason=last.finish_reason)])
    return S.CompletionResponse(**meta, created=created, usage=usage, timings=timings,
                                choices=[S.CompletionChoice(text=text, finish_reason=last.finish_reason)])


def _sse(obj: Any) -> str:
    data = obj.model_dump_json(exclude_none=False) if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


async def _relay(job: Job, watcher: asyncio.Task, make_chunk, make_final, make_usage,
                 include_usage: bool) -> AsyncIterator[str]:
    try:
        async for ev in job.events():
            if ev.finish_reason is None:
                if ev.text:
                    yield _sse(make_chunk(ev.text))
                continue
            yield _sse(make_final(ev.text, ev.finish_reason, _timings(ev.timings)))
            if include_usage:
                yield _sse(make_usage(_usage(ev.usage), _timings(ev.timings)))
        yield "data: [DONE]\n\n"
    except Exception as e:  # headers are sent already: report in-band, as OpenAI does
        err = _as_api_error(e)
        log.warning("stream %d failed: %s", job.id, err.message)
        yield f"data: {json.dumps(error_body(err.message, err.type, err.param, err.code))}\n\n"
    finally:
        # reached on normal end, and on GeneratorExit/CancelledError when the client vanished
        await _stop(job, watcher, "client disconnected")


def sse_completion(job: Job, watcher: asyncio.Task, meta: dict[str, Any], include_usage: bool
                   ) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(text: str, finish: str | None = None, timings: S.Timings | None = None,
              usage: S.Usage | None = None, choices: bool = True) -> S.CompletionResponse:
        ch = [S.CompletionChoice(text=text, finish_reason=finish)] if choices else []
        return S.CompletionResponse(**meta, created=created, choices=ch, usage=usage, timings=timings)

    return _relay(job, watcher, lambda text: chunk(text),
                  lambda text, finish, t: chunk(text, finish, t),
                  lambda u, t: chunk("", usage=u, timings=t, choices=False), include_usage)


def sse_chat(job: Job, watcher: asyncio.Task, meta: dict[str, Any], include_usage: bool
             ) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(delta: S.Delta | None, finish: str | None = None, timings: S.Timings | None = None,
              usage: S.Usage | None = None) -> S.ChatCompletionChunk:
        ch = [S.ChatChunkChoice(delta=delta, finish_reason=finish)] if delta is not None else []
        return S.ChatCompletionChunk(**meta, created=created, choices=ch, usage=usage, timings=timings)

    async def gen() -> AsyncIterator[str]:
        # OpenAI opens every chat stream with the role; clients key on it
        yield _sse(chunk(S.Delta(role="assistant", content="")))
        relay = _relay(job, watcher, lambda text: chunk(S.Delta(content=text)),
                       lambda text, finish, t: chunk(S.Delta(content=text or None), finish, t),
                       lambda u, t: chunk(None, usage=u, timings=t), include_usage)
        async with contextlib.aclosing(relay):  # close it (and cancel the job) as soon as we are
            async for s in relay:
                yield s

    return gen()
