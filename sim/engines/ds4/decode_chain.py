"""A decode token's layer steps in one compiled call, misses included, while the ds4 process runs alone (issue 33).

`CudaDecode.layer` issues a layer step's jobs one at a time and waits on each. When the process runs alone
(Environment.runs_alone: nothing queued, nothing else woken) and the drive, host DRAM and the copy engine have
nothing else in flight, nothing can come between those jobs: each wait takes the environment's short cut, and a
miss's drive read and pread copy are lone jobs whose ends are known when they are issued. A token's steps are then
arithmetic on the servers' clocks, which `token_chain` does in one numba call with the machine's own arithmetic
(sim/machine/chains.py: fifo_job, lone_drive_read, lone_dram_copy, pinned_copy_seconds) and the page cache's own
kernel, in the same order as the step path: the same floats, the same page cache, the same rows
(tests/test_ds4_engine.py runs scenarios with it and without it).

Covered: the selected/shared overlap path without hits first, no pread pool, misses read by buffered preads
(DS4_CUDA_NO_DIRECT_IO) one after another and uploaded by the worker, no non-routed weights over PCIe. A step
whose prepare() frees or allocates its pool (the pre-504 slab's change of size class) is covered too: that
prepare() is made before the call (ExpertCaches.prepare_at_once, `Prepared`) and the call pays its waits where the
step would. Anything else goes through `CudaDecode.layer`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from sim.cache.kernels import page_cache_read
from sim.engines.ds4.loads import PARTS_PER_EXPERT
from sim.machine.chains import (D2D_PAGEABLE_RATE, D2D_RATE, DRAM_CAPACITY, DRIVE_LATENCY_S, DRIVE_RATE_QD1,
                                H2D_DRAM_TRAFFIC, H2D_OP_LATENCY_S, H2D_PAGEABLE_RATE, H2D_RATE,
                                MEMCPY_TRAFFIC_PER_BYTE, PREAD_CAP, fifo_job, lone_dram_copy, lone_drive_read,
                                pinned_copy_seconds)

# the servers of a step, as rows of the clocks: the main thread, the GPU stream, the load worker, the H2D engine
MAIN, GPU, WORKER, H2D = 0, 1, 2, 3
# the jobs' log kinds, by code
KINDS = ("graph encode", "attention + router", "device sync", "shared expert", "ids readback", "pread copy", "copy",
         "stream sync", "D2D memcpy", "D2D gather kernel", "slot map upload", "flush + join", "routed experts", "busy")
ENCODE, ATTENTION, DEVICE_SYNC, SHARED, IDS, PREAD_COPY, H2D_COPY, STREAM_SYNC, D2D_MEMCPY, D2D_GATHER, SLOT_MAP, \
    JOIN, ROUTED, CACHE_ALLOC = range(len(KINDS))  # (a cudaFree or cudaMalloc: Server.hold's own kind)
KIND_NAMES = np.array(KINDS, object)  # a log's kind codes to names in one indexing
HAND_NONE, HAND_MEMCPY, HAND_GATHER = 0, 1, 2  # the variant's hand-over of hits to the kernels
JOBS_PER_STEP = 13  # a bound on a server's jobs in one step (the first step's cudaFree and cudaMalloc included)
SELECTED_IDS_BYTES = 6 * 4  # the router's 6 int32 ids read back per layer (ds4-engine.md §1.6)


@njit(cache=True)
def _log(log, n_log, server, start, end, n_bytes, n_ops, kind):
    """A job in its server's log: log[server, (start, end, bytes, ops, kind), job], n_log[server] jobs so far."""
    n = n_log[server]
    log[server, 0, n], log[server, 1, n], log[server, 2, n], log[server, 3, n], log[server, 4, n] = \
        start, end, n_bytes, n_ops, kind
    n_log[server] = n + 1


@njit(cache=True)
def _wait(clocks, totals, log, n_log, server, now, not_before, seconds, n_bytes, n_ops, kind):
    """A job the process waits for (Server.hold, or Server.synchronize with not_before the stream's idle time):
    the clock where Environment.elapse puts it."""
    start, end = fifo_job(clocks, totals, server, not_before, seconds, n_bytes, n_ops)
    _log(log, n_log, server, start, end, n_bytes, n_ops, kind)
    return now + (end - now)


@njit(cache=True)
def _sync_on(clocks, stream, now):
    idle = clocks[stream, 0]
    return idle if idle > now else now


@njit(cache=True)
def token_chain(now, layers, counts, missed, missed_ends, prepare_s, prepare_ends, figures, expert_bytes, step,
                machine, hand_over, drop_pages,
                n_experts, page_sizes, page_prev, page_next, page_where, page_state, page_inactive_share,
                clocks, totals, drive, dram, log, n_log, drive_log, dram_log, steps):
    """The token's layer steps from `now`: layers [steps], counts [steps, (hits, inserts, evictions, direct)],
    missed the steps' missed experts in order, missed_ends [steps] where each step's end, prepare_s the seconds of
    the steps' cudaFree and cudaMalloc waits in order and prepare_ends [steps] where each step's end (Prepared: a
    pool freed and allocated before the step's lookup, done before this call); figures [layer,
    (other, shared, routed) s]; step the ds4 figures named below, machine the machine's
    (Machine.compiled_step_figures). Updates clocks and totals [MAIN, GPU, WORKER, H2D],
    drive [busy s, bytes, reads] and dram [traffic, busy s, bytes, copies, updated s, reservation
    start, end, rate]; writes each server's job log (log [server, (start, end, bytes, ops, kind), job], n_log
    [server] its jobs), the drive's and DRAM's logs (drive_log [read, (start, end, bytes, reads, timers fired)],
    dram_log [copy, (start, end, traffic)]) and steps [step, (start, end, drive bytes, page-cache misses)].
    Returns the clock and the drive's and DRAM's logs' lengths."""
    encode_s, sync_s, memcpy_call_s, kernel_launch_s = step[0], step[1], step[2], step[3]
    ids_bytes, ids_s = step[4], step[5]
    h2d_latency_s, h2d_bytes_per_s = machine[H2D_OP_LATENCY_S], machine[H2D_RATE]
    h2d_pageable_bytes_per_s, dma_traffic = machine[H2D_PAGEABLE_RATE], machine[H2D_DRAM_TRAFFIC]
    dram_capacity, pread_cap, memcpy_traffic = machine[DRAM_CAPACITY], machine[PREAD_CAP], \
        machine[MEMCPY_TRAFFIC_PER_BYTE]
    drive_latency_s, drive_rate_qd1 = machine[DRIVE_LATENCY_S], machine[DRIVE_RATE_QD1]
    d2d_bytes_per_s, d2d_pageable_bytes_per_s = machine[D2D_RATE], machine[D2D_PAGEABLE_RATE]
    then_ops = 1 if memcpy_call_s else 0
    n_drive = n_dram = 0
    first = 0
    for i in range(layers.shape[0]):
        layer = layers[i]
        steps[i, 0] = now
        now = _wait(clocks, totals, log, n_log, MAIN, now, now, encode_s, 0, 1, ENCODE)
        start, end = fifo_job(clocks, totals, GPU, now, figures[layer, 0], 0, 0)
        _log(log, n_log, GPU, start, end, 0, 0, ATTENTION)
        now = _wait(clocks, totals, log, n_log, MAIN, now, _sync_on(clocks, GPU, now), sync_s, 0, 1,
                           DEVICE_SYNC)
        start, end = fifo_job(clocks, totals, GPU, now, figures[layer, 1], 0, 0)
        _log(log, n_log, GPU, start, end, 0, 0, SHARED)
        now = _wait(clocks, totals, log, n_log, WORKER, now, now, ids_s, ids_bytes, 1, IDS)
        for j in range(prepare_ends[i - 1] if i else 0, prepare_ends[i]):
            now = _wait(clocks, totals, log, n_log, WORKER, now, now, prepare_s[j], 0, 0, CACHE_ALLOC)
        hits, loaded = counts[i, 0], counts[i, 1] + counts[i, 2]
        eb = expert_bytes[layer]
        fetch = missed[first: missed_ends[i]]
        first = missed_ends[i]
        n_miss = 0
        if fetch.shape[0]:  # Loads.load: the buffered preads, then the upload and the worker's stream syncs
            n_bytes = eb * fetch.shape[0]
            n_parts = PARTS_PER_EXPERT * fetch.shape[0]
            n_miss = fetch.shape[0] - page_cache_read(layer * n_experts, fetch, page_sizes, page_prev, page_next,
                                                      page_where, page_state, page_inactive_share, drop_pages)
            if n_miss:
                read_bytes = n_miss * eb
                end, timers = lone_drive_read(now, read_bytes, PARTS_PER_EXPERT * n_miss, drive_latency_s,
                                              drive_rate_qd1)
                drive[0] += end - now
                drive[1] += read_bytes
                drive[2] += PARTS_PER_EXPERT * n_miss
                drive_log[n_drive, 0], drive_log[n_drive, 1], drive_log[n_drive, 2] = now, end, read_bytes
                drive_log[n_drive, 3], drive_log[n_drive, 4] = PARTS_PER_EXPERT * n_miss, timers
                n_drive += 1
                now = end
            traffic = np.int64(memcpy_traffic) * n_bytes  # Machine.memcpy's DRAM job
            end, done = lone_dram_copy(now, traffic, pread_cap, dram_capacity)
            if not done:
                raise ValueError("a pread copy that the clock cannot finish")
            dram[0] += traffic
            dram[1] += end - now
            dram[2] += traffic
            dram[3] += 1
            dram[4] = end
            dram[5] = -1.0  # the reservations before it have ended (the worker synced on their copies): pruned
            dram_log[n_dram, 0], dram_log[n_dram, 1], dram_log[n_dram, 2] = now, end, traffic
            n_dram += 1
            # Server.record on the worker: the copy's end as the lane's, its time busy
            if end > clocks[WORKER, 0]:
                clocks[WORKER, 0] = end
            clocks[WORKER, 1] += end - now
            totals[WORKER, 0] += n_bytes
            totals[WORKER, 1] += 1
            _log(log, n_log, WORKER, now, end, n_bytes, 1, PREAD_COPY)
            now = end
            seconds = pinned_copy_seconds(n_bytes, n_parts, h2d_latency_s, h2d_bytes_per_s, h2d_pageable_bytes_per_s)
            start, end = fifo_job(clocks, totals, H2D, now, seconds, n_bytes, n_parts)
            _log(log, n_log, H2D, start, end, n_bytes, n_parts, H2D_COPY)
            if n_bytes and seconds > 0:  # SharedBandwidth.reserve_during
                rate = dma_traffic * n_bytes / seconds
                if end > start and rate > 0:
                    dram[0] += (end - start) * rate
                    dram[5], dram[6], dram[7] = start, end, rate
            now = _wait(clocks, totals, log, n_log, WORKER, now, _sync_on(clocks, H2D, now),
                               n_parts * sync_s, 0, n_parts, STREAM_SYNC)
        steps[i, 2] = n_miss * eb
        steps[i, 3] = n_miss
        handed = hits + loaded  # Loads.to_staging, then the slot map's upload
        if handed == 0 or hand_over == HAND_NONE:
            now = _wait(clocks, totals, log, n_log, WORKER, now, now, memcpy_call_s, 0, then_ops, SLOT_MAP)
        else:
            n_bytes = handed * eb
            copies = 1 if hand_over == HAND_GATHER else PARTS_PER_EXPERT * handed
            fixed = kernel_launch_s if hand_over == HAND_GATHER else copies * memcpy_call_s
            seconds = fixed + pinned_copy_seconds(n_bytes, 0, 0.0, d2d_bytes_per_s, d2d_pageable_bytes_per_s)
            start, end = fifo_job(clocks, totals, GPU, now, seconds, n_bytes, copies)
            _log(log, n_log, GPU, start, end, n_bytes, copies,
                         D2D_GATHER if hand_over == HAND_GATHER else D2D_MEMCPY)
            now = _wait(clocks, totals, log, n_log, WORKER, now, _sync_on(clocks, GPU, now), memcpy_call_s,
                               0, then_ops, SLOT_MAP)
        steps[i, 1] = now
        now = _wait(clocks, totals, log, n_log, MAIN, now, _sync_on(clocks, GPU, now), sync_s, 0, 1, JOIN)
        start, end = fifo_job(clocks, totals, GPU, now, figures[layer, 2], 0, 0)
        _log(log, n_log, GPU, start, end, 0, 0, ROUTED)
    return now, n_drive, n_dram


class Prepared(NamedTuple):
    """The prepare() calls of steps done at once, made before the call (ExpertCaches.prepare_at_once): the seconds
    of their cudaFree and cudaMalloc waits in order, where each step's end among them, and the VRAM in use at each
    step's end (its row's figure)."""

    waits: list
    ends: list
    vram_used: list

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.array(self.waits, np.float64), np.array(self.ends, np.int64)


NO_WAITS = np.zeros(0)  # (steps none of whose pools is freed or allocated)


class TokenChain:
    """`token_chain` for one run: whether a token can take it, and its results handed to the servers, the drive,
    host DRAM, the page cache, the environment and the step rows, as the step path leaves them."""

    def __init__(self, run):
        self.run = run
        m = run.m
        self.servers = (run.main, m.gpu, run.worker, m.h2d)
        hand_over = run.variant.hit_copy
        self.hand_over = HAND_NONE if hand_over == "none" else HAND_MEMCPY if hand_over == "memcpy" else HAND_GATHER
        # the step's own figures (as `token_chain` unpacks them), then the machine's for its lone jobs
        self.step = np.array([run.encode_layer_s, m.sync_s, m.memcpy_call_s, m.kernel_launch_s, SELECTED_IDS_BYTES,
                              m.sync_s + m.memcpy_call_s])
        self.machine = m.compiled_step_figures()
        self.figures = np.ascontiguousarray(run.decode_s, np.float64)
        self.expert_bytes = np.ascontiguousarray(run.layers.expert_bytes, np.int64)

    def applies(self) -> bool:
        """Whether a token can be done now: its process runs alone and the drive and host DRAM have no job in
        flight and no DMA reservation that has not ended (the run's own settings are checked by its caller)."""
        m = self.run.m
        return (m.env.runs_alone() and not m.ssd.jobs and not m.dram.jobs
                and all(end <= m.env.now for _, end, _ in m.dram.reservations))

    def run_steps(self, row: dict, layers: np.ndarray, counts: np.ndarray, missed: np.ndarray,
                  missed_ends: np.ndarray, prepared: "Prepared | None") -> None:
        run = self.run
        m, servers = run.m, self.servers
        env, page_cache, drive, dram = m.env, m.page_cache, m.ssd, m.dram
        n = len(layers)
        clocks = np.array([(s.free_at[0], s.busy_s) for s in servers])
        totals = np.array([(s.bytes_moved, s.ops) for s in servers], np.int64)
        drive_state = np.array([drive.busy_s, 0.0, 0.0])
        dram_state = np.array([dram.traffic, dram.busy_s, 0.0, 0.0, dram.updated_s, -1.0, 0.0, 0.0])
        log = np.empty((len(servers), 5, JOBS_PER_STEP * n))
        n_log = np.zeros(len(servers), np.int64)
        drive_log = np.empty((n, 5))
        dram_log = np.empty((n, 3))
        steps = np.empty((n, 4))
        now, n_drive, n_dram = token_chain(
            env.now, layers, counts, missed, missed_ends,
            *((NO_WAITS, np.zeros(n, np.int64)) if prepared is None else prepared.arrays()),
            self.figures, self.expert_bytes, self.step, self.machine,
            self.hand_over, not run.knobs.keep_pages, run.layers.n_experts, page_cache.sizes, page_cache.prev,
            page_cache.next, page_cache.where, page_cache.state, page_cache.inactive_share, clocks, totals,
            drive_state, dram_state, log, n_log, drive_log, dram_log, steps)
        for server, (free, busy), (moved, ops) in zip(servers, clocks.tolist(), totals.tolist()):
            server.free_at[0], server.busy_s, server.bytes_moved, server.ops = free, busy, moved, ops
        self._logs(log, n_log.tolist())
        timers = 0
        for start, end, n_bytes, reads, fired in drive_log[:n_drive].tolist():
            drive.log.append((start, end, int(n_bytes), int(reads), "read"))
            drive.version += 2 + int(fired)
            timers += int(fired) + (1 if fired else 0)  # each timer, and the read's event fired by the last
            drive.updated_s = end
        drive.busy_s, drive.bytes_moved, drive.ops = drive_state[0], drive.bytes_moved + int(drive_state[1]), \
            drive.ops + int(drive_state[2])
        dram.traffic, dram.busy_s = dram_state[0], dram_state[1]
        if n_dram:
            dram.bytes_moved += int(dram_state[2])
            dram.ops += n_dram
            dram.version += 2 * n_dram
            dram.due_s = float("inf")
            dram.updated_s = dram_state[4]
            dram.reservations = [] if dram_state[5] < 0 else [tuple(dram_state[5:8].tolist())]
            dram.log.extend((start, end, int(traffic), 1, "pread copy") for start, end, traffic in
                            dram_log[:n_dram].tolist())
        env.events_scheduled += timers
        env.move_clock_to(now)
        self._record(row, layers, counts, missed_ends, steps, None if prepared is None else prepared.vram_used)

    def _logs(self, log: np.ndarray, n_log: list) -> None:
        """The job logs handed to each server's own: every job where it keeps them all, else its first job."""
        for code, (server, n) in enumerate(zip(self.servers, n_log)):
            if not n:
                continue
            if server.whole_log:
                start, end = log[code, :2, :n].tolist()
                n_bytes, n_ops, kinds = log[code, 2:, :n].astype(np.int64)
                server.log.extend(start, end, n_bytes.tolist(), n_ops.tolist(), KIND_NAMES[kinds].tolist())
            elif not server.log.start:
                start, end, n_bytes, n_ops, kind = log[code, :, 0].tolist()
                server.log.append(start, end, int(n_bytes), int(n_ops), KINDS[int(kind)])

    def _record(self, row: dict, layers: np.ndarray, counts: np.ndarray, missed_ends: np.ndarray,
                steps: np.ndarray, vram_used: list | None) -> None:
        """The steps' rows and copies (Loads.record_steps), and the page cache's reads counted."""
        loads, page_cache = self.run.loads, self.run.m.page_cache
        page_misses = int(steps[:, 3].sum())
        page_hits = int(missed_ends[-1]) - page_misses  # (every step with a miss reads its misses' pages)
        loads.page_cache_reads["hits"] += page_hits
        loads.page_cache_reads["misses"] += page_misses
        page_cache.hits += page_hits
        page_cache.misses += page_misses
        hits, inserts, evictions, direct = counts.T.tolist()
        loads.record_steps(row, layers.tolist(), int(counts[0].sum()), hits, inserts, evictions,
                           direct, steps[:, 2].astype(np.int64).tolist(), steps[:, 0].tolist(), steps[:, 1].tolist(),
                           vram_used)
