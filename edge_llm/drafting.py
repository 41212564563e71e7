"""Prompt-lookup drafting for speculative decoding: what to draft, how much, and when not to.

A draft is the continuation of the most recent earlier occurrence of the conversation's last
n-gram (n = `draft_ngram` down to 2), cut at `draft_max` tokens, at the tokens the request may
still generate and at image rows (they have no token id). The engine verifies a draft in one
multi-row forward of [last sampled token, draft...] and keeps the verified prefix
(`Engine.generate`); this module decides, per step, whether a draft of what length is worth it.

The decision is a cost model: the backend's declared profile of what a forward of T rows costs
relative to one row (`Backend.forward_cost`, edge_llm/backends/__init__.py), not a timing, so the
choices, and with them the output, are a function of the request alone. With an acceptance
probability p per drafted token, a draft of k tokens yields (1 - p^(k+1)) / (1 - p) tokens per
forward of k + 1 rows; the k with the most tokens per unit of cost is taken if it beats a plain
step by GAIN, else the step is plain. p is estimated per request, from the verified drafts and,
during plain steps, from the draft the lookup offered but the policy declined (compared with the
tokens the model then chose, as a verify would have: free), so drafting switches itself back on when the conversation
starts repeating itself; and per drafting site (the last two tokens), so that the sites where
copying fails stop drafting while the others go on.
See docs/speculative.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from edge_llm.settings import DEFAULTS, DRAFT_MODES

NGRAM_MIN = 2  # a one-token match drafts from anywhere the token occurred: rarely accepted
EMA = 0.2  # weight of a new observation in the running estimates
P_PRIOR = 0.3  # acceptance before anything is known about this conversation
GAIN = 1.1  # a draft must promise 10 % more tokens per unit of cost than plain steps (the
# profile is measured on one machine: margin for others)


@dataclass(frozen=True)
class DraftConfig:
    """The drafting settings (edge_llm/settings.py: `draft`, `draft_max`, `draft_ngram`)."""

    mode: str = DEFAULTS.draft
    max_tokens: int = DEFAULTS.draft_max
    ngram: int = DEFAULTS.draft_ngram

    def __post_init__(self) -> None:
        if self.mode not in DRAFT_MODES:
            raise ValueError(f"draft must be one of {DRAFT_MODES}, got {self.mode!r}")
        if self.max_tokens < 1 or self.ngram < NGRAM_MIN:
            raise ValueError(f"draft_max must be >= 1 and draft_ngram >= {NGRAM_MIN}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


def lookup(ctx: np.ndarray, ngram: int, limit: int) -> np.ndarray:
    """Up to `limit` tokens that followed the most recent earlier occurrence of ctx's last n-gram,
    for n = ngram down to NGRAM_MIN (longest match first); empty if none. Negative entries
    (image rows) never match and end a draft."""
    n_ctx = ctx.size
    for n in range(min(ngram, n_ctx - 1), NGRAM_MIN - 1, -1):
        tail = ctx[n_ctx - n:]
        if tail.min() < 0:
            continue
        # windows starting at i <= n_ctx - 1 - n: each has a continuation, none is the tail itself
        hits = np.flatnonzero((sliding_window_view(ctx[:n_ctx - 1], n) == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            draft = ctx[start:start + limit]
            neg = np.flatnonzero(draft < 0)
            return draft[:neg[0]] if neg.size else draft
    return ctx[:0]


def expected_tokens(p: float, k: int) -> float:
    """Tokens one verify forward of a k-token draft yields: the accepted run plus the one the
    model adds, with each drafted token accepted with probability p (given the ones before)."""
    return float(k + 1) if p >= 1.0 else (1.0 - p ** (k + 1)) / (1.0 - p)


class Drafter:
    """One request's drafting: the conversation so far (prompt + generated, image rows -1), the
    acceptance estimate, and the choice of each step's draft."""

    def __init__(self, config: DraftConfig, cost: Callable[[int], float], prompt: np.ndarray, max_new: int):
        self.config, self.cost = config, cost  # cost(rows): a forward's cost relative to one row
        self.ctx = np.full(prompt.size + max_new, -1, dtype=np.int64)
        self.ctx[:prompt.size] = prompt
        self.n = prompt.size
        self.p = P_PRIOR
        # the estimate per drafting site (the last two tokens when the draft was made), the global p
        # its prior: where the conversation repeats its structure but not its content (a line
        # whose number changes), the sites where copying fails learn it and stop drafting
        self.site_p: dict[tuple[int, int], float] = {}
        self.site: tuple[int, int] = (-1, -1)  # the site of the pending verify or declined draft
        # a declined draft, checked against the tokens the model then chose (`shadow_hits` so far)
        self.shadow: np.ndarray | None = None
        self.shadow_hits = 0

    def append(self, tok: int) -> None:
        """A generated token (call for every emitted token, in order)."""
        if self.shadow is not None:  # scored as a verify forward would have scored it
            if tok == self.shadow[self.shadow_hits]:
                self.shadow_hits += 1
                if self.shadow_hits == self.shadow.size:
                    self._observe(self.shadow_hits, self.shadow_hits)
                    self.shadow = None
            else:
                self._observe(self.shadow_hits, self.shadow_hits + 1)
                self.shadow = None
        self.ctx[self.n] = tok
        self.n += 1

    def _observe(self, accepted: int, drafted: int) -> None:
        # a new site starts from the conversation's estimate as it was before this outcome
        self.site_p[self.site] = _update(self.site_p.get(self.site, self.p), accepted, drafted)
        self.p = _update(self.p, accepted, drafted)

    def propose(self, room: int) -> np.ndarray:
        """The draft for the next forward (empty: a plain step); `room`: tokens the request may
        still generate after the one being forwarded."""
        limit = min(self.config.max_tokens, room)
        if limit < 1:
            return self.ctx[:0]
        cand = lookup(self.ctx[:self.n], self.config.ngram, limit)
        if cand.size == 0:
            return cand
        site = (int(self.ctx[self.n - 2]), int(self.ctx[self.n - 1])) if self.n >= 2 else (-1, -1)
        k = self._best_length(cand.size, self.site_p.get(site, self.p))
        if k > 0:  # the verify scores this draft: a pending declined one would count twice
            self.shadow, self.site = None, site
        elif self.shadow is None:  # declined: learn from it for free
            self.shadow, self.shadow_hits, self.site = cand.copy(), 0, site
        return cand[:k]

    def _best_length(self, available: int, p: float) -> int:
        best_k, best_rate = 0, GAIN  # a plain step: one token for a cost of 1
        for k in range(1, available + 1):
            rate = expected_tokens(p, k) / self.cost(k + 1)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def verified(self, drafted: int, accepted: int) -> None:
        """A verify forward's outcome (the emitted tokens are `append`ed separately)."""
        self._observe(accepted, drafted)


def _update(p: float, accepted: int, drafted: int) -> float:
    """An acceptance estimate after a draft of which `accepted` of `drafted` tokens were kept."""
    for _ in range(accepted):
        p += EMA * (1.0 - p)
    if accepted < drafted:  # tokens after the first rejection say nothing
        p -= EMA * p
    return p


def verify(logits: np.ndarray, draft: Sequence[int], sample: Callable[[np.ndarray], int]) -> list[int]:
    """The tokens a verify forward yields. `logits` (k + 1, vocab): row i follows the forwarded
    token and draft[:i]. Row i is sampled with the request's own sampler; the draft token is kept
    if the sample equals it, and the first sample that differs ends the run (it is the model's
    token there); if all k are kept, row k's sample is the bonus token.

    This is the speculative-sampling rule for a draft that proposes one token with certainty
    (q = 1 at d): keep d with probability min(1, p(d) / q(d)) = p(d), else sample from the
    residual max(0, p - q) normalised, which is p without d. Drawing x ~ p and keeping d iff x = d
    does exactly that, and uses one draw per emitted token in order: a seeded request draws what
    plain decoding draws, so drafting changes no sampled token (the rows' logits aside: a batch
    may round differently from a one-row step). Greedy is the sampler's argmax: the same rule."""
    out: list[int] = []
    for row in range(len(draft) + 1):
        out.append(sample(logits[row]))
        if row == len(draft) or out[-1] != draft[row]:
            break
    return out
