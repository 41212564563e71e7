"""Command-line flags generated from the one settings declaration (`edge_llm.settings.Settings`).

`settings_options(command)` adds `--config` and a `--flag` for every setting that the command
exposes, with the type, bounds, choices and `[default: ...]` taken from the declaration; the
command receives the merged, resolved `settings: Settings` (flag > EDGE_LLM_* > TOML > default).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from edge_llm.settings import CONFIG_ENV, FIELDS, describe_default, env_name


def _click_type(meta: dict[str, Any]) -> Any:
    kind = meta["kind"]
    if meta["choices"]:
        return click.Choice(list(meta["choices"]))
    if meta["nullable"]:  # a number or its null word ("auto", "none"): settings.convert checks both
        return str
    if kind is int:
        return click.IntRange(meta["minimum"], meta["maximum"])
    if kind is float:
        return click.FloatRange(meta["minimum"], meta["maximum"])
    if kind is bool:
        return click.BOOL
    return str


def settings_options(command: str, default_config: Path | None = None) -> Callable:
    """Decorator: the command gets `settings` instead of one parameter per setting.

    `default_config`: a TOML file read when neither --config nor EDGE_LLM_CONFIG names one and
    it exists (doctor checks the installed service's configuration by default)."""
    keys = [k for k, f in FIELDS.items() if command in f.metadata["commands"]]

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, config_file: str | None = None, no_disk_kv: bool = False, **kw: Any):
            from edge_llm.errors import ConfigError
            from edge_llm.settings import load_settings

            flags = {k: kw.pop(k) for k in keys}
            flags = {k: v for k, v in flags.items() if v is not None}
            if no_disk_kv:
                if "disk_kv" in flags:
                    raise click.UsageError("--disk-kv and --no-disk-kv are mutually exclusive")
                flags["disk_kv"] = "off"
            if (config_file is None and default_config is not None and CONFIG_ENV not in os.environ
                    and default_config.is_file()):
                config_file = str(default_config)
            try:
                settings = load_settings(flags, config_file=config_file)
            except ConfigError as e:
                raise click.ClickException(str(e)) from None
            return fn(*args, settings=settings, **kw)

        # click applies decorators bottom-up: add in reverse so --help lists them in declared order
        for key in reversed(keys):
            meta = FIELDS[key].metadata
            helptext = f"{meta['help']}  [env {env_name(key)}; default: {describe_default(key)}]"
            wrapper = click.option(f"--{key.replace('_', '-')}", key, default=None, type=_click_type(meta),
                                   metavar=meta["metavar"], help=helptext)(wrapper)
            if key == "disk_kv":
                wrapper = click.option("--no-disk-kv", "no_disk_kv", is_flag=True, default=False,
                                       help="Turn disk KV snapshots off (same as --disk-kv off).")(wrapper)
        return click.option("--config", "config_file", default=None, metavar="FILE",
                            help="TOML settings file (keys as in board/edge-llm.toml.example; "
                                 "env EDGE_LLM_CONFIG).")(wrapper)

    return decorate
