"""A chain of FIFO jobs repeated step after step, issued in one compiled call, for a process that runs alone.

Issue 33. Some engine steps, such as a ds4 decode layer whose experts all hit, are a fixed sequence of jobs on
single-lane FIFO servers (sim/machine/servers.py): a thread's host call it waits for, a kernel enqueued on the
stream, a thread's synchronize on the stream. Each job's service time is known when it is issued, and while the
issuing process runs alone (Environment.runs_alone: nothing queued, nothing else woken) nothing else can issue
a job in between. Such steps are then pure arithmetic on the servers' clocks: `JobChain.run` does many of them in
one numba call and hands the servers their jobs (busy time, bytes, operations, log rows) and the environment its
clock, the same floats, in the same order, as the jobs issued one at a time and waited for (`Server.book`,
`hold`, `synchronize`; tests/test_machine_chains.py compares the two).

A job of the chain is one of
    BOOK   issued now, nobody waits for it (a kernel enqueued on a stream): `Server.book`
    WAIT   issued now, the process waits for its end (a host call): `Server.hold`
    SYNC   the thread waits until another server's queue is done, then spends its own time (a stream synchronize
           and the call after it): `Server.synchronize`
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

BOOK, WAIT, SYNC = 0, 1, 2


@dataclass(frozen=True)
class Job:
    """One job of a chain: its server, what the process does about it, what it waits on (SYNC), its operation
    count and the log's kind. Its seconds and bytes come per step (`JobChain.run`)."""

    server: object
    wait: int = BOOK
    n_ops: int = 0
    kind: str = "busy"
    sync_on: object = None


class JobChain:
    """Jobs issued in this order at every step of a chain (see the module docstring)."""

    def __init__(self, env, jobs: list[Job], mark: int):
        """mark: the job after whose wait a step's mark time is taken (where an engine records the step's end)."""
        servers: list = []
        for job in jobs:
            if (job.wait == SYNC) != (job.sync_on is not None):
                raise ValueError(f"{job.server.name}: a SYNC job names the server it waits on (sync_on), no other does")
            for server in (job.server, job.sync_on):
                if server is not None and server not in servers:
                    servers.append(server)
        for server in servers:
            if server.lanes != 1 or server.dram is not None:
                raise ValueError(f"{server.name}: a chain's servers have one lane and share no bandwidth")
        self.env, self.jobs, self.servers, self.mark = env, jobs, servers, mark
        self._server_of = np.array([servers.index(j.server) for j in jobs], np.int64)
        self._wait = np.array([j.wait for j in jobs], np.int64)
        self._sync_on = np.array([-1 if j.sync_on is None else servers.index(j.sync_on) for j in jobs], np.int64)
        self._n_ops = np.array([j.n_ops for j in jobs], np.int64)
        # per server that runs jobs: its jobs' columns in issue order, their operation counts and kinds (its log)
        self._logs = [(server, np.array(cols), [jobs[j].n_ops for j in cols], [jobs[j].kind for j in cols])
                      for server in servers if (cols := [j for j, job in enumerate(jobs) if job.server is server])]

    def run(self, seconds: np.ndarray, n_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Steps of the chain, seconds and n_bytes [step, job] (bytes whole numbers), issued from now by the process
        that runs alone. Returns each step's start and mark time; the clock is left at the last step's end."""
        servers = self.servers
        clocks = np.array([(s.free_at[0], s.busy_s) for s in servers])
        totals = np.array([(s.bytes_moved, s.ops) for s in servers], np.int64)
        times = np.empty((len(seconds), len(self.jobs), 2))  # each job's start and end
        steps = np.empty((len(seconds), 2))  # each step's start and mark
        now = _run_chain(self.env.now, clocks, totals, self._server_of, self._wait, self._sync_on, self._n_ops,
                         seconds, n_bytes, self.mark, times, steps)
        for server, (free, busy), (moved, ops) in zip(servers, clocks.tolist(), totals.tolist()):
            server.free_at[0], server.busy_s, server.bytes_moved, server.ops = free, busy, moved, ops
        for server, cols, n_ops, kinds in self._logs:
            if server.whole_log:
                server.log.extend(times[:, cols, 0].ravel().tolist(), times[:, cols, 1].ravel().tolist(),
                                  n_bytes[:, cols].ravel().tolist(), n_ops * len(seconds), kinds * len(seconds))
            elif not server.log.start:  # a log of the first job only
                server.log.append(float(times[0, cols[0], 0]), float(times[0, cols[0], 1]), int(n_bytes[0, cols[0]]),
                                  n_ops[0], kinds[0])
        self.env.move_clock_to(now)
        return steps[:, 0], steps[:, 1]


@njit(cache=True)
def _run_chain(now, clocks, totals, server_of, wait, sync_on, n_ops, seconds, n_bytes, mark, times, steps):
    """clocks [server, (free at, busy s)], totals [server, (bytes, operations)]: updated in place."""
    for i in range(seconds.shape[0]):
        steps[i, 0] = now
        for j in range(seconds.shape[1]):
            s = server_of[j]
            not_before = now
            if wait[j] == SYNC:
                if n_bytes[i, j] != 0:
                    raise ValueError("a SYNC job moves no bytes")
                idle = clocks[sync_on[j], 0]
                if idle > now:
                    not_before = idle
            start = clocks[s, 0]
            if start < not_before:
                start = not_before
            end = start + seconds[i, j]
            clocks[s, 0] = end
            clocks[s, 1] += seconds[i, j]
            totals[s, 0] += n_bytes[i, j]
            totals[s, 1] += n_ops[j]
            times[i, j, 0] = start
            times[i, j, 1] = end
            if wait[j] != BOOK:
                now = now + (end - now)  # where Environment.elapse puts the clock
            if j == mark:
                steps[i, 1] = now
    return now


# --- the machine's arithmetic for compiled engine steps (issue 33) ------------------------------------------
# An engine step compiled whole (ds4's decode token, sim/engines/ds4/decode_chain.py) asks these for its jobs'
# times, as its process would ask the servers: each is the float arithmetic of the Python method it names, for
# the case the step's caller has checked (one lane, the resource otherwise idle), so the times are the same floats
# (tests/test_ds4_engine.py runs scenarios through the compiled steps and without them).

# The machine's figures a compiled step prices its lone jobs with (Machine.compiled_step_figures), by index: the H2D
# copy engine's fixed cost per operation, pinned and pageable rates and DRAM traffic per byte; host DRAM's
# bandwidth, one copying thread's cap on it and a CPU copy's traffic per byte; the drive's request latency and its
# transfer rate at depth 1 (Ssd.rate_at); the D2D copies' pinned and pageable rates.
(H2D_OP_LATENCY_S, H2D_RATE, H2D_PAGEABLE_RATE, H2D_DRAM_TRAFFIC, DRAM_CAPACITY, PREAD_CAP, MEMCPY_TRAFFIC_PER_BYTE,
 DRIVE_LATENCY_S, DRIVE_RATE_QD1, D2D_RATE, D2D_PAGEABLE_RATE, N_STEP_FIGURES) = range(12)


@njit(cache=True)
def fifo_job(clocks, totals, server, not_before, seconds, n_bytes, n_ops):
    """Server._book on one-lane server `server` (clocks [server, (free at, busy s)], totals [server, (bytes,
    operations)]): the job's (start, end)."""
    start = clocks[server, 0]
    if start < not_before:
        start = not_before
    end = start + seconds
    clocks[server, 0] = end
    clocks[server, 1] += seconds
    totals[server, 0] += n_bytes
    totals[server, 1] += n_ops
    return start, end


@njit(cache=True)
def pinned_copy_seconds(n_bytes, n_ops, op_latency_s, bytes_per_s, pageable_bytes_per_s):
    """Server.cost_s of a copy of pinned bytes with a fixed cost per operation."""
    fixed = n_ops * op_latency_s
    if bytes_per_s == 0.0:
        return fixed
    return fixed + (n_bytes - 0.0) / bytes_per_s + 0.0 / pageable_bytes_per_s


@njit(cache=True)
def _drive_rate(left, request_bytes, latency_s, rate_at_depth_1):
    """Ssd._rates for a lone read at depth 1 with `left` requests to go: its requests in flight are min(1, left), so
    a fraction left at the end is served as a fraction of a request in flight (its latency whole)."""
    in_flight = left if left < 1 else 1.0
    share = rate_at_depth_1 / in_flight  # (Ssd.rate_at of a depth up to the table's first: its first rate)
    return in_flight / (latency_s + request_bytes / share)


@njit(cache=True)
def lone_drive_read(now, n_bytes, n_reads, latency_s, rate_at_depth_1):
    """Ssd.read of n_reads reads at depth 1 on an idle drive, its process waiting at once: the short cut's end
    (SharedProgress._lone_at_once), then, while the progress check finds requests left, the completion timer's
    path (Ssd._reschedule, _finish). Returns the end and how many timers fired."""
    request_bytes = n_bytes / n_reads
    left = float(n_reads)
    rate = _drive_rate(left, request_bytes, latency_s, rate_at_depth_1)
    end = now + left / rate
    if end > now:
        left -= rate * (end - now)
    timers = 0
    while left > 1e-9:
        if timers == 64:
            raise ValueError("a drive read that the clock cannot finish")
        rate = _drive_rate(left, request_bytes, latency_s, rate_at_depth_1)
        later = end + max(left, 0.0) / rate
        if later > end:
            left -= rate * (later - end)
        end = later
        timers += 1
    return end, timers


@njit(cache=True)
def lone_dram_copy(now, traffic_bytes, cap_bytes_per_s, capacity_bytes_per_s):
    """SharedBandwidth._lone_unreserved: a DRAM job alone, no reservation in flight, its process waiting at once:
    (end, whether the progress check finds it done, as it always does for traffic below ~2^40 bytes)."""
    rate = min(cap_bytes_per_s, capacity_bytes_per_s)
    left = float(traffic_bytes)
    end = now + max(0.0, now + left / rate - now)
    if end > now:
        left -= rate * (end - now)
    return end, left <= 1e-3 or left <= rate * (4 * np.spacing(max(end, 1.0)))
