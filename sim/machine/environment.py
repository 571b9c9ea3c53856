"""The simulation's clock: SimPy's environment, counting its events, with a short cut for the commonest wait.

Most of what an engine process waits on is a job of a FIFO server (sim/machine/servers.py) whose end is known
when it is issued: a thread's host call, a stream sync. SimPy makes each such wait a timeout on its event queue:
pushed, popped, the process resumed from the queue. When the waiting process is the only one the event being
processed wakes, and no queued event is due before the job ends, nothing can happen in between: `elapse` then
moves the clock to the job's end and the process goes on at once (SimPy resumes a process on an already processed
event without the queue). A lone job of the host's DRAM or of the drive (SharedBandwidth, Ssd), which its process
yields at once, takes the short cut too: its completion is done where its timer would have fired (`can_elapse`
says whether that is exact). A process that finds itself alone with an empty queue (`runs_alone`) may go further: a
chain of such jobs computed in one call (sim/machine/chains.py; ds4's decode layers whose experts all hit), the
clock then moved to its end (`move_clock_to`). The times are the same floats either way (the clock lands where
the timeout would have: now + delay), so every result is too (tests/test_machine.py runs the same jobs on SimPy's own
environment; tests/test_outputs_unchanged.py every scenario against outputs written before this short cut).

Hand-written on SimPy's internals (its clock `_now` and its heap `_queue`, stable through simpy 4.x, the range
pyproject.toml allows): a public hook for it does not exist, and the short cut removes about nine in ten of a ds4
decode run's events.
"""

from __future__ import annotations

import simpy
from simpy.events import Process


class Environment(simpy.Environment):
    """SimPy's environment; `events_scheduled` counts the events it queued (a run's cost in events, the
    summary's simulated_events) and `elapse` is the short cut of the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.events_scheduled = 0
        self._alone: Process | None = None  # the process the event being processed wakes, if it wakes only that
        elapsed = simpy.Event(self)  # an event already processed: a process that yields it goes on at once
        elapsed._ok, elapsed._value, elapsed.callbacks = True, None, None
        self._elapsed = elapsed

    def schedule(self, event, priority=simpy.core.NORMAL, delay=0) -> None:
        self.events_scheduled += 1
        super().schedule(event, priority, delay)

    def step(self) -> None:
        """SimPy's step, noting first whether the next event wakes one process and nothing else."""
        queue = self._queue
        if queue:
            callbacks = queue[0][3].callbacks
            only = callbacks[0] if callbacks is not None and len(callbacks) == 1 else None
            self._alone = only.__self__ if getattr(only, "__func__", None) is Process._resume else None
        try:
            super().step()
        finally:
            self._alone = None

    def elapse(self, delay: float) -> simpy.Event:
        """The event a process yields at once to wait `delay` seconds: the short cut where it is exact, else
        a timeout. Only for a process that yields it straight away (an event to yield later, or to hang callbacks
        on, is a timeout)."""
        if not self.can_elapse(delay):
            return self.timeout(delay)
        self._now += delay
        return self._elapsed

    def can_elapse(self, delay: float) -> bool:
        """Whether `elapse(delay)` takes the short cut: the active process was woken alone and no queued event is
        due by the time it would wake."""
        queue = self._queue
        return (self._alone is not None and self._alone is self._active_proc and delay >= 0
                and not (queue and queue[0][0] <= self._now + delay))

    def runs_alone(self) -> bool:
        """Whether the active process may wait inline: the event being processed woke it alone and no event is
        queued, so nothing else can run before it next yields an event (each `elapse` it makes would take the
        short cut)."""
        return not self._queue and self._alone is not None and self._alone is self._active_proc

    def move_clock_to(self, time: float) -> None:
        """The clock set where a process that runs alone has taken it by waits of its own arithmetic, each wait
        computed as `elapse` moves the clock (now + (end - now)); sim/machine/chains.py."""
        if time < self._now:
            raise ValueError(f"the clock cannot go back from {self._now} to {time}")
        self._now = time
