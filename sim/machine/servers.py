"""FIFO servers: a GPU stream, a copy engine, a pool of host threads.

A server serves jobs in the order they arrive, each on the first of its `lanes` to become free. An engine
process asks for a job *at the simulated time it issues it* and waits on the event it gets back; a job
issued while the server is busy waits behind the jobs issued before it. Queueing, overlap and stalls
therefore come from which process waits on what, never from arithmetic inside one process.

Why not `simpy.Resource`: every job of these servers has a service time known when it is issued, and
for such jobs a FIFO resource is exactly "start = max(now, first free lane), end = start + service time".
simpy.Resource needs three events per job (request, timeout, release) where this needs one (the end);
the engines issue hundreds of thousands of jobs per run, so the saving is the difference between a seed
scenario in under a second and one in several (docs/design.md; tests/test_machine.py checks the start times
against simpy.Resource's). A job never waits for another server's job by booking: a job booked to start at
some later time would jump ahead of the jobs issued in between. The process waits for what the job needs,
then issues it. The one wait a server books is `synchronize`: the calling thread, blocked from the call until
this server's own queue (whose ends are all known) is done. Work whose duration is *not* known when it starts
(a read that shares an SSD with other reads, a copy sharing DRAM) lives in SharedBandwidth below and
sim/machine/storage.py instead.

Each job is logged as one busy interval (start_s, end_s, bytes, ops, kind): links.parquet, the report's
lanes and the Perfetto trace are drawn from these logs.
"""

from __future__ import annotations

import abc
import math

import simpy

from sim.machine.environment import Environment


class IntervalLog:
    """A server's busy intervals (start_s, end_s, bytes, ops, kind) as five columns. Appending a float, an int and
    a str to lists makes no object the garbage collector tracks, where a tuple per job did: a full ds4 run logs
    ~100K jobs, and the collections their tuples set off were a third of its time (a full collection scans every
    object the process holds, numpy's, pandas' and numba's included)."""

    __slots__ = ("start", "end", "n_bytes", "ops", "kind")

    def __init__(self):
        self.start, self.end, self.n_bytes, self.ops, self.kind = [], [], [], [], []

    def append(self, start: float, end: float, n_bytes: int, ops: int, kind: str) -> None:
        self.start.append(start)
        self.end.append(end)
        self.n_bytes.append(n_bytes)
        self.ops.append(ops)
        self.kind.append(kind)

    def extend(self, start: list, end: list, n_bytes: list, ops: list, kind: list) -> None:
        """Rows given as columns."""
        self.start += start
        self.end += end
        self.n_bytes += n_bytes
        self.ops += ops
        self.kind += kind

    def __len__(self) -> int:
        return len(self.start)

    def __getitem__(self, i: int) -> tuple[float, float, int, int, str]:
        return self.start[i], self.end[i], self.n_bytes[i], self.ops[i], self.kind[i]

    def columns(self) -> tuple[list, list, list, list, list]:
        return self.start, self.end, self.n_bytes, self.ops, self.kind


class Server:
    """`lanes` identical units serving jobs first come, first served. A copy engine has a rate for pinned host
    memory and one for pageable memory (the driver's staged copy), and a fixed cost per operation."""

    __slots__ = ("env", "name", "free_at", "busy_s", "bytes_moved", "ops", "log", "bytes_per_s",
                 "pageable_bytes_per_s", "op_latency_s", "dram", "dram_traffic", "host_thread", "_wait", "whole_log")

    def __init__(self, env: simpy.Environment, name: str, lanes: int = 1, bytes_per_s: float = 0.0,
                 op_latency_s: float = 0.0, dram: "SharedBandwidth | None" = None, dram_traffic: float = 1.0,
                 host_thread: bool = False, pageable_bytes_per_s: float = 0.0, whole_log: bool = True):
        if lanes < 1:
            raise ValueError("a server needs at least one lane")
        self.env, self.name = env, name
        # the wait a process yields at once: the environment's short cut where it has one (environment.py)
        self._wait = getattr(env, "elapse", env.timeout)
        self.free_at = [0.0] * lanes
        self.bytes_per_s, self.op_latency_s = bytes_per_s, op_latency_s
        self.pageable_bytes_per_s = pageable_bytes_per_s or bytes_per_s
        self.busy_s = 0.0
        self.bytes_moved = self.ops = 0
        self.log = IntervalLog()
        # False: the log keeps the first job only, which says the server was used (a run that writes no
        # links.parquet: a sweep point; building a tuple per job was ~8 % of its time)
        self.whole_log = whole_log
        # a copy engine reading or writing host DRAM takes dram_traffic x its rate of DRAM while a copy runs
        self.dram, self.dram_traffic = dram, dram_traffic
        # an engine's host thread: it waits on the devices as much as it works, so its busy time overlaps theirs
        self.host_thread = host_thread

    @property
    def lanes(self) -> int:
        return len(self.free_at)

    def cost_s(self, n_bytes: float, n_ops: int = 1, pageable_bytes: float = 0.0,
               fixed_costs: int | None = None) -> float:
        """Service time of a copy job on an idle server: a fixed cost per operation (`fixed_costs` of them when
        the operations share some: copies queued back to back, or a call whose cost the caller's thread pays)
        plus its pinned bytes over the server's rate and its pageable bytes over the pageable rate."""
        fixed = (n_ops if fixed_costs is None else fixed_costs) * self.op_latency_s
        if not self.bytes_per_s:
            return fixed
        return fixed + (n_bytes - pageable_bytes) / self.bytes_per_s + pageable_bytes / self.pageable_bytes_per_s

    def hold(self, seconds: float, n_bytes: float = 0, n_ops: int = 0, kind: str = "busy", *,
             later: bool = False) -> simpy.Event:
        """A job of `seconds` issued now; the event fires when it is done. The calling process yields it at
        once; `later`: it yields it after other work, or hangs callbacks on it (a plain timeout, see
        sim/machine/environment.py)."""
        delay = self.book(seconds, n_bytes, n_ops, kind) - self.env.now
        return self.env.timeout(delay) if later else self._wait(delay)

    def book(self, seconds: float, n_bytes: float = 0, n_ops: int = 0, kind: str = "busy") -> float:
        """`hold` for a job nobody waits on by itself (a kernel enqueued on a stream that a later sync waits
        for): the same job issued now, its end time instead of an event, so it costs the event loop nothing."""
        return self._book(seconds, n_bytes, n_ops, kind, self.env.now)

    def _book(self, seconds: float, n_bytes: float, n_ops: int, kind: str, not_before: float) -> float:
        # every job of a run comes here (about ten a layer step): written for the interpreter, no builtin calls
        free = self.free_at
        lane = 0 if len(free) == 1 else min(range(len(free)), key=free.__getitem__)
        start = free[lane]
        if start < not_before:
            start = not_before
        end = start + seconds
        free[lane] = end
        self.busy_s += seconds
        whole_bytes = int(n_bytes)
        self.bytes_moved += whole_bytes
        self.ops += n_ops
        if self.whole_log or not self.log.start:  # (the list's own truth test: no Python-level __len__ per job)
            self.log.append(start, end, whole_bytes, n_ops, kind)
        if self.dram is not None and n_bytes and seconds > 0:
            self.dram.reserve_during(start, end, self.dram_traffic * n_bytes / seconds)
        return end

    def record(self, start: float, end: float, n_bytes: float = 0, n_ops: int = 0, kind: str = "busy") -> None:
        """A job whose end another resource decided (a copy sharing DRAM, a kernel waiting on the link): logged,
        and the lane busy until it ended. Only for servers one process uses at a time."""
        self.free_at[0] = max(self.free_at[0], end)
        self.busy_s += end - start
        self.bytes_moved += int(n_bytes)
        self.ops += n_ops
        if self.whole_log or not self.log.start:
            self.log.append(start, end, int(n_bytes), n_ops, kind)

    def copy(self, n_bytes: float, n_ops: int = 1, kind: str = "copy", pageable_bytes: float = 0.0,
             fixed_costs: int | None = None, *, later: bool = False) -> simpy.Event:
        """A copy job issued now: `n_ops` operations moving `n_bytes` in all, `pageable_bytes` of them from
        pageable memory (see cost_s). `later` as for hold."""
        return self.hold(self.cost_s(n_bytes, n_ops, pageable_bytes, fixed_costs), n_bytes, n_ops, kind, later=later)

    def book_copy(self, n_bytes: float, n_ops: int = 1, kind: str = "copy", pageable_bytes: float = 0.0,
                  fixed_costs: int | None = None) -> float:
        """`copy` without an event (see `book`): a copy on a stream nobody waits on, or one a sync waits for."""
        return self.book(self.cost_s(n_bytes, n_ops, pageable_bytes, fixed_costs), n_bytes, n_ops, kind)

    def synchronize(self, thread: "Server", seconds: float, n_ops: int = 1, kind: str = "sync") -> simpy.Event:
        """A host thread's synchronize on this stream or copy engine, called now: the thread waits until every
        job issued here so far is done (their ends are known: each was issued with its service time), then
        spends `seconds` of its own (the call's cost, or its next host call). The event fires at its end."""
        free, now = self.free_at, self.env.now
        idle = free[0] if len(free) == 1 else max(free)  # idle_at and max(now, idle), without the calls
        return self._wait(thread._book(seconds, 0, n_ops, kind, idle if idle > now else now) - now)

    def drained(self, *, later: bool = False) -> simpy.Event:
        """An event at the end of every job issued so far (a stream synchronize), without a job of its own.
        `later` as for hold."""
        delay = max(0.0, max(self.free_at) - self.env.now)
        return self.env.timeout(delay) if later else self._wait(delay)

    def idle_at(self) -> float:
        """When the last issued job ends (the server is idle from then on unless more work comes)."""
        return max(self.free_at)

    def summary(self, elapsed_s: float) -> dict:
        return {"link": self.name, "busy_s": self.busy_s, "bytes": self.bytes_moved, "ops": self.ops,
                "utilisation": self.busy_s / (elapsed_s * self.lanes) if elapsed_s > 0 else 0.0,
                "host_thread": self.host_thread}

    def intervals(self) -> list[tuple[float, float, int, int, str]]:
        return list(zip(*self.log.columns()))


class SharedProgress(abc.ABC):
    """What a resource whose jobs share it (SharedBandwidth here, the drive's Ssd) does for a lone job that its
    process yields at once: the environment's short cut. The subclass keeps its jobs' progress (`_finish`: the
    progress to now, the jobs done fired but the waited one, the next completion timed; `_reschedule`: that
    timing alone) and says when the lone job would end."""

    env: simpy.Environment
    version: int  # a completion timer acts only if the version it was set at is still current

    @abc.abstractmethod
    def _finish(self, waited: list | None = None) -> bool: ...

    @abc.abstractmethod
    def _reschedule(self) -> None: ...

    def _lone_at_once(self, job: list, event: simpy.Event, delay: float) -> simpy.Event:
        """A lone job ending `delay` from now: when nothing can happen before then (Environment.can_elapse), the
        clock moves to where its completion timer would fire and the completion is done there, without the
        timer's and the job's events. The same floats as the timer's path: the same end, the same progress check
        (`_finish`). Otherwise, or if that check finds work left, the timer's path and the job's event."""
        elapsed = self._elapse_alone(delay)
        if elapsed is None:
            self._reschedule()
            return event
        return elapsed if self._finish(job) else event

    def _elapse_alone(self, delay: float) -> simpy.Event | None:
        """The clock moved `delay` on where nothing can happen before then (the environment's short cut), and
        any completion timer set before made void; None, with nothing changed, where the short cut is refused."""
        env = self.env
        if not (isinstance(env, Environment) and env.can_elapse(delay)):  # (SimPy's own has no short cut)
            return None
        self.version += 1  # a timer set before this job can no longer act (as _reschedule does)
        return env.elapse(delay)


class SharedBandwidth(SharedProgress):
    """A bandwidth every job in flight shares, such as host DRAM: copies by CPU threads are jobs of a known
    traffic (a memcpy reads and writes: 2 bytes of traffic per byte copied) whose rate is their fair share of
    what is left, capped by the job's own limit (one thread's copy rate), water-filling the rest; DMA engines
    reserve their rate while they run (a copy engine streams at its link rate and the CPU copies slow down
    around it). The reservations are known when the copy engine books its job, so a lone copy's end is found
    by integrating over them; with several copies their shares are re-timed at every start, end and change.
    """

    def __init__(self, env: simpy.Environment, name: str, bytes_per_s: float):
        self.env, self.name, self.capacity = env, name, bytes_per_s
        self.jobs: list[list] = []  # [traffic left, cap, event, traffic, issued_s, kind]
        self.reservations: list[tuple[float, float, float]] = []  # (start, end, bytes/s)
        self.updated_s = 0.0
        self.version = 0
        self.due_s = float("inf")  # when the next scheduled re-timing happens
        self.busy_s = 0.0  # time with a copy in flight
        self.traffic = 0.0  # bytes of traffic, copies and DMA reservations
        self.bytes_moved = self.ops = 0  # the copies' traffic and count
        self.log: list[tuple[float, float, int, int, str]] = []
        self._busy_since: float | None = None

    def transfer(self, traffic_bytes: float, cap_bytes_per_s: float, kind: str = "copy", *,
                 at_once: bool = False) -> simpy.Event:
        """A job of `traffic_bytes` at most `cap_bytes_per_s`, issued now; the event fires when it is done.
        `at_once`: the calling process yields it at once, and a lone job may then take the environment's short
        cut (`_lone_at_once`)."""
        if traffic_bytes <= 0:
            return self.env.event().succeed()
        self._advance()
        self.traffic += traffic_bytes
        self.bytes_moved += int(traffic_bytes)
        self.ops += 1
        if at_once and not self.jobs and not self.reservations:
            done = self._lone_unreserved(traffic_bytes, cap_bytes_per_s, kind)
            if done is not None:
                return done
        event = self.env.event()
        if not self.jobs:
            self._busy_since = self.env.now
        job = [float(traffic_bytes), cap_bytes_per_s, event, traffic_bytes, self.env.now, kind]
        self.jobs.append(job)
        if at_once and len(self.jobs) == 1:
            return self._lone_at_once(job, event, max(0.0, self._lone_job_end(job) - self.env.now))
        self._reschedule()
        return event

    def _lone_unreserved(self, traffic_bytes: float, cap_bytes_per_s: float, kind: str) -> simpy.Event | None:
        """`_lone_at_once` for its commonest case written out (a pread copy between two DMA copies that its thread
        waits for): no other job and no DMA reservation, so the job runs at min(cap, capacity) throughout and its
        end, its progress and its done check are single expressions, the same floats as `_lone_job_end`,
        `_advance` and `_finish` compute. None, with nothing changed, where the short cut is refused (the general
        path then takes the job)."""
        now = self.env.now
        rate = min(cap_bytes_per_s, self.capacity)
        left = float(traffic_bytes)
        elapsed = self._elapse_alone(max(0.0, now + left / rate - now))
        if elapsed is None:
            return None
        end = self.env.now
        if end > now:
            left -= rate * (end - now)
        self.updated_s = end
        if not (left <= 1e-3 or left <= rate * (4 * math.ulp(max(end, 1.0)))):  # bytes left: the timer's path
            self._busy_since = now
            event = self.env.event()
            self.jobs.append([left, cap_bytes_per_s, event, traffic_bytes, now, kind])
            self._reschedule()
            return event
        self.log.append((now, end, int(traffic_bytes), 1, kind))
        self.busy_s += end - now
        self.version += 1  # _finish's _reschedule with no job left
        self.due_s = float("inf")
        return elapsed

    def reserve_during(self, start_s: float, end_s: float, bytes_per_s: float) -> None:
        """A DMA's traffic from start_s to end_s (its job on a copy engine is already booked)."""
        if end_s <= start_s or bytes_per_s <= 0:
            return
        self.traffic += (end_s - start_s) * bytes_per_s
        if self.jobs:
            self._advance()
        self.reservations.append((start_s, end_s, bytes_per_s))
        if self.jobs and start_s < self.due_s:
            self._reschedule()

    def _available(self, t: float) -> float:
        if not self.reservations:  # the common case (no DMA in flight), without a generator's cost
            return self.capacity
        reserved = sum(rate for start, end, rate in self.reservations if start <= t < end)
        return max(self.capacity - reserved, self.capacity * 1e-6)

    def _next_boundary(self, t: float) -> float:
        nxt = float("inf")
        for start, end, _ in self.reservations:
            if start > t:
                nxt = min(nxt, start)
            elif end > t:
                nxt = min(nxt, end)
        return nxt

    def _rates(self, available: float) -> list[float]:
        """Water-filling: each job its cap or an equal share of what the smaller caps leave."""
        if len(self.jobs) == 1:
            return [min(self.jobs[0][1], available)]
        left = available
        order = sorted(range(len(self.jobs)), key=lambda i: self.jobs[i][1])
        rates = [0.0] * len(self.jobs)
        for n, i in enumerate(order):
            share = left / (len(order) - n)
            rates[i] = min(self.jobs[i][1], share)
            left -= rates[i]
        return rates

    def _advance(self) -> None:
        """Apply the jobs' progress from the last update to now, piece by piece between reservation changes."""
        now = self.env.now
        t = self.updated_s
        while self.jobs and t < now:
            piece_end = min(now, self._next_boundary(t))
            for job, rate in zip(self.jobs, self._rates(self._available(t))):
                job[0] -= rate * (piece_end - t)
            t = piece_end
        self.updated_s = now
        if self.reservations:
            self.reservations = [r for r in self.reservations if r[1] > now]

    def _lone_job_end(self, job: list) -> float:
        """When a lone job ends, integrating its rate over the known reservations."""
        t, left = self.env.now, job[0]
        while True:
            rate = min(job[1], self._available(t))
            boundary = self._next_boundary(t)
            if t + left / rate <= boundary:
                return t + left / rate
            left -= rate * (boundary - t)
            t = boundary

    def _reschedule(self) -> None:
        self.version += 1
        if not self.jobs:
            self.due_s = float("inf")
            return
        now = self.env.now
        if len(self.jobs) == 1:
            due = self._lone_job_end(self.jobs[0])
        else:
            rates = self._rates(self._available(now))
            due = min(now + min(max(job[0], 0.0) / rate for job, rate in zip(self.jobs, rates)),
                      self._next_boundary(now))
        self.due_s = due
        version = self.version
        timer = self.env.timeout(max(0.0, due - now))
        timer.callbacks.append(lambda _e: self._tick(version))

    def _tick(self, version: int) -> None:
        if version != self.version:
            return
        self._finish()

    def _finish(self, waited: list | None = None) -> bool:
        """The jobs' progress to now; those done logged and their events fired, but `waited`'s (a job whose
        process goes on at once, _lone_at_once); the next completion timed. Whether `waited` is done."""
        self._advance()
        now = self.env.now
        # A job is done when what is left would take less than the clock can resolve at `now`: float time
        # cannot advance by less than an ulp, so waiting for the last bytes would spin at one instant.
        resolution_s = 4 * math.ulp(max(now, 1.0))
        rates = self._rates(self._available(now))
        finished = [job[0] <= 1e-3 or job[0] <= rate * resolution_s for job, rate in zip(self.jobs, rates)]
        done = [job for job, f in zip(self.jobs, finished) if f]
        self.jobs = [job for job, f in zip(self.jobs, finished) if not f]
        for job in done:
            self.log.append((job[4], now, int(job[3]), 1, job[5]))
            if job is not waited:
                job[2].succeed()
        if not self.jobs and self._busy_since is not None:
            self.busy_s += now - self._busy_since
            self._busy_since = None
        self._reschedule()
        return any(job is waited for job in done)

    def summary(self, elapsed_s: float) -> dict:
        """busy_s: time with a CPU copy in flight; utilisation: all traffic (copies and DMA) over the bandwidth."""
        return {"link": self.name, "busy_s": self.busy_s, "bytes": self.bytes_moved, "ops": self.ops,
                "utilisation": self.traffic / (self.capacity * elapsed_s) if elapsed_s > 0 else 0.0,
                "host_thread": False}

    def intervals(self) -> list[tuple[float, float, int, int, str]]:
        """The copies' busy periods (copies overlap: one interval per copy would double count)."""
        return merge_intervals(self.log)


def merge_intervals(log: list[tuple[float, float, int, int, str]]) -> list[tuple[float, float, int, int, str]]:
    """Overlapping (start, end, bytes, ops, kind) jobs of a shared resource as its busy periods."""
    merged: list[list] = []
    for start, end, n_bytes, ops, kind in sorted(log):
        if merged and start <= merged[-1][1]:
            last = merged[-1]
            last[1], last[2], last[3] = max(last[1], end), last[2] + n_bytes, last[3] + ops
        else:
            merged.append([start, end, n_bytes, ops, kind])
    return [tuple(m) for m in merged]
