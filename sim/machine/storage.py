"""Storage: the SSD, whose reads share the drive, and the OS page cache of the model files.

The SSD serves every read in flight at once. Its throughput depends on how many requests are in flight
(the profile's table of bandwidth by queue depth, measured at one request size) and on the size of the
requests: a request costs a fixed latency plus its bytes at the drive's share for it,

    t(request) = L + s * Q / R(Q)          Q = requests in flight, s = request size,

with L the profile's small-read latency and R(Q) the transfer rate that makes Q requests of the table's
size reach the table's bandwidth B(Q): R(Q) = Q s_ref / (Q s_ref / B(Q) - L). So small requests are
IOPS-bound, large ones bandwidth-bound, and a second reader slows the first: when a read arrives or ends
the shares change, and every read in flight is re-timed (processor sharing). The table is read as an
application's view (fio's bs and iodepth): a pread of several MiB at depth 1 is one request at depth 1,
whatever the block layer splits it into. Page faults of a mapped file read `max_request_bytes` at a time.

The page cache holds file extents (an expert's bytes in one model file) in the RAM no process uses, on an
inactive and an active list (numba kernel sim.cache.kernels.page_cache_access): a page read once waits on
the inactive list, a second read makes it active, and eviction takes the inactive list's oldest. How much
of the cache the OS keeps inactive is its own (INACTIVE_SHARE_BY_OS); the share decides whether a loop over
more file than fits keeps part of it (two lists) or misses throughout (one LRU list). Its capacity moves
when the engine allocates or frees host memory (sim/machine/__init__.py, Memory), and on unified memory
also when the GPU allocates: the page cache, the expert cache and the process share one pool.
"""

from __future__ import annotations

import math

import numpy as np
import simpy

from sim.cache.kernels import page_cache_access, page_cache_drop, page_cache_read, page_cache_shrink
from sim.machine.servers import SharedProgress, merge_intervals


class Ssd(SharedProgress):
    """Reads sharing one drive (processor sharing over requests in flight)."""

    def __init__(self, env: simpy.Environment, name: str, table: list[tuple[int, float]], ref_request_bytes: float,
                 latency_s: float, max_request_bytes: float):
        self.env, self.name = env, name
        self.latency_s = latency_s
        self.max_request_bytes = max_request_bytes
        self.depths = [q for q, _ in table]
        self.rates = [self._transfer_rate(q, b, ref_request_bytes, latency_s) for q, b in table]
        self.jobs: list[list] = []  # [requests left, request bytes, depth, event, bytes, issued_s, reads]
        self.updated_s = 0.0
        self.version = 0
        self.busy_s = 0.0
        self.bytes_moved = self.ops = 0
        self.log: list[tuple[float, float, int, int, str]] = []
        self._busy_since: float | None = None

    @staticmethod
    def _transfer_rate(depth: int, bandwidth: float, ref_bytes: float, latency_s: float) -> float:
        """R(Q) of the module docstring, bytes/s; a table point below the latency floor keeps its bandwidth."""
        per_request_s = depth * ref_bytes / bandwidth - latency_s
        return depth * ref_bytes / per_request_s if per_request_s > 0 else bandwidth

    def rate_at(self, depth: float) -> float:
        """R(depth): linear between table points, flat beyond them."""
        d, r = self.depths, self.rates
        if depth <= d[0]:
            return r[0]
        for q0, r0, q1, r1 in zip(d, r, d[1:], r[1:]):
            if depth <= q1:
                return r0 + (r1 - r0) * (depth - q0) / (q1 - q0)
        return r[-1]

    def read(self, n_bytes: float, n_reads: int = 1, depth: int = 1, *, at_once: bool = False) -> simpy.Event:
        """`n_reads` reads of n_bytes / n_reads each, `depth` of them in flight at a time (a reader thread is
        depth 1; io_uring or a pool submits more). Fires when the last one is done. `at_once`: the calling process
        yields it at once, and a lone read may then take the environment's short cut (`_lone_at_once`)."""
        event = self.env.event()
        if n_bytes <= 0 or n_reads <= 0:
            event.succeed()
            return event
        self._advance()
        if not self.jobs:
            self._busy_since = self.env.now
        job = [float(n_reads), n_bytes / n_reads, depth, event, n_bytes, self.env.now, n_reads]
        self.jobs.append(job)
        self.bytes_moved += int(n_bytes)
        self.ops += n_reads
        if at_once and len(self.jobs) == 1:
            return self._lone_at_once(job, event, max(job[0], 0.0) / self._rates()[0])
        self._reschedule()
        return event

    def fault_reads(self, n_bytes: float) -> int:
        """How many requests page faults of a mapped file make to read n_bytes (read-ahead sized)."""
        return max(1, math.ceil(n_bytes / self.max_request_bytes))

    def _rates(self) -> list[float]:
        """Requests per second of each job."""
        in_flight = sum(min(job[2], job[0]) for job in self.jobs)
        share = self.rate_at(in_flight) / in_flight
        return [min(job[2], job[0]) / (self.latency_s + job[1] / share) for job in self.jobs]

    def _advance(self) -> None:
        now = self.env.now
        if self.jobs and now > self.updated_s:
            for job, rate in zip(self.jobs, self._rates()):
                job[0] -= rate * (now - self.updated_s)
        self.updated_s = now

    def _reschedule(self) -> None:
        self.version += 1
        if not self.jobs:
            return
        rates = self._rates()
        wait = min(max(job[0], 0.0) / rate for job, rate in zip(self.jobs, rates))
        version = self.version
        timer = self.env.timeout(wait)
        timer.callbacks.append(lambda _event: self._tick(version))

    def _tick(self, version: int) -> None:
        if version != self.version:
            return  # the shares changed since this completion was scheduled
        self._finish()

    def _finish(self, waited: list | None = None) -> bool:
        """The reads' progress to now; those done logged and their events fired, but `waited`'s (a read whose
        process goes on at once, _lone_at_once); the next completion timed. Whether `waited` is done."""
        self._advance()
        done = [job for job in self.jobs if job[0] <= 1e-9]
        self.jobs = [job for job in self.jobs if job[0] > 1e-9]
        now = self.env.now
        for job in done:
            self.log.append((job[5], now, int(job[4]), job[6], "read"))
            if job is not waited:
                job[3].succeed()
        if not self.jobs and self._busy_since is not None:
            self.busy_s += now - self._busy_since
            self._busy_since = None
        self._reschedule()
        return any(job is waited for job in done)

    def summary(self, elapsed_s: float) -> dict:
        return {"link": self.name, "busy_s": self.busy_s, "bytes": self.bytes_moved, "ops": self.ops,
                "utilisation": self.busy_s / elapsed_s if elapsed_s > 0 else 0.0, "host_thread": False}

    def intervals(self) -> list[tuple[float, float, int, int, str]]:
        """The drive's busy periods (reads overlap: one interval per read would double count)."""
        return merge_intervals(self.log)


# The share of the cached file pages an OS keeps on its inactive list.
# macOS: xnu's pageout daemon keeps "the fraction of active+inactive pages that should be inactive" at
#   VM_PAGE_INACTIVE_TARGET(avail) = avail * 1 / 2, and reactivates an inactive page that was referenced
#   (apple-oss-distributions/xnu osfmk/vm/vm_pageout.c @ 776661b7). Pages are moved to the inactive list at
#   every access here, where the daemon moves them when free memory runs low: the pages the cache holds are
#   the same, only their order when eviction starts may differ.
# Linux and Windows: one LRU list stands in. Linux sizes its lists by refault distance (mm/workingset.c) or, with
#   the multi-gen LRU, by generations, and Windows repurposes standby pages by priority: neither is modelled.
INACTIVE_SHARE_BY_OS = {"macos": 0.5}
LRU_SHARE = 1.0  # every page demoted as soon as it is promoted: one LRU list


class PageCache:
    """The OS page cache of the model's expert file extents, `capacity_bytes` large: an inactive and an active
    list (sim.cache.kernels.page_cache_access). `inactive_share` is the part of the cached bytes the OS keeps
    inactive; 1 makes it one LRU list."""

    def __init__(self, extent_bytes: np.ndarray, capacity_bytes: int, inactive_share: float = LRU_SHARE):
        if not 0.0 < inactive_share <= 1.0:
            raise ValueError(f"inactive_share must be in (0, 1], not {inactive_share}")
        self.inactive_share = float(inactive_share)
        self.sizes = np.asarray(extent_bytes, np.int64)
        self._lists(len(self.sizes))
        self.state = np.array([0, 0, max(0, int(capacity_bytes))], np.int64)
        self.hits = self.misses = 0

    def _lists(self, n: int) -> None:
        self.prev = np.empty(n + 2, np.int64)  # nodes n (inactive) and n + 1 (active) are the sentinels
        self.prev[:] = n
        self.prev[n + 1] = n + 1
        self.next = self.prev.copy()
        self.where = np.zeros(n, np.int8)

    def add_extents(self, extent_bytes: np.ndarray) -> np.ndarray:
        """More extents of the model files beside the experts' (an engine that reads other tensors through the
        cache, say the non-routed weights of a mapped file): their keys. Only while the cache holds nothing."""
        if self.used_bytes or self.where.any():
            raise ValueError("extents can be added only to an empty page cache")
        first = len(self.sizes)
        self.sizes = np.concatenate([self.sizes, np.asarray(extent_bytes, np.int64)])
        self._lists(len(self.sizes))
        return np.arange(first, len(self.sizes), dtype=np.int64)

    @property
    def capacity_bytes(self) -> int:
        return int(self.state[2])

    @property
    def used_bytes(self) -> int:
        return int(self.state[0] + self.state[1])

    def set_capacity(self, capacity_bytes: int) -> None:
        self.state[2] = max(0, int(capacity_bytes))
        page_cache_shrink(self.prev, self.next, self.where, self.sizes, self.state, self.inactive_share)

    def warm(self, keys_in_read_order: np.ndarray) -> None:
        """The files were read before the run (a previous run, the model load): the cache holds what fits,
        the last read most recent."""
        keys = np.ascontiguousarray(keys_in_read_order, np.int64)
        page_cache_access(keys, self.sizes, True, self.prev, self.next, self.where, self.state,
                          self.inactive_share, np.zeros(len(keys), np.bool_))

    def access(self, keys: np.ndarray, insert: bool = True) -> np.ndarray:
        """Reads of these extents through the page cache: True where the bytes were in RAM. Misses are
        read from the drive and kept (insert) unless the reader bypasses the cache."""
        keys = np.ascontiguousarray(keys, np.int64)
        hit = np.zeros(len(keys), np.bool_)
        page_cache_access(keys, self.sizes, insert, self.prev, self.next, self.where, self.state,
                          self.inactive_share, hit)
        n_hit = int(np.count_nonzero(hit))
        self.hits += n_hit
        self.misses += len(keys) - n_hit
        return hit

    def read(self, first_key: int, offsets: np.ndarray, drop: bool = False) -> int:
        """`access` of the extents first_key + offsets (one layer's experts, say), misses kept, counted as `access`
        counts them; `drop`: dropped again straight after (`drop`), in the same kernel call. Returns the hits."""
        n_hit = page_cache_read(first_key, offsets, self.sizes, self.prev, self.next, self.where, self.state,
                                self.inactive_share, drop)
        self.hits += n_hit
        self.misses += len(offsets) - n_hit
        return n_hit

    def contains(self, keys: np.ndarray) -> np.ndarray:
        return self.where[np.asarray(keys, np.int64)] != 0

    def drop(self, keys: np.ndarray, first_key: int = 0) -> None:
        """posix_fadvise(DONTNEED) after a read: the extents first_key + keys leave the cache."""
        page_cache_drop(first_key, keys, self.prev, self.next, self.where, self.sizes, self.state)
