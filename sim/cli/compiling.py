"""The line a first run prints while numba compiles its kernels: a cold cache (a fresh install, a new numba, changed
kernel code) costs ~20 s before the first result, which would otherwise pass in silence."""

from __future__ import annotations

import sys

from numba.core import event

COMPILING_LINE = ("expertsim: compiling numba kernels (first run only, ~20 s; they are cached for the runs "
                  "after it) ...")


class CompileNotice(event.Listener):
    """Prints COMPILING_LINE on stderr when numba starts its first compile of the command: numba fires
    "numba:compile" only on a cache miss (a kernel loaded from its cache fires none), so a warm run prints
    nothing. Like a progress bar it is for a terminal: stderr piped to a file or a program gets no such line,
    and --json's stdout stays JSON only either way."""

    def __init__(self) -> None:
        self.said = not sys.stderr.isatty()

    def on_start(self, event_) -> None:
        if not self.said:
            self.said = True
            print(COMPILING_LINE, file=sys.stderr, flush=True)

    def on_end(self, event_) -> None:
        pass


def compile_notice():
    """A context manager: the notice's listener installed for the command's duration."""
    return event.install_listener("numba:compile", CompileNotice())
