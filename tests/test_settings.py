"""Settings precedence (flag > env > TOML > default), defaults under systemd, and bad values."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from edge_llm.errors import ConfigError
from edge_llm.settings import Settings, load_settings, read_toml
from edge_llm.snapshot.layout import SNAPSHOT_GLOB

REPO = Path(__file__).resolve().parents[1]


def test_defaults(tmp_path):
    s = load_settings({}, env={"EDGE_LLM_HOME": str(tmp_path)})
    assert (s.host, s.port, s.max_seq, s.kv_bs, s.queue_size, s.model) == ("127.0.0.1", 8080, 8192, 64, 16, "default")
    assert s.disk_kv == str(tmp_path / "kv")
    assert s.log_file == str(tmp_path / "logs" / "edge-llm.log")


def test_systemd_directories(tmp_path):
    env = {"EDGE_LLM_HOME": str(tmp_path / "home"), "STATE_DIRECTORY": f"{tmp_path}/state:{tmp_path}/other",
           "LOGS_DIRECTORY": str(tmp_path / "logs")}
    s = load_settings({}, env=env)
    assert s.disk_kv == str(tmp_path / "state" / "kv")
    assert s.log_file == str(tmp_path / "logs" / "edge-llm.log")


def test_precedence_flag_env_file_default(tmp_path):
    cfg = tmp_path / "edge-llm.toml"
    cfg.write_text('port = 9001\nhost = "0.0.0.0"\nqueue_size = 3\nmax_seq = 2048\n')
    env = {"EDGE_LLM_HOME": str(tmp_path), "EDGE_LLM_PORT": "9002", "EDGE_LLM_QUEUE_SIZE": "5"}
    s = load_settings({"port": 9003}, config_file=cfg, env=env)
    assert s.port == 9003  # flag beats env and file
    assert s.queue_size == 5  # env beats file
    assert s.host == "0.0.0.0" and s.max_seq == 2048  # file beats default
    assert s.kv_bs == 64  # default
    # EDGE_LLM_CONFIG names the file when --config is absent
    s = load_settings({}, env={"EDGE_LLM_HOME": str(tmp_path), "EDGE_LLM_CONFIG": str(cfg)})
    assert s.port == 9001


def test_disk_kv_off_and_on(tmp_path):
    env = {"EDGE_LLM_HOME": str(tmp_path)}
    cfg = tmp_path / "c.toml"
    cfg.write_text("disk_kv = false\n")
    assert load_settings({}, config_file=cfg, env=env).disk_kv is None  # None is the one meaning of off
    assert not load_settings({}, config_file=cfg, env=env).disk_kv_enabled
    assert load_settings({}, env={**env, "EDGE_LLM_DISK_KV": "off"}).disk_kv is None
    assert load_settings({"disk_kv": "off"}, env=env).disk_kv is None
    assert load_settings({}, env={**env, "EDGE_LLM_LOG_FILE": ""}).log_file is None
    assert load_settings({"disk_kv": str(tmp_path / "x")}, config_file=cfg, env=env).disk_kv == str(tmp_path / "x")
    assert load_settings({}, env={**env, "EDGE_LLM_DISK_KV": "on"}).disk_kv == str(tmp_path / "kv")


@pytest.mark.parametrize("text,needle", [
    ("port = 0\n", "port must be > 0"),
    ("port = 70000\n", "port must be <= 65535"),
    ('port = "eighty"\n', "port must be int"),
    ("max_seq = true\n", "max_seq must be int"),
    ("prot = 8080\n", "unknown key(s) prot"),
    ("port = [\n", "invalid TOML"),
    ('backend = "npu"\n', "backend 'npu' is not available"),
    ("disk_kv = 3\n", "disk_kv must be a directory or false"),
])
def test_bad_file_values(tmp_path, text, needle):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_settings({}, config_file=cfg, env={"EDGE_LLM_HOME": str(tmp_path)})
    assert needle in str(e.value) and ("bad.toml" in str(e.value) or "backend" in needle)


def test_bad_env_value_names_the_variable(tmp_path):
    with pytest.raises(ConfigError, match="EDGE_LLM_QUEUE_SIZE"):
        load_settings({}, env={"EDGE_LLM_HOME": str(tmp_path), "EDGE_LLM_QUEUE_SIZE": "many"})
    with pytest.raises(ConfigError, match="not found"):
        load_settings({}, config_file=tmp_path / "missing.toml", env={})


def test_board_example_parses_with_every_key():
    """board/edge-llm.toml.example (the installed config) uses exactly our key names."""
    values = read_toml(REPO / "board" / "edge-llm.toml.example")
    assert set(values) <= set(Settings.__dataclass_fields__)
    assert {"model", "host", "port", "disk_kv", "max_seq", "queue_size", "log_file"} <= set(values)


def test_serve_cli_rejects_bad_config_before_loading(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("queue_size = -1\n")
    r = subprocess.run([sys.executable, "-m", "edge_llm", "serve", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=120,
                       env={"EDGE_LLM_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and "queue_size must be > 0" in r.stderr
    r = subprocess.run([sys.executable, "-m", "edge_llm", "serve", "--disk-kv", "x", "--no-disk-kv"],
                       capture_output=True, text=True, timeout=120, env={"EDGE_LLM_HOME": str(tmp_path)})
    assert r.returncode == 2 and "mutually exclusive" in r.stderr


@pytest.mark.parametrize("home", ["~/eh", "eh"])
def test_edge_llm_home_tilde_and_relative_resolve_once(tmp_path, tiny_synth_dir, home):
    """`EDGE_LLM_HOME='~/eh'` and a relative `eh` put the kv dir, the digest cache and the models
    under one absolute directory (never a literal `~` directory in the working directory)."""
    work = tmp_path / "work"
    work.mkdir()
    base = tmp_path if home.startswith("~") else work
    env = {**os.environ, "HOME": str(tmp_path), "EDGE_LLM_HOME": home}
    r = subprocess.run([sys.executable, "-m", "edge_llm", "generate", "--model", str(tiny_synth_dir),
                        "--max-tokens", "2", "--temperature", "0", "-p", "Tell me about the sea. " * 4],
                       capture_output=True, text=True, timeout=300, env=env, cwd=work)
    assert r.returncode == 0, r.stderr
    r2 = subprocess.run([sys.executable, "-c", "from edge_llm import settings as s; print(s.models_dir());"
                         "print(s.load_settings({}).disk_kv); print(s.digest_cache_path())"],
                        capture_output=True, text=True, timeout=60, env=env, cwd=work)
    models, kv, digests = r2.stdout.split()
    assert (models, kv, digests) == (str(base / "eh" / "models"), str(base / "eh" / "kv"),
                                     str(base / "eh" / "digests.json"))
    assert (base / "eh" / "digests.json").is_file()  # written by the generate run's identity
    assert list((base / "eh" / "kv").glob(f"*/{SNAPSHOT_GLOB}")), "the generate run saved no snapshot"
    assert not (work / "~").exists()


def test_every_setting_is_documented_once():
    """The example config and docs/configuration.md name every key of the one declaration."""
    example = (REPO / "board" / "edge-llm.toml.example").read_text()
    doc = (REPO / "docs" / "configuration.md").read_text()
    from edge_llm.settings import FIELDS, describe_default, env_name

    for key in FIELDS:
        assert re.search(rf"^#? ?{key} = ", example, re.M), f"{key} missing from the example config"
        row = f"| `{key}` | `{env_name(key)}` | {describe_default(key)} |"
        assert row in doc, f"docs/configuration.md lacks the row starting {row!r}"


def test_cli_flags_come_from_the_declaration():
    """serve / generate / doctor expose every setting of their command, with the declared default."""
    from click.testing import CliRunner

    from edge_llm.cli import cli
    from edge_llm.settings import FIELDS, describe_default

    for command in ("serve", "generate", "doctor"):
        out = CliRunner().invoke(cli, [command, "--help"], terminal_width=400).output
        for key, f in FIELDS.items():
            flag = "--" + key.replace("_", "-")
            if command in f.metadata["commands"]:
                assert flag in out and describe_default(key) in out, (command, key)
            else:
                assert flag + " " not in out, (command, key)


def _via_flag(key: str, value: str):
    """The value as `--key value` on a command decorated like serve/generate/doctor."""
    import click
    from click.testing import CliRunner

    from edge_llm.cli.options import settings_options

    got = {}

    @click.command()
    @settings_options("serve")
    def probe(settings):
        got["s"] = settings

    r = CliRunner().invoke(probe, [f"--{key.replace('_', '-')}", value])
    assert r.exit_code == 0, (key, value, r.output)
    return getattr(got["s"], key)


def _spellings():
    """Every documented spelling of a 'no value' setting: its null word (threads: auto) and none."""
    from edge_llm.settings import FIELDS

    for key, f in FIELDS.items():
        if f.metadata["nullable"] and "serve" in f.metadata["commands"]:
            for word in sorted({f.metadata.get("null_word", "none"), "none"} | ({"auto"} if key == "threads" else set())):
                yield key, word


def test_numbers_still_checked_through_the_flag():
    assert _via_flag("threads", "3") == 3
    import click
    from click.testing import CliRunner

    from edge_llm.cli.options import settings_options

    @click.command()
    @settings_options("serve")
    def probe(settings):
        pass

    for bad in ("0", "many"):
        r = CliRunner().invoke(probe, ["--threads", bad])
        assert r.exit_code != 0 and "threads must be" in r.output, r.output


def _word_spellings():
    """The other documented words: true/false (and on/off, yes/no, 1/0) for every switch, off for
    the disk_kv / log_file locations."""
    from edge_llm.settings import FIELDS

    for key, f in FIELDS.items():
        if "serve" not in f.metadata["commands"]:
            continue
        if f.metadata["kind"] is bool:
            for word, value in (("true", True), ("false", False), ("on", True), ("off", False), ("yes", True),
                                ("no", False), ("1", True), ("0", False)):
                yield key, word, value
        elif f.metadata["kind"] in ("dir-or-off", "file-or-off"):
            yield key, "off", None


@pytest.mark.parametrize("key,word,value", [(k, w, None) for k, w in _spellings()] + list(_word_spellings()))
def test_documented_spellings_in_every_channel(key, word, value, tmp_path):
    """Every documented spelling means the same through the flag, the variable and TOML:
    `--threads auto` / `EDGE_LLM_THREADS=auto` / `threads = "auto"` are the default None (and
    `none` for every optional setting), true/false/on/off/... set a switch, off a location."""
    from edge_llm.settings import env_name

    env = {"EDGE_LLM_HOME": str(tmp_path)}
    assert _via_flag(key, word) is value
    assert getattr(load_settings({}, env={**env, env_name(key): word}), key) is value
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'{key} = "{word}"\n')
    assert getattr(load_settings({}, config_file=cfg, env=env), key) is value


def test_byte_sizes_take_binary_units_in_every_channel(tmp_path):
    """disk_kv_max_bytes reads 4294967296, "4GiB", "4G" alike (settings.parse_size, which
    `kv gc --max-bytes` uses too); a word that is no size is a ConfigError naming the key."""
    from edge_llm.settings import parse_size

    assert parse_size("1500000") == 1500000 and parse_size("512M") == 512 << 20
    assert parse_size("1.5GiB") == 3 << 29 and parse_size(" 1k ") == 1024
    env = {"EDGE_LLM_HOME": str(tmp_path)}
    assert load_settings({}, env={**env, "EDGE_LLM_DISK_KV_MAX_BYTES": "4GiB"}).disk_kv_max_bytes == 4 << 30
    cfg = tmp_path / "c.toml"
    cfg.write_text('disk_kv_max_bytes = "4G"\n')
    assert load_settings({}, config_file=cfg, env=env).disk_kv_max_bytes == 4 << 30
    cfg.write_text("disk_kv_max_bytes = 4294967296\n")
    assert load_settings({}, config_file=cfg, env=env).disk_kv_max_bytes == 4 << 30
    assert load_settings({"disk_kv_max_bytes": "512MiB"}, env=env).disk_kv_max_bytes == 512 << 20
    with pytest.raises(ConfigError, match="disk_kv_max_bytes must be a size in bytes"):
        load_settings({"disk_kv_max_bytes": "lots"}, env=env)
    with pytest.raises(ValueError):
        parse_size("4 parsecs")


def test_allowed_hosts_read_alike_in_every_channel(tmp_path):
    """allowed_hosts: a TOML list or a comma-separated string (flag, environment), each entry
    normalised (case, trailing dot, IPv6 brackets and spelling); `auto` is the default (None); an
    entry that is no name, address or `*.` pattern is a ConfigError naming it."""
    env = {"EDGE_LLM_HOME": str(tmp_path)}
    want = ("fleet.example", "*.lan", "::1", "192.168.1.11")
    assert load_settings({}, env=env).allowed_hosts is None
    assert load_settings({"allowed_hosts": "Fleet.Example., *.lan,[0:0::1] ,192.168.1.11"}, env=env).allowed_hosts == want
    got = load_settings({}, env={**env, "EDGE_LLM_ALLOWED_HOSTS": "fleet.example,*.LAN,::1,192.168.1.11"})
    assert got.allowed_hosts == want
    cfg = tmp_path / "c.toml"
    cfg.write_text('allowed_hosts = ["fleet.example", "*.lan", "[::1]", "192.168.1.11", "fleet.example."]\n')
    assert load_settings({}, config_file=cfg, env=env).allowed_hosts == want
    assert load_settings({"allowed_hosts": "auto"}, env=env).allowed_hosts is None
    assert load_settings({"allowed_hosts": "*"}, env=env).allowed_hosts == ("*",)
    for bad in ("evil.example:8080", "a b", "*.[::1]", "x*.lan", "[::1", "caf\u00e9.example", ","):
        with pytest.raises(ConfigError, match="allowed_hosts"):
            load_settings({"allowed_hosts": bad}, env=env)
    cfg.write_text("allowed_hosts = [1, 2]\n")
    with pytest.raises(ConfigError, match="allowed_hosts must be a list"):
        load_settings({}, config_file=cfg, env=env)
