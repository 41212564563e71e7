"""`edge-llm bench` (placeholder until its issue lands; replace this file)."""

import click


@click.group("bench")
def bench() -> None:
    """Not yet implemented."""
    raise click.ClickException("'bench' is not implemented yet")
