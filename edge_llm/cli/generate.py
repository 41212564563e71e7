"""`edge-llm generate` (placeholder until its issue lands; replace this file)."""

import click


@click.command("generate")
def generate() -> None:
    """Not yet implemented."""
    raise click.ClickException("'generate' is not implemented yet")
