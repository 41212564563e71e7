import numpy as np
import psutil
import pytest

from edge_llm.config import Geometry
from edge_llm.errors import KVCacheError
from edge_llm.kvcache import KVCache, lcp

G = Geometry(n_layers=3, n_kv_heads=2, head_dim=4)


def test_layout_and_bytes():
    c = KVCache(G, max_seq=10, kv_bs=4)
    assert c.data.shape == (3, 2, 10, 8) and c.data.dtype == np.float32
    assert c.nbytes == 10 * G.kv_bytes_per_token == 10 * 2 * 3 * 8 * 4
    assert not c.data.any() and c.data.flags.writeable and c.data.flags.c_contiguous


def test_tokens_truncate_and_limits():
    c = KVCache(G, max_seq=5)
    c.append_tokens([1, 2, 3])
    assert c.length == 3
    assert c.common_prefix([1, 2, 9, 9]) == 2
    c.truncate(1)
    assert c.tokens == [1]
    with pytest.raises(KVCacheError):
        c.truncate(2)
    with pytest.raises(KVCacheError):
        c.append_tokens([0] * 5)
    with pytest.raises(KVCacheError):
        c.rows(0, 0, 3, 6)


def test_allocation_beyond_available_memory_is_refused_clearly():
    avail = psutil.virtual_memory().available
    too_many = avail // G.kv_bytes_per_token + 1
    with pytest.raises(KVCacheError, match=r"needs \d+ MiB .* available.*lower --max-seq"):
        KVCache(G, max_seq=too_many)


@pytest.mark.parametrize("a,b,n", [([], [1], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2], [1, 2, 3], 2),
                                   ([5, 2], [1, 2], 0), ([1, 2, 4], [1, 2, 3], 2)])
def test_lcp(a, b, n):
    assert lcp(a, b) == n == lcp(b, a)
