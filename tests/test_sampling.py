import numpy as np
import pytest

from edge_llm.sampling import Sampler, SamplingParams


def logits(seed=0, n=500):
    return np.random.default_rng(seed).normal(size=n).astype(np.float32) * 3


def test_greedy_is_argmax():
    x = logits()
    assert Sampler(SamplingParams())(x) == int(np.argmax(x))
    assert Sampler(SamplingParams(temperature=1.0, top_k=1))(x) == int(np.argmax(x))


def test_seed_reproducible_and_seed_matters():
    x = logits()
    p = SamplingParams(temperature=1.0, seed=123)
    a = [Sampler(p)(x) for _ in range(3)]
    s1, s2 = Sampler(p), Sampler(SamplingParams(temperature=1.0, seed=124))
    seq1 = [s1(x) for _ in range(50)]
    seq2 = [s2(x) for _ in range(50)]
    assert len(set(a)) == 1
    assert seq1 != seq2
    s3 = Sampler(p)
    assert [s3(x) for _ in range(50)] == seq1


def test_top_k_restricts_support():
    x = logits(1)
    top = set(np.argsort(-x)[:5].tolist())
    s = Sampler(SamplingParams(temperature=5.0, top_k=5, seed=0))
    drawn = {s(x) for _ in range(300)}
    assert drawn <= top and len(drawn) > 1


def test_top_p_restricts_to_nucleus():
    x = np.array([5.0, 4.0, 0.0, -1.0, -2.0], dtype=np.float32)
    p = np.exp(x - x.max()); p /= p.sum()
    # p[0] + p[1] ~ 0.99 > 0.9: nucleus is {0, 1}
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=0))
    drawn = {s(x) for _ in range(500)}
    assert drawn == {0, 1}


def test_distribution_matches_softmax():
    x = np.array([1.0, 0.0, -1.0], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=1.0, seed=7))
    counts = np.bincount([s(x) for _ in range(20000)], minlength=3) / 20000
    p = np.exp(x) / np.exp(x).sum()
    assert np.abs(counts - p).max() < 0.02


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5)])
def test_invalid_params(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


@pytest.mark.parametrize("config,want", [
    (None, (1.0, 1.0, 0, "openai")),
    ({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "do_sample": True}, (0.7, 0.8, 20, "generation_config.json")),
    ({"temperature": 0.2, "top_p": 0.9}, (0.2, 0.9, 0, "generation_config.json")),
    ({"do_sample": False, "temperature": 0.7}, (0.0, 1.0, 0, "generation_config.json (do_sample: false = greedy)")),
    ({"eos_token_id": 2}, (1.0, 1.0, 0, "openai")),
    ({"temperature": -1}, (1.0, 1.0, 0, "openai")),  # out of range: ignored, with a warning
    ("[not an object]", (1.0, 1.0, 0, "openai")),
])
def test_model_sampling_defaults(tmp_path, config, want):
    import json

    from edge_llm.sampling import model_sampling_defaults

    if config is not None:
        (tmp_path / "generation_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    d = model_sampling_defaults(tmp_path)
    assert (d.temperature, d.top_p, d.top_k, d.source) == want
    p = d.params(top_p=0.5, seed=3)  # a request's own values win field by field
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (want[0], 0.5, want[2], 3)
