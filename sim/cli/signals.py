"""Ctrl-C for the command line: while a command runs, SIGINT raises Interrupted, even where Python would drop it."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

REDELIVER_S = 0.01  # a Ctrl-C that Python dropped is sent again this much later (see CtrlC)
REDELIVERY_TAKEN_S = 1.0  # restore waits at most this long for a redelivery already sent to reach the handler


class Interrupted(BaseException):
    """Ctrl-C, raised by our SIGINT handler. Not a KeyboardInterrupt: click and typer turn that into exit 1
    ("Aborted!") or a silent exit 130 depending on their version, and commands need to say what was saved."""


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
        self.closing = False
        self._redelivery: threading.Timer | None = None
        self._on_its_way = threading.Event()  # a redelivery sent and not yet taken by the handler
        self._previous_handler = signal.signal(signal.SIGINT, self._interrupt)
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self._redeliver

    def _interrupt(self, signum, frame):
        self._on_its_way.clear()
        if self.closing or isinstance(sys.exception(), Interrupted):
            return
        raise Interrupted()

    def _send_again(self) -> None:
        self._on_its_way.set()
        os.kill(os.getpid(), signal.SIGINT)

    def _redeliver(self, unraisable) -> None:
        if not isinstance(unraisable.exc_value, Interrupted):
            self._previous_hook(unraisable)
            return
        self.dropped = True
        self._redelivery = threading.Timer(REDELIVER_S, self._send_again)
        self._redelivery.start()

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
        signal.signal(signal.SIGINT, self._previous_handler)
        sys.unraisablehook = self._previous_hook
