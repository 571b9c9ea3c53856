"""The per-process routing memo: a hit returns the same (read-only) routing, and runs give the same results
with and without it. Also the sweep benchmark's function on a tiny grid, and the scenario rows' targets."""

import json
from pathlib import Path

import numpy as np
import pytest

import sim.simulate as run_module
from sim import workload
from sim.simulate import run_scenario
from sim.workload import clear_routing_memo, memo_stats, routing_key, workload_routing
from sim.explore.runner import load_scenario_data
from sim.schema import read_toml
from sim.scenario import load_scenario

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"
PER_CLASS = SCENARIOS / "ds4-504-per-class.toml"


def _variant(**changes):
    data = read_toml(PER_CLASS, str(PER_CLASS))
    for path, value in changes.items():
        node = data
        *head, last = path.split(".")
        for part in head:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[last] = value
    return load_scenario_data(str(PER_CLASS), data)


def test_memo_hits_on_identical_trace_settings_and_freezes_the_arrays():
    clear_routing_memo()
    scenario = load_scenario(PER_CLASS)
    first = workload_routing(scenario)
    assert memo_stats == {"hits": 0, "misses": 1}
    # another cache budget and reserve: same routing inputs, so the same routing object
    other = _variant(**{"engine.flags.ssd-streaming-cache-experts": "2048",
                        "engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB": "8"})
    assert routing_key(other) == routing_key(scenario)
    assert workload_routing(other) is first
    assert memo_stats == {"hits": 1, "misses": 1}
    for request in first.requests:
        assert not request.prompt.flags.writeable and not request.decode.flags.writeable
    with pytest.raises(ValueError):
        first.requests[0].decode[0, 0, 0] = 1  # a caller cannot change what the next point gets
    fresh = workload_routing(scenario, memo=False)
    assert fresh is not first and fresh.sha256 == first.sha256
    for a, b in zip(fresh.requests, first.requests):
        assert np.array_equal(a.prompt, b.prompt) and np.array_equal(a.decode, b.decode)


def test_memo_misses_when_a_routing_input_changes():
    clear_routing_memo()
    base = workload_routing(load_scenario(PER_CLASS))
    seed = workload_routing(_variant(**{"trace.seed": 1}))
    size = workload_routing(_variant(**{"workload.requests.0.prompt_tokens": 1000}))
    assert memo_stats == {"hits": 0, "misses": 3}
    assert len({base.sha256, seed.sha256, size.sha256}) == 3
    assert len(size.requests[0].prompt) == 1000


def test_memo_is_bounded():
    clear_routing_memo()
    for seed in range(workload.ROUTING_MEMO_SIZE + 2):
        workload_routing(_variant(**{"trace.seed": seed, "workload.requests.0.prompt_tokens": 64}))
    assert len(workload._ROUTING_MEMO) == workload.ROUTING_MEMO_SIZE


def test_runs_are_identical_with_and_without_the_memo(monkeypatch):
    short = {"workload.requests.0.prompt_tokens": 1200, "workload.requests.0.decode_tokens": 40}
    scenarios = [_variant(**short), _variant(**short, **{"engine.flags.ssd-streaming-cache-experts": "4096",
                                                         "engine.flags.prefill-chunk": 512})]
    clear_routing_memo()
    with_memo = [json.dumps(run_scenario(s).summary, sort_keys=True, default=str) for s in scenarios * 2]
    assert memo_stats["hits"] == 3 and memo_stats["misses"] == 1
    monkeypatch.setattr(run_module, "workload_routing", lambda s, **options: workload_routing(s, memo=False, **options))
    without = [json.dumps(run_scenario(s).summary, sort_keys=True, default=str) for s in scenarios]
    assert with_memo[:2] == without
    assert with_memo[0] == with_memo[2] and with_memo[0] != with_memo[1]


def test_sweep_bench_rows_on_a_tiny_grid():
    from sim.explore.bench import sweep_rows

    rows = {r["name"]: r for r in sweep_rows(n_points=2)}
    assert set(rows) == {"sweep_expand", "sweep_2_points", "sweep_cpu_per_point", "sweep_failed_points",
                         "sweep_speedup_1_to_2_workers"}
    assert rows["sweep_failed_points"]["value"] == 0
    assert rows["sweep_2_points"]["target"] == "< 60" and rows["sweep_2_points"]["value"] > 0
    # the workers' CPU seconds are counted (a point's routing and simulation run in them, not in this process)
    assert rows["sweep_cpu_per_point"]["target"] == "< 0.12" and rows["sweep_cpu_per_point"]["value"] > 0.05
    assert rows["sweep_speedup_1_to_2_workers"]["target"] == ">= 1.7"
    assert all(set(r) == {"name", "value", "unit", "target", "met"} for r in rows.values())


def test_bench_times_every_seed_against_its_targets_and_a_user_file_against_none():
    from sim.explore.bench import SEED_SCENARIOS, _load_scenarios, _scenario_rows, seed_scenario_paths

    seeds = seed_scenario_paths()
    assert [p.stem for p in seeds] == list(SEED_SCENARIOS)  # a checkout holds every seed
    one = _load_scenarios([PER_CLASS])
    seed_rows, user_rows = _scenario_rows(one, targets=True), _scenario_rows(one, targets=False)
    assert [(r["name"], r["target"], type(r["met"])) for r in seed_rows] == [
        ("run_ds4-504-per-class", "< 1", bool), ("run_ds4-504-per-class_accesses", ">= 1", bool),
        ("run_ds4-504-per-class_over_lru_replay", "<= 20", bool)]
    assert [(r["target"], r["met"]) for r in user_rows] == [(None, None)] * 3


def test_the_replay_a_simulation_is_compared_with_makes_the_scenarios_lookups(monkeypatch):
    """The peer of the over-replay row replays the scenario's own routing: every routed selection of every request,
    prompt then decode, once (its lookups counted by the replay against the routing's cells)."""
    from sim.explore import bench

    scenario = load_scenario(PER_CLASS)
    seen = {}
    real_replay = bench.replay

    def counting(trace, geometry, policy, scope, capacity):
        seen.update(lookups=trace.n_lookups, rows=trace.n_rows, prefill=int((trace.phase == 0).sum()))
        return real_replay(trace, geometry, policy, scope, capacity)

    monkeypatch.setattr(bench, "replay", counting)
    assert bench._lru_replay_cpu_seconds(scenario) > 0
    requests = workload_routing(scenario).requests
    assert seen["rows"] == sum(len(r.prompt) + len(r.decode) for r in requests)
    assert seen["prefill"] == sum(len(r.prompt) for r in requests)
    assert seen["lookups"] == sum(int((r.prompt != 0xFFFF).sum() + (r.decode != 0xFFFF).sum()) for r in requests)


def test_the_machine_probe_reports_its_cpu_seconds_and_the_load():
    from sim.explore.bench import probe_rows

    rows = {r["name"]: r["value"] for r in probe_rows()}
    # one thread cannot use more CPU seconds than wall seconds pass (the load is >= 1 up to the clocks' resolution)
    assert rows["machine_probe"] > 0 and rows["machine_load"] >= 0.95


@pytest.mark.parametrize("name", ["ds4-504-per-class", "strata-658-own", "llamacpp-qwen3.8-ncmoe"])
def test_a_summary_only_run_has_the_same_summary(name):
    """Sweep points skip the copy rows, the servers' busy intervals and the steps' frame (runner.evaluate): no
    figure of the summary may read them, the list of links included (which servers worked)."""
    scenario = load_scenario(SCENARIOS / f"{name}.toml")
    full, lean = run_scenario(scenario), run_scenario(scenario, summary_only=True)
    as_text = [json.dumps(r.summary, sort_keys=True, default=str) for r in (lean, full)]
    assert as_text[0] == as_text[1]
    assert lean.copies.empty and lean.steps.empty and lean.links == ()
    assert list(lean.steps.columns) == list(full.steps.columns) and len(full.steps)
    assert len(full.summary["links"]) >= 3 and all(len(link.intervals()) for link in full.links)
    if name.startswith("ds4"):
        assert not full.copies.empty  # ds4 records its copy plan: the test compares something
