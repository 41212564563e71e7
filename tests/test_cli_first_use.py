"""A new user's first minutes with the CLI, as real processes: what `kv ls` says on a fresh home,
`convert rknn default`, the `generate` stats lines on an 80-column terminal and its backend line,
the backend's reason in `serve`'s /health, `bench npu --predict-only` with the runtime dependencies
only, and the recovery script's port in local mode."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def edge_llm(*args: str, home: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edge_llm", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "EDGE_LLM_HOME": str(home), **env})


def test_convert_rknn_takes_default_as_model_dir(edge_home, tmp_path):
    """`convert rknn default OUT` resolves the embedded default model as `--model default` does
    (it once said "Directory 'default' does not exist"). An unknown --w8a8-fp16 kind stops it right
    after it read the model: 61 graphs = 2 x 30 layers + 1 head part, the default model's."""
    r = edge_llm("convert", "rknn", "default", str(tmp_path / "out"), "--w8a8-fp16", "no-such-kind", home=edge_home)
    assert r.returncode == 1, r.stderr
    assert "does not exist" not in r.stderr and "graph kinds are" in r.stderr, r.stderr
    assert re.search(r"\b0/61\b", r.stderr), r.stderr
    missing = edge_llm("convert", "rknn", str(tmp_path / "nope"), str(tmp_path / "out"), home=edge_home)
    assert missing.returncode == 1 and "not a model directory (pass an HF model directory or 'default')" in \
        missing.stderr, missing.stderr


def test_recovery_script_local_port_is_settable(edge_home, tmp_path):
    """tools/test-recovery.sh --port N: its own server listens on N. Here N is taken (a socket of
    this test listens on it), so the server cannot bind it and exits: the run fails at once, names
    the port on its first line and shows why from the server's stderr."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = tmp_path / "results"
        r = subprocess.run([str(ROOT / "tools" / "test-recovery.sh"), "--port", str(port), "--repeats", "1",
                            "--ready-timeout", "120", "--out", str(out)],
                           env={**os.environ, "EDGE_LLM_HOME": str(edge_home), "PYTHON": sys.executable},
                           capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"(server on http://127.0.0.1:{port})" in r.stdout.splitlines()[0], r.stdout
    (res,) = out.iterdir()
    failures = (res / "failures.txt").read_text()
    assert "exited" in failures and "address already in use" in failures.lower(), failures
    assert json.loads((res / "summary.json").read_text())["pass"] is False
    board = subprocess.run([str(ROOT / "tools" / "test-recovery.sh"), "--port", "9000", "--base-url",
                            "http://127.0.0.1:8080", "--log-file", "x", "--kv-dir", "y", "--restart-cmd", "true"],
                           env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=60)
    assert board.returncode == 2 and "--port is for the local mode" in board.stderr, board.stderr


def test_kv_ls_on_a_fresh_home_says_no_snapshots_yet(tmp_path):
    """Before the first `serve` there is no kv dir: `kv ls` says so and exits 0 (it once failed
    with "…/kv: not a directory"). A path that is a file is still an error."""
    home = tmp_path / "home"
    r = edge_llm("kv", "ls", home=home, timeout=120, COLUMNS="200")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"no snapshots yet in {home / 'kv'}" in r.stdout and "not a directory" not in r.stdout + r.stderr
    (tmp_path / "file").write_text("x")
    bad = edge_llm("kv", "ls", "--kv-dir", str(tmp_path / "file"), home=home, timeout=120)
    assert bad.returncode != 0 and "is a file" in bad.stderr, bad.stderr


def test_kv_commands_on_a_fresh_home_find_nothing_to_do(tmp_path):
    """The kv dir's absence is one answer for every kv command (`cli/kv.py` `namespaces`): verify, gc
    and rm --all find nothing and exit 0 (they once failed with "…/kv: not a directory"); export has
    no namespace to write and says so."""
    home = tmp_path / "home"
    for args, said in ((("verify",), "0 file(s), 0 bad"), (("gc",), "0 snapshot(s) evicted"),
                       (("rm", "--all"), "0 file(s) removed")):
        r = edge_llm("kv", *args, home=home, timeout=120)
        assert r.returncode == 0 and said in r.stdout, (args, r.stdout + r.stderr)
        assert "not a directory" not in r.stdout + r.stderr
    exp = edge_llm("kv", "export", "-o", str(tmp_path / "a.tar"), home=home, timeout=120)
    assert exp.returncode == 1 and "0 namespaces here" in exp.stderr, exp.stderr
    assert not (home / "kv").exists()  # looking created nothing


def test_generate_stats_are_short_lines_not_wrapped(edge_home):
    """On an 80-column terminal the stats come as one line per phase, each phrase whole (the one
    long line was wrapped mid-phrase)."""
    r = edge_llm("generate", "--model", "default", "--backend", "cpu", "--no-disk-kv", "--temperature", "0",
                 "--max-tokens", "3", "-p", "Hi", home=edge_home, COLUMNS="80")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    prefill = r"prefill \d+ tok in [\d.]+ ms \([\d.]+ tok/s\), cache none \(0 tok\)"
    for pattern in (prefill, r"decode \d+ tok in [\d.]+ ms \([\d.]+ tok/s\)", r"TTFT [\d.]+ ms; finish (length|stop)"):
        assert any(re.fullmatch(pattern, ln.strip()) for ln in lines), (pattern, r.stderr)


def test_bench_npu_predict_only_runs_with_the_runtime_dependencies(edge_home, tiny_synth_dir, tmp_path):
    """`bench npu --predict-only` in the venv `make serve` builds (no onnx, no onnxruntime, no
    torch: every module of a distribution outside the runtime dependencies fails to import, as if
    not installed): the conversion it reads (`convert npu-mm`, numpy only) and the prediction both
    run. It once died importing onnx (bench/npu/run.py took its sample inputs from the exporter)."""
    from helpers.runtime_deps import not_runtime_modules, runtime_only_env

    assert {"onnx", "onnxruntime", "torch"} <= not_runtime_modules()
    env = runtime_only_env(EDGE_LLM_HOME=str(edge_home))
    probe = subprocess.run([sys.executable, "-c", "import onnx"], env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "not a runtime dependency" in probe.stderr, probe.stderr  # the blocker works
    run = lambda *a: subprocess.run([sys.executable, "-m", "edge_llm", *a], env=env, capture_output=True,  # noqa: E731
                                    text=True, timeout=600)
    conv = run("convert", "npu-mm", str(tiny_synth_dir), str(tmp_path / "mm"), "--gptq-tokens", "16")
    assert conv.returncode == 0, conv.stderr[-3000:]
    r = run("bench", "npu", "--model", str(tiny_synth_dir), "--rknn-dir", str(tmp_path / "mm"), "--predict-only",
            "--drafting-tokens", "4", "--contexts", "128", "--repeats", "1", "--out", str(tmp_path / "res"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "## Prediction: the matmul path" in r.stdout and "No module named" not in r.stderr
    assert next((tmp_path / "res").glob("*-bench-npu/npu.json")).is_file()


def test_generate_says_which_backend_ran_and_why(edge_home, tmp_path):
    """One stderr line names the backend and why: the flag, the configuration file (named), the
    environment variable, or auto's reason. A flag once read "set in the configuration"."""
    conf = tmp_path / "edge-llm.toml"
    conf.write_text('backend = "cpu"\n')
    args = ("generate", "--model", "default", "--no-disk-kv", "--temperature", "0", "--max-tokens", "2", "-p", "Hi")
    cases = {"backend cpu, set on the command line (--backend)": ((*args, "--backend", "cpu"), {}),
             f"backend cpu, set in the configuration ({conf})": ((*args, "--config", str(conf)), {}),
             "backend cpu, set in the environment (EDGE_LLM_BACKEND)": (args, {"EDGE_LLM_BACKEND": "cpu"})}

    def run(*argv: str, **env: str) -> subprocess.CompletedProcess:  # the suite's own EDGE_LLM_BACKEND unset
        base = {k: v for k, v in os.environ.items() if k != "EDGE_LLM_BACKEND"}
        return subprocess.run([sys.executable, "-m", "edge_llm", *argv], capture_output=True, text=True, timeout=300,
                              env={**base, "EDGE_LLM_HOME": str(edge_home), "COLUMNS": "80", **env})

    for line, (argv, env) in cases.items():
        r = run(*argv, **env)
        assert r.returncode == 0, r.stderr
        assert line in r.stderr.splitlines(), (line, r.stderr)
    # the flag wins over the file, and says so
    r = run(*args, "--config", str(conf), "--backend", "cpu")
    assert "backend cpu, set on the command line (--backend)" in r.stderr.splitlines(), r.stderr
    auto = run(*args)
    assert auto.returncode == 0, auto.stderr
    # cpu-q only with a passing accuracy record (tests/test_quant_record.py), else cpu and why
    assert re.search(r"^backend auto -> (cpu-q \(no RKNPU device node; onnxruntime .*; cpu-q's accuracy record passes|"
                     r"cpu \(no RKNPU device node; cpu-q not taken: its accuracy record fails)", auto.stderr, re.M), \
        auto.stderr


def test_serve_health_says_where_the_backend_was_set(edge_home, tmp_path):
    """`serve --backend cpu`: /health's backend_reason (and the start-up log line) name the flag;
    the same backend from a configuration file names the file."""
    from serverutil import ServerProc

    conf = tmp_path / "edge-llm.toml"
    conf.write_text('backend = "cpu"\n')
    for argv, reason in ((("--backend", "cpu"), "backend cpu, set on the command line (--backend)"),
                         (("--config", str(conf)), f"backend cpu, set in the configuration ({conf})")):
        with ServerProc(edge_home, tmp_path / argv[0].strip("-"), "--model", "default", "--no-disk-kv",
                        *argv) as srv:
            srv.env.pop("EDGE_LLM_BACKEND", None)  # the suite's own
            srv.start()
            health = srv.health().json()
            assert (health["backend"], health["backend_reason"]) == ("cpu", reason), health
            assert reason in srv.log(), srv.log()[-2000:]


def test_every_option_of_every_command_has_help_text():
    """`--help` of every command explains each of its options (convert's -v, generate's --seed,
    the benchmarks' --repeats once showed nothing but the flag)."""
    import click

    from edge_llm.cli import cli

    def commands(cmd: click.Command, path: tuple[str, ...]):
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                yield from commands(sub, (*path, name))
        else:
            yield path, cmd

    found = list(commands(cli, ()))
    assert len(found) > 20 and (("convert", "npu-mm") in dict(found))
    bare = [f"{' '.join(path)} {'/'.join(p.opts)}" for path, cmd in found for p in cmd.params
            if isinstance(p, click.Option) and not p.hidden and not (p.help or "").strip()]
    assert bare == [], bare


def test_generate_help_describes_both_npu_paths(tmp_path):
    """`generate --help` says what --backend rknn runs: the compiled graphs of `convert rknn` or
    the int8 matmul path of `convert npu-mm` (it named the graphs only)."""
    r = edge_llm("generate", "--help", home=tmp_path, COLUMNS="200")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    backend = text[text.index("--backend"):text.index("--quant")]
    for words in ("`edge-llm convert rknn`", "`edge-llm convert npu-mm`", "int8 matmul", "librknnrt",
                  "manifest says which"):
        assert words in backend, (words, backend)


def test_convert_npu_mm_reports_progress_when_piped(tiny_synth_dir, tmp_path):
    """`convert npu-mm` is never silent (it once said nothing for minutes): with stderr not a
    terminal it prints one line per step, in order: each layer of the F32 model's run over the GPTQ
    calibration tokens, each layer quantized and the head, weights.npz written and hashed, the
    accuracy record measured (on a terminal the same phases are rich bars)."""
    r = edge_llm("convert", "npu-mm", str(tiny_synth_dir), str(tmp_path / "mm"), "--gptq-tokens", "16",
                 home=tmp_path)
    assert r.returncode == 0, r.stderr
    layers = json.loads((tiny_synth_dir / "config.json").read_text())["text_config"]["num_hidden_layers"]
    steps = [re.fullmatch(r"(.+): (\d+)/(\d+) \(\d+ s\)", ln) for ln in r.stderr.splitlines()]
    assert all(steps), r.stderr
    got = [(m[1], int(m[2]), int(m[3])) for m in steps]
    want = ([("GPTQ calibration: the F32 model on 16 tokens, layers", i, layers) for i in range(1, layers + 1)]
            + [("quantize: layers + head (GPTQ)", i, layers + 1) for i in range(1, layers + 2)]
            + [("write weights.npz and its digest", 1, 2)]
            # the accuracy record, measured on the new directory before it is published (0/1: it has begun)
            + [("accuracy record: the int8 model against F32 (host emulation)", i, 1) for i in (0, 1)]
            + [("write weights.npz and its digest", 2, 2)])
    assert got == want, r.stderr
    assert f"{layers} layers -> " in r.stdout
