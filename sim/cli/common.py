"""The typer app, its command groups, and what every command uses: the --force and --wide options, printing JSON
on stdout, and the exit codes. Tables: sim.cli.tables. The commands register themselves on these apps from the
other sim.cli modules."""

from __future__ import annotations

import sys

import typer

from sim.outputs import dumps

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Simulate MoE expert caches (SSD, RAM, GPU) of local LLM inference engines.")
trace_app = typer.Typer(no_args_is_help=True, help="Routing traces: import, generate, record, measure.")
app.add_typer(trace_app, name="trace")
hardware_app = typer.Typer(no_args_is_help=True, help="Hardware profiles: list them, show one's figures and sources, "
                                                        "copy one with figures changed.")
app.add_typer(hardware_app, name="hardware")
model_app = typer.Typer(no_args_is_help=True, help="Model layouts: a preset's or a GGUF file's experts and classes.")
app.add_typer(model_app, name="model")
scenario_app = typer.Typer(no_args_is_help=True, help="Scenarios: write a commented starting scenario.")
app.add_typer(scenario_app, name="scenario")

EXIT_BAD_INPUT = 2
# The ranges of the command line's counts, given to typer as min/max (a value outside is a usage error naming the
# option and its range; a huge one overflowed a C integer with a traceback). Seeds: numpy's and the generator's
# 64-bit state (sim.trace.generate refuses 2**63 and up). Workers: the most CPUs Linux runs (sim.hardware.MAX_CPUS).
# Samples: --uncertainty runs the scenario once per sample, so 100,000 is days of CPU already.
MAX_SEED = 2**63 - 1
MAX_WORKERS = 8_192
MAX_SAMPLES = 100_000
EXIT_POINTS_FAILED = 1  # a sweep that ran but where points failed: not bad input (2), not success


def flag(*names: str, help: str, default: bool = False, **options):
    """An on/off option. Its metavar is empty: typer 0.29's help shows a flag's type, "<bool>", as if it took a
    value (a flag takes none; earlier typers showed nothing there, as this does)."""
    return typer.Option(default, *names, help=help, metavar="", **options)


def _version(value: bool) -> None:
    if value:
        from sim.version import __version__

        typer.echo(f"expertsim {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = flag("--version", callback=_version, is_eager=True,
                                  help="print the version and exit")) -> None:
    """Simulate MoE expert caches (SSD, RAM, GPU) of local LLM inference engines."""


def force_option():
    return flag("--force", help="replace output files that already exist")


def wide_option():
    return flag("--wide", help="print every table whole, each column at its full width, even past the terminal's "
                               "edge (a narrow terminal otherwise turns or trims a wide table and says what it left "
                               "out)")


def print_json(payload) -> None:
    sys.stdout.write(dumps(payload, indent=2) + "\n")
