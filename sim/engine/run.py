"""Run a scenario: build the routing, drive the engine's SimPy process, summarise, write results.

Results of a run (`expertsim run SCENARIO -o DIR`):
- summary.json: the headline metrics (docs/metrics.md) and the provenance of the run;
- steps.parquet: one row per engine step (a layer of a decode token or of a prefill chunk);
- copy_plan.parquet: per step, the copies the engine makes (kind, count, bytes each, source, destination),
  which the GPU calibration replays;
- links.parquet: every busy interval of every resource of the machine (link, start_s, end_s, bytes, ops, kind;
  sim/machine/);
- routing.parquet: the measured request's routing as the engine looked it up, one row per (token, layer) cell:
  phase, token, layer, size class, expert bytes, experts (the report's miss-ratio curves, docs/report.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import simpy

from sim import __version__
from sim.engine import process_class
from sim.engine.records import Domain
from sim.engine.timeline import Recorder, hit_rate, link_frame, safe_rate
from sim.engine.workload import workload_routing
from sim.errors import InputError
from sim.machine import Machine
from sim.outputs import dumps
from sim.units import MIB


@dataclass
class RunResult:
    summary: dict
    steps: pd.DataFrame
    copies: pd.DataFrame
    timings: pd.DataFrame
    links: tuple = ()  # the machine's servers: write_results writes their busy intervals
    scenario: object = None  # with routing: write_results writes the measured request's routing
    routing: object = None  # WorkloadRouting


class CountingEnvironment(simpy.Environment):
    """SimPy's environment, counting the events it schedules: what a run costs in events (the summary's
    simulated_events, docs/design.md), for one integer increment per event."""

    def __init__(self) -> None:
        super().__init__()
        self.events_scheduled = 0

    def schedule(self, event, priority=simpy.core.NORMAL, delay=0) -> None:
        self.events_scheduled += 1
        super().schedule(event, priority, delay)


def provenance(scenario, trace_sha256: str, **extra) -> dict:
    """What a result was made from: package version, scenario hash, hardware profile and calibration file
    (with its hash), the routing's sha256 and the engine command line; `extra` adds keys (a replay's profile)."""
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


def context_tokens(scenario) -> int | None:
    """The context the run's engine is configured for (the calibration records' `context` key)."""
    flags = scenario.engine.flags
    if scenario.engine.name == "ds4":
        from sim.engine.ds4_plan import context_tokens as ds4_context

        return ds4_context(flags)
    return getattr(flags, "max_context", None)


def extent_bytes(layout) -> np.ndarray:
    """Bytes of each (layer, expert) file extent of the routed layers, key = layer * n_experts + expert."""
    return np.repeat(np.asarray([x.expert_bytes for x in layout.layers], np.int64), layout.n_experts)


def run_scenario(scenario, record_values: dict[str, float] | None = None) -> RunResult:
    """Simulate the scenario; `record_values` (record id -> value) stand in for calibration records' figures."""
    if scenario.engine.name == "replay":  # no engine: the workload through one cache, counts only
        from sim.engine.cache_only import run_replay

        return run_replay(scenario)
    routing = workload_routing(scenario)
    recorder = Recorder()
    env = CountingEnvironment()
    machine = Machine(env, scenario.hardware_profile, extent_bytes(scenario.layout))
    domain = Domain(scenario.engine.name, scenario.layout.name, scenario.hardware_profile.name,
                    context_tokens(scenario), record_values)
    domain.use_profile(scenario.hardware_profile, scenario.compute_key)
    engine = process_class(scenario.engine.name)(scenario, routing, recorder, machine, domain)
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
    bound = engine.bounds(measured)["belady_decode_hit_rate"]
    elapsed = float(timing["end_s"].max())
    servers = machine.servers()
    summary = {
        "scenario": str(scenario.path) if scenario.path else None,
        "engine": scenario.engine.name,
        "variant": scenario.engine.variant,
        "hardware": profile.name,
        "model": scenario.layout.name,
        "measured_request": int(measured),
        "cache_slots": state["cache_slots"],
        "planned_cache_slots": state.get("planned_cache_slots", state["cache_slots"]),
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
        "simulated_s": elapsed,
        "simulated_events": env.events_scheduled,
        # time the GPU compute stream was not busy: waiting on copies, syncs and host work
        "gpu_idle_s": elapsed - machine.gpu.busy_s,
        "vram_peak_mib": machine.memory.peak["vram"] / MIB,
        "ram_peak_mib": machine.memory.peak["ram"] / MIB,
        "links": [server.summary(elapsed) for server in servers],
        "notices": list(state.get("notices", [])),
        "out_of_domain": domain.out_of_domain(),
        "engine_state": state,
        "provenance": provenance(scenario, routing.sha256),
    }
    return RunResult(summary, steps, copies, timing, tuple(servers), scenario, routing)


def routing_table(scenario, routing, request: int):
    """routing.parquet: the request's routing as the engines look it up, one row per recorded (token, layer) cell
    with the layer's size class (sim.cache.replay.Geometry order) and expert bytes. Decode rows: every cell
    (routed layers, then the MTP draft's layers when the scenario runs MTP). Prompt rows (routed layers): only
    the cells that hold some key's last prompt access. The rest of the prompt changes neither the recency order
    of the keys at the first decode token nor the set of keys the prompt touched, which is all an LRU's or the
    Belady bound's decode hits depend on (docs/report.md), and it is most of the bytes: strata-658-borrow's
    17,944-token prompt takes 10 MB whole, 0.13 MB kept."""
    import pyarrow as pa

    from sim.cache.kernels import last_access_cells
    from sim.cache.replay import Geometry
    from sim.engine.workload import runs_mtp
    from sim.trace.format import MISSING

    r = routing.requests[request]
    n_routed, n_experts, top_k = scenario.layout.n_routed_layers, scenario.layout.n_experts, r.prompt.shape[2]
    decode = r.decode[:, :n_routed]
    if runs_mtp(scenario) and r.mtp is not None:
        decode = np.concatenate([decode, r.mtp[: len(decode)]], axis=1)
    geometry = Geometry.of_layout(scenario.layout, decode.shape[1])
    prompt = r.prompt[:, :n_routed]
    p_token, p_layer = np.nonzero(last_access_cells(prompt, n_experts))  # in order: token, then layer
    d_token, d_layer = np.nonzero(decode[:, :, 0] != MISSING)
    phase = np.r_[np.full(len(p_token), "prefill", object), np.full(len(d_token), "decode", object)]
    token, layer = np.r_[p_token, d_token], np.r_[p_layer, d_layer]
    cells = np.concatenate([prompt[p_token, p_layer], decode[d_token, d_layer]])
    return pa.table({
        "phase": pa.array(phase, pa.string()).dictionary_encode(),
        "token": pa.array(token.astype(np.int32)),
        "layer": pa.array(layer.astype(np.int16)),
        "class": pa.array(geometry.class_of_layer[layer].astype(np.int16)),
        "expert_bytes": pa.array(geometry.expert_bytes[layer].astype(np.int64)),
        "experts": pa.FixedSizeListArray.from_arrays(pa.array(cells.reshape(-1).astype(np.uint16)), top_k),
    })


def write_results(result: RunResult, out_dir: str | Path) -> dict:
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        paths = {"summary": out / "summary.json", "steps": out / "steps.parquet",
                 "copy_plan": out / "copy_plan.parquet", "requests": out / "requests.parquet"}
        paths["summary"].write_text(dumps(result.summary, indent=2) + "\n")
        result.steps.to_parquet(paths["steps"], index=False)
        result.copies.to_parquet(paths["copy_plan"], index=False)
        result.timings.to_parquet(paths["requests"], index=False)
        if result.links:
            paths["links"] = out / "links.parquet"
            link_frame(result.links).to_parquet(paths["links"], index=False)
        if result.routing is not None:
            import pyarrow.parquet as pq

            paths["routing"] = out / "routing.parquet"
            pq.write_table(routing_table(result.scenario, result.routing, result.summary["measured_request"]),
                           paths["routing"], compression="zstd")
    except OSError as exc:
        raise InputError(str(out), "output", str(out), f"cannot write results: {exc.strerror}") from None
    return {k: str(v) for k, v in paths.items()}
