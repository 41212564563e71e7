"""`edge-llm bench fleet`: three boards behind the shipped HAProxy config, the same conversations
routed by consistent hashing and by round-robin; with --spread, how HAProxy's hash types
spread chat keys over 3 boards and move them to a 4th; with --bounded, what bounded loads
(`hash-balance-factor`) cost in affinity and gain in balance under a hot key range (docs/fleet.md)."""

from __future__ import annotations

import contextlib
import shutil
import sys
from pathlib import Path

import click

from edge_llm.cli.bench.common import bench, console, out_option, save_results, spinner
from edge_llm.settings import DEFAULTS

BOARDS = 3


@bench.command("fleet")
@click.option("--model", default=DEFAULTS.model, show_default=True, help="HF model dir or 'default'.")
@click.option("--backend", default="cpu", show_default=True, help="Backend of every board.")
@click.option("--conversations", type=click.IntRange(BOARDS), default=10, show_default=True,
              help="Conversations sent through HAProxy, each with its own chat key.")
@click.option("--turns", type=click.IntRange(2), default=4, show_default=True,
              help="Turns per conversation (the first is cold; the follow-ups are measured).")
@click.option("--history-tokens", type=click.IntRange(1), default=400, show_default=True,
              help="About this many tokens of history in each conversation's first message.")
@click.option("--max-tokens", type=click.IntRange(1), default=8, show_default=True,
              help="Greedy tokens per answer.")
@click.option("--ready-timeout", type=float, default=600.0, show_default=True,
              help="Seconds a board may take to answer /health before the run fails.")
@click.option("--spread", is_flag=True, help="Instead: how each of HAProxy's hash types spreads --keys chat "
              "keys over 3 boards and how many move when a 4th joins (no generation).")
@click.option("--keys", type=click.IntRange(1), default=300, show_default=True, help="Chat keys for --spread.")
@click.option("--bounded", is_flag=True, help="Instead: each --factors value of hash-balance-factor with stand-in "
              "boards (no model) and --conversations keys, --hot-share of them on one board, --clients at once.")
@click.option("--factors", default="0,125,150,200,300", show_default=True,
              help="hash-balance-factor values for --bounded (0: unbounded).")
@click.option("--clients", type=click.IntRange(1), default=6, show_default=True,
              help="Conversations in flight at once for --bounded.")
@click.option("--hold-ms", type=click.FloatRange(0), default=50.0, show_default=True,
              help="How long a stand-in board takes per request for --bounded (one at a time).")
@click.option("--hot-share", type=click.FloatRange(0, 1), default=0.6, show_default=True,
              help="Share of the --bounded conversations whose key maps to b1.")
@out_option
def fleet_cmd(model, backend, conversations, turns, history_tokens, max_tokens, ready_timeout, spread, keys,
              bounded, factors, clients, hold_ms, hot_share, out) -> None:
    """Follow-up TTFT and RAM/disk hit rate over 3 boards: `balance hash` (the shipped config) vs
    `balance roundrobin`, the same conversations in the same run, each policy on fresh boards."""
    from edge_llm.bench import fleet as F
    from edge_llm.bench.disk import new_results_dir

    if shutil.which("haproxy") is None:
        raise click.ClickException("haproxy is not installed (Debian: apt-get install haproxy)")
    if not F.SHIPPED_CONFIG.is_file():
        raise click.ClickException(f"bench fleet needs a source checkout: {F.SHIPPED_CONFIG.name} not found")
    text = F.SHIPPED_CONFIG.read_text()
    if spread:
        return spread_cmd(text, model, backend, keys, ready_timeout, out)
    if bounded:
        try:
            levels = tuple(int(f) for f in factors.split(","))
        except ValueError:
            raise click.BadParameter(f"not a comma-separated list of integers: {factors!r}", param_hint="--factors")
        if any(f != 0 and f <= 100 for f in levels):
            raise click.BadParameter("each factor is 0 (off) or above 100 (percent of the mean)", param_hint="--factors")
        return bounded_cmd(text, levels, conversations, turns, clients, hold_ms / 1e3, hot_share, out)
    res_dir = new_results_dir(out, "bench-fleet")
    res: dict = {"command": " ".join(sys.argv), "model": model, "backend": backend, "boards": BOARDS,
                 "conversations": conversations, "turns": turns, "history_tokens": history_tokens,
                 "max_tokens": max_tokens, "policies": {}}
    policies = {"hash": F.fleet_config(text, BOARDS), "roundrobin": F.fleet_config(text, BOARDS, F.ROUND_ROBIN)}
    with spinner() as prog:
        task = prog.add_task("fleet bench")
        for policy, cfg in policies.items():
            work = res_dir / policy
            prog.update(task, description=f"{policy}: starting {BOARDS} boards")
            with boards(model, backend, work, BOARDS, ready_timeout) as addresses:
                convs = F.long_conversations(conversations, turns, history_tokens)
                res["policies"][policy] = F.run_policy(
                    cfg, addresses, work, convs, max_tokens,
                    step=lambda m, p=policy: prog.update(task, description=f"{p}: {m}"))
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


@contextlib.contextmanager
def boards(model: str, backend: str, work: Path, n: int, ready_timeout: float):
    """`n` fresh boards (b1..bn) on loopback, each with its own kv dir under `work`; yields their
    host:port addresses, stops them at the end."""
    from edge_llm.bench import client as S

    work.mkdir(parents=True, exist_ok=True)
    servers = [S.LocalServer(model, work / f"b{i}" / "kv", work / f"b{i}.log",
                             extra_args=["--backend", backend, "--node-name", f"b{i}"],
                             stderr_file=work / f"b{i}.stderr") for i in range(1, n + 1)]
    try:
        for s in servers:
            s.start()
        for s in servers:
            S.wait_ready(s.base_url, ready_timeout, s.proc, stderr_file=s.stderr_file)
        yield [f"127.0.0.1:{s.port}" for s in servers]
    finally:
        for s in servers:
            s.stop()


def spread_cmd(text: str, model: str, backend: str, keys: int, ready_timeout: float, out: str) -> None:
    from edge_llm.bench import fleet as F
    from edge_llm.bench.disk import new_results_dir

    res_dir = new_results_dir(out, "bench-fleet-spread")
    res: dict = {"command": " ".join(sys.argv), "keys": keys}
    with spinner() as prog:
        task = prog.add_task("fleet spread")
        prog.update(task, description="starting 4 boards")
        with boards(model, backend, res_dir, 4, ready_timeout) as addresses:
            res["hash_types"] = F.hash_spread(text, addresses, res_dir, keys,
                                              step=lambda m: prog.update(task, description=m))
    rows = ["| hash-type | keys on b1 / b2 / b3 | moved to 4 boards | moved to |", "|---|---|---|---|"]
    for fn, r in res["hash_types"].items():
        rows.append(f"| {fn} | {' / '.join(str(r['spread'].get(b, 0)) for b in ('b1', 'b2', 'b3'))} | "
                    f"{r['moved']} ({r['moved'] / keys:.0%}) | {r['moved_to']} |")
    save_results(res_dir, "fleet-spread", res,
                 f"# bench fleet --spread\n\n{keys} chat keys sharing a system prompt, the shipped config with "
                 f"each hash-type (shipped: {F.HASH_TYPE}): 3 boards, then 4.\n\n" + "\n".join(rows) + f"\n\n`{res['command']}`\n")



def bounded_cmd(text: str, factors: tuple[int, ...], conversations: int, turns: int, clients: int, hold: float,
                hot_share: float, out: str) -> None:
    from edge_llm.bench import fleet_load as L
    from edge_llm.bench.disk import new_results_dir

    res_dir = new_results_dir(out, "bench-fleet-bounded")
    res: dict = {"command": " ".join(sys.argv), "conversations": conversations, "turns": turns, "clients": clients,
                 "hold_s": hold, "hot_share": hot_share}
    with spinner() as prog:
        task = prog.add_task("fleet bounded loads")
        res["factors"] = L.bounded_loads(text, res_dir, factors, conversations, turns, clients, hold, hot_share,
                                         step=lambda m: prog.update(task, description=m))
    rows = ["| hash-balance-factor | turns on their key's board | conversations never moved | turns b1 / b2 / b3 "
            "| max / mean | peak in flight b1 / b2 / b3 | wall s |", "|---|---|---|---|---|---|---|"]
    for f, s in res["factors"].items():
        rows.append(f"| {f or 'off'} | {s['turns_on_home']:.0%} | {s['conversations_on_home']:.0%} | "
                    f"{' / '.join(str(v) for v in s['turns_per_board'].values())} | {s['max_over_mean']:.2f} | "
                    f"{' / '.join(str(v) for v in s['peak_in_flight'].values())} | {s['wall_s']:.1f} |")
    table = "\n".join(rows)
    save_results(res_dir, "fleet-bounded", res,
                 f"# bench fleet --bounded\n\n{conversations} conversations x {turns} turns, {hot_share:.0%} of the "
                 f"keys on b1, {clients} at once; stand-in boards (one request at a time, {hold * 1e3:.0f} ms each), "
                 f"the shipped config with each hash-balance-factor.\n\n{table}\n\n`{res['command']}`\n")
