"""`edge-llm doctor` (placeholder until its issue lands; replace this file)."""

import click


@click.command("doctor")
def doctor() -> None:
    """Not yet implemented."""
    raise click.ClickException("'doctor' is not implemented yet")
