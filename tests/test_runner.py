"""The experiment runner (sim/explore/runner.py): one point gives one row, whichever command asks for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.errors import InputError
from sim.explore import plan as plan_module
from sim.explore.runner import METRICS, evaluate, make_point, run_points
from sim.explore.sweep import expand_grid, load_sweep, run_sweep
from sim.explore.validate import load_case, validate_cases
from sim.schema import read_toml
from sim.scenario import load_scenario, scenario_hash

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
BASE = SCENARIOS / "ds4-504-per-class.toml"
SHORT = {"workload.requests.0.prompt_tokens": 600, "workload.requests.0.decode_tokens": 4}
CHUNK = "engine.flags.prefill-chunk"


def _point(overrides: dict):
    return make_point(BASE, read_toml(BASE), overrides, scenario_hash(load_scenario(BASE)))


def test_one_point_gives_one_row_through_sweep_plan_and_validate(tmp_path):
    overrides = {**SHORT, CHUNK: 512}
    direct = evaluate(_point(overrides))
    assert direct["error"] is None
    # sweep: the same point from a grid, persisted and read back
    points = expand_grid(_short_scenario(tmp_path), [f"{CHUNK}=512"])
    run_sweep(points, tmp_path / "sweep", workers=1)
    swept = load_sweep(tmp_path / "sweep").iloc[0]
    # plan: the same candidate
    plan = plan_module.make_plan(_short_scenario(tmp_path), grids=[f"{CHUNK}=512"])
    planned = plan.candidates[0].metrics
    # validate: a case whose arm is the point
    case_file = tmp_path / "one.toml"
    case_file.write_text(f'id = "one"\ntitle = "one point"\nsource = "a test"\nbase = "{BASE}"\n\n[[arms]]\n'
                         f'name = "a"\nset = {json.dumps(overrides).replace(":", " =")}\n\n[[measured]]\n'
                         'metric = "decode_tok_s"\nkind = "absolute"\narms = ["a"]\nvalue = 1.0\n'
                         'source = "a test figure"\n')
    record = validate_cases([(case_file, load_case(case_file))], executor="inline")
    validated = record["cases"][0]["arm_rows"]["a"]
    for key in METRICS:
        ours = direct[key]
        assert swept[key] == pytest.approx(ours, nan_ok=True) if ours is not None else swept[key] != swept[key]
        assert planned[key] == pytest.approx(ours) if ours is not None else planned[key] is None
        assert validated[key] == ours, key


def _short_scenario(tmp_path: Path) -> Path:
    """The base scenario with the short request written into the file (sweep and plan read a file)."""
    text = BASE.read_text().replace("prompt_tokens = 5000", "prompt_tokens = 600") \
                           .replace("decode_tokens = 270", "decode_tokens = 4")
    text = text.replace('hardware = "rtx-pro-6000-96gb"', f'hardware = "{SCENARIOS / "hardware" / "rtx-pro-6000-96gb.toml"}"')
    path = tmp_path / "short.toml"
    path.write_text(text)
    return path


def test_a_point_that_does_not_load_records_its_error_without_running():
    point = _point({**SHORT, "engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB": "999"})
    assert point.error is not None and "reserve" in point.error
    [(_, row)] = list(run_points([point], executor="inline"))
    assert row["error"] == point.error and row["method"] is None and row["decode_tok_s"] is None
    assert row["error_kind"] == "refused"  # it fails again, whatever the rerun


@pytest.mark.parametrize("executor", ["inline", "processes"])
def test_a_scheduler_without_the_dask_executor_is_refused(executor):
    """Issue 34: `sweep --scheduler ADDRESS` without `--executor dask` ran every point here without a word."""
    point = _point(SHORT)
    with pytest.raises(InputError, match="--scheduler.*needs --executor dask"):
        list(run_points([point], executor=executor, scheduler="tcp://10.0.0.9:8786"))


def test_a_point_that_fails_at_run_time_records_one_line(monkeypatch):
    import sim.simulate as run_module

    def boom(scenario, record_values=None, summary_only=False):
        raise RuntimeError("the engine fell over\nin two lines")

    monkeypatch.setattr(run_module, "run_scenario", boom)
    row = evaluate(_point(SHORT))
    assert row["error"] == "RuntimeError: the engine fell over in two lines" and row["method"] == "run"
    assert row["error_kind"] == "crashed"  # not an input the engine refuses: a bug to report


def test_a_refusal_at_run_time_and_a_lost_worker_are_told_apart(monkeypatch):
    """A failed row's error_kind says whether running it again can help: an InputError raised while the point runs
    (the engine's refusal) fails again; a worker whose result never came back may not."""
    import sim.explore.runner as runner
    import sim.simulate as run_module

    def refuse(scenario, record_values=None, summary_only=False):
        raise InputError("x.toml", "hardware", "box", "too small")

    monkeypatch.setattr(run_module, "run_scenario", refuse)
    assert evaluate(_point(SHORT))["error_kind"] == "refused"

    def lost(tasks):
        for task in tasks:
            yield task, OSError("the worker process died")

    monkeypatch.setattr(runner, "_inline", lost)
    [(_, row)] = list(run_points([_point(SHORT)], executor="inline"))
    assert row["error"] == "worker failed: OSError: the worker process died" and row["error_kind"] == "worker-lost"


def test_processes_and_inline_give_the_same_rows():
    points = [_point({**SHORT, CHUNK: c}) for c in (256, 512)]
    inline = {p.point_id: row for p, row in run_points(points, executor="inline")}
    spawned = {p.point_id: row for p, row in run_points(points, executor="processes", workers=2)}
    for pid, row in inline.items():
        assert {k: v for k, v in row.items() if k != "wall_s"} == {k: v for k, v in spawned[pid].items() if k != "wall_s"}


def test_shared_routing_groups_the_points_that_route_alike_and_gives_the_same_rows():
    from sim.explore.runner import SHARED_TASKS_PER_WORKER, plan_tasks

    # chunk sizes on one routing, interleaved with as many on another (another prompt size)
    chunks = [256 * (i + 1) for i in range(SHARED_TASKS_PER_WORKER)]
    alike = [_point({**SHORT, CHUNK: c}) for c in chunks]
    other = [_point({**SHORT, "workload.requests.0.prompt_tokens": 700, CHUNK: c}) for c in chunks]
    points = [p for pair in zip(alike, other) for p in pair]
    # one worker: a group holds at most 1/8 of the 16 points, so each routing's 8 points come as 4 tasks of 2
    tasks = plan_tasks(points, share_routing=True, workers=1)
    ids = lambda group: [p.point_id for p in group]  # noqa: E731
    assert [ids(t.points) for t in tasks] == [ids(alike[i: i + 2]) for i in range(0, 8, 2)] + \
        [ids(other[i: i + 2]) for i in range(0, 8, 2)]
    assert {t.method for t in tasks} == {"shared"}
    # two workers: groups of one, so each worker gets several tasks
    assert [len(t.points) for t in plan_tasks(points, share_routing=True, workers=2)] == [1] * 16
    one_each = {p.point_id: row for p, row in run_points(points, executor="inline")}
    shared = {p.point_id: row for p, row in run_points(points, executor="inline", share_routing=True)}
    assert one_each.keys() == shared.keys()
    for pid, row in one_each.items():
        assert {k: v for k, v in row.items() if k != "wall_s"} == {k: v for k, v in shared[pid].items() if k != "wall_s"}


class _Workers:
    """Stands in for a Dask client: `run` answers for each worker what it was told that worker sees."""

    def __init__(self, answers: dict):
        self.answers = answers

    def run(self, fn, *args):
        return {address: answer(fn, *args) for address, answer in self.answers.items()}


def test_dask_workers_that_cannot_load_the_scenario_or_load_another_are_named_before_any_point_runs():
    from sim.errors import InputError
    from sim.explore.runner import _check_workers_load, plan_tasks

    tasks = plan_tasks([_point(SHORT)], mrc=False)
    here = scenario_hash(load_scenario(BASE, tasks[0].points[0].data))
    same = lambda fn, *args: fn(*args)  # noqa: E731 - a worker that sees this machine's files
    _check_workers_load(_Workers({"tcp://a:1": same, "tcp://b:1": same}), tasks)
    missing = lambda fn, path, data: fn("/nowhere/" + Path(path).name, data)  # noqa: E731 - no shared filesystem
    with pytest.raises(InputError, match=r"^--scheduler: worker tcp://b:1 = .*ds4-504-per-class.toml: cannot load "
                                         r"the scenario there \(.*no such file"):
        _check_workers_load(_Workers({"tcp://a:1": same, "tcp://b:1": missing}), tasks)
    other = lambda fn, path, data: ("0" * 64, None)  # noqa: E731 - another version of the files
    with pytest.raises(InputError, match=f"loads another scenario there \\(hash 000000000000, here {here[:12]}\\)"):
        _check_workers_load(_Workers({"tcp://a:1": other}), tasks)


def test_stopping_the_workers_also_waits_for_the_pools_manager_thread():
    """An interrupted sweep's pool: its workers end, and so does the manager thread that closes the pool's
    wake-up pipe, before the interpreter's exit hook writes to that pipe (a CPython 3.11 race that printed
    "Exception ignored ... Bad file descriptor" after SIGTERM)."""
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor

    from sim.explore.runner import _stop_workers

    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    pool.submit(time.sleep, 60)
    deadline = time.monotonic() + 30
    while not pool._processes and time.monotonic() < deadline:
        time.sleep(0.05)
    manager, workers = pool._executor_manager_thread, list(pool._processes.values())
    _stop_workers(pool)
    assert manager is not None and not manager.is_alive()
    for worker in workers:
        worker.join(timeout=10)
        assert not worker.is_alive()
