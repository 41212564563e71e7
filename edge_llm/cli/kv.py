"""`edge-llm kv` (placeholder until its issue lands; replace this file)."""

import click


@click.group("kv")
def kv() -> None:
    """Not yet implemented."""
    raise click.ClickException("'kv' is not implemented yet")
