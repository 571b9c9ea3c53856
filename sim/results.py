"""A run's results and the files they are written to (`expertsim run SCENARIO -o DIR`):

- summary.json: the headline metrics (docs/metrics.md) and the provenance of the run;
- steps.parquet: one row per engine step (a layer of a decode token or of a prefill chunk);
- copy_plan.parquet: per step, the copies the engine makes (kind, count, bytes each, source, destination),
  which the GPU calibration replays;
- requests.parquet: per request, its arrival, prefill end, first token and end;
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

from sim.errors import InputError
from sim.machine.servers import IntervalLog
from sim.outputs import dumps


@dataclass
class RunResult:
    summary: dict
    steps: pd.DataFrame
    copies: pd.DataFrame
    timings: pd.DataFrame
    links: tuple = ()  # the machine's servers: write_results writes their busy intervals
    scenario: object = None  # with routing: write_results writes the measured request's routing
    routing: object = None  # WorkloadRouting


LINK_COLUMNS = ("link", "start_s", "end_s", "bytes", "ops", "kind")


def _interval_columns(link) -> tuple:
    """A server's busy intervals as columns (start_s, end_s, bytes, ops, kind): a one-queue server keeps them so
    (IntervalLog); a shared resource's overlapping jobs are merged into busy periods first."""
    if isinstance(link.log, IntervalLog):
        return link.log.columns()
    return tuple(zip(*link.intervals()))


def link_frame(links) -> pd.DataFrame:
    """One row per busy interval of each server (LINK_COLUMNS), in the given order: links.parquet. Built column
    by column per server: a row tuple per interval held a million-token prompt's intervals twice over."""
    parts = [pd.DataFrame({"link": link.name, **dict(zip(LINK_COLUMNS[1:], columns))})
             for link in links if (columns := _interval_columns(link)) and len(columns[0])]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=list(LINK_COLUMNS))


def routing_table(scenario, routing, request: int):
    """routing.parquet: the request's routing as the engines look it up, one row per recorded (token, layer) cell
    with the layer's size class (sim.cache.replay.Geometry order) and expert bytes. Decode rows: every cell
    (routed layers, then the MTP draft's layers when the scenario runs MTP). Prompt rows (routed layers): only
    the cells that hold some key's last prompt access. The rest of the prompt changes neither the recency order
    of the keys at the first decode token nor the set of keys the prompt touched, which is all an LRU's or the
    Belady bound's decode hits depend on (docs/report.md), and it is most of the bytes: strata-658-borrow's
    17,944-token prompt takes 10 MB whole, 0.13 MB kept."""
    import pyarrow as pa

    from sim.cache.replay import Geometry, last_access_cells_of
    from sim.workload import runs_mtp
    from sim.trace.format import MISSING

    r = routing.requests[request]
    n_routed, n_experts, top_k = scenario.layout.n_routed_layers, scenario.layout.n_experts, r.prompt.shape[2]
    decode = r.decode[:, :n_routed]
    if runs_mtp(scenario) and r.mtp is not None:
        decode = np.concatenate([decode, r.mtp[: len(decode)]], axis=1)
    geometry = Geometry.of_layout(scenario.layout, decode.shape[1])
    p_token, p_layer, p_cells = last_access_cells_of(r.prompt, n_routed, n_experts)  # in order: token, then layer
    d_token, d_layer = np.nonzero(decode[:, :, 0] != MISSING)
    phase = np.r_[np.full(len(p_token), "prefill", object), np.full(len(d_token), "decode", object)]
    token, layer = np.r_[p_token, d_token], np.r_[p_layer, d_layer]
    cells = np.concatenate([p_cells, decode[d_token, d_layer]])
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
