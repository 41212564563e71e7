"""`edge-llm kv` on real snapshot files: ls, inspect, verify, gc, rm."""

from __future__ import annotations

import os

import numpy as np
import pytest
from click.testing import CliRunner

from edge_llm.cli import cli
from edge_llm.config import Geometry
from edge_llm.kvcache import KVCache
from edge_llm.snapshot import format as fmt
from edge_llm.snapshot.identity import Identity
from edge_llm.snapshot.store import SnapshotStore

G = Geometry(n_layers=2, n_kv_heads=2, head_dim=8)
KV_BS = 4
IDENT = Identity(config={"model_type": "qwen3", "num_hidden_layers": 2, "num_key_value_heads": 2,
                         "head_dim": 8}, weights_digest="ab" * 32)
WORDS = ["<unk>", "the", "cache", "survives", "a", "restart", "and", "is", "read", "back"]


def invoke(*args):
    return CliRunner().invoke(cli, ["kv", *map(str, args)], env={"COLUMNS": "220"}, catch_exceptions=False)


@pytest.fixture
def kv_dir(tmp_path):
    """Three snapshots (20, 30, 40 tokens) written by a real store; last use 40 > 30 > 20."""
    d = tmp_path / "kv"
    s = SnapshotStore(d, IDENT, G, kv_bs=KV_BS)
    s.scan()
    for i, n in enumerate((20, 30, 40)):
        c = KVCache(G, max_seq=64, kv_bs=KV_BS, check_memory=False)
        c.data[:] = np.random.default_rng(i).standard_normal(c.data.shape, dtype=np.float32)
        c.set_tokens([1 + i] + [(7 * t + i) % len(WORDS) for t in range(1, n)])
        s.save_async(c)
        assert s.flush(60)
    s.close()
    for k, p in enumerate(sorted(s.ns.glob(fmt.SNAPSHOT_GLOB), key=lambda p: os.path.getsize(p))):
        os.utime(p, (1_700_000_000 + k * 100,) * 2)
    return d


def files(kv_dir):
    return sorted(kv_dir.glob(f"*/{fmt.SNAPSHOT_GLOB}"), key=lambda p: os.path.getsize(p))


def test_ls_shows_namespaces_and_snapshots(kv_dir):
    r = invoke("ls", "--kv-dir", kv_dir)
    assert r.exit_code == 0, r.output
    assert f"namespace {IDENT.namespace}" in r.output and "model_type=qwen3" in r.output
    for p in files(kv_dir):
        assert p.name in r.output and f"{p.stat().st_size:,}" in r.output
    assert "3 snapshot(s)" in r.output and "ago" in r.output


def test_inspect_walks_through_the_bytes(kv_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tk.save(str(tok_dir / "tokenizer.json"))

    path = files(kv_dir)[0]  # 20 tokens
    r = invoke("inspect", path, "--tokenizer", tok_dir, "--tokens", 5, "--blocks", 3)
    assert r.exit_code == 0, r.output
    out = r.output
    assert "56 4b 4c 56" in out and "(VLKV)" in out and "header_crc" in out and "(ok)" in out
    assert " 60 " in out and " 40 " in out  # field offsets
    size = fmt.snapshot_size(2, 20, 16, KV_BS)
    assert f"= 64 + 80 + 5,120 + 80 = {size:,} bytes; actual {size:,} bytes: matches" in out
    assert "'the'" in out and "'is'" in out  # ids 1, 7 decoded by the tokenizer
    assert "text of the first 5 tokens: 'the is a the read'" in out
    assert "block map (first 3 of 20)" in out and "[0, 4)" in out
    assert "valid" in out


def test_inspect_reports_a_bad_file(kv_dir):
    path = files(kv_dir)[0]
    with open(path, "r+b") as f:
        f.seek(24)
        f.write(b"\xff")  # n_tokens
    r = invoke("inspect", path)
    assert r.exit_code == 0 and "INVALID: header-crc" in r.output


def test_verify_good_and_corrupt(kv_dir):
    r = invoke("verify", "--kv-dir", kv_dir)
    assert r.exit_code == 0, r.output
    assert r.output.count("OK ") == 3 and "3 file(s), 0 bad" in r.output
    path = files(kv_dir)[2]
    hdr = fmt.verify_file(path)
    off = hdr.block_offset(1, hdr.n_blocks - 1, 1)  # the very last block: only a full verify sees it
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 1]))
    r = invoke("verify", path)
    assert r.exit_code == 1 and "BAD" in r.output and "block-crc" in r.output
    assert invoke("verify", "--kv-dir", kv_dir).exit_code == 1
    assert invoke("verify", files(kv_dir)[0], files(kv_dir)[1]).exit_code == 0


def test_verify_rejects_a_file_in_the_wrong_namespace(kv_dir):
    other = kv_dir / ("0" * 16)
    other.mkdir()
    src = files(kv_dir)[0]
    (other / src.name).write_bytes(src.read_bytes())
    r = invoke("verify", other / src.name)
    assert r.exit_code == 1 and "model-id" in r.output


def test_gc_applies_caps_lru_first(kv_dir):
    small, mid, big = files(kv_dir)  # last use: small oldest, big newest
    r = invoke("gc", "--kv-dir", kv_dir, "--max-files", 2, "--dry-run")
    assert r.exit_code == 0 and "would evict" in r.output and small.exists()
    r = invoke("gc", "--kv-dir", kv_dir, "--max-files", 2)
    assert r.exit_code == 0 and not small.exists() and mid.exists() and big.exists()
    assert f"evicted {IDENT.namespace}/{small.name} (lru: 3 chains > max_files 2)" in r.output
    r = invoke("gc", "--kv-dir", kv_dir, "--max-bytes", big.stat().st_size + 1)
    assert r.exit_code == 0 and not mid.exists() and big.exists()
    assert invoke("gc", "--kv-dir", kv_dir, "--max-bytes", "1K").exit_code == 0 and not big.exists()
    assert invoke("gc", "--kv-dir", kv_dir, "--max-bytes", "lots").exit_code == 2


def test_rm_by_name_and_all(kv_dir):
    small, mid, big = files(kv_dir)
    r = invoke("rm", "--kv-dir", kv_dir, small.name)
    assert r.exit_code == 0 and not small.exists() and mid.exists()
    assert invoke("rm", "--kv-dir", kv_dir, "../../etc/passwd").exit_code == 2  # names never paths
    r = CliRunner().invoke(cli, ["kv", "rm", "--kv-dir", str(kv_dir), small.name])
    assert r.exit_code == 1 and "not found" in r.output
    (big.parent / "kv_00.kv.abc.tmp").write_bytes(b"x")
    r = invoke("rm", "--kv-dir", kv_dir, "--namespace", IDENT.namespace, "--all")
    assert r.exit_code == 0 and files(kv_dir) == [] and not list(big.parent.glob("*.tmp"))
    assert (big.parent / "identity.json").exists()


def test_commands_default_to_the_settings_kv_dir(kv_dir, tmp_path):
    """Without --kv-dir every command works on the directory `serve` would use: $EDGE_LLM_HOME/kv,
    or EDGE_LLM_DISK_KV; `kv ls` says which, and never cuts a name on a narrow terminal."""
    home = tmp_path / "home"
    (home / "kv").parent.mkdir(parents=True)
    kv_dir.rename(home / "kv")
    env = {"EDGE_LLM_HOME": str(home), "COLUMNS": "60"}
    r = CliRunner().invoke(cli, ["kv", "ls"], env=env, catch_exceptions=False)
    assert r.exit_code == 0 and f"kv dir {home / 'kv'}" in r.output.replace("\n", ""), r.output
    names = [p.name for p in files(home / "kv")]
    assert all(n in r.output for n in names), r.output  # whole, on a 60-column terminal
    r = CliRunner().invoke(cli, ["kv", "verify"], env=env, catch_exceptions=False)
    assert r.exit_code == 0 and "3 file(s), 0 bad" in r.output
    moved = tmp_path / "elsewhere"
    (home / "kv").rename(moved)
    r = CliRunner().invoke(cli, ["kv", "ls"], env={**env, "EDGE_LLM_DISK_KV": str(moved)}, catch_exceptions=False)
    assert r.exit_code == 0 and all(n in r.output for n in names)
    r = CliRunner().invoke(cli, ["kv", "ls"], env={**env, "EDGE_LLM_DISK_KV": "off"})
    assert r.exit_code != 0 and "give --kv-dir" in r.output


def test_inspect_takes_what_ls_prints_and_the_default_tokenizer(kv_dir, edge_home):
    name = files(kv_dir)[0].name  # a bare name, as `kv ls` prints it
    r = CliRunner().invoke(cli, ["kv", "inspect", name, "--kv-dir", str(kv_dir), "--tokenizer", "default",
                                 "--tokens", "3"], env={"COLUMNS": "220", "EDGE_LLM_HOME": str(edge_home)},
                           catch_exceptions=False)
    assert r.exit_code == 0 and "text of the first 3 tokens" in r.output, r.output
    r = invoke("inspect", "kv_0000000000000000.kv", "--kv-dir", kv_dir)
    assert r.exit_code == 2 and "no namespace" in r.output
