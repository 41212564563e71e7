"""The int8 matmul seam's host engine and the quantization around it (backends/npu/matmul/int8.py).

`HostInt8Matmul` is the reference every board result is compared with, so it is checked against
int64 numpy arithmetic at the largest K librknnrt takes, with the extreme values: an engine that
summed a longer block of K in float32 (or summed in float32 at all) fails `test_host_is_exact`
(127 * 127 * 10240 is far above 2**24, where float32 stops holding every integer).
"""

from __future__ import annotations

import numpy as np
import pytest

from edge_llm.backends.npu.matmul.int8 import HostInt8Matmul, dequantize, quantize_rows, quantize_weight
from edge_llm.errors import ConfigError


def _exact(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    return (a.astype(np.int64) @ w.astype(np.int64)).astype(np.int32)


def test_host_is_exact():
    rng = np.random.default_rng(0)
    K, N = 10240, 64
    w = rng.integers(-127, 128, (K, N), dtype=np.int8)
    w[:, 0] = 127  # the extremes: every product +-16129, sums up to 1.65e8
    w[:, 1] = -127
    a = rng.integers(-127, 128, (5, K), dtype=np.int8)
    a[0] = 127
    a[1] = -127
    a[2, ::2], a[2, 1::2] = 127, 1  # odd partial sums far above 2**24
    mm = HostInt8Matmul()
    mm.add("w", w)
    c = mm.run("w", a)
    assert c.dtype == np.int32 and c.shape == (5, N)
    np.testing.assert_array_equal(c, _exact(a, w))
    assert c[0, 0] == 127 * 127 * K
    # rows never mix: each row alone gives the same bits
    for i in range(5):
        np.testing.assert_array_equal(mm.run("w", a[i:i + 1])[0], c[i])


def test_host_refusals():
    mm = HostInt8Matmul()
    with pytest.raises(ConfigError, match="multiples of 32"):
        mm.add("w", np.zeros((48, 32), np.int8))
    with pytest.raises(ConfigError, match="K <= 10240"):
        mm.add("w", np.zeros((10272, 32), np.int8))
    with pytest.raises(ConfigError, match="int8"):
        mm.add("w", np.zeros((32, 32), np.int16))
    mm.add("w", np.zeros((32, 32), np.int8))
    with pytest.raises(ConfigError, match="twice"):
        mm.add("w", np.zeros((32, 32), np.int8))
    with pytest.raises(ValueError, match=r"\(M >= 1, 32\)"):
        mm.run("w", np.zeros((1, 64), np.int8))
    with pytest.raises(KeyError, match="never added"):
        mm.run("nope", np.zeros((1, 32), np.int8))


def test_quantize_rows():
    x = np.array([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.5, -0.75, 2.25]], np.float32)
    q, s = quantize_rows(x)
    assert q.dtype == np.int8 and s.dtype == np.float32
    np.testing.assert_array_equal(s, np.float32([2 / 127, 1.0, 3 / 127]))
    np.testing.assert_array_equal(q[1], 0)
    assert q[0, 1] == -127 and q[2, 0] == 127
    assert q[0, 2] == 32  # 0.5 / (2/127) = 31.75 -> 32
    # round half to even: 1.5 / (3/127) = 63.5 -> 64, 0.75 -> 31.75 -> 32, 2.25 -> 95.25 -> 95
    assert list(q[2]) == [127, 64, -32, 95]
    # a row's result depends only on that row
    q1, s1 = quantize_rows(x[2:3])
    np.testing.assert_array_equal(q1[0], q[2])
    assert s1[0] == s[2]


def test_quantize_weight_and_dequantize():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    w[:, 3] = 0
    q, s = quantize_weight(w)
    assert s[3] == 1 and not q[:, 3].any()
    np.testing.assert_array_equal(np.abs(q).max(axis=0)[[0, 1, 2]], 127)
    err = np.abs(q * s - w).max(axis=0)
    assert (err <= s / 2 * 1.0001).all()  # at most half a step per channel
    # clip: a smaller scale, the tail saturates at +-127
    qc, sc = quantize_weight(w, clip=np.full(32, 0.5, np.float32))
    np.testing.assert_allclose(sc[:3], s[:3] * 0.5, rtol=1e-6)
    assert np.abs(qc).max() == 127
    # dequantize: (c * row) * col, in that order, float32
    c = np.array([[100, -3], [2**25 + 1, 7]], np.int32)
    r, col = np.float32([0.1, 3.0]), np.float32([0.7, 1.3])
    y = dequantize(c, r, col)
    assert y.dtype == np.float32
    want = (c.astype(np.float32) * r[:, None]).astype(np.float32) * col[None, :]
    np.testing.assert_array_equal(y, want)
    # the whole chain approximates the float product
    x = rng.standard_normal((3, 64)).astype(np.float32)
    qa, sa = quantize_rows(x)
    mm = HostInt8Matmul()
    mm.add("w", q)
    y = dequantize(mm.run("w", qa), sa, s)
    ref = x @ w
    assert np.abs(y - ref).max() < 0.05 * np.abs(ref).max()
