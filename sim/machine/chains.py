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
