import numpy as np
import psutil
import pytest

from edge_llm.config import Geometry
from edge_llm.errors import KVCacheError, SnapshotBlockCRC
from edge_llm.kvcache import KVCache, lcp
from edge_llm.progress import Cancelled, Work
from helpers.rows_source import RowsFrom
from threadutil import LookedAt, blocked, finishes

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
    # more than the machine's total memory: the product reads `available` again, and that moves
    # with whatever else runs (a busy machine frees memory too); no reading of it can be this large
    total = psutil.virtual_memory().total
    too_many = total // G.kv_bytes_per_token + 1
    with pytest.raises(KVCacheError, match=r"needs \d+ MiB .* available.*lower --max-seq"):
        KVCache(G, max_seq=too_many)


@pytest.mark.parametrize("a,b,n", [([], [1], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2], [1, 2, 3], 2),
                                   ([5, 2], [1, 2], 0), ([1, 2, 4], [1, 2, 3], 2)])
def test_lcp(a, b, n):
    assert lcp(a, b) == n == lcp(b, a)


def test_lease_protects_rows_until_each_layer_is_written_out():
    """The rule of who may overwrite a row: a writer waits only for rows [0, n) of the layers a
    pending save (the lease) has not written out yet."""
    c = KVCache(G, max_seq=10)
    c.append_tokens(range(6))
    lease = c.lease(6)
    z = np.ones((2, G.kv_dim), np.float32)
    assert finishes(c.write, 0, 6, z, z)  # rows >= 6 are not leased
    w1 = blocked(c.write, 1, 4, z, z)
    assert w1 is not None
    lease.layer_done(1)  # layer 0 is in the file
    assert finishes(c.write, 0, 0, z, z) and w1.is_alive()
    lease.layer_done(2)
    w1.join(30)  # bounds a hang only
    assert not w1.is_alive() and np.all(c.data[1, :, 4:6] == 1)
    assert blocked(c.write, 2, 0, z, z) is not None  # layer 2 still pending
    lease.release()
    assert finishes(c.write, 2, 0, z, z)
    with pytest.raises(KVCacheError):
        c.lease(7)  # only valid rows can be leased
    with pytest.raises(KVCacheError):
        c.write(0, 9, z, z)  # rows [9, 11) do not fit


def test_waiting_writer_reports_save_progress_and_honours_cancel():
    import threading
    import time

    from edge_llm.progress import Cancelled, Work

    c = KVCache(G, max_seq=10)
    c.append_tokens(range(6))
    lease = c.lease(6)
    reports, cancel, err = [], LookedAt(), []  # the writer's cancel flag
    z = np.ones((1, G.kv_dim), np.float32)

    def write():
        try:
            c.write(2, 0, z, z, Work(cancel, lambda *a: reports.append(a)))
        except Cancelled as e:
            err.append(e)

    def until(n):  # the deadline bounds a hang only: each step waits for the writer, not a clock
        deadline = time.monotonic() + 30
        while len(reports) < n and time.monotonic() < deadline:
            th.join(0.05)

    th = threading.Thread(target=write, daemon=True)
    th.start()
    # each layer is written out only once the writer waits (its first cancel check is in its wait
    # loop, under the cache's lock, which layer_done takes): a writer a busy machine started late
    # would otherwise see layer 1 already written and report only layer 2
    assert cancel.asked.wait(30)
    lease.layer_done(1)
    until(1)
    lease.layer_done(2)
    until(2)
    assert reports == [("save-wait", 1, 3), ("save-wait", 2, 3)]  # each layer the save wrote
    cancel.set()
    th.join(30)
    assert not th.is_alive() and err and err[0].stage == "save-wait"
    assert not np.any(c.data[2, :, 0])  # nothing was written


def _rows(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((3, 2, 8, G.kv_dim)).astype(np.float32)


@pytest.mark.parametrize("pipelined", [False, True])
def test_restore_fills_rows_sets_tokens_and_reports_the_path_taken(pipelined):
    c = KVCache(G, max_seq=10)
    c.append_tokens([9, 9])  # rows of another prompt: replaced
    src = RowsFrom(_rows(), list(range(8)))
    r = c.restore(src, pipelined)
    seen = []
    out = r.finish(behind=lambda: seen.append(c.valid(2, 8)[0].copy()) or "tail")
    assert out == "tail" and c.tokens == list(range(8)) and np.array_equal(c.data[:, :, :8], src.data)
    assert np.array_equal(seen[0], src.data[2, 0])  # the tail saw layer 2 only once it was read
    assert r.restored.mode == ("pipelined" if pipelined else "sequential") and r.restored.n_tokens == 8
    assert src.outcome is r.restored and src.closed


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_failed_restore_has_one_channel_finish(pipelined):
    """A CRC error at layer 1: the tail (pipelined) is abandoned at its wait for layer 1, finish()
    raises what the source's `failed` returned, the cache is empty, nothing else raised."""
    c = KVCache(G, max_seq=10)
    import threading

    layer1 = threading.Event()  # pipelined: the reader fails on layer 1 once the tail used layer 0
    src = RowsFrom(_rows(), list(range(8)), fail_at=1, gate={1: layer1} if pipelined else {})
    r = c.restore(src, pipelined)
    reached = []

    def tail():
        c.valid(0, 8)
        reached.append(0)
        layer1.set()
        c.valid(1, 8)  # never returns: the reader failed on this layer
        reached.append(1)

    with pytest.raises(SnapshotBlockCRC):
        r.finish(behind=tail)
    assert c.length == 0 and isinstance(src.outcome, SnapshotBlockCRC) and src.closed
    assert reached == ([0] if pipelined else [])  # sequential: nothing computes on a failed read
    c.append_tokens([1])  # the cache is usable again: no restore left blocking it
    z = np.zeros((1, G.kv_dim), np.float32)
    assert finishes(c.write, 2, 0, z, z) and c.lease(1) is not None


def test_cancel_during_a_pipelined_restore_resets_unless_every_row_was_read():
    import threading

    cancel = threading.Event()
    c = KVCache(G, max_seq=10)
    gate = {2: threading.Event()}
    src = RowsFrom(_rows(), list(range(8)), gate=gate)
    r = c.restore(src, True, Work(cancel=cancel))

    def tail():
        c.valid(1, 8)
        cancel.set()
        gate[2].set()  # the reader sees the cancel before layer 2 or after: both are handled
        c.valid(2, 8, Work(cancel=cancel))

    with pytest.raises(Cancelled):
        r.finish(behind=tail)
    assert c.length in (0, 8)  # reset if the reader stopped, kept if it had read every layer
    if c.length == 8:
        assert np.array_equal(c.data[:, :, :8], src.data)


def test_a_restore_waits_for_the_rows_a_pending_save_still_needs():
    c = KVCache(G, max_seq=10)
    c.append_tokens(range(6))
    lease = c.lease(6)
    src = RowsFrom(_rows(), list(range(8)))
    restorer = blocked(lambda: c.restore(src, False).finish())
    assert restorer is not None and src.outcome is None  # layer 0 is still to be saved
    lease.release()
    restorer.join(30)  # bounds a hang only
    assert not restorer.is_alive() and np.array_equal(c.data[:, :, :8], src.data)


def test_a_second_restore_while_one_runs_is_refused_and_gives_up_no_row():
    import threading

    c = KVCache(G, max_seq=10)
    hold = threading.Event()
    first = RowsFrom(_rows(), list(range(8)), gate={1: hold})
    r = c.restore(first, True)
    with pytest.raises(KVCacheError, match="already in progress"):
        c.restore(RowsFrom(_rows(1), list(range(5))), False)
    assert c.tokens == list(range(8))  # the running restore's rows are still declared
    hold.set()
    r.finish()
    assert np.array_equal(c.data[:, :, :8], first.data)
