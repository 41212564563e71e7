"""Prompt-lookup drafting (edge_llm/drafting.py): the lookup, the cost model's choice, and the
verification rule, whose output distribution must be the model's (docs/speculative.md)."""

import numpy as np
import pytest

from edge_llm.drafting import DraftConfig, Drafter, expected_tokens, lookup, verify
from edge_llm.sampling import Sampler, SamplingParams


def arr(*xs):
    return np.array(xs, dtype=np.int64)


def test_lookup_takes_the_most_recent_longest_match_and_stops_at_image_rows():
    # last 3-gram (1 2 3) occurred at 0 (-> 4 5) and at 6 (-> 9 9): the most recent wins
    ctx = arr(1, 2, 3, 4, 5, 0, 1, 2, 3, 9, 9, 7, 1, 2, 3)
    assert lookup(ctx, 3, 8).tolist() == [9, 9, 7, 1, 2, 3]
    assert lookup(ctx, 3, 2).tolist() == [9, 9]
    # no 3-gram match: falls back to the 2-gram (8 2 3 -> 2 3 occurred, followed by 4)
    assert lookup(arr(2, 3, 4, 5, 8, 2, 3), 3, 4).tolist() == [4, 5, 8, 2]
    assert lookup(arr(1, 2, 3, 4), 3, 4).size == 0  # nothing repeats: no draft
    assert lookup(arr(5, 6), 3, 4).size == 0  # only the tail itself
    # image rows (-1) never match and end a draft
    assert lookup(arr(7, 8, 9, -1, -1, 4, 7, 8), 3, 5).tolist() == [9]
    assert lookup(arr(-1, -1, 3, -1, -1), 3, 5).size == 0


def test_policy_drafts_only_where_the_cost_profile_says_it_pays():
    from edge_llm.backends.cost import NEVER_PAYS, ForwardCost

    free = ForwardCost(1.0, 0.0)  # a weight-bound forward: T rows cost one
    d = Drafter(DraftConfig(), free, arr(*range(10), *range(10)), max_new=20)
    d.append(0)  # ... 8 9 0: "9 0" occurred at 9, followed by 1 2 3 ...
    assert d.propose(room=20).tolist() == [1, 2, 3, 4, 5, 6, 7, 8]  # free rows: the longest draft
    assert d.propose(room=3).size == 3 and d.propose(room=0).size == 0  # never past max_tokens
    d.cost = ForwardCost(2.3, 0.07)  # backend cpu's profile: two rows cost 2.3 steps
    d.p = 0.3  # the prior: no draft pays, the lookup's is watched instead
    assert d.propose(room=20).size == 0 and d.shadow.tolist()[:3] == [1, 2, 3]
    d.append(1)
    d.append(2)  # the model chose what the declined draft said, twice, then not: scored as a verify
    d.append(7)
    assert d.shadow is None and d.p == pytest.approx(((0.3 + 0.2 * 0.7) * 0.8 + 0.2) * 0.8)
    d.append(8)  # "7 8" occurred: a draft of 6 is on offer (9 0 1 2 7 8)
    d.p = 0.9  # a conversation that repeats itself: long drafts pay, up to a point
    rate = [expected_tokens(0.9, k) / d.cost(k + 1) for k in range(1, 7)]
    d.shadow = np.array([9, 9])  # a declined draft still pending: the verify scores instead
    assert max(rate) > 1.1 and d.propose(room=20).tolist() == [9, 0, 1, 2, 7, 8][:1 + int(np.argmax(rate))]
    assert d.shadow is None
    d.cost = NEVER_PAYS  # a backend without a profile
    assert d.propose(room=20).size == 0
    d.p = 0.999
    assert d.propose(room=20).size == 0


def test_a_site_where_copying_fails_stops_drafting_there_only():
    """Lines that repeat their structure but not their numbers (the 135M model's answers from a
    log): after a drafting site (the last two tokens) fails, drafts there need its own estimate
    to recover, while the other sites keep the conversation's."""
    from edge_llm.backends.cost import ForwardCost

    line = [5, 6, 7, 8]  # "the east warehouse received" ... then a number that changes
    d = Drafter(DraftConfig(), ForwardCost(1.15, 0.17), arr(*line, 100, 9, *line, 101, 9), max_new=40)
    d.p = 0.8
    d.append(5)
    d.append(6)  # site (5, 6): the line's head
    assert d.propose(room=20).tolist()[:3] == [7, 8, 101]
    d.verified(3, 2)  # 7 8 kept, 101 was not: the model wrote 102
    for t in (7, 8, 102, 9, 5, 6):
        d.append(t)
    # both learnt from it, each from 0.8 (the site's prior is the estimate before this outcome)
    assert d.site_p[(5, 6)] == d.p == pytest.approx((0.8 + 0.2 * 0.2 + 0.2 * 0.16) * 0.8)  # 2 kept, then 1 not
    d.site_p[(5, 6)] = 0.2  # after a few more failures there
    assert d.propose(room=20).size == 0  # ... site (5, 6) declines (its lookup is watched instead)
    assert d.site == (5, 6) and d.shadow is not None
    d.append(7)
    d.append(8)
    d.append(103)  # the watched draft failed at the number: scored for site (5, 6) only
    assert d.site_p[(5, 6)] < 0.2 + 2 * 0.2 * 0.8 and d.shadow is None
    d.append(9)
    d.append(5)
    d.p = 0.8
    assert d.propose(room=20).tolist()[:2] == [6, 7]  # site (9, 5), never seen: the conversation's estimate


def test_expected_tokens_per_forward():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_verify_keeps_the_prefix_the_sampler_agrees_with():
    vocab = 6
    rows = np.full((4, vocab), -10.0, dtype=np.float32)
    for i, t in enumerate((3, 1, 4, 2)):  # the model's argmax after each row
        rows[i, t] = 10.0
    greedy = Sampler(SamplingParams())
    assert verify(rows, [3, 1, 4], greedy) == [3, 1, 4, 2]  # all kept + the bonus token
    assert verify(rows, [3, 5, 4], greedy) == [3, 1]  # the first miss is replaced, the rest dropped
    assert verify(rows, [0, 1, 4], greedy) == [3]
    assert verify(rows[:1], [], greedy) == [3]


def test_seeded_verification_draws_exactly_what_plain_sampling_draws():
    """One draw per emitted token, in order: with the same seed, a verified run is the prefix of
    the tokens plain steps sample from the same rows (drafts right, wrong, or half right)."""
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(6, 50)).astype(np.float32) * 2
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    plain_s = Sampler(params)
    plain = [plain_s(r) for r in rows]
    for draft in (plain[:5], [plain[0], plain[1], -5, 1, 1], [(plain[0] + 1) % 50, 1, 2, 3, 4]):
        s = Sampler(params)
        got = verify(rows, draft, s)
        n_ok = next((i for i, (a, b) in enumerate(zip(draft, plain)) if a != b), len(draft))
        assert got == plain[:n_ok + 1]
        # and the generator is where plain sampling's is after as many tokens
        assert s.rng.random() == Sampler(params).rng.random(len(got) + 1)[-1]


def test_verification_samples_the_model_distribution_and_accepts_with_p_of_the_draft():
    """The rule against the textbook one (keep d with min(1, p/q), else sample the residual):
    for a one-token draft (q = 1 at d), both give p; the draft is kept with probability p(d)."""
    logits = np.array([2.0, 1.2, 0.3, 0.0, -1.0], dtype=np.float32)
    params = SamplingParams(temperature=0.8, top_k=4)
    x = logits.astype(np.float64) / 0.8
    x[-1] = -np.inf  # top_k = 4 removes the smallest
    p = np.exp(x - x.max())
    p /= p.sum()
    n, draft = 40000, 1
    s = Sampler(SamplingParams(params.temperature, params.top_k, seed=1))
    rows = np.stack([logits, logits])
    ours, kept = np.zeros(5), 0
    for _ in range(n):
        out = verify(rows, [draft], s)
        ours[out[0]] += 1
        kept += len(out) == 2
    textbook = np.zeros(5)
    rng = np.random.default_rng(2)
    residual = p.copy()
    residual[draft] = 0
    residual /= residual.sum()
    for _ in range(n):
        textbook[draft if rng.random() < p[draft] else rng.choice(5, p=residual)] += 1
    sigma = np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(ours / n - p) < 5 * sigma + 1e-12), (ours / n, p)
    assert np.all(np.abs(textbook / n - p) < 5 * sigma + 1e-12), (textbook / n, p)
    assert abs(kept / n - p[draft]) < 5 * sigma[draft]
    assert ours[4] == 0  # top_k's cut holds for drafted positions too


def test_config_validates():
    with pytest.raises(ValueError, match="draft must be one of"):
        DraftConfig(mode="eagle")
    with pytest.raises(ValueError, match="draft_ngram"):
        DraftConfig(ngram=1)
    assert not DraftConfig(mode="off").enabled
