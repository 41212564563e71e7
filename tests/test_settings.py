"""Settings precedence (flag > env > TOML > default), defaults under systemd, and bad values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from edge_llm.errors import ConfigError
from edge_llm.settings import Settings, load_settings, read_toml

REPO = Path(__file__).resolve().parents[1]


def test_defaults(tmp_path):
    s = load_settings({}, env={"EDGE_LLM_HOME": str(tmp_path)})
    assert (s.host, s.port, s.max_seq, s.kv_bs, s.queue_size, s.model) == ("127.0.0.1", 8080, 8192, 64, 16, "default")
    assert s.disk_kv == str(tmp_path / "kv")
    assert s.log_file == str(tmp_path / "logs" / "edge-llm.log")
    opts = s.runtime_options()
    assert opts.disk_kv == str(tmp_path / "kv") and opts.max_seq == 8192


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
    assert load_settings({}, config_file=cfg, env=env).disk_kv == ""
    assert load_settings({}, config_file=cfg, env=env).runtime_options().disk_kv is None
    assert load_settings({}, env={**env, "EDGE_LLM_DISK_KV": "off"}).disk_kv == ""
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
