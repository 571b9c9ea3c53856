"""A run as a Perfetto trace: Chrome trace-event JSON (`perfetto_trace`; `write_perfetto` writes it for
`run --perfetto`) with the steps, each link's lane (sim.explore.report.lanes) and each request's phases as threads,
and counter tracks of memory in use, lent slots and the hit rate.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from sim.errors import InputError
from sim.explore.report.lanes import link_busy_per_step
from sim.outputs import dumps
from sim.units import GIB


def perfetto_trace(steps: pd.DataFrame, summary: dict, links: pd.DataFrame | None = None) -> dict:
    """Chrome trace-event JSON of a run: "X" events in µs; threads: the steps, one per busy link, per-request phases;
    "C" counter tracks of VRAM and RAM in use, lent slots and the hit rate per step (`_counter_events`).

    With `links` (links.parquet) a link lane holds its busy intervals as booked. Without, its events are laid one
    after another from each step's start (never overlapping), durations as apportioned by `link_busy_per_step`.
    Either way each lane's durations sum to the link's busy time."""
    steps = steps.reset_index(drop=True)
    us = 1e6
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0,
                           "args": {"name": f"expertsim {summary.get('engine', '')} {summary.get('variant', '')}"}}]
    tid = 0

    def thread(name: str) -> int:
        nonlocal tid
        tid += 1
        events.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": tid, "args": {"sort_index": tid}})
        return tid

    start = steps["start_s"].to_numpy(dtype=float)
    end = steps["end_s"].to_numpy(dtype=float)
    labels = [f"{p} {s} L{l}" for p, s, l in zip(steps["phase"], steps["step"], steps["layer"])]
    t = thread("steps")
    for i in range(len(steps)):
        events.append({"ph": "X", "name": labels[i], "cat": "step", "pid": 1, "tid": t, "ts": start[i] * us,
                       "dur": max(end[i] - start[i], 0.0) * us,
                       "args": {"request": int(steps["request"].iat[i]), "hits": int(steps["hits"].iat[i]),
                                "lookups": int(steps["lookups"].iat[i])}})
    if links is not None:
        for name, lane in links.groupby("link", sort=False):
            if not (lane["end_s"] > lane["start_s"]).any():
                continue
            t = thread(str(name))
            for a, b, n_bytes, ops, kind in zip(lane["start_s"].tolist(), lane["end_s"].tolist(),
                                                lane["bytes"].tolist(), lane["ops"].tolist(), lane["kind"].tolist()):
                events.append({"ph": "X", "name": f"{name} ({kind})", "cat": "link", "pid": 1, "tid": t,
                               "ts": a * us, "dur": (b - a) * us, "args": {"bytes": n_bytes, "ops": ops}})
    else:
        for name, busy in link_busy_per_step(steps, summary).items():
            t = thread(name)
            free = 0.0
            for i in np.flatnonzero(busy > 0):
                ts = max(start[i], free)
                free = ts + busy[i]
                events.append({"ph": "X", "name": name, "cat": "link", "pid": 1, "tid": t, "ts": ts * us,
                               "dur": busy[i] * us, "args": {"step_row": int(i)}})
    for request, frame in steps.groupby("request", sort=True):
        t = thread(f"request {request}")
        for phase, part in frame.groupby("phase", sort=False):
            events.append({"ph": "X", "name": str(phase), "cat": "request", "pid": 1, "tid": t,
                           "ts": float(part["start_s"].min()) * us,
                           "dur": float(part["end_s"].max() - part["start_s"].min()) * us,
                           "args": {"steps": int(len(part)), "tokens": int(part["tokens"].sum())
                                    if "tokens" in part else 0}})
    events += _counter_events(steps)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "metadata": {"scenario": summary.get("scenario"), "simulated_s": summary.get("simulated_s")}}


# Counter tracks of the Perfetto trace from the steps frame: (track, steps column, series, divisor to the unit)
COUNTER_TRACKS = (("VRAM in use", "vram_used_bytes", "GiB", GIB), ("RAM in use", "ram_used_bytes", "GiB", GIB),
                  ("lent slots", "lent_slots", "slots", 1))


def _counter_events(steps: pd.DataFrame) -> list[dict]:
    """"C" counter events, sampled at each step's start with what its row records: VRAM and RAM in use and
    lent slots (a sample only where the value changes: a counter holds its value until the next one), and the
    step's hit rate hits / lookups in % (every step with lookups; a step without, a Strata refill, adds no
    sample, so the track holds the previous step's rate through it)."""
    steps = steps.sort_values("start_s", kind="stable")
    ts = steps["start_s"].to_numpy(float) * 1e6  # µs
    events = []
    for track, column, series, unit in COUNTER_TRACKS:
        if column not in steps:
            continue
        values = steps[column].to_numpy()
        changed = np.r_[True, values[1:] != values[:-1]]
        events += [{"ph": "C", "name": track, "pid": 1, "ts": float(t), "args": {series: float(v) / unit}}
                   for t, v in zip(ts[changed], values[changed])]
    lookups = steps["lookups"].to_numpy(float)
    rate = 100 * steps["hits"].to_numpy(float) / np.where(lookups > 0, lookups, np.nan)
    events += [{"ph": "C", "name": "hit rate", "pid": 1, "ts": float(t), "args": {"%": float(r)}}
               for t, r in zip(ts[lookups > 0], rate[lookups > 0])]
    return events


def write_perfetto(steps: pd.DataFrame, summary: dict, path: str | Path, links: pd.DataFrame | None = None) -> int:
    trace = perfetto_trace(steps, summary, links)
    try:
        Path(path).write_text(dumps(trace))
    except OSError as exc:
        raise InputError(str(path), "perfetto", str(path), f"cannot write: {exc.strerror}") from None
    return sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
