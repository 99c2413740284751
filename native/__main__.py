"""Ahead-of-time build of the native ops: ``python -m chaos._native build [--build-dir DIR]``."""

from __future__ import annotations

import logging
from pathlib import Path

import click
from chaos._native import build, default_build_dir


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Chaos native ops: build them ahead of time."""


@main.command("build")
@click.option(
    "--build-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Cache directory (default: ~/.cache/chaos/native/<torch>-<python>-<build key>).",
)
@click.option("--verbose", is_flag=True, help="Show the compiler's output.")
def build_command(build_dir: Path | None, verbose: bool) -> None:
    """Compile the C++ extension into the cache so that first use does not wait."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    directory = build_dir if build_dir is not None else default_build_dir()
    try:
        build(directory, verbose=verbose)
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"chaos native ops built in {directory}")


if __name__ == "__main__":
    main()
