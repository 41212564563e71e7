"""The most bytes of text one token can stand for, from a tokenizer.json's structure: a prompt's
byte length divided by it is a lower bound of its token count (docs/api.md, "Request limits").

Known for BPE models whose pre-tokenizer keeps every byte and that never fuse a run of unknown
characters into one token. A byte-level vocabulary spells each byte as one character, so a token
covers as many bytes as its string has characters; otherwise a token's UTF-8 string is at least
the text it covers (a Metaspace "▁" is 3 bytes for 1, a byte-fallback "<0x41>" 6 for 1). Added
tokens match their content literally. The text is measured after the tokenizer's normalizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# pre-tokenizers that keep every byte of their input in some piece (Whitespace, WhitespaceSplit and
# BertPreTokenizer drop whitespace, Split can remove what it matches): see `bytes_per_token`
_KEEPING_PRE = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


def _keeps_bytes(pre: Any) -> bool:
    if pre is None:
        return True
    kind = pre.get("type") if isinstance(pre, dict) else None
    if kind == "Sequence":
        return all(_keeps_bytes(p) for p in pre.get("pretokenizers", []))
    if kind == "Split":
        return pre.get("behavior") != "Removed" and not pre.get("invert")
    return kind in _KEEPING_PRE


def _uses_byte_level(pre: Any) -> bool:
    if not isinstance(pre, dict):
        return False
    if pre.get("type") == "Sequence":
        return any(_uses_byte_level(p) for p in pre.get("pretokenizers", []))
    return pre.get("type") == "ByteLevel"


def bytes_per_token(config: dict[str, Any], added: Iterable[str]) -> int | None:
    """The bound for a parsed tokenizer.json (`added`: the added tokens' contents), or None."""
    model, pre = config.get("model") or {}, config.get("pre_tokenizer")
    if model.get("type") != "BPE" or not _keeps_bytes(pre):
        return None
    if model.get("unk_token") and model.get("fuse_unk") and not model.get("byte_fallback"):
        return None
    byte_level = _uses_byte_level(pre)
    vocab = model.get("vocab") or {}
    longest = max((len(t) if byte_level else len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1)
    longest_added = max((len(t.encode("utf-8", "surrogatepass")) for t in added), default=1)
    return max(longest, longest_added, 4)  # 4: an unknown character (one UTF-8 character) as one unk token
