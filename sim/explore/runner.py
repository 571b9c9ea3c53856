"""The experiment runner: a point is a scenario with some settings changed; `evaluate(point)` simulates it and
gives its row; `run_points` evaluates many, here, on local processes or on a Dask cluster.

    point = make_point("scenarios/ds4-504-per-class.toml", data, {"engine.flags.prefill-chunk": 2048}, base_hash)
    row = evaluate(point)               # {"point_id", overrides..., METRICS..., "notices", "error", ...}
    for point, row in run_points(points, executor="processes", workers=2): ...

Sweep (a grid of points, persisted and resumable), plan (a search over candidate points) and validate (the arms
of the validation cases) all go through here, so a point gives the same row whichever command asked for it
(tests/test_runner.py), with one error policy: a point that does not load or fails records its error in one
line and the others go on.

The one-pass path: points whose engine computes a knob's values in one pass (Engine.one_pass: the cache-only
replay's slot count with an evicting LRU, from one miss-ratio curve, exact because LRU is a stack algorithm when
every miss evicts) and that differ only in that knob are grouped, a task per group instead of a run per point.
Column `method` says which path made a row.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from sim.errors import InputError
from sim.units import MIB

# The numbers every row carries: a run's headline (docs/metrics.md). An engine's rows may add its own
# (Engine.extra_metrics: a cache-only replay's hit rate, misses and bytes; its tok/s, TTFT... are null).
METRICS = ("cache_slots", "planned_cache_slots", "cache_mib", "lent_slots", "prefill_buffer_mib", "file_blob_reads",
           "prefill_tok_s", "decode_tok_s", "decode_hit_rate", "prefill_hit_rate", "belady_decode_hit_rate",
           "belady_gap", "ttft_s", "simulated_s", "gpu_idle_s", "vram_peak_mib", "vram_free_mib", "ram_peak_mib")
# whole numbers
COUNTS = ("cache_slots", "planned_cache_slots", "lent_slots", "file_blob_reads", "misses", "load_bytes")
RECORD_INPUT = "record."  # a point's profile value naming a calibration record: record.<id>
EXECUTORS = ("inline", "processes", "dask")
# share_routing's smallest number of tasks per worker: a batch of points that all route alike still comes in
# this many pieces a worker, so the workers finish near together (a scheduling choice, no model input)
SHARED_TASKS_PER_WORKER = 8
# how long an interrupted sweep waits for its pool's manager thread to see the workers gone (s; it takes
# milliseconds; the bound only keeps a stuck thread from holding the exit)
MANAGER_JOIN_S = 5.0


def load_scenario_data(path: str | Path, data: dict, profile_values: dict | None = None):
    """`load_scenario(path)` with `data` in place of the file's parsed TOML (and `profile_values` in place of some
    of its profile's figures)."""
    from sim.scenario import load_scenario

    return load_scenario(path, copy.deepcopy(data), profile_values)


# ---------------------------------------------------------------------------------------------- points


@dataclass(frozen=True)
class Point:
    """A scenario file's data with overrides (dotted key -> value) applied, and its id."""

    scenario_path: str
    overrides: dict
    data: dict
    point_id: str
    base_hash: str
    scenario_hash: str | None = None
    error: str | None = None  # the combination does not load (the loader's one-line error)
    # hardware-profile figures (dotted key -> value) and calibration records (record.<id> -> value) set for this
    # point: an uncertainty sample
    profile_values: dict | None = None
    routing: tuple | None = None  # the loaded scenario's routing_key: points that route alike share it


def split_key(key: str) -> list[str | int]:
    """`engine.flags.prefill-chunk`, `workload.requests.0.prompt_tokens` -> its parts (numbers index arrays)."""
    parts: list[str | int] = []
    for part in key.replace("[", ".").replace("]", "").split("."):
        if part == "":
            raise ValueError("empty part")
        parts.append(int(part) if part.isascii() and part.isdigit() else part)
    return parts


def set_key(data: dict, parts: list[str | int], value: Any, where: str, key: str) -> None:
    """Set `key` (its parts) to `value` in scenario data, creating tables on the way; a one-line error if the
    path runs into a value or off an array."""
    node: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        here = ".".join(map(str, parts[:i])) or "(top level)"
        if isinstance(node, list):
            if not isinstance(part, int):
                raise InputError(where, key, value, f"{here} is an array: index it with a number")
            if part >= len(node):
                raise InputError(where, key, value, f"{here} has {len(node)} entries (0..{len(node) - 1})")
        elif isinstance(node, dict):
            part = str(part)
            if not last and part not in node:
                node[part] = {}
        else:
            raise InputError(where, key, value, f"{here} is a value, not a table")
        if last:
            node[part] = value
        else:
            node = node[part]


def _digest(payload: object) -> str:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def point_id(base_hash: str, overrides: dict) -> str:
    return _digest({"base_scenario": base_hash, "overrides": overrides})[:20]


def make_point(path: str | Path, base: dict, overrides: dict, base_hash: str) -> Point:
    """The point of `base` (a scenario's TOML data) with `overrides` applied, loaded through the scenario's own
    checks: a combination that does not load is a point with `error` set."""
    return load_point(path, base, overrides, base_hash)[0]


def load_point(path: str | Path, base: dict, overrides: dict, base_hash: str) -> tuple[Point, InputError | None]:
    """`make_point`, with the loader's error itself when the point does not load."""
    from sim.workload import routing_key
    from sim.scenario import scenario_hash

    path = str(path)
    data = copy.deepcopy(base)
    for key, value in overrides.items():
        try:
            parts = split_key(key)
        except ValueError:
            raise InputError(path, key, value, "the key must be a dotted path such as engine.flags.prefill-chunk")
        set_key(data, parts, value, path, key)
    pid = point_id(base_hash, overrides)
    try:
        loaded = load_scenario_data(path, data)
    except InputError as exc:
        return Point(path, dict(overrides), data, pid, base_hash, error=str(exc)), exc
    return Point(path, dict(overrides), data, pid, base_hash, scenario_hash=scenario_hash(loaded),
                 routing=routing_key(loaded)), None


# ---------------------------------------------------------------------------------------------- evaluation


def one_line(exc: BaseException) -> str:
    """The error policy: an InputError's own line, anything else as `Type: message`, on one line."""
    text = str(exc) if isinstance(exc, InputError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:500]


# A failed row's error_kind, which says whether running it again can help:
REFUSED = "refused"  # an InputError: a setting out of range or the engine's own refusal; it fails again
CRASHED = "crashed"  # any other exception in the simulation: an expertsim bug, worth reporting with its line
WORKER_LOST = "worker-lost"  # the worker process died or its result did not come back; it may pass when run again


def error_kind(exc: BaseException) -> str:
    return REFUSED if isinstance(exc, InputError) else CRASHED


def _engine(data: dict):
    """The engine a point's data names (None for a name no engine has: the point did not load)."""
    from sim.engines import ENGINES

    return ENGINES.get((data.get("engine") or {}).get("name"))


def metrics_of(data: dict) -> tuple[str, ...]:
    """A row's metric columns: the headline, plus its engine's own (Engine.extra_metrics)."""
    engine = _engine(data)
    return METRICS + (engine.extra_metrics if engine is not None else ())


def _row(point: Point, found: dict, error: str | None, method: str | None, wall_s: float | None,
         notices: list | None = None, out_of_domain: list | None = None, kind: str | None = None) -> dict:
    return {"point_id": point.point_id, **point.overrides, "scenario_hash": point.scenario_hash,
            **{k: found.get(k) for k in metrics_of(point.data)}, "notices": list(notices or []),
            "out_of_domain": list(out_of_domain or []), "error": error,
            # no kind given: a point that did not load, whose error is the loader's InputError
            "error_kind": None if error is None else kind or REFUSED, "method": method, "wall_s": wall_s}


def _figures(scenario, summary: dict) -> dict:
    found = dict(summary)
    if "vram_peak_mib" in summary:  # a timed run's
        found["vram_free_mib"] = scenario.hardware_profile.vram_bytes / MIB - summary["vram_peak_mib"]
    return found


def split_values(values: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """A sample's values as (hardware-profile figures, calibration records by id)."""
    profile = {k: v for k, v in values.items() if not k.startswith(RECORD_INPUT)}
    records = {k[len(RECORD_INPUT):]: v for k, v in values.items() if k.startswith(RECORD_INPUT)}
    return profile, records


def evaluate(point: Point) -> dict:
    """Simulate one point: its row (METRICS, the engine's notices and out-of-domain notes, or `error`)."""
    from sim.simulate import run_scenario

    if point.error is not None:
        return _row(point, {}, point.error, None, 0.0)
    start = time.perf_counter()
    try:
        profile_values, record_values = split_values(point.profile_values or {})
        scenario = load_scenario_data(point.scenario_path, point.data, profile_values)
        summary = run_scenario(scenario, record_values or None, summary_only=True).summary  # a row is a summary's
    except Exception as exc:  # noqa: BLE001 - a failing point records its error; the others go on
        return _row(point, {}, one_line(exc), "run", time.perf_counter() - start, kind=error_kind(exc))
    notices = list(dict.fromkeys(summary.get("notices", [])))
    return _row(point, _figures(scenario, summary), None, "run", time.perf_counter() - start, notices,
                summary.get("out_of_domain"))


def evaluate_mrc(points: list[Point]) -> list[dict]:
    """The rows of points that differ only in their engine's one-pass knob, from one pass (a miss-ratio curve).
    Each row is the one `evaluate` gives, but for method "mrc" and wall_s: the group's time shared out."""
    start = time.perf_counter()
    knob = one_pass_knob(points[0])
    try:
        scenario = load_scenario_data(points[0].scenario_path, points[0].data)  # every point's other settings
        figures = _engine(points[0].data).one_pass_figures(scenario, [p.overrides[knob] for p in points])
        error = kind = None
    except Exception as exc:  # noqa: BLE001 - every point of the group records the error evaluate would
        figures, error, kind = [{}] * len(points), one_line(exc), error_kind(exc)
    wall_s = (time.perf_counter() - start) / len(points)
    return [_row(p, found, error, "mrc", wall_s, kind=kind) for p, found in zip(points, figures)]


def one_pass_knob(point: Point) -> str | None:
    """The knob the point's engine computes in one pass for its settings, when the point sets it to a whole number
    (the same count in every pool); None otherwise (the point runs)."""
    engine = None if point.error is not None else _engine(point.data)
    if engine is None:
        return None
    knob = engine.one_pass(point.data["engine"])
    return knob if knob is not None and isinstance(point.overrides.get(knob), int) else None


# ---------------------------------------------------------------------------------------------- running


def evaluate_shared(points: list[Point]) -> list[dict]:
    """Points that route alike (one `routing_key`), one after another in one worker: the first builds the
    routing, the others take it from the worker's memo (sim.workload). Each row is `evaluate`'s."""
    return [evaluate(p) for p in points]


@dataclass(frozen=True)
class Task:
    """What one call in a worker computes: a point through its engine ("run"), points that share one routing
    through their engines in turn ("shared"), or a group of points from one miss-ratio curve ("mrc")."""

    points: tuple[Point, ...]
    method: str

    def call(self) -> tuple[Callable, tuple]:
        """The worker function and its arguments."""
        if self.method == "mrc":
            return evaluate_mrc, (list(self.points),)
        if self.method == "shared":
            return evaluate_shared, (list(self.points),)
        return evaluate, (self.points[0],)

    def rows(self, result) -> list[dict]:
        """The worker's result as one row per point, in the order of `points`."""
        return [result] if self.method == "run" else result


def plan_tasks(points: list[Point], mrc: bool = True, share_routing: bool = False, workers: int = 1) -> list[Task]:
    """A task per point, except (with `mrc`) the points the one-pass curve gives exactly: those are grouped by all
    their other overrides, a task (one curve) per group. Groups come first: they finish fast.

    With `share_routing` (a batch that waits for all its rows, such as validate's arms or their uncertainty
    samples), the other points are grouped by routing, in the order they come, so that a long prompt's routing is
    built once per group rather than once per worker that runs one of its points. A group holds at most
    1 / (SHARED_TASKS_PER_WORKER x workers) of the points, so that a batch that routes alike throughout still keeps
    every worker busy. A sweep keeps a task per point: its rows are saved, and shown, as each point finishes."""
    groups: dict[str, list[Point]] = {}
    singles: list[Point] = []
    for p in points:
        knob = one_pass_knob(p) if mrc else None
        if knob is not None:
            rest = {k: v for k, v in p.overrides.items() if k != knob}
            groups.setdefault(json.dumps(rest, sort_keys=True), []).append(p)
        else:
            singles.append(p)
    curves = [Task(tuple(group), "mrc") for group in groups.values()]
    if not share_routing:
        return [*curves, *(Task((p,), "run") for p in singles)]
    alike: dict[tuple, list[Point]] = {}
    for p in singles:
        alike.setdefault(p.routing, []).append(p)
    most = max(1, -(-len(singles) // (SHARED_TASKS_PER_WORKER * workers)))
    return [*curves, *(Task(tuple(members[i: i + most]), "shared")
                       for members in alike.values() for i in range(0, len(members), most))]


def _inline(tasks: list[Task]):
    for task in tasks:
        fn, args = task.call()
        yield task, fn(*args)


def _worker_start(parent_pid: int) -> None:
    """In each local worker: Ctrl-C is the parent's to handle (it says what was saved and stops the workers),
    and a worker whose parent is gone (killed with SIGKILL, say) leaves instead of running on."""
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()


def _exit_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    # Hand-written: the kernel's parent-death signal (prctl PR_SET_PDEATHSIG) is Linux-only and psutil is not a
    # dependency; a changed parent pid is the portable sign that the parent has died.
    import os
    import time

    while os.getppid() == parent_pid:
        time.sleep(poll_s)
    os._exit(1)


def _stop_workers(pool) -> None:
    """End a pool's workers now (an interrupted sweep): what they are running would be lost anyway.

    Then wait (bounded) for the pool's manager thread, which sees the workers gone and closes its wake-up pipe.
    Left running, it races concurrent.futures' exit hook, which writes to that pipe without the pool's lock:
    on CPython 3.11 the interpreter's exit then printed "Exception ignored ... Bad file descriptor"."""
    manager = getattr(pool, "_executor_manager_thread", None)  # private, read before shutdown forgets it
    stop = getattr(pool, "terminate_workers", None)  # Python >= 3.14
    if stop is not None:
        stop()
    else:
        for process in list((getattr(pool, "_processes", None) or {}).values()):  # before 3.14: no public way
            process.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
    if manager is not None:
        manager.join(timeout=MANAGER_JOIN_S)


def _local(tasks: list[Task], workers: int):
    """Tasks as spawned processes finish them (numba and imports warm once per worker)."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor, as_completed

    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_start, initargs=(os.getpid(),))
    try:
        futures = {}
        for task in tasks:
            fn, args = task.call()
            futures[pool.submit(fn, *args)] = task
        for future in as_completed(futures):
            try:
                result = future.result()
            except Exception as exc:  # noqa: BLE001 - a worker that died: its points record it
                result = exc
            yield futures[future], result
    except BaseException:  # Ctrl-C, or the caller stopped reading
        _stop_workers(pool)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _scenario_as_loaded(scenario_path: str, data: dict) -> tuple[str | None, str | None]:
    """(scenario hash, None) as this process loads the point's scenario, or (None, its one-line error)."""
    from sim.scenario import load_scenario, scenario_hash

    try:
        return scenario_hash(load_scenario(scenario_path, data)), None
    except InputError as exc:
        return None, str(exc)


def _check_workers_load(client, tasks: list[Task]) -> None:
    """Before any point is submitted: every Dask worker loads each scenario of the sweep (its first point)
    and gets the hash it has here. The workers read the scenario and every file it names (hardware profile,
    calibration, GGUF, trace, Strata packs) at the same absolute paths: a worker without a shared
    filesystem, or with other versions of those files, is named here in one line instead of failing (or
    silently differing) point by point. The hash covers the content of what the scenario names."""
    first = {}
    for task in tasks:
        for point in task.points:
            first.setdefault(point.scenario_path, point)
    for path, point in first.items():
        here, _ = _scenario_as_loaded(path, point.data)
        for address, (there, error) in sorted(client.run(_scenario_as_loaded, path, point.data).items()):
            if error is not None:
                raise InputError("--scheduler", f"worker {address}", path,
                                 f"cannot load the scenario there ({error}); workers read the scenario and the "
                                 "files it names at the same absolute paths: a shared filesystem")
            if here is not None and there != here:
                raise InputError("--scheduler", f"worker {address}", path,
                                 f"loads another scenario there (hash {there[:12]}, here {here[:12]}): the files "
                                 "it names differ between this machine and the worker")


def _dask(tasks: list[Task], workers: int, scheduler: str | None):
    try:
        from distributed import Client, LocalCluster, as_completed
    except ImportError:
        raise InputError("--executor", "executor", "dask",
                         "needs dask[distributed]: pip install 'expertsim[cluster]'") from None
    cluster = None
    try:
        if scheduler:
            try:
                client = Client(scheduler, timeout="20s")
            except (OSError, TimeoutError) as exc:
                raise InputError("--scheduler", "scheduler", scheduler, f"cannot connect: {one_line(exc)}") from None
        else:
            cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None)
            client = Client(cluster)
        try:
            _check_workers_load(client, tasks)
            futures = {}
            for task in tasks:
                fn, args = task.call()
                key = f"expertsim-{'point' if task.method == 'run' else task.method}-{task.points[0].point_id}"
                futures[client.submit(fn, *args, key=key, pure=False)] = task
            for future in as_completed(futures):
                try:
                    result = future.result()
                except Exception as exc:  # noqa: BLE001 - a worker that died: its points record it
                    result = exc
                yield futures[future], result
        finally:
            client.close()
    finally:
        if cluster is not None:
            cluster.close()


def run_points(points: list[Point], executor: str = "processes", workers: int | None = None,
               scheduler: str | None = None, mrc: bool = True,
               share_routing: bool = False) -> Iterator[tuple[Point, dict]]:
    """Evaluate the points, yielding (point, row) as each finishes (in task order with "inline"). Points that do
    not load yield their error row without running. `share_routing`: see `plan_tasks`. A caller that may stop
    reading early (Ctrl-C) closes the iterator (`with contextlib.closing(run_points(...))`): that stops the
    workers then, not at the interpreter's exit."""
    import os

    if executor not in EXECUTORS:
        raise InputError("--executor", "executor", executor, f"must be one of: {', '.join(EXECUTORS[1:])}")
    if workers is not None and workers < 1:
        raise InputError("--workers", "workers", workers, "must be >= 1")
    if scheduler is not None and executor != "dask":
        raise InputError("--scheduler", "scheduler", scheduler, f"needs --executor dask (the {executor} executor "
                                                                "has no scheduler: the points would run here)")
    runnable = []
    for p in points:
        if p.error is not None:
            yield p, _row(p, {}, p.error, None, 0.0)
        else:
            runnable.append(p)
    if not runnable:
        return
    if executor == "dask":
        # Dask workers may run in another folder (a `dask worker` started elsewhere): each point names its
        # scenario by absolute path, so its relative references (hardware, model, trace) resolve as they did
        # here, where the point was already loaded and checked; `_check_workers_load` checks they do there.
        runnable = [dataclasses.replace(p, scenario_path=str(Path(p.scenario_path).resolve())) for p in runnable]
    tasks = plan_tasks(runnable, mrc, share_routing, workers or os.cpu_count() or 1)
    workers = workers or min(os.cpu_count() or 1, len(tasks))
    if executor == "inline":
        stream = _inline(tasks)
    elif executor == "processes":
        stream = _local(tasks, workers)
    else:
        stream = _dask(tasks, workers, scheduler)
    # Closed here, not whenever the garbage collector gets to it: a stream left open at exit (a Ctrl-C between
    # two points) stops its pool at the interpreter's shutdown, racing concurrent.futures' own exit hook.
    with closing(stream):
        for task, result in stream:
            if isinstance(result, BaseException):
                rows = [_row(p, {}, f"worker failed: {one_line(result)}", task.method, None, kind=WORKER_LOST)
                        for p in task.points]
            else:
                rows = task.rows(result)
            yield from zip(task.points, rows)


__all__ = [
    "COUNTS", "EXECUTORS", "METRICS", "Point", "RECORD_INPUT", "Task", "evaluate", "evaluate_mrc", "evaluate_shared",
    "load_point", "load_scenario_data", "make_point", "metrics_of", "one_line", "one_pass_knob", "plan_tasks",
    "point_id", "run_points", "set_key", "split_key", "split_values",
]
