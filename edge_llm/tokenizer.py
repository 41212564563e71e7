"""Tokenizer: `tokenizers` on tokenizer.json, special tokens, HF-compatible chat templates,
incremental detokenisation that never emits half a UTF-8 character, and stop-string matching.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from edge_llm.errors import TokenizerError
from edge_llm.files import read_regular
from edge_llm.token_bound import bytes_per_token

log = logging.getLogger(__name__)

# end-of-turn tokens of the chat formats we meet (ChatML, GPT-2 style, Llama 3)
STOP_TOKEN_NAMES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")
REPLACEMENT_CHAR = "\ufffd"
# a UTF-8 character is at most 4 bytes; beyond this many pending ids the bytes are really invalid
_MAX_PENDING_IDS = 8


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(read_regular(path, TokenizerError).decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: invalid JSON: {e}") from None
    return data if isinstance(data, dict) else {}


def _token_str(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as strings or AddedToken dicts."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


# ---- chat template ------------------------------------------------------------------------
def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF overrides jinja's tojson, which would HTML-escape characters
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant masks in HF); renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


@lru_cache(maxsize=8)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template with the environment transformers uses (sandboxed, trim/lstrip blocks)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template: syntax error at line {e.lineno}: {e.message}") from None


def _alias_reasoning(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    # transformers fills `reasoning_content` (read by Qwen3 templates) from the other spellings
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise TokenizerError(f"chat message must be a dict, got {type(m).__name__}")
        m = dict(m)
        r = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if m.get(k) is not None), None)
        if r is not None:
            m = {"thinking": r, **m, "reasoning_content": r}
        out.append(m)
    return out


# Text between these marks is encoded as plain text: a special-token string typed into a chat
# message stays text, so no client can forge a role with "<|im_end|><|im_start|>system". The marks
# are lone surrogates: no request text can hold one (the API refuses them), so none can be forged.
PLAIN_OPEN, PLAIN_CLOSE = "\ud800", "\udbff"
_MARK_CHARS = re.compile("[\ud800\udbff]")
_MARKED = re.compile("(\ud800[^\ud800\udbff]*\udbff)")


def plain(text: str) -> str:
    """`text` marked for `Tokenizer.encode` as plain text (any mark inside it is dropped)."""
    return PLAIN_OPEN + _MARK_CHARS.sub("", text) + PLAIN_CLOSE


def _encode_ids(tk: _HFTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    # encode_batch releases the GIL while it tokenizes (encode does not): a long prompt
    # tokenized in an HTTP thread must not stall the event loop, /health or the worker
    return tk.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def _plain_message(m: dict[str, Any]) -> dict[str, Any]:
    c = m.get("content")
    if isinstance(c, str) and PLAIN_OPEN not in c:
        return {**m, "content": plain(c)}
    if isinstance(c, list):
        return {**m, "content": [{**p, "text": plain(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str)
                                 else p for p in c]}
    return m


class Tokenizer:
    """A model directory's tokenizer: ids <-> text, special tokens and the chat template."""

    def __init__(self, tk: _HFTokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None, chat_template: str | None = None,
                 extra_eos_ids: Iterable[int] = (), source_digest: str = ""):
        self._tk = tk
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.chat_template = chat_template
        self.digest = source_digest  # sha256 of tokenizer.json (+ template); part of the model identity
        self.bos_token_id = self.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = self.token_to_id(eos_token) if eos_token else None
        self.pad_token_id = self.token_to_id(pad_token) if pad_token else None
        stops: list[int] = []
        for i in [self.eos_token_id, *extra_eos_ids, *(self.token_to_id(n) for n in STOP_TOKEN_NAMES)]:
            if i is not None and i not in stops:
                stops.append(i)
        self.stop_token_ids: tuple[int, ...] = tuple(stops)
        self._special_ids = frozenset(
            i for i, t in tk.get_added_tokens_decoder().items() if t.special
        )
        self._added = tuple(t.content for t in tk.get_added_tokens_decoder().values())
        self._plain_tk: _HFTokenizer | None = None  # encode_special_tokens=True, made on first need

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        """Load tokenizer.json, tokenizer_config.json, chat_template.jinja and the eos ids of the
        generation_config.json / config.json of an HF model directory."""
        d = Path(model_dir)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(f"{tj}: not found (the model directory needs an HF tokenizer.json)")
        raw = read_regular(tj, TokenizerError)  # a FIFO swapped in is refused, never read
        try:
            tk = _HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise TokenizerError(f"{tj}: cannot be loaded: {e}") from None
        tcfg = _read_json(d / "tokenizer_config.json")
        gcfg = _read_json(d / "generation_config.json")
        mcfg = _read_json(d / "config.json")
        text_cfg = mcfg.get("text_config") if isinstance(mcfg.get("text_config"), dict) else {}

        template = None
        jinja_file = d / "chat_template.jinja"
        if jinja_file.is_file():  # transformers 5 saves the template here; it wins over the json key
            template = read_regular(jinja_file, TokenizerError).decode("utf-8")
        else:
            ct = tcfg.get("chat_template")
            if isinstance(ct, list):  # named templates: [{"name": "default", "template": ...}, ...]
                named = {t.get("name"): t.get("template") for t in ct if isinstance(t, dict)}
                ct = named.get("default")
            template = ct if isinstance(ct, str) else None

        def id_token(ids: list[int]) -> str | None:
            return tk.id_to_token(ids[0]) if ids else None

        eos_ids = _ids(gcfg.get("eos_token_id")) + _ids(mcfg.get("eos_token_id")) + _ids(text_cfg.get("eos_token_id"))
        bos_ids = _ids(gcfg.get("bos_token_id")) or _ids(mcfg.get("bos_token_id"))
        bos = _token_str(tcfg.get("bos_token")) if "bos_token" in tcfg else id_token(bos_ids)
        eos = _token_str(tcfg.get("eos_token")) or id_token(eos_ids)
        pad = _token_str(tcfg.get("pad_token"))
        digest = hashlib.sha256(raw + b"\0" + (template or "").encode()).hexdigest()
        tok = cls(tk, bos_token=bos, eos_token=eos, pad_token=pad, chat_template=template,
                  extra_eos_ids=eos_ids, source_digest=digest)
        log.debug("tokenizer %s: vocab %d, stop ids %s", d, tok.vocab_size, tok.stop_token_ids)
        return tok

    # ---- ids <-> text ---------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> ids. Special-token strings in `text` map to their single ids, except inside
        `plain()` marks: there they are plain text."""
        if PLAIN_OPEN not in text:
            return _encode_ids(self._tk, text, add_special_tokens)
        pieces = _MARKED.split(text)  # odd pieces: marked plain text, marks included
        if not any(t in p for p in pieces[1::2] for t in self._added):  # nothing to keep from parsing:
            return _encode_ids(self._tk, _MARK_CHARS.sub("", text), add_special_tokens)
        if self._plain_tk is None:  # a second instance: the flag is per instance, encode runs in threads
            self._plain_tk = _HFTokenizer.from_str(self._tk.to_str())
            self._plain_tk.encode_special_tokens = True
        ids: list[int] = []
        for i, p in enumerate(pieces):
            if p:
                ids += _encode_ids(self._plain_tk if i % 2 else self._tk, p[1:-1] if i % 2 else p, False)
        return ids

    @cached_property
    def bytes_per_token(self) -> int | None:
        """The most bytes of (normalized) text one token can stand for, or None when this
        tokenizer's structure gives no such bound (`edge_llm.token_bound`). Computed once."""
        return bytes_per_token(json.loads(self._tk.to_str()), self._added)

    def min_tokens(self, text: str) -> int:
        """A lower bound on `len(self.encode(text))`, found without tokenizing (linear in the
        text; 0 when `bytes_per_token` is unknown). It never exceeds the real count, so a prompt
        refused with it could not have fit (docs/api.md, "Request limits")."""
        per = self.bytes_per_token
        if per is None or not text:
            return 0
        text = _MARK_CHARS.sub("", text)
        if self._tk.normalizer is not None:  # e.g. NFC can shorten the text the model sees
            text = self._tk.normalizer.normalize_str(text)
        return math.ceil(len(text.encode("utf-8", "surrogatepass")) / per)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat -----------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, tools: list[dict[str, Any]] | None = None,
                            plain_text: bool = True, **kwargs: Any) -> str | list[int]:
        """Render a conversation exactly as transformers' `apply_chat_template`: the text, or with
        `tokenize=True` its ids (encoded without adding special tokens; the template holds any BOS).
        `plain_text`: the messages' text is encoded as plain text (a special-token string in it is
        not a control token; content already holding `plain()` marks is left as it is)."""
        if tokenize and plain_text:
            messages = [_plain_message(m) for m in messages]
        if not self.chat_template:
            raise TokenizerError("this model has no chat template (tokenizer_config.json / chat_template.jinja)")
        special = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                                     ("pad_token", self.pad_token)) if v is not None}
        try:
            text = compile_chat_template(self.chat_template).render(
                messages=_alias_reasoning(messages), tools=tools, documents=None,
                add_generation_prompt=add_generation_prompt, **{**special, **kwargs})
        except jinja2.exceptions.TemplateError as e:
            raise TokenizerError(f"chat template: {e}") from None
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def apply_chat_template_ids(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                                **kwargs: Any) -> list[int]:
        """The rendered conversation as ids (same as `apply_chat_template(..., tokenize=True)`)."""
        ids = self.apply_chat_template(messages, add_generation_prompt, tokenize=True, **kwargs)
        assert isinstance(ids, list)
        return ids

    def incremental_decoder(self, skip_special_tokens: bool = True) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)


class IncrementalDecoder:
    """Feed ids one at a time; get back only complete text.

    Decodes a short window of recent ids and emits the new suffix unless it ends in U+FFFD (an
    incomplete UTF-8 sequence). The window starts one emission back so decoders that depend on
    context (SentencePiece's leading space) see it, as in transformers' TextStreamer / vLLM.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this index have been emitted

    def _dec(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def feed(self, token_id: int) -> str:
        """Add one id; return the text that became complete (maybe "")."""
        self._ids.append(int(token_id))
        prefix_text = self._dec(self._ids[self._prefix:self._read])
        text = self._dec(self._ids[self._prefix:])
        pending = len(self._ids) - self._read
        if len(text) > len(prefix_text) and (not text.endswith(REPLACEMENT_CHAR) or pending >= _MAX_PENDING_IDS):
            out = text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
            return out
        return ""

    def flush(self) -> str:
        """Text still held back at the end of generation. A trailing incomplete character (e.g.
        generation hit max_tokens in the middle of an emoji's bytes) is dropped, not sent as U+FFFD."""
        prefix_text = self._dec(self._ids[self._prefix:self._read])
        text = self._dec(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text):].rstrip(REPLACEMENT_CHAR)

    @property
    def ids(self) -> list[int]:
        return list(self._ids)


class StopMatcher:
    """Streams text through, holding back anything that could begin a stop string.

    `feed(text)` returns `(safe_text, stopped)`; once a stop string matches, the text before it is
    returned with `stopped=True` and the stop string itself is never emitted.
    """

    def __init__(self, stops: Iterable[str]):
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buf = self._held + text
        if not self.stops:
            self._held = ""
            return buf, False
        hit = self._first_hit(buf)
        # a stop string that starts before the hit but is not complete yet may still match first
        pending = self._pending_start(buf, hit[0] if hit else len(buf))
        if hit and pending is None:
            i, s = hit
            self._held, self.stopped, self.matched = "", True, s
            return buf[:i], True
        cut = len(buf) if pending is None else pending
        self._held = buf[cut:]
        return buf[:cut], False

    def _first_hit(self, buf: str) -> tuple[int, str] | None:
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        return min(hits) if hits else None

    def _pending_start(self, buf: str, before: int) -> int | None:
        """Earliest j < before where buf[j:] is a proper prefix of some stop string."""
        for j in range(max(0, len(buf) - max(len(s) for s in self.stops) + 1), min(before, len(buf))):
            tail = buf[j:]
            if any(len(tail) < len(s) and s.startswith(tail) for s in self.stops):
                return j
        return None

    def flush(self) -> str:
        """Held-back text at the end of generation: cut at a stop string it holds, if any."""
        out, self._held = ("" if self.stopped else self._held), ""
        hit = self._first_hit(out) if self.stops else None
        if hit:
            self.stopped, self.matched = True, hit[1]
            return out[:hit[0]]
        return out
