"""Tokenizer: round trips, chat templates equal to transformers', GGUF-rebuilt SmolLM2 tokenizer
semantics, incremental decoding of multi-byte text, stop strings."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from edge_llm.checkpoints.gguf_import import import_tokenizer
from edge_llm.checkpoints.packaged import default_gguf_path, qwen3_tokenizer_dir
from edge_llm.errors import TokenizerError
from edge_llm.tokenizer import REPLACEMENT_CHAR, StopMatcher, Tokenizer

TEXTS = [
    "The capital of France is Paris.",
    "I have 12345 apples and 3.14 pies!",
    "  multiple   spaces\n\nnewlines\ttabs  ",
    "café naïve Übermaß — “quotes” 日本語の文章 中文测试 😀🦙🧑‍🚀",
    "def f(x):\n    return x ** 2  # comment\n",
    "<|im_start|>user\nhello<|im_end|>",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "多少钱? 😀"}],
]


@pytest.fixture(scope="module")
def qwen_dir():
    return qwen3_tokenizer_dir()


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory):
    """Only the tokenizer files rebuilt from the real SmolLM2 GGUF (no weights: fast)."""
    return import_tokenizer(default_gguf_path(), tmp_path_factory.mktemp("smol_tok"))


@pytest.fixture(scope="module", params=["qwen", "smol"])
def tok_dir(request, qwen_dir, smol_dir):
    return qwen_dir if request.param == "qwen" else smol_dir


_CACHE: dict = {}


def _tok(path) -> Tokenizer:
    key = ("ours", str(path))
    if key not in _CACHE:
        _CACHE[key] = Tokenizer.from_dir(path)
    return _CACHE[key]


def _hf(path):
    """transformers' tokenizer for the same directory (loaded once per module: it is slow)."""
    transformers = pytest.importorskip("transformers")
    key = ("hf", str(path))
    if key not in _CACHE:
        _CACHE[key] = transformers.AutoTokenizer.from_pretrained(str(path))
    return _CACHE[key]


def test_round_trip(tok_dir):
    tok = _tok(tok_dir)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("conv", CONVERSATIONS)
def test_chat_template_matches_transformers(tok_dir, conv):
    tok, hf = _tok(tok_dir), _hf(tok_dir)
    want = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(conv, add_generation_prompt=True) == want
    assert tok.apply_chat_template(conv, tokenize=True) == tok.encode(want)
    assert tok.apply_chat_template(conv, add_generation_prompt=False) == \
        hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=False)


def test_qwen3_template_with_tools_and_thinking(qwen_dir):
    """Qwen3's template uses tojson on tools and reads reasoning_content: HF semantics matter."""
    tok, hf = _tok(qwen_dir), _hf(qwen_dir)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter <heute>",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    conv = [{"role": "user", "content": "Weather in Zürich?"},
            {"role": "assistant", "content": "It is sunny.", "reasoning_content": "look it up"},
            {"role": "user", "content": "Thanks"}]
    for kw in ({"tools": tools}, {"enable_thinking": False}):
        assert tok.apply_chat_template(conv, **kw) == hf.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=True, **kw)


def test_qwen3_ids_match_transformers(qwen_dir):
    tok, hf = _tok(qwen_dir), _hf(qwen_dir)
    for text in TEXTS:
        assert tok.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
    assert tok.stop_token_ids[:2] == (151645, 151643)  # <|im_end|> (eos), <|endoftext|>
    assert tok.eos_token == "<|im_end|>" and tok.bos_token is None


def test_smollm2_tokenizer_semantics(smol_dir):
    """The rebuilt tokenizer keeps the GGUF vocabulary and llama.cpp's 'smollm' pre-tokenizer rules."""
    import gguf

    tok = _tok(smol_dir)
    reader = gguf.GGUFReader(default_gguf_path())
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    assert tok.vocab_size == len(tokens) == 49152
    assert all(tok.id_to_token(i) == t for i, t in enumerate(tokens))
    ids = tok.encode("The capital of France is Paris.")
    assert tok.decode(ids) == "The capital of France is Paris."
    assert [tokens[i] for i in ids] == ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis", "ĠParis", "."]
    for i, t in enumerate(types):  # control tokens: one id each, and flagged special
        if t == 3:
            assert tok.encode(tokens[i]) == [i] and tok.is_special(i)
    assert tok.encode("<|im_start|>user\nHi<|im_end|>")[0] == 1
    # \p{N} split first: every digit is its own token (SmolLM2 / StarCoder style)
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=True)  # add_bos_token false
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert set(tok.stop_token_ids) == {2, 0}
    cfg = json.loads((smol_dir / "generation_config.json").read_text())
    assert cfg["eos_token_id"] == 2


MULTIBYTE = "中文测试：你好，世界！😀🦙🧑‍🚀 Ünïcödé ✓ 𝄞"


def test_incremental_decoder_never_emits_half_characters(tok_dir):
    tok = _tok(tok_dir)
    ids = tok.encode(MULTIBYTE)
    assert any(REPLACEMENT_CHAR in tok.decode([i]) for i in ids)  # some ids are partial characters
    dec = tok.incremental_decoder()
    pieces = [dec.feed(i) for i in ids]
    assert "" in pieces  # something was held back
    assert all(REPLACEMENT_CHAR not in p for p in pieces)
    assert "".join(pieces) + dec.flush() == tok.decode(ids) == MULTIBYTE


def test_incremental_decoder_skips_special_and_flushes_invalid_bytes(qwen_dir):
    tok = _tok(qwen_dir)
    dec = tok.incremental_decoder(skip_special_tokens=True)
    out = "".join(dec.feed(i) for i in tok.encode("Hi<|im_end|>")) + dec.flush()
    assert out == "Hi"
    cont = tok.token_to_id("Ĥ")  # byte 0x84: a UTF-8 continuation byte on its own is invalid
    dec = tok.incremental_decoder()
    assert [dec.feed(cont) for _ in range(3)] == ["", "", ""]
    assert dec.flush() == ""  # an incomplete tail at the end is dropped, never half a character
    emoji = tok.encode("🪿")
    assert len(emoji) > 1
    dec = tok.incremental_decoder()
    assert "".join(dec.feed(i) for i in [*tok.encode("ok "), *emoji[:-1]]) + dec.flush() == "ok "
    dec = tok.incremental_decoder()  # invalid bytes do not stall the stream forever
    out = [dec.feed(cont) for _ in range(8)]
    assert out[:7] == [""] * 7 and out[7] == REPLACEMENT_CHAR * 8
    assert dec.feed(tok.token_to_id("Ġ")) == " "


def test_stop_matcher_holds_back_and_truncates():
    m = StopMatcher(["STOP", "\n\n"])
    assert m.feed("Hello wor") == ("Hello wor", False)
    assert m.feed("ld ST") == ("ld ", False)  # "ST" could start "STOP"
    assert m.feed("AR") == ("STAR", False)
    assert m.feed(" x\n") == (" x", False)
    assert m.feed("\nrest") == ("", True) and m.matched == "\n\n"
    assert m.feed("more") == ("", True) and m.flush() == ""
    m = StopMatcher(["<end>"])
    assert m.feed("a <en") == ("a ", False)
    assert m.flush() == "<en"  # generation ended without the stop string: the text is real output
    assert StopMatcher([]).feed("x") == ("x", False)


@settings(max_examples=200, deadline=None)
@example(text="aXX", stops=["X", "aXX"], cuts=[2])  # a longer stop string that starts earlier wins
@given(text=st.text(alphabet="abc XY", max_size=40), stops=st.lists(st.text(alphabet="abcX", min_size=1, max_size=4),
                                                                    max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=8))
def test_stop_matcher_equals_truncation_at_first_stop(text, stops, cuts):
    m = StopMatcher(stops)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    out, stopped = "", False
    for a, b in zip(bounds, bounds[1:]):
        piece, stopped = m.feed(text[a:b])
        out += piece
        if stopped:
            break
    if not stopped:
        out += m.flush()
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    assert out == (text[:min(hits)] if hits else text)
    assert stopped == bool(hits)


def test_template_sources_and_errors(tmp_path, qwen_dir):
    d = tmp_path / "m"
    d.mkdir()
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(d)
    (d / "tokenizer.json").write_bytes((qwen_dir / "tokenizer.json").read_bytes())
    tok = Tokenizer.from_dir(d)
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": [
        {"name": "tool_use", "template": "T"},
        {"name": "default", "template": "{% if messages|length > 1 %}{{ raise_exception('one only') }}{% endif %}"
                                        "{{ messages[0].content|tojson }}|{{ eos_token }}|{{ strftime_now('%Y') }}"}]}))
    tok = Tokenizer.from_dir(d)
    out = tok.apply_chat_template([{"role": "user", "content": "<b>é</b>"}])
    assert out.startswith('"<b>é</b>"|<|im_end|>|2')  # tojson without HTML escaping or ASCII escapes
    with pytest.raises(TokenizerError, match="one only"):
        tok.apply_chat_template([{"role": "user", "content": "a"}] * 2)
    # trim_blocks + lstrip_blocks as in transformers: compare with its own compiled template
    from transformers.utils.chat_template_utils import _compile_jinja_template

    src = "{% for m in messages %}\n  {% if m.role %}\n    [{{ m.role }}] {{ m.content }}\n  {% endif %}\n{% endfor %}"
    (d / "chat_template.jinja").write_text(src)
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    got = Tokenizer.from_dir(d).apply_chat_template(msgs)
    assert got == _compile_jinja_template(src).render(messages=msgs, add_generation_prompt=True)
    assert got == "    [user] a\n    [assistant] b\n"
    (d / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(TokenizerError, match="syntax"):
        Tokenizer.from_dir(d).apply_chat_template([])


# ---- the byte-length bound (the server refuses a prompt from it before tokenizing) ----------
NASTY = st.lists(st.sampled_from(
    [" ", "  ", "\n", "\t", "\r\n", "a", "Z", "7", "12345", "é", "e\u0301", "\u1100\u1161\u11a8",  # Hangul jamo: NFC composes
     "\uff21", "\u212a", "𝐀", "😀", "🧑‍🚀", "日本", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
     "ĠĠ", "\x00", "\u200b", "-" * 40, " " * 80, "\n" + " " * 80]), max_size=60).map("".join)


@given(text=NASTY)
@settings(max_examples=300, deadline=None)
@example(text=("\n" + " " * 80) * 50)
@example(text="𝐀" * 100)
def test_min_tokens_never_exceeds_the_real_count(tok_dir, text):
    tok = _tok(tok_dir)
    assert tok.bytes_per_token is not None
    assert tok.min_tokens(text) <= len(tok.encode(text))
    from edge_llm.tokenizer import plain  # a chat message's text: plain pieces encoded separately
    marked = "x" + plain(text) + "<|im_end|>" + plain(text[::-1])
    assert tok.min_tokens(marked) <= len(tok.encode(marked))


def test_min_tokens_is_tight_on_the_longest_token(tok_dir):
    """Text made of the longest vocabulary token reaches the bound: it cannot be raised."""
    tok = _tok(tok_dir)
    vocab = json.loads(tok._tk.to_str())["model"]["vocab"]
    longest = max(vocab, key=len)
    text = tok.decode([vocab[longest]]) * 40
    n = len(tok.encode(text))
    assert tok.min_tokens(text) <= n <= 41 and tok.min_tokens(text) >= 39


def test_min_tokens_is_zero_where_the_structure_gives_no_bound(tmp_path):
    """A pre-tokenizer that drops whitespace has no byte bound: nothing is refused from it."""
    from tokenizers import Tokenizer as HF
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    hf = HF(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    hf.pre_tokenizer = Whitespace()
    tok = Tokenizer(hf)
    assert tok.bytes_per_token is None and tok.min_tokens("a" + " " * 1000 + "a") == 0


def test_encode_releases_the_gil(smol_dir):
    """A long prompt tokenized in an HTTP thread must leave the other threads running (the event
    loop, /health, the worker): count the turns another thread gets while one encode runs."""
    import threading
    import time

    tok = _tok(smol_dir)
    text = "0123456789" * 50_000  # digits are single tokens: 500,000 of them
    started, turns, during = threading.Event(), [], []

    def run():
        started.set()
        before = len(turns)
        tok.encode(text)
        during.append(len(turns) - before)  # the turns taken while this thread was in encode

    t = threading.Thread(target=run)
    t.start()
    started.wait()
    while t.is_alive():
        turns.append(1)
        time.sleep(0.0005)
    t.join()
    # counted from inside the encoding thread, over the encode alone: an encode that holds the GIL
    # leaves no turn (at most one at each edge of the call; tokenizers' own `encode`, which holds
    # it, measured 2 here), and a busy machine cannot add any, as a turn needs the GIL. Released,
    # the other thread ran hundreds of times here (~1300 in 0.8 s); a few are asked for, so a busy
    # scheduler's late wake-ups are not mistaken for a held GIL
    assert during[0] > 5, f"the encode held the GIL: the other thread ran {during[0]} times while it tokenized"
