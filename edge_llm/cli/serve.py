"""`edge-llm serve`: the OpenAI-compatible HTTP server with its process lifecycle.

SIGTERM/SIGINT: stop accepting, let the running request finish for up to --grace-seconds (then
cancel it; a second SIGTERM/SIGINT cancels it at once), flush the pending snapshot save, write the
exit line, exit 0. SIGHUP reopens the log file. Settings: flag > EDGE_LLM_* env > --config TOML > default (edge_llm/settings.py).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

import click

from edge_llm.cli.options import settings_options
from edge_llm.cli.progress import import_default_model_in_terminal

log = logging.getLogger("edge_llm.lifecycle")
RESPONSE_DRAIN_S = 10.0  # after the grace period: time for the cancelled job's answer to be sent


@click.command("serve")
@settings_options("serve")
def serve(settings) -> None:
    """Serve the OpenAI-compatible API (completions, chat, models, health, metrics)."""
    from edge_llm.errors import EdgeLLMError

    try:
        import_default_model_in_terminal(settings.model)
    except EdgeLLMError as e:
        raise click.ClickException(str(e)) from None
    sys.exit(run_server(settings))


def run_server(settings) -> int:
    """Run until a signal or a fatal load error; return the process exit code."""
    import uvicorn

    from edge_llm.errors import ConfigError
    from edge_llm.footprint import EXIT_REFUSED, MemoryRefused
    from edge_llm.logsetup import log_banner, log_exit, setup_logging
    from edge_llm.sdnotify import Notifier
    from edge_llm.server.app import create_app

    try:
        logs = setup_logging(settings.log_file)
    except OSError as e:
        raise click.ClickException(f"log file {settings.log_file}: {e}") from None
    logs.install_sighup()
    notifier = Notifier()
    log_banner(model=settings.model, backend=settings.backend, host=settings.host, port=settings.port,
               disk_kv=settings.disk_kv or "off", max_seq=settings.max_seq, log_file=settings.log_file or "-",
               notify="on" if notifier.enabled else "off")
    fatal: list[Exception] = []
    holder: dict[str, uvicorn.Server] = {}

    def on_fatal(e: Exception) -> None:
        fatal.append(e)
        if "server" in holder:
            holder["server"].should_exit = True

    try:
        app = create_app(settings, notifier=notifier, on_fatal=on_fatal)
    except ConfigError as e:  # e.g. an unreadable api_key_file
        log.error("%s", e)
        log_exit(f"config error: {e}", logs, 2)
        return 2
    state = app.state.edge

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            name = signal.Signals(sig).name
            # leave signal context (the state takes locks, sends datagrams): a thread does the work
            if self.should_exit:
                # a second signal ends the grace period: the running request is cancelled and still
                # answered. uvicorn's own second-Ctrl-C force quit would skip the snapshot flush and
                # cut the answers off (a text/plain 500 and tracebacks), so it is not passed on.
                threading.Thread(target=state.cut_grace, args=(f"second {name}",), daemon=True).start()
                return
            super().handle_exit(sig, frame)
            # the reason now, in the handler (a plain store; the state's lock is not for signal
            # context): the lifespan's `close` may run before the thread below and would say "shutdown"
            state.exit_reason = state.exit_reason or name
            threading.Thread(target=state.begin_shutdown, args=(name,), daemon=True).start()

    # uvicorn cancels the request tasks when its graceful-shutdown timeout ends. At grace_seconds
    # our worker cancels the running job, which then ends with finish_reason "cancelled"; uvicorn
    # waits RESPONSE_DRAIN_S longer, so that this answer reaches the client (a whole JSON body, a
    # stream's last chunk and [DONE]) instead of a bare 500 or a cut stream.
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None,
                            timeout_graceful_shutdown=settings.grace_seconds + RESPONSE_DRAIN_S, lifespan="on",
                            timeout_keep_alive=5, server_header=False)
    server = holder["server"] = _Server(config)
    # uvicorn re-raises the caught signal after shutdown; with a no-op handler underneath, the
    # process ends through our exit path (exit line, code 0) instead of dying by the signal
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    code = 0
    try:
        server.run()
    except SystemExit as e:  # uvicorn exits this way when it cannot bind the port
        code = e.code if isinstance(e.code, int) else 1
    except BaseException as e:
        log.exception("server crashed: %s", e)
        code = 1
    if fatal and isinstance(fatal[0], MemoryRefused):  # a restart would refuse again (unit:
        reason, code = str(fatal[0]), EXIT_REFUSED      # RestartPreventExitStatus=)
    elif fatal:
        reason, code = f"model load failed: {state.error}", 1
    elif code:
        reason = "startup failed (see above)"
    else:
        reason = state.exit_reason or "server stopped"
    if notifier.enabled:
        notifier.stopping()
    log_exit(reason, logs, code)
    notifier.close()
    logging.shutdown()
    return code
