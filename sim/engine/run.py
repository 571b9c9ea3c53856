"""Run a scenario: build the routing, drive the engine's SimPy process, summarise, write results.

Results of a run (`expertsim run SCENARIO -o DIR`):
- summary.json: the headline metrics (docs/metrics.md) and the provenance of the run;
- steps.parquet: one row per engine step (a layer of a decode token or of a prefill chunk);
- copy_plan.parquet: per step, the copies the engine makes (kind, count, bytes each, source, destination),
  which the GPU calibration replays.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import simpy

from sim import __version__
from sim.engine.timeline import Recorder, hit_rate, safe_rate
from sim.engine.workload import workload_routing
from sim.errors import InputError


def _engine_class(name: str):
    if name == "ds4":
        from sim.engine.ds4 import Ds4Engine

        return Ds4Engine
    from sim.engine.strata import StrataEngine

    return StrataEngine


@dataclass
class RunResult:
    summary: dict
    steps: pd.DataFrame
    copies: pd.DataFrame
    timings: pd.DataFrame


def run_scenario(scenario) -> RunResult:
    from sim.scenario import scenario_hash

    routing = workload_routing(scenario)
    recorder = Recorder()
    engine = _engine_class(scenario.engine.name)(scenario, routing, recorder)
    env = simpy.Environment()
    timings: list[dict] = []
    env.process(engine.serve(env, timings))
    env.run()
    steps, copies, timing = recorder.step_frame(), recorder.copy_frame(), pd.DataFrame(timings)
    measured = scenario.measured[-1] if scenario.measured else len(timings) - 1
    m = timing.iloc[measured]
    mine = steps[steps["request"] == measured]
    decode = mine[mine["phase"] == "decode"]
    prefill = mine[mine["phase"] == "prefill"]
    profile = scenario.hardware_profile
    state = engine.state()
    bound = engine.belady_decode_hit_rate(measured) if hasattr(engine, "belady_decode_hit_rate") else None
    summary = {
        "scenario": str(scenario.path) if scenario.path else None,
        "engine": scenario.engine.name,
        "variant": scenario.engine.variant,
        "hardware": profile.name,
        "model": scenario.layout.name,
        "measured_request": int(measured),
        "cache_slots": state["cache_slots"],
        "cache_mib": state["cache_mib"],
        "lent_slots": state["lent_slots"],
        "prefill_buffer_mib": state["prefill_buffer_mib"],
        "file_blob_reads": int(prefill["file_blob_reads"].sum()),
        "prefill_tok_s": safe_rate(m["prompt_tokens"], m["prefill_end_s"] - m["arrival_s"]),
        "decode_tok_s": safe_rate(m["decode_tokens"], m["end_s"] - m["prefill_end_s"]),
        "decode_hit_rate": hit_rate(decode),
        "prefill_hit_rate": hit_rate(prefill),
        "belady_decode_hit_rate": bound,
        "belady_gap": None if bound is None else bound - hit_rate(decode),
        "ttft_s": float(m["first_token_s"] - m["arrival_s"]),
        "simulated_s": float(timing["end_s"].max()),
        # time the GPU compute stream was not busy: waiting on copies, syncs and host work
        "gpu_idle_s": float(timing["end_s"].max()) - engine.links["compute"].busy_s,
        "links": [link.summary(float(timing["end_s"].max())) for link in engine.links.values()],
        "engine_state": state,
        "provenance": {
            "expertsim": __version__,
            "scenario_sha256": scenario_hash(scenario),
            "hardware_profile": str(getattr(profile, "_path", None) or profile.name),
            "calibration": str(profile.calibration_path) if profile.calibration_path else None,
            "calibration_sha256": profile.calibration_sha256,
            "trace_sha256": routing.sha256,
            "command_line": scenario.command_line(),
        },
    }
    return RunResult(summary, steps, copies, timing)


def write_results(result: RunResult, out_dir: str | Path) -> dict:
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        paths = {"summary": out / "summary.json", "steps": out / "steps.parquet",
                 "copy_plan": out / "copy_plan.parquet", "requests": out / "requests.parquet"}
        paths["summary"].write_text(json.dumps(result.summary, indent=2, default=str) + "\n")
        result.steps.to_parquet(paths["steps"], index=False)
        result.copies.to_parquet(paths["copy_plan"], index=False)
        result.timings.to_parquet(paths["requests"], index=False)
    except OSError as exc:
        raise InputError(str(out), "output", str(out), f"cannot write results: {exc.strerror}") from None
    return {k: str(v) for k, v in paths.items()}
