"""`edge-llm bench fleet`: three boards behind the shipped HAProxy config, the same conversations
routed by consistent hashing and by round-robin (docs/fleet.md)."""

from __future__ import annotations

import shutil
import sys

import click

from edge_llm.cli.bench.common import bench, console, out_option, save_results, spinner
from edge_llm.settings import DEFAULTS

BOARDS = 3


@bench.command("fleet")
@click.option("--model", default=DEFAULTS.model, show_default=True, help="HF model dir or 'default'.")
@click.option("--backend", default="cpu", show_default=True, help="Backend of every board.")
@click.option("--conversations", type=click.IntRange(BOARDS), default=10, show_default=True)
@click.option("--turns", type=click.IntRange(2), default=4, show_default=True)
@click.option("--history-tokens", type=click.IntRange(1), default=400, show_default=True,
              help="About this many tokens of history in each conversation's first message.")
@click.option("--max-tokens", type=click.IntRange(1), default=8, show_default=True)
@click.option("--ready-timeout", type=float, default=600.0, show_default=True)
@out_option
def fleet_cmd(model, backend, conversations, turns, history_tokens, max_tokens, ready_timeout, out) -> None:
    """Follow-up TTFT and RAM/disk hit rate over 3 boards: `balance hash` (the shipped config) vs
    `balance roundrobin`, the same conversations in the same run, each policy on fresh boards."""
    from edge_llm.bench import client as S
    from edge_llm.bench import fleet as F
    from edge_llm.bench.disk import new_results_dir

    if shutil.which("haproxy") is None:
        raise click.ClickException("haproxy is not installed (Debian: apt-get install haproxy)")
    if not F.SHIPPED_CONFIG.is_file():
        raise click.ClickException(f"bench fleet needs a source checkout: {F.SHIPPED_CONFIG.name} not found")
    text = F.SHIPPED_CONFIG.read_text()
    res_dir = new_results_dir(out, "bench-fleet")
    res: dict = {"command": " ".join(sys.argv), "model": model, "backend": backend, "boards": BOARDS,
                 "conversations": conversations, "turns": turns, "history_tokens": history_tokens,
                 "max_tokens": max_tokens, "policies": {}}
    policies = {"hash": F.fleet_config(text, BOARDS), "roundrobin": F.fleet_config(text, BOARDS, F.ROUND_ROBIN)}
    with spinner() as prog:
        task = prog.add_task("fleet bench")
        for policy, cfg in policies.items():
            work = res_dir / policy
            servers = [S.LocalServer(model, work / f"b{i}" / "kv", work / f"b{i}.log",
                                     extra_args=["--backend", backend, "--node-name", f"b{i}"],
                                     stderr_file=work / f"b{i}.stderr") for i in range(1, BOARDS + 1)]
            work.mkdir(parents=True, exist_ok=True)
            try:
                prog.update(task, description=f"{policy}: starting {BOARDS} boards")
                for s in servers:
                    s.start()
                for s in servers:
                    S.wait_ready(s.base_url, ready_timeout, s.proc, stderr_file=s.stderr_file)
                convs = F.long_conversations(conversations, turns, history_tokens)
                stats = F.run_policy(cfg, [f"127.0.0.1:{s.port}" for s in servers], work, convs, max_tokens,
                                     step=lambda m, p=policy: prog.update(task, description=f"{p}: {m}"))
            finally:
                for s in servers:
                    s.stop()
            res["policies"][policy] = stats
    h, rr = res["policies"]["hash"], res["policies"]["roundrobin"]
    res["ttft_median_ratio_rr_over_hash"] = rr["ttft_median_ms"] / h["ttft_median_ms"]
    save_results(res_dir, "fleet", res, markdown(res))
    if h["failed"] or rr["failed"]:
        raise click.ClickException("some requests failed (see fleet.json)")
    console.print(f"round-robin / hash, median follow-up TTFT: {res['ttft_median_ratio_rr_over_hash']:.2f}x")


def markdown(res: dict) -> str:
    rows = ["| policy | follow-ups | TTFT median ms | TTFT p90 ms | hit rate | RAM hits | disk hits | misses "
            "| conversations on one board |", "|---|---|---|---|---|---|---|---|---|"]
    for name, s in res["policies"].items():
        rows.append(f"| {name} | {s['follow_ups']} | {s['ttft_median_ms']:.0f} | {s['ttft_p90_ms']:.0f} | "
                    f"{s['hit_rate']:.0%} | {s['ram_hits']} | {s['disk_hits']} | {s['misses']} | "
                    f"{s['conversations_on_one_board']}/{s['conversations']} |")
    return (f"# bench fleet\n\n{res['boards']} boards ({res['backend']}, {res['model']}), {res['conversations']} "
            f"conversations x {res['turns']} turns, ~{res['history_tokens']}-token first message, "
            f"max_tokens {res['max_tokens']}; follow-ups = turns 2..{res['turns']}.\n\n" + "\n".join(rows) +
            f"\n\nround-robin / hash, median follow-up TTFT: {res['ttft_median_ratio_rr_over_hash']:.2f}x\n\n"
            f"`{res['command']}`\n")
