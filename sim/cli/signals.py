"""Ctrl-C and SIGTERM for the command line: while a command runs, SIGINT or SIGTERM raises Interrupted, even where
Python would drop it, so that the command says what was saved and stops its workers either way (a `kill` or a
service manager's stop sends SIGTERM; its default action would end the process at once, the workers left
behind)."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time

REDELIVER_S = 0.01  # a Ctrl-C that Python dropped is sent again this much later (see CtrlC)
REDELIVERY_TAKEN_S = 1.0  # restore waits at most this long for a redelivery already sent to reach the handler


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code_of(signum: int) -> int:
    return 128 + int(signum)


def end_interrupted(exit_code: int):
    """Ends an interrupted command's process without the interpreter's teardown. The interrupt can cut a native
    library short (llvmlite mid-compile; numba #2324: a Ctrl-C in compiled code sometimes segfaults), and freeing
    what it left half-built can crash: a CI run printed "expertsim: interrupted" and then died of SIGSEGV (-11)
    instead of exiting 143. The command's own cleanup has run by now (its finally blocks stopped its workers and
    closed its files); the atexit handlers still run here (multiprocessing reaps any child left), and the streams
    are flushed. Only the freeing of every object at the interpreter's exit is skipped."""
    atexit._run_exitfuncs()  # CPython's own exit path calls this; os._exit would skip it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


class Interrupted(BaseException):
    """Ctrl-C (or SIGTERM), raised by our handler. Not a KeyboardInterrupt: click and typer turn that into exit 1
    ("Aborted!") or a silent exit 130 depending on their version, and commands need to say what was saved."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signum)  # args rebuild it: SimPy re-raises a process's exception as type(exc)(*exc.args)
        self.signum = int(signum)

    @property
    def exit_code(self) -> int:
        """What a shell reports for a process the signal ended: 128 + its number (130 Ctrl-C, 143 SIGTERM)."""
        return exit_code_of(self.signum)


class CtrlC:
    """Ctrl-C raises Interrupted while installed. Python prints and drops an exception that escapes a finalizer or
    a ctypes callback ("Exception ignored in ..."), and llvmlite runs both while numba compiles (its objects'
    __del__, its object-cache notify callback): a Ctrl-C landing in one would be lost and the command would run
    on. Python hands every such exception to sys.unraisablehook, so an Interrupted that reaches it is delivered
    again once that code has returned, and `dropped` remembers it: the code it cut short may fail before then
    (numba, its object never stored, raises "no compiled object yet"), and that failure is the interrupt's.
    A redelivery that comes once the interrupt is being acted on (an Interrupted is being handled, or `closing`)
    is taken and ignored: raised there it would end the command with a traceback, and after `restore` it would
    reach the interpreter's shutdown as a KeyboardInterrupt."""

    def __init__(self) -> None:
        self.dropped = False
        self.dropped_signum = int(signal.SIGINT)  # the signal of a dropped interrupt (what `exit_code` reports)
        self.closing = False
        self._redelivery: threading.Timer | None = None
        self._on_its_way = threading.Event()  # a redelivery sent and not yet taken by the handler
        self._in_hook = False  # _redeliver is running
        self._previous_handlers = {signum: signal.signal(signum, self._interrupt) for signum in STOP_SIGNALS}
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self._redeliver

    def _interrupt(self, signum, frame):
        self._on_its_way.clear()
        if self.closing or isinstance(sys.exception(), Interrupted):
            return
        if self._in_hook:  # raised here it would be dropped too; the redelivery being set up delivers it
            return
        raise Interrupted(signum)

    @property
    def exit_code(self) -> int:
        """The exit code of the dropped interrupt's signal."""
        return exit_code_of(self.dropped_signum)

    def _send_again(self) -> None:
        self._on_its_way.set()
        # to the main thread, where Python runs the handler: a signal sent to the process may be taken by this
        # timer's thread, and a main thread asleep would then run the handler only when its sleep ends
        if hasattr(signal, "pthread_kill"):
            signal.pthread_kill(threading.main_thread().ident, self.dropped_signum)
        else:
            os.kill(os.getpid(), self.dropped_signum)

    def _redeliver(self, unraisable) -> None:
        if not isinstance(unraisable.exc_value, Interrupted):
            self._previous_hook(unraisable)
            return
        self.dropped = True
        self.dropped_signum = unraisable.exc_value.signum
        # starting the timer waits for its thread, and Python runs a pending handler there: an Interrupted raised
        # inside this hook would be dropped as well (a CI run printed "Exception ignored in sys.unraisablehook"
        # and lost the Ctrl-C), so _interrupt leaves it to this redelivery
        self._in_hook = True
        try:
            self._redelivery = threading.Timer(REDELIVER_S, self._send_again)
            self._redelivery.start()
        finally:
            self._in_hook = False

    def restore(self) -> None:
        """The previous handler and hook back, after any redelivery: one not yet sent is not sent, one sent is
        taken here."""
        self.closing = True
        if self._redelivery is not None:
            self._redelivery.cancel()
            self._redelivery.join()
        deadline = time.monotonic() + REDELIVERY_TAKEN_S
        while self._on_its_way.is_set() and time.monotonic() < deadline:
            time.sleep(REDELIVER_S)  # Python runs the handler in this thread, between two sleeps
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        sys.unraisablehook = self._previous_hook
