"""Run a scenario: build the routing, drive the engine's SimPy process on the machine, summarise (the files a
run writes: sim/results.py)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pandas as pd

from sim.engines import engine_of
from sim.engines.records import Domain
from sim.engines.recorder import Recorder
from sim.errors import InputError
from sim.machine import Machine
from sim.machine.environment import Environment
from sim.results import RunResult
from sim.units import MIB
from sim.version import __version__
from sim.workload import workload_routing


def provenance(scenario, trace_sha256: str, **extra) -> dict:
    """What a result was made from: package version, scenario hash, hardware profile and calibration file
    (with its hash), the routing's sha256 and the engine command line; `extra` adds keys (files an engine read)."""
    from sim.scenario import scenario_hash

    profile = scenario.hardware_profile
    return {
        "expertsim": __version__,
        "scenario_sha256": scenario_hash(scenario),
        "hardware_profile": str(getattr(profile, "_path", None) or profile.name),
        "calibration": str(profile.calibration_path) if profile.calibration_path else None,
        "calibration_sha256": profile.calibration_sha256,
        "trace_sha256": trace_sha256,
        **extra,
        "command_line": scenario.command_line(),
    }


def safe_rate(numerator: float, seconds: float) -> float:
    return float(numerator / seconds) if seconds > 0 else float("nan")


def hit_rate(steps: dict[str, np.ndarray], rows: np.ndarray) -> float | None:
    """Hits per cache lookup over these step rows (a mask); None where nothing was looked up (an engine without
    an expert cache)."""
    lookups = steps["lookups"][rows].sum()
    return float(steps["hits"][rows].sum() / lookups) if lookups else None


def extent_bytes(layout) -> np.ndarray:
    """Bytes of each (layer, expert) file extent of the routed layers, key = layer * n_experts + expert."""
    return np.repeat(np.asarray([x.expert_bytes for x in layout.layers], np.int64), layout.n_experts)


def _refuse_past_the_box(scenario, peak: dict[str, int], knob: str | None) -> None:
    """A run whose allocations exceeded the GPU's memory or the host's RAM at some point gives no figure of record:
    an allocation would have failed there, or the OS paged the run's own buffers out (the engines' own refusals come
    earlier, where the engines make them)."""
    profile = scenario.hardware_profile
    for pool, holds, words in (("vram", profile.vram_bytes, "GPU memory"), ("ram", profile.ram_bytes, "host RAM")):
        if peak[pool] > holds:
            change = f"; change {knob}, or the settings that fill it" if knob and pool == "vram" else ""
            raise InputError(str(scenario.path or "scenario"), "hardware", profile.name,
                             f"the run needs {peak[pool] / MIB:,.0f} MiB of {words} at its peak, "
                             f"{(peak[pool] - holds) / MIB:,.0f} MiB more than the {holds / MIB:,.0f} MiB this box "
                             f"has: an allocation would fail there{change}")


def run_scenario(scenario, record_values: dict[str, float] | None = None, summary_only: bool = False,
                 stage: Callable[[str], None] = lambda name: None) -> RunResult:
    """Simulate the scenario; `record_values` (record id -> value) stand in for calibration records' figures.
    `summary_only` (a sweep point, a validation arm): the result is read for its summary, so the copy rows and the
    servers' busy intervals are not kept, and the steps are read for the summary but not made a frame: its steps
    and copies frames are empty and it has no links to write (the summary is the same: tests/test_workload.py).
    `stage(name)` is told each step as it starts: "routing", "simulating", "results" (a command's live line)."""
    engine = engine_of(scenario)
    # the engine's start-up refusals (a GPU too small for what comes before the cache) before the routing is built:
    # generating a long prompt's routing took ~40 s of a run that was then refused
    plan = engine.plan_memory(scenario) if engine.timed else None
    stage("routing")
    routing = workload_routing(scenario, prompts_to_file=engine.reads_prompt_in_chunks)
    stage("simulating" if engine.timed else "replaying")
    recorder = Recorder(copy_plan=not summary_only)
    if not engine.timed:  # no machine and no clock: the engine only counts
        state = engine.process(scenario, routing, recorder, None, None).state()
        summary = {
            "scenario": str(scenario.path) if scenario.path else None,
            "engine": engine.name,
            "variant": getattr(scenario.engine, "variant", None),
            "hardware": scenario.hardware_profile.name,  # named by the scenario, not used: nothing is timed
            "model": scenario.layout.name,
            "measured_request": None,  # the figures cover every request
            **state.figures,
            "links": [],
            "engine_state": state.detail,
            "provenance": provenance(scenario, routing.sha256, **state.provenance),
        }
        return RunResult(summary, recorder.step_frame(), recorder.copy_frame(), pd.DataFrame())
    env = Environment()
    machine = Machine(env, scenario.hardware_profile, extent_bytes(scenario.layout), whole_logs=not summary_only)
    domain = Domain(engine.name, scenario.layout.name, scenario.hardware_profile.name,
                    engine.context_tokens(scenario.engine), record_values)
    domain.use_profile(scenario.hardware_profile, scenario.compute_key)
    process = engine.process(scenario, routing, recorder, machine, domain)
    timings: list[dict] = []
    env.process(process.serve(env, timings))
    env.run()
    _refuse_past_the_box(scenario, machine.memory.peak, plan.knob)
    stage("results")
    steps, copies, timing = recorder.step_columns(), recorder.copy_frame(), pd.DataFrame(timings)
    measured = scenario.measured[-1] if scenario.measured else len(timings) - 1
    m = timing.iloc[measured]
    mine = steps["request"] == measured
    decode = mine & (steps["phase"] == "decode")
    prefill = mine & (steps["phase"] == "prefill")
    profile = scenario.hardware_profile
    state = process.state()
    bound = process.bounds(measured).belady_decode_hit_rate
    decode_hits = hit_rate(steps, decode)
    elapsed = float(timing["end_s"].max())
    servers = machine.servers()
    summary = {
        "scenario": str(scenario.path) if scenario.path else None,
        "engine": engine.name,
        "variant": scenario.engine.variant,
        "hardware": profile.name,
        "model": scenario.layout.name,
        "measured_request": int(measured),
        "cache_slots": state.cache_slots,
        "planned_cache_slots": state.planned_cache_slots,
        "cache_mib": state.cache_mib,
        "lent_slots": state.lent_slots,
        "prefill_buffer_mib": state.prefill_buffer_mib,
        "file_blob_reads": int(steps["file_blob_reads"][prefill].sum()),
        "prefill_tok_s": safe_rate(m["prompt_tokens"], m["prefill_end_s"] - m["arrival_s"]),
        "decode_tok_s": safe_rate(m["decode_tokens"], m["end_s"] - m["prefill_end_s"]),
        "decode_hit_rate": decode_hits,
        "prefill_hit_rate": hit_rate(steps, prefill),
        "belady_decode_hit_rate": bound,
        "belady_gap": None if bound is None or decode_hits is None else bound - decode_hits,
        "ttft_s": float(m["first_token_s"] - m["arrival_s"]),
        "simulated_s": elapsed,
        "simulated_events": env.events_scheduled,
        # time the GPU compute stream was not busy: waiting on copies, syncs and host work
        "gpu_idle_s": elapsed - machine.gpu.busy_s,
        "vram_peak_mib": machine.memory.peak["vram"] / MIB,
        "ram_peak_mib": machine.memory.peak["ram"] / MIB,
        "links": [server.summary(elapsed) for server in servers],
        "notices": list(state.notices),
        "out_of_domain": domain.out_of_domain(),
        "engine_state": state.detail,
        "provenance": provenance(scenario, routing.sha256, **state.provenance),
    }
    if summary_only:  # the summary has read the steps: their frame is left empty (its columns typed)
        steps = {name: column[:0] for name, column in steps.items()}
    return RunResult(summary, pd.DataFrame(steps), copies, timing, () if summary_only else tuple(servers), scenario,
                     routing)
