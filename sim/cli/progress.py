"""A live line on stderr while a command works: what it is doing, a count where it knows one, the time so far
("expertsim run: simulating 0:00:12") and the time left where the count gives a rate. A 1M-token generation, a run
or every validation case takes from seconds to minutes, and silence reads as a hang.

Like the compile notice, it is for a terminal: with stderr piped to a file or a program, or with --json, the
command prints no such line, and the line is gone from the screen when the command ends (stdout keeps only the
table). rich's Progress draws it, from a thread of its own, so a stage that never calls back still shows its
time passing."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.text import Text


class _Count(MofNCompleteColumn):
    """"3/17" where the stage has a count, nothing where it has none (rich would print "0/?")."""

    def render(self, task) -> Text:
        return Text("") if task.total is None else super().render(task)


class _Remaining(TimeRemainingColumn):
    """"ETA 0:01:10" once a counted stage has a rate to go by, nothing where it has no count."""

    def render(self, task) -> Text:
        if task.total is None:
            return Text("")
        return Text.assemble("ETA ", super().render(task))


class Stages:
    """What the command tells its live line: `stage("simulating")` names the step, `count(done, of)` its count."""

    def __init__(self, command: str, bar: Progress | None = None) -> None:
        self._command = command
        self._bar = bar
        self._task = bar.add_task(f"expertsim {command}", total=None) if bar is not None else None

    def stage(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=f"expertsim {self._command}: {text}", completed=0, total=None)

    def count(self, done: int, of: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=of)


@contextmanager
def working(command: str, quiet: bool = False) -> Iterator[Stages]:
    """The live line for the duration of the block; `quiet` (--json) or a stderr that is not a terminal: none."""
    if quiet or not sys.stderr.isatty():
        yield Stages(command)
        return
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=20),
                  _Count(), TimeElapsedColumn(), _Remaining(), console=Console(stderr=True), transient=True,
                  redirect_stdout=False) as bar:  # stdout is the table's or the JSON's, never the live line's
        yield Stages(command, bar)
