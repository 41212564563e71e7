"""`edge-llm serve` (placeholder until its issue lands; replace this file)."""

import click


@click.command("serve")
def serve() -> None:
    """Not yet implemented."""
    raise click.ClickException("'serve' is not implemented yet")
