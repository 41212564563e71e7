"""`edge-llm generate`: stream a completion for one prompt and print prefill/decode timing."""

from __future__ import annotations

import logging
import sys

import click

from edge_llm.cli.options import settings_options
from edge_llm.cli.progress import resolve_model_with_bar
from edge_llm.settings import Settings


@click.command("generate")
@settings_options("generate")
@click.option("--prompt", "-p", default=None, help="Prompt text (default: read stdin).")
@click.option("--chat/--raw", default=True, show_default=True, help="Wrap the prompt in the chat template.")
@click.option("--system", default=None, help="System message (with --chat).")
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(1),
              help="Most tokens generated (fewer when the model ends its turn or a --stop string appears).")
@click.option("--temperature", default=None, type=click.FloatRange(0),
              help="0 = greedy.  [default: the model's generation_config.json, else 1.0]")
@click.option("--top-k", default=None, type=click.IntRange(0),
              help="0 = off.  [default: the model's generation_config.json, else 0]")
@click.option("--top-p", default=None, type=click.FloatRange(0, 1, min_open=True),
              help="[default: the model's generation_config.json, else 1.0]")
@click.option("--seed", default=None, type=int,
              help="Sampling seed: the same seed, prompt and settings give the same text.  [default: a fresh "
                   "one per run]")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--image", "images", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Image file (PNG, JPEG, WebP) shown before the prompt (repeatable; Qwen3-VL).")
@click.option("-v", "--verbose", is_flag=True, help="Show library log lines ([KV-DISK], [PREFILL-TIMING]).")
def generate(settings: Settings, prompt, chat, system, max_tokens, temperature, top_k, top_p, seed,
             stop, images, verbose) -> None:
    """Generate text for one prompt, streaming it to stdout."""
    from rich.console import Console

    from edge_llm.engine import GenerationRequest
    from edge_llm.errors import EdgeLLMError, ImageError, ImageNotRegular
    from edge_llm.files import read_regular
    from edge_llm.logsetup import setup_cli_logging
    from edge_llm.runtime import load_runtime
    from edge_llm.tokenizer import plain

    err = Console(stderr=True)
    setup_cli_logging(logging.INFO if verbose else logging.WARNING)
    if prompt is None:
        prompt = sys.stdin.read()
    try:
        resolve_model_with_bar(settings.model)  # a first-use import of the default model: a bar
        with err.status("loading model..."):
            engine = load_runtime(settings)
        # which backend runs and why, as the server logs it and /health shows it (docs/configuration.md)
        err.print(engine.backend_reason, style="dim", markup=False, soft_wrap=True)
        prepared, shown = [], ""
        if images:
            if engine.vision is None:
                raise click.ClickException(f"{settings.model}: this model has no vision encoder (--image)")
            for path in images:
                try:
                    # a FIFO or device is refused, never read (a plain open of a FIFO blocks)
                    prepared.append(engine.vision.prepare(read_regular(path, ImageNotRegular)))
                except (ImageError, OSError) as e:
                    raise click.ClickException(f"--image {path}: {e}") from None
            shown = engine.vision.placeholder(engine.tokenizer.id_to_token) * len(images)
        if chat:  # the typed text is plain text; the image placeholders are control tokens
            messages = ([{"role": "system", "content": plain(system)}] if system else [])
            messages.append({"role": "user", "content": shown + plain(prompt)})
            ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       plain_text=False)
        else:
            ids = engine.tokenizer.encode(shown + prompt)
        if prepared:
            ids = engine.vision.expand(ids, prepared)
        req = GenerationRequest(ids, max_tokens=max_tokens, stop=list(stop),
                                sampling=engine.sampling_defaults.params(temperature, top_p, top_k, seed),
                                images=prepared)
        last = None
        for ev in engine.generate(req):
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            last = ev
        engine.close()  # the pending save is finished first
    except (EdgeLLMError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    sys.stdout.write("\n")
    t = last.timings
    # one short line per phase, never wrapped by the console (a wrap once cut "tok/s" in two)
    stats = [f"prefill {t.prefill_tokens} tok in {t.prefill_ms:.1f} ms "
             f"({t.prefill_tokens / max(t.prefill_ms, 1e-9) * 1e3:.1f} tok/s), cache {t.cache_source} "
             f"({t.ram_cached_tokens + t.disk_cached_tokens} tok)",
             f"decode {t.decode_tokens} tok in {t.decode_ms:.1f} ms "
             f"({t.decode_tokens / max(t.decode_ms, 1e-9) * 1e3:.1f} tok/s)"]
    if t.images:
        stats.append(f"{t.images} image(s), {t.image_tokens} image tok, {t.images_encoded} encoded in "
                     f"{t.vision_ms:.1f} ms")
    stats.append(f"TTFT {t.ttft_ms:.1f} ms; finish {last.finish_reason}")
    for line in stats:
        err.print(line, style="dim", markup=False, soft_wrap=True)
