"""Every registered engine against the engine spec (sim/engines/base.py): members present and typed, refusals as
one-line errors, a memory plan its startup keeps, a declared state, deterministic runs, and a search space whose
knobs `run --set` takes. A new engine gets all of this from its registry line; an engine that lacks a member fails
by name."""

from __future__ import annotations

import copy
import dataclasses
import tomllib
from pathlib import Path

import numpy as np
import pytest
import simpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.engines import ENGINES, register
from sim.engines.base import Bounds, Engine, EngineProcess, EngineState, MemoryPlan, SearchAxis, TimedProcess, \
    spec_problems
from sim.errors import InputError
from sim.explore.sweep import parse_settings
from sim.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = sorted((ROOT / "scenarios").glob("*.toml"))
DECLARED = [f.name for f in dataclasses.fields(EngineState)]


def seed_of(engine: Engine) -> Path:
    """The first committed scenario that runs the engine (every engine ships one)."""
    for path in SCENARIOS:
        if tomllib.loads(path.read_text())["engine"]["name"] == engine.name:
            return path
    pytest.fail(f"engine {engine.name} has no scenario under scenarios/")


def small(path: Path) -> dict:
    """The scenario's data with one short request: what a contract needs to see, in a fraction of a second."""
    data = tomllib.loads(path.read_text())
    data["workload"]["requests"] = [{"prompt_tokens": 300, "decode_tokens": 8}]
    return data


def run_small(path: Path):
    from sim.simulate import run_scenario

    return run_scenario(load_scenario(path, small(path)))


@pytest.fixture(params=list(ENGINES), ids=list(ENGINES))
def engine(request) -> Engine:
    return ENGINES[request.param]


def test_the_engine_meets_the_spec(engine):
    assert spec_problems(engine) == []
    assert isinstance(engine, Engine) and engine.name in ENGINES
    assert all(isinstance(axis, SearchAxis) for axis in engine.search_space(small(seed_of(engine))))


def test_an_incomplete_engine_fails_by_the_member_it_lacks():
    class NoPlan(Engine):  # everything but plan_memory, and no Settings
        name, label, description, variants, default_objective, knobs = "noplan", "x", "x", {}, "decode_tok_s", ()

        def validate(self, scenario, where):
            pass

        def search_space(self, data):
            return []

        def process(self, scenario, routing, recorder, machine, domain):
            return None

    with pytest.raises(TypeError, match="plan_memory"):
        NoPlan()

    class Duck:  # no Engine subclass: the spec names what it lacks, and registering it fails on that
        name, label, description, variants, default_objective, knobs, timed = "duck", "x", "x", {}, "x", (), True
        validate = search_space = process = NoPlan.validate

    assert spec_problems(Duck()) == ["Duck lacks Settings", "Duck lacks plan_memory"]
    with pytest.raises(TypeError, match="Duck lacks Settings; Duck lacks plan_memory"):
        register(Duck())


def test_the_memory_plan_is_what_startup_allocates(engine):
    from sim.engines.records import Domain
    from sim.engines.recorder import Recorder
    from sim.machine import Machine
    from sim.simulate import extent_bytes
    from sim.workload import workload_routing

    path = seed_of(engine)
    scenario = load_scenario(path, small(path))
    plan = engine.plan_memory(scenario)
    assert isinstance(plan, MemoryPlan) and plan.why_no_cache is None
    if not engine.timed:
        return
    machine = Machine(simpy.Environment(), scenario.hardware_profile, extent_bytes(scenario.layout))
    domain = Domain(engine.name, scenario.layout.name, scenario.hardware_profile.name, None)
    process = engine.process(scenario, workload_routing(scenario), Recorder(), machine, domain)
    assert isinstance(process, TimedProcess)
    for allocation in plan.allocations:
        assert machine.memory.get(allocation.pool, allocation.name) == allocation.bytes, allocation


def test_the_state_declares_every_key_and_agrees_with_its_detail(engine):
    """The process's state after serving (an untimed engine only counts): an EngineState whose headline fields its
    own account repeats unchanged, and a timed process's bounds."""
    from sim.engines.records import Domain
    from sim.engines.recorder import Recorder
    from sim.machine import Machine
    from sim.machine.environment import Environment
    from sim.simulate import extent_bytes
    from sim.workload import workload_routing

    path = seed_of(engine)
    scenario = load_scenario(path, small(path))
    env = Environment()
    machine = Machine(env, scenario.hardware_profile, extent_bytes(scenario.layout)) if engine.timed else None
    domain = Domain(engine.name, scenario.layout.name, scenario.hardware_profile.name, None)
    process = engine.process(scenario, workload_routing(scenario), Recorder(), machine, domain)
    assert isinstance(process, TimedProcess if engine.timed else EngineProcess)
    if engine.timed:
        timings: list = []
        env.process(process.serve(env, timings))
        env.run()
        assert len(timings) == 1 and isinstance(process.bounds(0), Bounds)
    state = process.state()
    assert isinstance(state, EngineState) and [f.name for f in dataclasses.fields(state)] == DECLARED
    for key in DECLARED[:5]:  # the headline fields, where the engine's own account repeats them
        if key in state.detail:
            assert state.detail[key] == getattr(state, key), key
    assert list(state.notices) == list(state.detail.get("notices", state.notices))
    assert engine.timed or state.figures, "an untimed engine's figures are its summary's headline"


def test_a_run_is_deterministic(engine):
    first, second = run_small(seed_of(engine)), run_small(seed_of(engine))
    assert first.summary == second.summary
    assert first.steps.equals(second.steps)


def test_a_step_row_counts_in_integers(engine, monkeypatch):
    """The steps frame takes each column's declared type (sim/engines/recorder.py STEP_DTYPES) without inferring it,
    so a fractional count would be cut to an integer there: every engine gives its counts as integers."""
    import numbers

    import numpy as np

    from sim.engines import recorder

    seen = []
    columns = recorder.Recorder.step_columns
    monkeypatch.setattr(recorder.Recorder, "step_columns", lambda self: seen.append(list(self.steps)) or columns(self))
    run_small(seed_of(engine))
    [rows] = seen  # none for an engine without steps (the replay)
    for column, dtype in recorder.STEP_DTYPES.items():
        values = [row[recorder.STEP_COLUMNS.index(column)] for row in rows]
        if dtype is object:
            assert all(isinstance(v, str) for v in values), column
        elif dtype is np.int64:
            assert all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values), column
        else:
            assert all(isinstance(v, numbers.Real) for v in values), column


def test_a_prompt_kept_in_a_file_runs_as_one_in_memory(engine, monkeypatch):
    """Issue 33: an engine that reads its prompts a chunk at a time (Engine.reads_prompt_in_chunks) gets a long
    prompt's routing in a temporary file (sim.workload.PROMPT_FILE_BYTES); every other engine gets arrays. Here
    every prompt goes to the file and a pass over it reads 7 rows at a time: the run and its routing table are
    those of the prompt in memory."""
    import sim.workload
    from sim.results import routing_table
    from sim.simulate import run_scenario
    from sim.trace import rowfile

    path = seed_of(engine)
    scenario = load_scenario(path, small(path))

    def run():
        sim.workload.clear_routing_memo()
        result = run_scenario(scenario)
        # the run's own, from the memo
        return result, sim.workload.workload_routing(scenario, prompts_to_file=engine.reads_prompt_in_chunks)

    (in_memory, memory_routing) = run()
    monkeypatch.setattr(sim.workload, "PROMPT_FILE_BYTES", 0)
    layers, top_k = memory_routing.requests[0].prompt.shape[1:]
    monkeypatch.setattr(rowfile, "ROW_BLOCK_BYTES", 7 * layers * top_k * 2)
    (in_file, file_routing) = run()
    sim.workload.clear_routing_memo()
    prompt = file_routing.requests[0].prompt
    assert isinstance(prompt, rowfile.FileRows) == engine.reads_prompt_in_chunks
    assert np.array_equal(np.asarray(prompt), memory_routing.requests[0].prompt)
    assert file_routing.sha256 == memory_routing.sha256
    assert in_file.summary == in_memory.summary and in_file.steps.equals(in_memory.steps)
    if engine.timed:
        measured = in_memory.summary["measured_request"]
        assert routing_table(scenario, file_routing, measured).equals(routing_table(scenario, memory_routing, measured))


def _spelled(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def test_every_knob_round_trips_through_run_set(engine):
    path = seed_of(engine)
    data = tomllib.loads(path.read_text())
    axes = engine.search_space(data)
    assert axes, "an engine offers plan at least one knob"
    for axis in axes:
        assert axis.knob in engine.knobs, axis.knob.key
        for value in axis.values:
            changed, overrides = parse_settings(path, [f"{axis.knob.key}={_spelled(value)}"])
            assert overrides[axis.knob.key] == value and type(overrides[axis.knob.key]) is type(value)
            try:
                load_scenario(path, changed)
            except InputError as exc:  # a candidate the engine refuses on this box: plan records it, one line
                assert "\n" not in str(exc)


FUZZ = st.one_of(st.integers(-2, 2**40), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                 st.text(max_size=12), st.sampled_from(["auto", "0", "-1", "1e30", "nan", "12GB", "auto:0"]))


@pytest.mark.parametrize("name", list(ENGINES))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_refusal_is_one_line(name, data):
    """Any value of any of the engine's flags: the scenario loads, or fails with one InputError line."""
    engine = ENGINES[name]
    path = seed_of(engine)
    base = small(path)
    flags = engine.Settings.model_fields["flags"].annotation.model_fields
    field = data.draw(st.sampled_from(sorted(flags)))
    scenario = copy.deepcopy(base)
    scenario["engine"].setdefault("flags", {})[flags[field].alias or field] = data.draw(FUZZ)
    try:
        load_scenario(path, scenario)
    except InputError as exc:
        assert "\n" not in str(exc) and str(path) in str(exc)


def test_a_file_with_a_forks_own_types_is_refused_by_every_build_that_does_not_load_them(engine):
    """glm-5.1-iq3_ks holds ik_llama.cpp's IQ3_KS and IQ4_KS experts (sim/model/quant.py): only the llama.cpp
    family's ik build loads them, and an untimed replay reads sizes only; every other build refuses the file when the
    scenario loads, in one line naming the first such tensor and its type id, before any other check."""
    seed = seed_of(engine)
    for variant in list(engine.variants) or [None]:
        data = small(seed)
        data["model"] = "glm-5.1-iq3_ks"
        data["trace"] = {"generator": "glm-5.1-iq3_ks"}
        if variant is not None:
            data["engine"]["variant"] = variant
        if (engine.name, variant) == ("llama.cpp", "ik") or not engine.timed:
            try:  # the file loads; a later check may still refuse the seed's box (its compute figures, its RAM)
                load_scenario(seed, data)
            except InputError as error:
                assert "own type" not in str(error) and "invalid ggml type" not in str(error), error
            continue
        with pytest.raises(InputError) as info:
            load_scenario(seed, data)
        message = str(info.value)
        assert "\n" not in message and "blk.3.ffn_gate_exps.weight" in message and "156" in message, message


def test_a_box_the_engine_has_no_backend_for_is_refused_when_its_scenario_loads(engine):
    """Engine.refuses_hardware, for every committed profile: where it names a reason, the engine's scenario on that
    box is refused with that reason as one line (field hardware), before anything runs."""
    from sim.hardware import load_hardware_file

    path = seed_of(engine)
    for profile_file in sorted((ROOT / "scenarios" / "hardware").glob("*.toml")):
        reason = engine.refuses_hardware(load_hardware_file(profile_file))
        if reason is None:
            continue
        data = small(path)
        data["hardware"] = str(profile_file)
        with pytest.raises(InputError) as refused:
            load_scenario(path, data)
        assert refused.value.field == "hardware" and refused.value.why == reason and "\n" not in str(refused.value)


def test_strata_and_llamacpp_refuse_a_mac():
    """Known answers: Strata is CUDA with HIP and SYCL ports, no Metal (strata-engine.md §0); llama.cpp is modelled
    with a discrete GPU only. ds4 has a Metal backend (ds4-engine.md) and runs there."""
    from sim.hardware import load_hardware

    mac = load_hardware("m5-pro-64gb")
    assert "no Metal backend" in ENGINES["strata"].refuses_hardware(mac)
    assert "discrete" in ENGINES["llama.cpp"].refuses_hardware(mac)
    assert ENGINES["ds4"].refuses_hardware(mac) is None
