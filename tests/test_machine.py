"""The simulated machine (sim/machine): known answers for each resource, an OrderedDict oracle for the page
cache, and the busy intervals of whole runs against their summaries."""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np
import pandas as pd
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.simulate import run_scenario
from sim.results import write_results
from sim.machine import Machine, Memory, PageCache, Server, SharedBandwidth, Ssd
from sim.machine.environment import Environment
from sim.machine.storage import INACTIVE_SHARE_BY_OS
from sim.hardware import load_hardware
from sim.scenario import load_scenario
from sim.units import GIB, MIB


def run(env: simpy.Environment, *procs) -> None:
    for p in procs:
        env.process(p)
    env.run()


# ------------------------------------------------------------------------------------------ FIFO servers


def test_server_serves_first_come_first_served():
    env = simpy.Environment()
    s = Server(env, "link", bytes_per_s=100.0, op_latency_s=0.5)
    ends = {}

    def job(name, at, seconds):
        yield env.timeout(at)
        yield s.hold(seconds)
        ends[name] = env.now

    run(env, job("a", 1.0, 2.0), job("b", 2.0, 1.0), job("c", 10.0, 0.0))
    assert ends == {"a": 3.0, "b": 4.0, "c": 10.0}  # b arrived at 2 and waited for a
    assert s.intervals() == [(1.0, 3.0, 0, 0, "busy"), (3.0, 4.0, 0, 0, "busy"), (10.0, 10.0, 0, 0, "busy")]
    assert s.cost_s(100, 2) == 2.0  # 2 ops x 0.5 s + 100 B at 100 B/s


def test_lanes_serve_in_parallel():
    env = simpy.Environment()
    pool = Server(env, "threads", lanes=2)
    ends = []

    def job():
        yield pool.hold(1.0)
        ends.append(env.now)

    run(env, *(job() for _ in range(3)))
    assert sorted(ends) == [1.0, 1.0, 2.0]


def test_drained_waits_for_queued_work_without_a_job():
    env = simpy.Environment()
    s = Server(env, "gpu")
    seen = []

    def proc():
        s.hold(3.0)  # enqueued, not waited for (a kernel launch)
        yield s.drained()
        seen.append(env.now)

    run(env, proc())
    assert seen == [3.0] and len(s.intervals()) == 1


@settings(max_examples=200, deadline=None)
@given(lanes=st.integers(1, 4),
       jobs=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 7)), min_size=1, max_size=30))
def test_server_starts_jobs_when_a_fifo_simpy_resource_would(lanes, jobs):
    # The oracle: simpy.Resource with `lanes` units, requests granted first come, first served, on the same stream
    # of arrivals (gaps and service times in whole seconds, so every sum is exact).
    def starts(serve) -> list[float]:
        env = simpy.Environment()
        job = serve(env)
        started = [0.0] * len(jobs)

        def arrivals():
            for i, (gap, seconds) in enumerate(jobs):
                yield env.timeout(gap)
                env.process(job(i, seconds, started))

        run(env, arrivals())
        return started

    def resource(env):
        units = simpy.Resource(env, capacity=lanes)

        def job(i, seconds, started):
            with units.request() as granted:
                yield granted
                started[i] = env.now
                yield env.timeout(seconds)
        return job

    def server(env):
        fifo = Server(env, "fifo", lanes=lanes)

        def job(i, seconds, started):
            done = fifo.hold(seconds)
            started[i] = fifo.log[-1][0]
            yield done
        return job

    assert starts(server) == starts(resource)


program = st.lists(st.tuples(st.sampled_from(["hold", "sync", "drained", "book", "timeout", "gate", "spawn",
                                              "later", "dram", "read", "dma"]), st.integers(0, 2), st.integers(0, 6)),
                   min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(programs=st.lists(program, min_size=1, max_size=4))
def test_the_environments_short_cut_moves_nothing(programs):
    """sim.machine.environment.Environment resumes a process without the event queue where nothing can happen in
    between: processes issuing jobs to shared servers, waiting on a gate several of them wait on (an event with
    several callbacks), spawning others and yielding an event later, see the same times in the same order and
    leave the same server logs as on SimPy's own environment. Times in quarter seconds. Lone jobs of the shared
    DRAM and of the drive take the short cut too (their completion done where its timer would fire), among copies
    and DMA reservations that share them."""
    def trace(env):
        servers = [Server(env, "stream"), Server(env, "thread", host_thread=True), Server(env, "pool", lanes=2)]
        dram = SharedBandwidth(env, "dram", 3.0)
        copy_engine = Server(env, "h2d", bytes_per_s=0.7, dram=dram)
        ssd = Ssd(env, "ssd", [(1, 2.0), (4, 5.0)], 1.0, 0.1, 4.0)
        gate = env.timeout(1.25)
        seen = []

        def proc(pid, steps):
            for n, (op, which, quarters) in enumerate(steps):
                server, seconds = servers[which], quarters / 4
                if op == "hold":
                    yield server.hold(seconds)
                elif op == "sync":
                    yield servers[0].synchronize(server, seconds)
                elif op == "drained":
                    yield server.drained()
                elif op == "book":
                    server.book(seconds)
                elif op == "timeout":
                    yield env.timeout(seconds)
                elif op == "gate":
                    yield gate
                elif op == "spawn":
                    env.process(proc(f"{pid}.{n}", [("hold", which, quarters)]))
                elif op == "later":  # an event yielded after other work
                    done = server.hold(seconds, later=True)
                    servers[0].book(0.25)
                    yield done
                elif op == "dram":  # a CPU copy of `quarters` bytes (twice the traffic), one thread's cap
                    yield dram.transfer(2 * quarters + 0.1, 1.3 + which, at_once=True)
                elif op == "read":
                    yield ssd.read(quarters + 0.3, which + 1, which + 1, at_once=True)
                else:  # a DMA booked on the copy engine: it reserves DRAM while it runs
                    copy_engine.book_copy(quarters + 0.2)
                seen.append((pid, n, env.now))

        for pid, steps in enumerate(programs):
            env.process(proc(pid, steps))
        env.run()
        return seen, [s.intervals() for s in (*servers, dram, copy_engine, ssd)], dram.traffic, ssd.busy_s

    assert trace(Environment()) == trace(simpy.Environment())


def test_the_short_cut_saves_the_events_of_a_lone_process():
    env = Environment()
    thread = Server(env, "thread", host_thread=True)

    def proc():
        for _ in range(10):
            yield thread.hold(1.0)

    run(env, proc())
    assert env.now == 10.0 and env.events_scheduled == 2  # the process's start and its end, no timeout


def test_the_short_cut_saves_the_events_of_lone_dram_jobs_and_reads():
    env = Environment()
    dram = SharedBandwidth(env, "dram", 4.0)
    ssd = Ssd(env, "ssd", [(1, 2.0)], 1.0, 0.0, 4.0)

    def proc():
        for _ in range(5):
            yield dram.transfer(2.0, 1.0, at_once=True)  # 2 s at its cap
            yield ssd.read(4.0, 2, at_once=True)  # 2 s at the drive's rate
    run(env, proc())
    assert env.now == 20.0 and env.events_scheduled == 2  # no completion timer, no job event
    assert len(dram.intervals()) == 5 and dram.busy_s == 10.0 and ssd.busy_s == 10.0


def test_synchronize_waits_for_the_queue_then_pays_the_call():
    env = simpy.Environment()
    stream, thread = Server(env, "stream"), Server(env, "thread", host_thread=True)
    seen = []

    def proc():
        stream.book(2.0)  # a kernel enqueued, not waited for
        stream.book(1.0)
        yield stream.synchronize(thread, 0.5)
        seen.append(env.now)

    run(env, proc())
    assert seen == [3.5] and thread.intervals() == [(3.0, 3.5, 0, 1, "sync")]


def test_a_copy_engine_prices_pinned_and_pageable_bytes_and_fixed_costs():
    env = simpy.Environment()
    link = Server(env, "h2d", bytes_per_s=100.0, op_latency_s=0.5, pageable_bytes_per_s=50.0)
    assert link.cost_s(300, 2, pageable_bytes=100) == pytest.approx(2 * 0.5 + 200 / 100 + 100 / 50)
    assert link.cost_s(300, 4, fixed_costs=1) == pytest.approx(0.5 + 3.0)  # copies queued back to back
    assert link.cost_s(300, 4, fixed_costs=0) == pytest.approx(3.0)


def machine(name: str = "rtx-4090") -> tuple[simpy.Environment, Machine]:
    env = simpy.Environment()
    return env, Machine(env, load_hardware(name), np.full(4, MIB, np.int64))


def test_two_copies_on_one_link_slow_each_other():
    # a refill issued first and a GPU read over PCIe right after it (a decode's PCIe share, say): the read
    # ends later than it would alone by the refill's service time, since both cross the one link
    def read_ends(with_refill: bool) -> float:
        env, m = machine()
        done = {}

        def refill():
            yield m.h2d.copy(64 * MIB, 32, "refill", pageable_bytes=16 * MIB)
            done["refill"] = env.now

        def share():
            yield from m.host_read(8 * MIB, "PCIe share")
            done["share"] = env.now

        run(env, *([refill()] if with_refill else []), share())
        if with_refill:
            assert done["refill"] < done["share"]
        return done["share"]

    rates = load_hardware("rtx-4090").copy_rates()
    refill_s = 32 * rates["latency_s"] + 48 * MIB / rates["h2d_pinned"] + 16 * MIB / rates["h2d_pageable"]
    alone = read_ends(False)
    assert alone == pytest.approx(8 * MIB / rates["h2d_pinned"])
    assert read_ends(True) == pytest.approx(alone + refill_s)


def test_two_cpu_copies_share_host_dram():
    # enough threads that one copy alone is DRAM-bound: two at once each get half, so both take twice as long
    env, m = machine()
    dram = m.profile.host.dram_bandwidth_gbps.value * 1e9
    threads = int(4 * dram / (m.profile.host.memcpy_gbps.value * 1e9)) + 1
    pool = m.threads("copiers", 2)
    done = []

    def copier():
        yield m.memcpy(pool, GIB, threads)
        done.append(env.now)

    run(env, copier())
    alone = 2 * GIB / dram  # a copy reads and writes each byte
    assert done == [pytest.approx(alone)]
    env, m = machine()
    pool = m.threads("copiers", 2)
    done = []
    run(env, copier(), copier())
    assert done == [pytest.approx(2 * alone)] * 2


def test_a_dma_slows_a_cpu_expert_kernel_sharing_dram():
    # a CPU pool's kernel that could take all of DRAM, and a pinned H2D copy that reserves its link rate of DRAM
    # while it runs: the kernel gets what the copy leaves, then everything
    env, m = machine()
    dram = m.profile.host.dram_bandwidth_gbps.value * 1e9
    threads = int(2 * dram / m.expert_kernel_bytes_per_s) + 1
    m.physical_cores = threads  # a host with that many cores: only DRAM bounds the kernel
    pool = m.threads("pool")
    n_bytes = 4 * GIB
    done = {}

    def kernel():
        yield m.cpu_kernel(pool, n_bytes, threads)
        done["kernel"] = env.now

    def dma():
        yield m.h2d.copy(GIB, 1)
        done["dma"] = env.now

    run(env, kernel())
    assert done["kernel"] == pytest.approx(n_bytes / dram)
    env, m = machine()
    m.physical_cores = threads
    pool = m.threads("pool")
    done = {}
    run(env, kernel(), dma())
    # the copy ends first; DRAM is full throughout, so the kernel ends when both jobs' bytes have crossed it
    assert done["dma"] < done["kernel"] == pytest.approx((n_bytes + GIB) / dram)
    assert pool.intervals()[0][:2] == (0.0, pytest.approx(done["kernel"]))


def test_threads_beyond_the_physical_cores_add_no_kernel_throughput():
    """A CPU kernel's rate is the profile's per-core rate times the threads, at most the physical cores (SMT
    threads share a core's vector units); far below DRAM's rate, so the cores alone bound it."""
    def kernel_seconds(threads: int) -> float:
        env, m = machine()
        pool, done = m.threads("pool"), {}

        def kernel():
            yield m.cpu_kernel(pool, GIB, threads)
            done["end"] = env.now

        run(env, kernel())
        return done["end"]

    env, m = machine()
    cores, rate = m.physical_cores, m.expert_kernel_bytes_per_s
    assert cores * rate < m.profile.host.dram_bandwidth_gbps.value * 1e9
    assert kernel_seconds(cores) == pytest.approx(GIB / (cores * rate))
    assert kernel_seconds(2 * cores) == pytest.approx(kernel_seconds(cores))


# ------------------------------------------------------------------------------------------ the SSD

MiB = float(MIB)


def drive(table=((1, 2e9), (8, 8e9)), ref=MiB, latency=50e-6) -> tuple[simpy.Environment, Ssd]:
    env = simpy.Environment()
    return env, Ssd(env, "ssd", list(table), ref, latency, 4 * MiB)


def test_one_reader_at_queue_depth_1_gets_the_table_bandwidth():
    env, ssd = drive()
    done = []

    def reader():
        yield ssd.read(100 * MiB, 100, 1)
        done.append(env.now)

    run(env, reader())
    assert done[0] == pytest.approx(100 * MiB / 2e9, rel=1e-9)  # 100 reads of the table's size at QD1


def test_reads_in_flight_share_the_drive_and_a_deeper_queue_helps():
    env, ssd = drive()
    done = {}

    def reader(name, n):
        yield ssd.read(n * MiB, n, 1)
        done[name] = env.now

    run(env, reader("a", 100), reader("b", 100))
    alone = 100 * MiB / 2e9
    # two QD1 readers: QD2 on the drive, faster than one after the other, slower than two drives
    assert done["a"] == pytest.approx(done["b"]) and alone < done["a"] < 2 * alone
    env, ssd = drive()
    t = {}

    def deep():
        yield ssd.read(800 * MiB, 800, 8)
        t["deep"] = env.now

    run(env, deep())
    assert t["deep"] == pytest.approx(800 * MiB / 8e9, rel=1e-9)  # QD8 reaches the table's 8 GB/s


def test_small_reads_are_latency_bound():
    env, ssd = drive()
    t = {}

    def reader():
        yield ssd.read(1000 * 4096, 1000, 1)
        t["end"] = env.now

    run(env, reader())
    assert t["end"] > 1000 * 50e-6  # 1000 reads can not beat 1000 latencies at QD1


# ------------------------------------------------------------------------------------------ DRAM


def test_copies_share_dram_and_dma_reservations_slow_them():
    env = simpy.Environment()
    dram = SharedBandwidth(env, "dram", 60.0)
    t = {}

    def copy(name, traffic, cap):
        yield dram.transfer(traffic, cap)
        t[name] = env.now

    run(env, copy("a", 60.0, 100.0), copy("b", 60.0, 100.0))
    assert t == {"a": pytest.approx(2.0), "b": pytest.approx(2.0)}  # 30 each
    env = simpy.Environment()
    dram = SharedBandwidth(env, "dram", 60.0)
    t = {}

    def capped():
        yield dram.transfer(40.0, 20.0)  # one thread: at most 20
        t["capped"] = env.now

    def fast():
        yield dram.transfer(80.0, 100.0)  # gets the other 40
        t["fast"] = env.now

    run(env, capped(), fast())
    assert t["capped"] == pytest.approx(2.0) and t["fast"] == pytest.approx(2.0)
    env = simpy.Environment()
    dram = SharedBandwidth(env, "dram", 60.0)
    dram.reserve_during(0.0, 1.0, 30.0)  # a DMA takes 30 for the first second
    t = {}

    def alone():
        yield dram.transfer(60.0, 100.0)
        t["end"] = env.now

    run(env, alone())
    assert t["end"] == pytest.approx(1.5)  # 30 in the first second, 60/s after


# ------------------------------------------------------------------------------------------ page cache


def test_page_cache_evicts_least_recent_bytes():
    cache = PageCache(np.array([4, 4, 8, 2]), 10)
    assert cache.access(np.array([0, 1])).tolist() == [False, False]
    assert cache.access(np.array([0])).tolist() == [True]
    assert cache.access(np.array([2])).tolist() == [False]  # 8 bytes: 1 (older) and then 0 go
    assert cache.contains(np.array([0, 1, 2])).tolist() == [False, False, True]
    cache.set_capacity(5)
    assert cache.used_bytes == 0  # the 8-byte extent no longer fits
    assert cache.access(np.array([3, 3])).tolist() == [False, True]
    cache.drop(np.array([3]))
    assert cache.used_bytes == 0


def test_page_cache_takes_more_extents_while_empty():
    cache = PageCache(np.array([4, 4]), 10)
    keys = cache.add_extents(np.array([3, 5]))
    assert keys.tolist() == [2, 3]
    assert cache.access(np.array([3, 0, 2])).tolist() == [False, False, False]  # 5 + 4 bytes, then 3: 5 goes
    assert cache.contains(np.array([0, 2, 3])).tolist() == [True, True, False]
    with pytest.raises(ValueError):
        cache.add_extents(np.array([1]))


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=12), capacity=st.integers(0, 40),
       accesses=st.lists(st.integers(0, 11), max_size=80))
def test_page_cache_equals_an_ordered_dict_lru_of_bytes(sizes, capacity, accesses):
    keys = [a % len(sizes) for a in accesses]
    cache = PageCache(np.array(sizes), capacity)
    got = cache.access(np.array(keys, np.int64)).tolist() if keys else []
    lru: OrderedDict[int, int] = OrderedDict()
    want = []
    for k in keys:
        if k in lru:
            want.append(True)
            lru.move_to_end(k)
            continue
        want.append(False)
        if sizes[k] > capacity:
            continue
        while sum(lru.values()) + sizes[k] > capacity:
            lru.popitem(last=False)
        lru[k] = sizes[k]
    assert got == want
    assert cache.used_bytes == sum(lru.values())


class TwoListOracle:
    """An inactive and an active OrderedDict (oldest first), written from the rule in xnu's vm_pageout.c:
    a second reference on the inactive list reactivates the page, eviction takes the inactive list's oldest,
    and the active list's oldest are deactivated while the inactive list holds less than its share."""

    def __init__(self, sizes: list[int], capacity: int, share: float):
        self.sizes, self.capacity, self.share = sizes, capacity, share
        self.inactive: OrderedDict[int, int] = OrderedDict()
        self.active: OrderedDict[int, int] = OrderedDict()

    def used(self) -> int:
        return sum(self.inactive.values()) + sum(self.active.values())

    def _balance(self) -> None:
        while self.active and sum(self.inactive.values()) < self.share * self.used():
            key, size = self.active.popitem(last=False)
            self.inactive[key] = size

    def access(self, key: int) -> bool:
        if key in self.active:
            self.active.move_to_end(key)
            return True
        if key in self.inactive:
            self.active[key] = self.inactive.pop(key)
            self._balance()
            return True
        if self.sizes[key] <= self.capacity:
            while self.used() + self.sizes[key] > self.capacity:
                (self.inactive or self.active).popitem(last=False)
            self.inactive[key] = self.sizes[key]
            self._balance()
        return False

    def shrink(self, capacity: int) -> None:
        self.capacity = capacity
        while self.used() > capacity:
            (self.inactive or self.active).popitem(last=False)
        self._balance()


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=12), capacity=st.integers(0, 40),
       share=st.sampled_from([0.25, 0.5, 0.75]), accesses=st.lists(st.integers(0, 11), max_size=80))
def test_two_list_page_cache_equals_an_ordered_dict_oracle(sizes, capacity, share, accesses):
    keys = [a % len(sizes) for a in accesses]
    cache = PageCache(np.array(sizes), capacity, share)
    got = cache.access(np.array(keys, np.int64)).tolist() if keys else []
    oracle = TwoListOracle(sizes, capacity, share)
    assert got == [oracle.access(k) for k in keys]
    assert cache.used_bytes == oracle.used()
    cache.set_capacity(capacity // 2)
    oracle.shrink(capacity // 2)
    assert cache.used_bytes == oracle.used()
    held = sorted([*oracle.inactive, *oracle.active])
    assert np.flatnonzero(cache.contains(np.arange(len(sizes)))).tolist() == held


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=12), capacity=st.integers(0, 40),
       share=st.sampled_from([0.25, 0.5, 1.0]), before=st.lists(st.integers(0, 11), max_size=30),
       first=st.integers(0, 11), offsets=st.lists(st.integers(0, 11), max_size=6), drop=st.booleans())
def test_a_read_of_one_layers_extents_counts_its_hits_and_drops_them_at_once_if_asked(sizes, capacity, share, before,
                                                                                     first, offsets, drop):
    # PageCache.read: one layer's experts (first key + offsets, distinct) read as the oracle reads them one by
    # one, and with `drop` dropped again (posix_fadvise DONTNEED: the extents leave their lists, nothing else moves)
    n = len(sizes)
    first %= n
    offsets = list(dict.fromkeys(o % (n - first) for o in offsets))
    cache = PageCache(np.array(sizes), capacity, share)
    oracle = TwoListOracle(sizes, capacity, share)
    for k in before:
        cache.access(np.array([k % n]))
        oracle.access(k % n)
    hits = cache.read(first, np.array(offsets, np.uint16), drop)
    assert hits == sum(oracle.access(first + o) for o in offsets)
    if drop:
        for o in offsets:
            oracle.inactive.pop(first + o, None)
            oracle.active.pop(first + o, None)
    assert cache.used_bytes == oracle.used()
    # the lists' order too: every extent read once more, in key order, hits alike
    assert cache.access(np.arange(n)).tolist() == [oracle.access(k) for k in range(n)]


def test_a_scan_evicts_what_was_read_twice_from_one_list_and_not_from_two():
    # 4 extents of 1 byte read twice, a scan of 6 others read once, then the 4 again, through 8 bytes.
    # One LRU list: the scan pushes the 4 out (0 hits). Two lists, half inactive (traced by hand): the second
    # reads make 0-3 active, the balance sends 0 and 1 back to the inactive list, the scan evicts those two,
    # and 2 and 3 stay active.
    keys = np.array([0, 1, 2, 3] * 2 + [4, 5, 6, 7, 8, 9] + [0, 1, 2, 3])
    lru = PageCache(np.ones(10, np.int64), 8)
    assert lru.access(keys)[-4:].tolist() == [False, False, False, False]
    two = PageCache(np.ones(10, np.int64), 8, INACTIVE_SHARE_BY_OS["macos"])
    assert two.access(keys)[-4:].tolist() == [False, False, True, True]


def test_unified_memory_shares_one_pool_with_the_page_cache():
    discrete = load_hardware("rtx-pro-6000-96gb")
    cache = PageCache(np.full(10, GIB), 0)
    mem = Memory(discrete, cache)
    before = cache.capacity_bytes
    mem.set("vram", "expert cache", 40 * GIB)
    assert cache.capacity_bytes == before  # device memory is not host RAM
    mem.set("ram", "pinned staging", 2 * GIB)
    assert cache.capacity_bytes == before - 2 * GIB


# ------------------------------------------------------------------------------------------ whole runs


@pytest.mark.parametrize("scenario", ["scenarios/ds4-504-per-class.toml", "scenarios/strata-658-borrow.toml"])
def test_run_intervals_match_summary(scenario, tmp_path):
    files = write_results(run_scenario(load_scenario(scenario)), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    intervals = pd.read_parquet(files["links"])
    assert set(intervals["link"]) <= {link["link"] for link in summary["links"]}
    for link in summary["links"]:
        mine = intervals[intervals["link"] == link["link"]].sort_values(["start_s", "end_s"], kind="stable")
        assert (mine["end_s"] >= mine["start_s"]).all()
        assert (mine["start_s"].to_numpy()[1:] >= mine["end_s"].to_numpy()[:-1] - 1e-12).all()  # no overlap
        assert (mine["end_s"] - mine["start_s"]).sum() == pytest.approx(link["busy_s"], rel=1e-9, abs=1e-12)
        assert mine["bytes"].sum() == link["bytes"] and mine["ops"].sum() == link["ops"]
