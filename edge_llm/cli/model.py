"""`edge-llm model` (placeholder until its issue lands; replace this file)."""

import click


@click.group("model")
def model() -> None:
    """Not yet implemented."""
    raise click.ClickException("'model' is not implemented yet")
