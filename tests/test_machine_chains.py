"""sim/machine/chains.py: a chain of FIFO jobs done in one call against the same jobs issued one at a time by a
SimPy process (Server.book / hold / synchronize, each wait yielded): the same clocks, totals and logs, exactly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.machine import Server, SharedBandwidth
from sim.machine.chains import BOOK, SYNC, WAIT, Job, JobChain
from sim.machine.environment import Environment

N_SERVERS = 3
job_specs = st.lists(st.tuples(st.integers(0, N_SERVERS - 1), st.sampled_from([BOOK, WAIT, SYNC]),
                               st.integers(0, N_SERVERS - 1), st.integers(0, 3)), min_size=1, max_size=8)


def _machine(whole_log: bool):
    env = Environment()
    return env, [Server(env, f"server {i}", whole_log=whole_log) for i in range(N_SERVERS)]


def _jobs(specs, servers) -> list[Job]:
    return [Job(servers[s], wait, n_ops, f"job {j}", servers[on] if wait == SYNC else None)
            for j, (s, wait, on, n_ops) in enumerate(specs)]


def _one_at_a_time(env, jobs, seconds, n_bytes, mark, marks, starts, lead_s):
    """The oracle: each job issued as an engine issues it, each wait yielded."""
    yield env.timeout(lead_s)
    for step in range(len(seconds)):
        starts.append(env.now)
        for j, job in enumerate(jobs):
            s, b = float(seconds[step, j]), int(n_bytes[step, j])
            if job.wait == BOOK:
                job.server.book(s, b, job.n_ops, job.kind)
            elif job.wait == WAIT:
                yield job.server.hold(s, b, job.n_ops, job.kind)
            else:
                yield job.sync_on.synchronize(job.server, s, job.n_ops, job.kind)
            if j == mark:
                marks.append(env.now)


def _chained(env, chain, seconds, n_bytes, out, lead_s):
    yield env.timeout(lead_s)
    assert env.runs_alone()
    out.extend(chain.run(seconds, n_bytes))


@settings(max_examples=60, deadline=None)
@given(specs=job_specs, n_steps=st.integers(1, 6), whole_log=st.booleans(), data=st.data())
def test_a_chain_equals_its_jobs_issued_one_at_a_time(specs, n_steps, whole_log, data):
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    # a few round times and fine ones mixed: ties between a sync's wait and a server's free time happen, and sums
    # of decimal fractions round differently in different orders
    shape = (n_steps, len(specs))
    seconds = np.where(rng.random(shape) < 0.5, rng.choice([0.0, 0.1, 0.25, 0.3, 0.7], shape),
                       rng.random(shape) * 1e-3)
    n_bytes = rng.integers(0, 1000, (n_steps, len(specs)))
    n_bytes[:, [j for j, spec in enumerate(specs) if spec[1] == SYNC]] = 0  # a sync moves no bytes
    mark = data.draw(st.integers(0, len(specs) - 1))
    lead_s = 0.1  # earlier work on the servers: their queues are not empty when the chain starts

    env_a, servers_a = _machine(whole_log)
    servers_a[0].book(0.5, 3, 1, "earlier")
    starts, marks = [], []
    env_a.process(_one_at_a_time(env_a, _jobs(specs, servers_a), seconds, n_bytes, mark, marks, starts, lead_s))
    env_a.run()

    env_b, servers_b = _machine(whole_log)
    servers_b[0].book(0.5, 3, 1, "earlier")
    chain = JobChain(env_b, _jobs(specs, servers_b), mark)
    out = []
    env_b.process(_chained(env_b, chain, seconds, n_bytes, out, lead_s))
    env_b.run()

    assert out[0].tolist() == starts and out[1].tolist() == marks
    assert env_b.now == env_a.now
    for a, b in zip(servers_a, servers_b):
        assert (b.free_at, b.busy_s, b.bytes_moved, b.ops) == (a.free_at, a.busy_s, a.bytes_moved, a.ops)
        assert b.intervals() == a.intervals()
        assert all(type(x) is type(y) for row_a, row_b in zip(a.intervals(), b.intervals())
                   for x, y in zip(row_a, row_b))  # Python floats, ints and strs, as a job logs them


def test_a_chain_takes_single_lane_servers_that_share_no_bandwidth():
    env = Environment()
    pool = Server(env, "pool", lanes=2)
    dram = SharedBandwidth(env, "dram", 1e9)
    copy_engine = Server(env, "h2d", bytes_per_s=1e9, dram=dram)
    with pytest.raises(ValueError, match="one lane"):
        JobChain(env, [Job(pool)], 0)
    with pytest.raises(ValueError, match="share no bandwidth"):
        JobChain(env, [Job(copy_engine)], 0)


def test_only_a_sync_job_names_the_server_it_waits_on():
    env = Environment()
    thread, stream = Server(env, "thread"), Server(env, "stream")
    with pytest.raises(ValueError, match="sync_on"):
        JobChain(env, [Job(thread, wait=SYNC)], 0)
    with pytest.raises(ValueError, match="sync_on"):
        JobChain(env, [Job(thread, wait=WAIT, sync_on=stream)], 0)
    JobChain(env, [Job(thread, wait=SYNC, sync_on=stream)], 0)


def test_the_clock_never_goes_back():
    env = Environment()
    env.move_clock_to(2.0)
    assert env.now == 2.0
    with pytest.raises(ValueError, match="cannot go back"):
        env.move_clock_to(1.0)


def test_a_process_woken_with_another_does_not_run_alone():
    env = Environment()
    seen = []

    def waiter(event):
        yield event
        seen.append(env.runs_alone())

    shared = env.timeout(1.0)
    env.process(waiter(shared))
    env.process(waiter(shared))
    env.run()
    assert seen == [False, False]


# --- the machine's arithmetic for compiled engine steps: the same floats as the resources' own methods ---------

def _alone_from(start_s: float, body):
    """Run `body(env)` (a process generator function) as a process that runs alone, its clock starting at start_s;
    returns the environment after it."""
    env = Environment()

    def process():
        yield env.timeout(start_s)
        yield from body(env)

    env.process(process())
    env.run()
    return env


@settings(max_examples=150, deadline=None)
@given(start=st.sampled_from([0.0, 1.5, 3.7e3, 2.9e6, 4.1e8]), parts=st.integers(1, 30),
       part_bytes=st.integers(4096, 64 << 20), latency_us=st.floats(10, 200), gbps=st.floats(0.5, 14))
def test_a_lone_drive_read_ends_where_the_drive_ends_it(start, parts, part_bytes, latency_us, gbps):
    # Ssd.read at depth 1, yielded at once by a process alone; from late clocks the progress check may find a
    # fraction of a request left, which the completion timer's path finishes (the next test)
    _lone_drive_read_against_the_drive(start, parts, part_bytes, latency_us, gbps)


def test_a_drive_read_that_the_short_cut_leaves_unfinished_ends_where_the_timer_ends_it():
    # at 3,700 s an ulp is 4.5e-13 s: one 4 KiB read at 1 GB/s leaves ~1e-8 of its request, which the timer serves
    # as a fraction of a request in flight (its latency whole)
    assert _lone_drive_read_against_the_drive(3700.0, 1, 4096, 10.0, 1.0) >= 1


def _lone_drive_read_against_the_drive(start, parts, part_bytes, latency_us, gbps) -> int:
    """lone_drive_read against Ssd.read on the environment; the timers that fired."""
    from sim.machine import Ssd
    from sim.machine.chains import lone_drive_read

    ends = []

    def read(env):
        drive = Ssd(env, "SSD", [(1, gbps * 1e9), (32, 2 * gbps * 1e9)], 1 << 20, latency_us * 1e-6, 1 << 20)
        env.drive = drive
        yield drive.read(parts * part_bytes, parts, 1, at_once=True)
        ends.append(env.now)

    env = _alone_from(start, read)
    before = 3  # the process started, its first timeout, its end
    end, timers = lone_drive_read(start, parts * part_bytes, parts, latency_us * 1e-6, env.drive.rate_at(1))
    assert end == ends[0]
    assert env.events_scheduled - before == (timers + 1 if timers else 0)
    assert env.drive.log == [(start, end, parts * part_bytes, parts, "read")]
    return timers


@settings(max_examples=150, deadline=None)
@given(start=st.sampled_from([0.0, 2.5, 7.1e5, 3.3e8]), n_bytes=st.integers(1, 1 << 32),
       cap_gbps=st.floats(1, 60), capacity_gbps=st.floats(20, 800))
def test_a_lone_dram_copy_ends_where_host_dram_ends_it(start, n_bytes, cap_gbps, capacity_gbps):
    from sim.machine.chains import lone_dram_copy

    ends = []

    def copy(env):
        env.dram = SharedBandwidth(env, "host DRAM", capacity_gbps * 1e9)
        yield env.dram.transfer(2 * n_bytes, cap_gbps * 1e9, "pread copy", at_once=True)
        ends.append(env.now)

    env = _alone_from(start, copy)
    end, done = lone_dram_copy(start, 2 * n_bytes, cap_gbps * 1e9, capacity_gbps * 1e9)
    assert done and end == ends[0] and env.dram.log == [(start, end, 2 * n_bytes, 1, "pread copy")]


@settings(max_examples=100, deadline=None)
@given(n_bytes=st.integers(0, 1 << 34), n_ops=st.integers(0, 60), latency_us=st.floats(0, 30),
       gbps=st.sampled_from([0.0, 3.2, 24.5, 55.0]))
def test_a_pinned_copys_seconds_are_the_copy_engines(n_bytes, n_ops, latency_us, gbps):
    from sim.machine.chains import pinned_copy_seconds

    engine = Server(Environment(), "H2D", bytes_per_s=gbps * 1e9, op_latency_s=latency_us * 1e-6,
                    pageable_bytes_per_s=gbps * 0.4e9)
    assert pinned_copy_seconds(n_bytes, n_ops, engine.op_latency_s, engine.bytes_per_s,
                               engine.pageable_bytes_per_s) == engine.cost_s(n_bytes, n_ops)
