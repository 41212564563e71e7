"""Long, deterministic English conversation histories with a fact to recall (the lab's
"Bob lives in Tokyo"), sized in tokens. Used by the recovery benchmark, the evidence script and
to generate the ready request files under docs/prompts/.
"""

from __future__ import annotations

import random

CHARS_PER_TOKEN = 3.7  # this text: 3.67 chars/token with SmolLM2, 4.1 with the Qwen3 vocabulary
FACT = "Bob lives in Tokyo."
FOLLOW_UP = "Question: Based on the conversation above, where does Bob live?\nAnswer:"
QUESTION = "Question: Summarise the conversation above in one sentence.\nAnswer:"

_NAMES = ["Alice", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Mallory"]
_PLACES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Quebec", "Tbilisi", "Perth", "Bergen", "Cusco"]
_TOPICS = ["the garden", "a new bicycle", "the weather", "a recipe for soup", "the train timetable",
           "an old camera", "a chess opening", "the library", "a board game", "the river walk"]
_TEMPLATES = [
    "{a}: I spent the weekend in {p} and talked about {t} with {b}.",
    "{b}: That sounds nice. Did you also look at {t} while you were in {p}?",
    "{a}: Yes, and {b} showed me a map of {p} with every street marked by hand.",
    "{b}: I would like to visit {p} next spring, mostly because of {t}.",
    "{a}: Remember to bring a warm coat; the evenings in {p} are cold.",
    "{b}: Thanks. By the way, {a}, what did you think of {t}?",
    "{a}: Honestly, {t} was the best part of the whole trip.",
]


def history(target_tokens: int, nonce: str = "", seed: int = 0) -> str:
    """A chat log of about `target_tokens` tokens that states FACT early; ends with a newline.

    `nonce` starts the first line, so histories with different nonces share no long prefix
    (each evidence repeat starts cold even when old snapshots are on disk).
    """
    rng = random.Random(seed)
    lines = [f"{nonce} conversation log." if nonce else "Conversation log.",
             "Alice: Hi Bob, where do you live these days?", f"Bob: {FACT} I moved there last year."]
    budget = target_tokens * CHARS_PER_TOKEN
    size = sum(len(x) + 1 for x in lines)
    while size < budget:
        a, b = rng.sample(_NAMES, 2)
        line = rng.choice(_TEMPLATES).format(a=a, b=b, p=rng.choice(_PLACES), t=rng.choice(_TOPICS))
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines) + "\n"


def sized_history(encode, target_tokens: int, nonce: str = "", seed: int = 0) -> str:
    """history() rescaled until the tokenizer (`encode`) counts about `target_tokens` tokens."""
    t = target_tokens
    for _ in range(4):
        h = history(t, nonce, seed)
        n = len(encode(h))
        if abs(n - target_tokens) <= max(4, target_tokens // 200):
            break
        t = max(1, round(t * target_tokens / n))
    return h
