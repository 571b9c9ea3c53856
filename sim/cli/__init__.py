"""The `expertsim` command: parses arguments, calls the library, prints tables or JSON. Nothing else.

Every verb that prints a table takes --json and then prints only JSON on stdout. Bad input ends with one
line on stderr naming the file, field and value, and exit code 2.

Where each command lives: `trace ...` in sim.cli.trace; `hardware ...`, `model show` and `scenario init` in
sim.cli.inputs; `cache` in sim.cli.cache; `run` and `demo` in sim.cli.run; `bench` and `calibrate` in
sim.cli.measure; `sweep`, `plan`, `validate` and `report` in sim.cli.explore. The app, its groups and the printing
they share are in sim.cli.common, the Ctrl-C handling in sim.cli.signals, the first run's compile line in
sim.cli.compiling.
"""

from __future__ import annotations

import sys

import typer

# Importing a command module registers its commands; this order is the order `expertsim --help` lists them in.
import sim.cli.trace  # noqa: F401
import sim.cli.inputs  # noqa: F401
import sim.cli.cache  # noqa: F401
import sim.cli.run  # noqa: F401
import sim.cli.measure  # noqa: F401
import sim.cli.explore  # noqa: F401
from sim.cli.common import EXIT_BAD_INPUT, app
from sim.cli.compiling import compile_notice
from sim.cli.signals import CtrlC, Interrupted, end_interrupted
from sim.errors import InputError

__all__ = ["app", "main"]


def main() -> None:
    """The console script. Usage errors go through click's own standalone handling (the usage line, one
    message, exit 2), whichever copy of click typer carries; bad input is one line and exit 2; Ctrl-C is one
    line and exit 130, SIGTERM the same line and exit 143."""
    ctrl_c = CtrlC()
    interrupted_exit = None
    try:
        with compile_notice():
            app(prog_name="expertsim")
    except InputError as exc:
        typer.echo(f"expertsim: error: {exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except (Interrupted, Exception) as exc:
        if not isinstance(exc, Interrupted) and not ctrl_c.dropped:
            raise
        ctrl_c.closing = True
        # a failure after a dropped Ctrl-C is the interrupt's: it cut that code short (see CtrlC)
        typer.echo("expertsim: interrupted", err=True)
        interrupted_exit = exc.exit_code if isinstance(exc, Interrupted) else ctrl_c.exit_code
    finally:
        ctrl_c.restore()
    if interrupted_exit is not None:
        end_interrupted(interrupted_exit)
