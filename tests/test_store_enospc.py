"""ENOSPC on a real, tiny filesystem mounted for the test (docs/store.md: faults never stop the service)."""

from __future__ import annotations

import errno
import logging
import os
import re
import subprocess

import numpy as np
import pytest

from edge_llm.config import Geometry
from edge_llm.kvcache import KVCache
from edge_llm.snapshot import format as fmt
from edge_llm.snapshot import writer as writer_mod
from edge_llm.snapshot.identity import Identity
from edge_llm.snapshot.store import SnapshotStore

G = Geometry(n_layers=4, n_kv_heads=4, head_dim=64)  # 8 KiB of KV per token
KV_BS = 16
IDENT = Identity(config={"test": "enospc"}, weights_digest="e0" * 32)
FS_BYTES = 2 * 1024 * 1024


def _run(cmd: list[str]) -> str | None:
    """Run a command; None on success, else its error text."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{cmd[0]}: {e}"
    return None if p.returncode == 0 else f"{' '.join(cmd)}: {p.stderr.strip() or p.returncode}"


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB filesystem: tmpfs, else a loop-mounted ext4 image; unmounted afterwards."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    err_tmpfs = _run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(mnt)])
    if err_tmpfs:
        img = tmp_path / "fs.img"
        with open(img, "wb") as f:
            f.truncate(4 * FS_BYTES)  # ext4 metadata takes a share; still far below one big snapshot
        err_loop = _run(["mkfs.ext4", "-q", "-F", str(img)]) or _run(["mount", "-o", "loop", str(img), str(mnt)])
        if err_loop:
            pytest.skip(f"cannot mount a small filesystem: tmpfs ({err_tmpfs}); loop ext4 ({err_loop})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def make_cache(tokens, seed=0) -> KVCache:
    c = KVCache(G, max_seq=1024, kv_bs=KV_BS, check_memory=False)
    c.data[:] = np.random.default_rng(seed).standard_normal(c.data.shape, dtype=np.float32)
    c.set_tokens(list(tokens))
    return c


def seq(n, start=1000):
    return list(range(start, start + n))


def debris(ns):
    return sorted(p.name for p in ns.iterdir() if p.name.startswith("kv_"))


@pytest.mark.parametrize("prealloc", [True, False], ids=["fallocate", "write-path"])
def test_enospc_leaves_nothing_and_store_recovers(small_fs, monkeypatch, caplog, prealloc):
    caplog.set_level(logging.INFO, logger="edge_llm.kvdisk")
    if not prealloc:  # make the disk fill up in the middle of write() instead of at fallocate
        def no_fallocate(fd, off, size):
            raise OSError(errno.EOPNOTSUPP, "fallocate disabled by the test")
        monkeypatch.setattr(writer_mod.os, "posix_fallocate", no_fallocate)
    s = SnapshotStore(small_fs, IDENT, G, kv_bs=KV_BS)
    s.scan()
    big = seq(512)
    assert fmt.snapshot_size(G.n_layers, 512, G.kv_dim, KV_BS) > FS_BYTES
    s.save_async(make_cache(big))  # must not raise: the request path never sees the error
    assert s.flush(timeout=60)
    assert debris(s.ns) == []  # no final file, no temp file
    st = s.stats()
    assert st["save_failures"] == 1 and st["saves"] == 0
    assert st["degraded"] == ["snapshot disk full"]
    fails = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[KV-DISK] save failed")]
    assert len(fails) == 1 and "No space left on device" in fails[0]

    small = seq(64, start=9000)  # 512 KiB: fits
    s.save_async(make_cache(small, seed=1))
    assert s.flush(timeout=60)
    name = fmt.snapshot_name(fmt.fnv1a64(np.asarray(small, dtype="<u4").tobytes()))
    assert debris(s.ns) == [name]
    fmt.verify_file(s.ns / name, G, IDENT.model_id)
    assert s.stats()["degraded"] == [] and s.stats()["saves"] == 1
    hit = s.lookup(small + [1])
    dst = make_cache([], seed=2)
    s.restore(hit, dst)
    assert np.array_equal(dst.data[:, :, :64], make_cache(small, seed=1).data[:, :, :64])
    s.close()


def test_full_disk_makes_room_by_evicting_lru(small_fs, caplog):
    caplog.set_level(logging.INFO, logger="edge_llm.kvdisk")
    s = SnapshotStore(small_fs, IDENT, G, kv_bs=KV_BS)
    s.scan()
    first, second = seq(160, start=100), seq(160, start=50_000)  # 1.25 MiB each: not both at once
    s.save_async(make_cache(first))
    assert s.flush(timeout=60) and s.stats()["files"] == 1
    s.save_async(make_cache(second, seed=3))
    assert s.flush(timeout=60)
    names = debris(s.ns)
    assert len(names) == 1 and s.stats()["saves"] == 2 and s.stats()["save_failures"] == 0
    assert s.lookup(second + [1]) is not None and s.lookup(first + [1]) is None
    assert any("making room" in r.getMessage() for r in caplog.records)
    assert os.statvfs(s.ns).f_bavail > 0
    s.close()


def test_enospc_through_http_answers_flags_degraded_and_recovers(small_fs, tiny_synth_dir, tmp_path):
    """A real server whose kv dir is full: the request is answered, /health shows the degraded
    flag, no partial file remains, and once space returns the next save succeeds."""
    import httpx
    from serverutil import ServerProc, wait_for

    kv = small_fs / "kv"
    with ServerProc(tmp_path / "home", tmp_path / "srv", "--model", str(tiny_synth_dir), "--max-seq", "1024",
                    kv_dir=kv) as srv:
        srv.start()
        filler = small_fs / "filler"
        with open(filler, "wb") as f:  # leave ~8 KiB: far below a 200-token snapshot (~100 KiB)
            f.write(b"\0" * (os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize - 8192))

        def ask(seed: int) -> dict:
            prompt = [int(x) for x in np.random.default_rng(seed).integers(1000, 100000, 200)]
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4,
                                                              "temperature": 0}, timeout=300)
            assert r.status_code == 200, r.text
            return r.json()

        assert ask(1)["usage"]["completion_tokens"] == 4
        wait_for(lambda: "snapshot disk full" in srv.health().json()["degraded"], timeout=60,
                 what="the degraded flag")
        (ns,) = [p for p in kv.iterdir() if p.is_dir()]
        assert debris(ns) == []  # neither a final nor a temp file
        assert srv.health().json()["status"] == "ok"  # degraded, still serving
        filler.unlink()
        ask(2)
        wait_for(lambda: srv.health().json()["degraded"] == [], timeout=60, what="recovery")
        (name,) = debris(ns)
        fmt.verify_file(ns / name)
        log = srv.log()
        assert "[KV-DISK] save failed" in log and "No space left on device" in log
        assert re.search(rf"\[KV-DISK\] saved \d+-token KV -> {name}", log)
