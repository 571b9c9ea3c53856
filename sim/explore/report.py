"""Reports: one self-contained, offline HTML file from a run or sweep results folder, and a Perfetto trace.

    html = build_report("out/ds4run")          # a run folder: summary.json + steps.parquet ...
    html = build_report("out/sweep")           # a sweep folder: manifest.json + points/
    trace = perfetto_trace(steps, summary)     # Chrome trace-event JSON of a run

The HTML embeds the plotly.js bundle inline (no CDN, no network; `plotly_js="cdn"`: plotly's own <script src> to
its CDN instead) and each figure's spec as a JSON `<script type="application/json" class="expertsim-figure">`
block, plotly's default template once for all of them, drawn by a small inline script. A sweep report opens with
a "what changed most" paragraph (`what_changed_most`). Axes are titled with a short name and unit: grid keys from
the engines' knobs, metrics from their suffix (docs/metrics.md).

Link lanes (timeline figure and Perfetto trace) are the machine's busy intervals as its resources logged them
(links.parquet, sim/machine/). A results folder written before links.parquet existed has only
each step's bytes, start and end, so there a link's busy time (summary `links`) is apportioned over the steps:
byte links by the step's share of the bytes they move (PCIe H2D and host memcpy by h2d_bytes, D2D by d2d_bytes,
D2H by d2h_bytes, file/SSD by file_read_bytes), the others (GPU compute, host calls, stream syncs) by the step's
share of the stepped time. Per lane the totals are exact; the placement within the run is an estimate.

Miss-ratio curves (routing.parquet, the measured request's routing): per size class, the decode hit rate of an
evicting LRU at every cache size from one Mattson pass (sim.cache.replay.lru_mrc) and the Belady bound at a few
sizes from the OPT kernel, next to the run's own capacity and hit rate (see `hit_rate_curves`).
"""

from __future__ import annotations

import html as html_lib
import json
import re
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd

from sim.results import LINK_COLUMNS
from sim.errors import InputError
from sim.outputs import dumps
from sim.trace.format import MISSING, PHASE_DECODE, PHASE_PREFILL
from sim.units import GIB, MIB

RUN_FILES = ("summary.json", "steps.parquet")
# One figure per metric a sweep's rows hold (all-null metrics are skipped: a cache-only replay has no tok/s,
# an engine run no overall hit_rate).
SWEEP_METRICS = ("decode_tok_s", "prefill_tok_s", "decode_hit_rate", "prefill_hit_rate", "hit_rate")
ROUTING_COLUMNS = ("phase", "token", "layer", "class", "expert_bytes", "experts")  # sim.results.routing_table
# Cache sizes per size class of the miss-ratio figure, log-spaced from 1 slot to every key the request touches.
# The exact LRU curve has one value per slot count (up to 37 x 256 = 9,472 for ds4's q2 class): 200 points keep
# its shape and the figure's JSON to a few tens of kB. The Belady bound costs one OPT replay per size: 12.
LRU_POINTS = 200
BELADY_POINTS = 12
# A grid dimension with at most this many values (or any text value) is drawn on a categorical axis: one tick per
# value, evenly spaced, and in a heatmap one labelled cell each. Longer numeric ranges keep a linear axis.
CATEGORY_MAX_VALUES = 12
PLOTLY_JS_MODES = ("inline", "cdn")  # plotly.js in the page (works offline) or a <script src> to plotly's CDN


# --------------------------------------------------------------------------------------------- labels


def _dimension_name(key: str) -> tuple[str, str]:
    """A grid key's short name and unit ("" for none): an engine's knob of that key (Engine.knobs: the engines' own
    flag semantics, ds4's reserve in whole GiB, Strata's --expert-cache a count of its largest experts), else its
    last dotted part."""
    from sim.engines import ENGINES

    knob = next((k for engine in ENGINES.values() for k in engine.knobs if k.key == key), None)
    return (knob.name, knob.unit) if knob is not None else (key.rsplit(".", 1)[-1], "")


def _is_rate(metric: str) -> bool:
    """A fraction shown in % (hit rates and the Belady gap): on axes and cells (`_value_format`) and in the
    headline (`with_unit`) alike."""
    return metric.endswith("hit_rate") or metric == "belady_gap"


# The unit a metric's name ends in (docs/metrics.md's naming), as the values are stored.
METRIC_SUFFIX_UNITS = (("_tok_s", "tok/s"), ("_mib", "MiB"), ("_bytes", "bytes"), ("_s", "s"))


def _metric_name(metric: str) -> tuple[str, str]:
    """A headline metric's short name and unit, from its name's suffix (METRIC_SUFFIX_UNITS); a rate is in %."""
    if _is_rate(metric):
        return metric.replace("_", " "), "%"
    for suffix, unit in METRIC_SUFFIX_UNITS:
        if metric.endswith(suffix):
            return metric[: -len(suffix)].replace("_", " "), unit
    return metric.replace("_", " "), ""


def _titled(name: str, unit: str) -> str:
    return f"{name} ({unit})" if unit else name


def _dimension_title(key: str) -> str:
    return _titled(*_dimension_name(key))


def _metric_title(metric: str) -> str:
    return _titled(*_metric_name(metric))


def _value_format(metric: str) -> str:
    """The d3 format of a metric's values on axes, cells and hovers: hit rates are fractions drawn as %."""
    return ".1%" if _is_rate(metric) else ",.1f"


# --------------------------------------------------------------------------------------------- inputs


def _kind(results: Path) -> str:
    if not results.is_dir():
        raise InputError(str(results), "results", str(results), "not a folder (expected a run or sweep results folder)")
    if (results / "manifest.json").is_file():
        if not (results / "points").is_dir():
            raise InputError(str(results), "points", str(results / "points"), "sweep results folder without points/")
        return "sweep"
    if (results / "summary.json").exists() or (results / "steps.parquet").exists():
        missing = [name for name in RUN_FILES if not (results / name).is_file()]
        if missing:
            raise InputError(str(results), "missing", ", ".join(missing), "run results folder lacks these files")
        return "run"
    raise InputError(str(results), "results", str(results), "neither a run results folder (summary.json, "
                     "steps.parquet) nor a sweep results folder (manifest.json, points/)")


def load_run(results: str | Path) -> tuple[dict, pd.DataFrame]:
    results = Path(results)
    try:
        summary = json.loads((results / "summary.json").read_text())
    except (OSError, ValueError) as exc:
        raise InputError(str(results), "summary.json", str(results / "summary.json"), f"unreadable: {exc}") from None
    try:
        steps = pd.read_parquet(results / "steps.parquet")
    except Exception as exc:  # noqa: BLE001 - any unreadable Parquet is bad input
        raise InputError(str(results), "steps.parquet", str(results / "steps.parquet"),
                         f"unreadable: {type(exc).__name__}") from None
    need = {"request", "phase", "step", "layer", "start_s", "end_s", "lookups", "hits"}
    if not need <= set(steps.columns):
        raise InputError(str(results), "steps.parquet", ", ".join(sorted(need - set(steps.columns))),
                         "missing columns")
    return summary, steps


def _read_table(results: Path, name: str, columns: tuple[str, ...]):
    """An optional file of a run folder (absent in folders written before it existed) as a pyarrow Table: None
    when missing."""
    import pyarrow.parquet as pq

    path = results / name
    if not path.exists():
        return None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - any unreadable Parquet is bad input
        raise InputError(str(results), name, str(path), f"unreadable: {type(exc).__name__}") from None
    if not set(columns) <= set(table.column_names):
        raise InputError(str(results), name, ", ".join(sorted(set(columns) - set(table.column_names))),
                         "missing columns")
    return table


def load_links(results: str | Path) -> pd.DataFrame | None:
    """links.parquet of a run folder: every busy interval of every link; None when the folder has none."""
    table = _read_table(Path(results), "links.parquet", LINK_COLUMNS)
    return None if table is None else table.to_pandas()


def load_routing(results: str | Path):
    """routing.parquet of a run folder as (Trace, Geometry), size classes and expert bytes as the run recorded
    them; None when the folder has none."""
    import pyarrow.compute as pc

    from sim.cache.replay import Geometry
    from sim.trace.format import Trace, TraceHeader

    results = Path(results)
    table = _read_table(results, "routing.parquet", ROUTING_COLUMNS)
    if table is None:
        return None
    where = str(results / "routing.parquet")
    if not table.num_rows:
        raise InputError(where, "rows", 0, "no routed cell")
    lists = table.column("experts").combine_chunks()
    widths = pc.unique(pc.list_value_length(lists)).to_pylist()
    if len(widths) != 1 or not widths[0]:
        raise InputError(where, "experts", widths, "every cell lists the same number (top-k >= 1) of experts")
    cells = lists.flatten().to_numpy(zero_copy_only=False).astype(np.int64).reshape(-1, widths[0])
    frame = table.drop_columns(["experts"]).to_pandas()
    phase = frame["phase"].astype(str).to_numpy()
    if not np.isin(phase, ("prefill", "decode")).all():
        raise InputError(where, "phase", sorted(set(phase) - {"prefill", "decode"})[0], "expected prefill or decode")
    for name, bad in (("layer", frame["layer"] < 0), ("class", frame["class"] < 0),
                      ("expert_bytes", frame["expert_bytes"] < 0)):
        if bad.any():
            raise InputError(where, name, int(frame[name][bad].iloc[0]), "must be >= 0")
    if cells.min() < 0 or cells.max() >= int(MISSING):
        raise InputError(where, "experts", f"{cells.min()}..{cells.max()}", f"expert ids are 0..{int(MISSING) - 1}")
    # one layer per cell: its size class and expert bytes; one expert size per class
    per_layer = frame.groupby("layer")[["class", "expert_bytes"]].nunique()
    per_class = frame.groupby("class")["expert_bytes"].nunique()
    if (per_layer > 1).any(axis=None) or (per_class > 1).any():
        raise InputError(where, "class/expert_bytes", "varies", "one size class per layer, one expert size per class")
    # one trace row per (phase, token), in file order: a new row wherever phase or token changes
    layer = frame["layer"].to_numpy(np.int64)
    token = frame["token"].to_numpy(np.int64)
    new_row = np.r_[True, (phase[1:] != phase[:-1]) | (token[1:] != token[:-1])]
    row = np.cumsum(new_row) - 1
    n_layers, n_experts, top_k = int(layer.max()) + 1, int(cells.max()) + 1, cells.shape[1]
    if len(np.unique(row * n_layers + layer)) != len(row):
        raise InputError(where, "token/layer", "repeated", "one row per (token, layer) cell")
    experts = np.full((int(row[-1]) + 1, n_layers, top_k), MISSING, np.uint16)
    experts[row, layer] = cells
    first = frame.drop_duplicates("layer")
    class_of_layer = np.zeros(n_layers, np.int16)  # a layer without cells is never looked up: any class
    class_of_layer[first["layer"].to_numpy(np.int64)] = first["class"].to_numpy(np.int64)
    expert_bytes = np.zeros(n_layers, np.int64)
    expert_bytes[first["layer"].to_numpy(np.int64)] = first["expert_bytes"].to_numpy(np.int64)
    class_bytes = np.zeros(int(class_of_layer.max()) + 1, np.int64)
    class_bytes[first["class"].to_numpy(np.int64)] = first["expert_bytes"].to_numpy(np.int64)
    decode = phase[new_row] == "decode"
    if decode.any() and not decode[int(np.argmax(decode)):].all():
        raise InputError(where, "phase", "prefill after decode", "the prompt's rows come before the decode rows")
    header = TraceHeader("run", n_layers, n_experts, top_k, where, "")
    trace = Trace(header, np.zeros(len(decode)), np.arange(len(decode)),
                  np.where(decode, PHASE_DECODE, PHASE_PREFILL), experts)
    return trace, Geometry(n_layers, n_experts, expert_bytes, class_of_layer, class_bytes)


# ------------------------------------------------------------------------------------ miss-ratio curves


def _log_sizes(upper: int, n: int) -> np.ndarray:
    return np.unique(np.round(np.geomspace(1, max(int(upper), 1), n)).astype(np.int64))


def hit_rate_curves(trace, geometry, run_slots: dict[int, int] | None = None) -> pd.DataFrame:
    """Per size class with decode lookups, the decode hit rate vs cache slots of that class (one pool per class):
    policy "lru" at LRU_POINTS log-spaced sizes (exact, from one stack-distance pass: an evicting LRU, the prompt
    rows warming it token by token) and "belady" (`sim.cache.replay.decode_bound_hits`) at BELADY_POINTS of them, each up to every
    key the request touches in the class (or the run's slots, when larger), the run's slots (class -> slots)
    included.
    Columns: class, policy, slots, hits, lookups, hit_rate."""
    from sim.cache.replay import decode_bound_hits, lru_mrc

    mrc = lru_mrc(trace, geometry, "class")
    lookups = mrc.hist[:, PHASE_DECODE].sum(axis=1) + mrc.cold[:, PHASE_DECODE]
    classes = [c for c in range(geometry.n_classes) if lookups[c]]
    belady_sizes, rows = {}, []
    for c in classes:
        upper = int(mrc.cold[c].sum())  # distinct keys: past them an LRU never evicts
        extra = [int(run_slots[c])] if run_slots and c in run_slots else []
        upper = max([upper, *extra])
        belady_sizes[c] = np.union1d(_log_sizes(upper, BELADY_POINTS), extra).astype(np.int64)
        hits = np.cumsum(mrc.hist[c, PHASE_DECODE])  # hits[s]: accesses at stack distance <= s
        for s in np.union1d(_log_sizes(upper, LRU_POINTS), belady_sizes[c]).astype(np.int64):
            rows.append((c, "lru", int(s), int(hits[min(s, len(hits) - 1)])))
    for i in range(max((len(v) for v in belady_sizes.values()), default=0)):  # one OPT replay per size
        capacity = np.zeros(geometry.n_classes, np.int64)
        for c, sizes in belady_sizes.items():
            capacity[c] = sizes[min(i, len(sizes) - 1)]
        bound = decode_bound_hits(trace, geometry, capacity)
        rows += [(c, "belady", int(capacity[c]), int(bound[c])) for c in classes if i < len(belady_sizes[c])]
    frame = pd.DataFrame.from_records(rows, columns=["class", "policy", "slots", "hits"])
    frame["lookups"] = lookups[frame["class"].to_numpy(np.int64)].astype(np.int64)
    frame["hit_rate"] = frame["hits"] / frame["lookups"]
    return frame


def run_class_points(summary: dict, steps: pd.DataFrame, geometry) -> pd.DataFrame:
    """The run's own point per size class: its slots (engine_state cache_slots_per_class, one pool per class)
    and the measured request's decode hit rate from steps.parquet's per-layer rows. Empty when the run has no
    per-class pools (a slab, Strata's one pool) or no per-layer decode rows (Strata's decode steps span every
    layer). Columns: class, slots, hits, lookups, hit_rate."""
    slots = (summary.get("engine_state") or {}).get("cache_slots_per_class")
    columns = ["class", "slots", "hits", "lookups", "hit_rate"]
    if not isinstance(slots, list) or len(slots) != geometry.n_classes:
        return pd.DataFrame(columns=columns)
    mine = steps[(steps["request"] == summary.get("measured_request")) & (steps["phase"] == "decode")
                 & (steps["layer"] >= 0) & (steps["layer"] < geometry.n_layers)]
    if mine.empty:
        return pd.DataFrame(columns=columns)
    cls = geometry.class_of_layer[mine["layer"].to_numpy(np.int64)]
    hits = np.bincount(cls, weights=mine["hits"].to_numpy(float), minlength=geometry.n_classes)
    lookups = np.bincount(cls, weights=mine["lookups"].to_numpy(float), minlength=geometry.n_classes)
    keep = lookups > 0
    return pd.DataFrame({"class": np.flatnonzero(keep), "slots": np.asarray(slots, np.int64)[keep],
                         "hits": hits[keep].astype(np.int64), "lookups": lookups[keep].astype(np.int64),
                         "hit_rate": hits[keep] / lookups[keep]})


def _mrc_figure(summary: dict, steps: pd.DataFrame, trace, geometry):
    import plotly.graph_objects as go
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    points = run_class_points(summary, steps, geometry)
    curves = hit_rate_curves(trace, geometry, dict(zip(points["class"].tolist(), points["slots"].tolist())))
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=("decode hit rate", "decode miss ratio (log)"))
    star = {"mode": "markers", "marker": {"symbol": "star", "size": 14, "line": {"color": "black", "width": 1}}}
    for c, part in curves.groupby("class", sort=True):
        color = qualitative.Plotly[int(c) % len(qualitative.Plotly)]
        layers = int((geometry.class_of_layer == c).sum())
        label = f"class {c}: {geometry.class_bytes[c] / MIB:.2f} MiB experts, {layers} layers"
        series = [(part[part["policy"] == "lru"], "LRU", {"mode": "lines", "line": {"color": color}}),
                  (part[part["policy"] == "belady"], "Belady bound",
                   {"mode": "lines+markers", "line": {"color": color, "dash": "dot"}})]
        mine = points[points["class"] == c]
        if len(mine):
            series.append((mine, "this run", {**star, "marker": {**star["marker"], "color": color}}))
        for frame, name, style in series:
            miss = (1.0 - frame["hit_rate"]).where(frame["hit_rate"] < 1)  # a log axis has no 0: leave a gap
            for row, y in ((1, frame["hit_rate"]), (2, miss)):
                fig.add_trace(go.Scatter(x=frame["slots"].tolist(), y=[None if pd.isna(v) else float(v) for v in y],
                                         name=f"{label}, {name}", legendgroup=f"class {c}", showlegend=row == 1,
                                         **style), row, 1)
    fig.update_xaxes(type="log", title_text="cache size (slots of the class, log)", showticklabels=True)
    fig.update_yaxes(title_text="hit rate (%)", tickformat=".0%", row=1, col=1)
    fig.update_yaxes(type="log", title_text="miss ratio (fraction, log)", row=2, col=1)
    request = summary.get("measured_request")
    fig.update_layout(title=f"Decode hit rate vs cache size per size class (request {request}: its prompt warms "
                            "the cache, its decode tokens are counted)", height=800)
    return fig


# ------------------------------------------------------------------------------------------ link lanes


def _link_column(name: str) -> str | None:
    """The steps column whose bytes a link moves, or None for a time-only link."""
    low = name.lower()
    if "d2d" in low:
        return "d2d_bytes"
    if "d2h" in low:
        return "d2h_bytes"
    if "h2d" in low or "pcie" in low or "memcpy" in low:
        return "h2d_bytes"
    if "file" in low or "ssd" in low or "disk" in low:
        return "file_read_bytes"
    return None


def link_busy_per_step(steps: pd.DataFrame, summary: dict) -> dict[str, np.ndarray]:
    """Each busy link's busy time apportioned over the steps (seconds per step row); sums to its busy_s."""
    duration = (steps["end_s"] - steps["start_s"]).clip(lower=0).to_numpy(dtype=float)
    lanes: dict[str, np.ndarray] = {}
    for link in summary.get("links", []):
        busy = float(link.get("busy_s") or 0.0)
        if busy <= 0:
            continue
        column = _link_column(str(link["link"]))
        weight = steps[column].to_numpy(dtype=float) if column in steps.columns else duration
        if weight.sum() <= 0:
            weight = duration if duration.sum() > 0 else np.ones(len(steps))
        lanes[str(link["link"])] = busy * weight / weight.sum()
    return lanes


# ------------------------------------------------------------------------------------------- perfetto


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


# ----------------------------------------------------------------------------------------- run figures


def _groups(steps: pd.DataFrame) -> pd.DataFrame:
    """One row per (request, phase, step): a decode token or a prefill chunk, in time order."""
    keys = ["request", "phase", "step"]
    agg = {"start_s": "min", "end_s": "max", "lookups": "sum", "hits": "sum"}
    for c in ("h2d_bytes", "d2d_bytes", "file_read_bytes", "d2h_bytes"):
        if c in steps:
            agg[c] = "sum"
    for c in ("lent_slots", "vram_used_bytes", "ram_used_bytes"):
        if c in steps:
            agg[c] = "max"
    g = steps.groupby(keys, sort=False).agg(agg).reset_index().sort_values("start_s", kind="stable")
    g["label"] = [f"r{r} {p} {s}" for r, p, s in zip(g["request"], g["phase"], g["step"])]
    return g.reset_index(drop=True)


def hit_heatmap_matrix(steps: pd.DataFrame) -> tuple[list[str], list[int], list[list[float | None]]]:
    """Per-layer hit rate: columns are the step groups (r0 prefill 0, r0 decode 0...), rows the layers."""
    groups = _groups(steps)
    table = steps.groupby(["layer", "request", "phase", "step"], sort=False)[["hits", "lookups"]].sum()
    rate = (table["hits"] / table["lookups"].where(table["lookups"] > 0)).unstack("layer")
    index = pd.MultiIndex.from_frame(groups[["request", "phase", "step"]])
    rate = rate.reindex(index)
    layers = sorted(int(x) for x in rate.columns)
    z = [[None if pd.isna(v) else float(v) for v in rate[layer].to_numpy()] for layer in layers]
    return list(groups["label"]), layers, z


def _link_busy_per_group(links: pd.DataFrame, groups: pd.DataFrame) -> dict[str, np.ndarray]:
    """Each link's booked busy time per step group, an interval counted in the group it starts in (the last
    group starting at or before it; the first group for anything earlier), so a lane sums to its busy time."""
    starts = groups["start_s"].to_numpy(float)
    lanes: dict[str, np.ndarray] = {}
    for name, lane in links.groupby("link", sort=False):
        duration = (lane["end_s"] - lane["start_s"]).to_numpy(float)
        if duration.sum() <= 0:
            continue
        at = np.clip(np.searchsorted(starts, lane["start_s"].to_numpy(float), side="right") - 1, 0, len(starts) - 1)
        lanes[str(name)] = np.bincount(at, weights=duration, minlength=len(starts))
    return lanes


TIMELINE_PANEL_PX = 220  # height of one timeline panel
TIMELINE_GAP_PX = 95  # between panels: the x tick labels and title of one, the subplot title of the next
TIMELINE_LEGEND_PX = 230  # right margin, where each panel's legend sits
STEP_BYTES = (("file_read_bytes", "file read"), ("h2d_bytes", "H2D"), ("d2d_bytes", "D2D"), ("d2h_bytes", "D2H"))


def _phase_clock(groups: pd.DataFrame) -> np.ndarray:
    """Each group's start on its phase's own clock: simulated time from the phase's first step, the time between
    one request's last step of the phase and the next request's first cut out (other phases ran there: on
    simulated time a warm-up request's decode and the measured one's would sit 17 s apart at the axis' ends)."""
    start, end = groups["start_s"].to_numpy(float), groups["end_s"].to_numpy(float)
    request = groups["request"].to_numpy()
    new_request = np.r_[False, request[1:] != request[:-1]]
    cut = np.where(new_request, start - np.r_[start[0], end[:-1]], 0.0)
    return start - start[0] - np.cumsum(cut)


def _step_line(groups: pd.DataFrame, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A step function on the phase clock (`_phase_clock`): each group's value from its start to the next
    group's start, the last group's to its end; a gap (NaN: plotly.js breaks the line there) where the request
    changes. Returns x (phase clock), y and each point's simulated time, as arrays (plotly writes them as compact
    typed arrays)."""
    clock = _phase_clock(groups)
    start, end = groups["start_s"].to_numpy(float), groups["end_s"].to_numpy(float)
    values = np.asarray(values, float)
    last = np.flatnonzero(np.r_[groups["request"].to_numpy()[1:] != groups["request"].to_numpy()[:-1], True])
    at = np.repeat(last + 1, 2)  # after each request's last group: its end (holding its value), then a gap
    gap = np.full(len(last), np.nan)

    def closed(points: np.ndarray, closing: np.ndarray) -> np.ndarray:
        return np.insert(points, at, np.column_stack([closing, gap]).ravel())[:-1]  # no gap after the last

    return (closed(clock, clock[last] + end[last] - start[last]), closed(values, values[last]),
            closed(start, end[last]))


def _timeline(groups: pd.DataFrame, lanes: dict[str, np.ndarray], link_title: str, phase: str, title: str):
    """One phase's step groups in panels on the phase's clock, each panel with its own legend and axis titles;
    a series that is zero throughout (a link idle in this phase, lent slots of an engine that never lends) is left
    out, and so is a panel left without series. Where the request changes a dotted line marks it."""
    import plotly.graph_objects as go
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    ms = 1e3  # seconds -> ms
    lookups = groups["lookups"].to_numpy(float)
    hit_rate = groups["hits"].to_numpy(float) / np.where(lookups > 0, lookups, np.nan)
    # (panel title, y axis title, tick format, hover format, series)
    candidates = [
        (link_title, "time (ms)", None, ",.2f",
         [*((name, busy * ms) for name, busy in lanes.items()),
          ("step wall", (groups["end_s"] - groups["start_s"]).to_numpy(float) * ms)]),
        ("hits / lookups per step", "hit rate (%)", ".0%", ".1%", [("hit rate", hit_rate)]),
        ("copied per step", "bytes (MiB)", None, ",.1f",
         [(name, groups[c].to_numpy(float) / MIB) for c, name in STEP_BYTES if c in groups]),
        ("cache slots lent to the prompt path", "lent (slots)", None, ",.0f",
         [("lent slots", groups["lent_slots"].to_numpy(float))] if "lent_slots" in groups else []),
        ("memory in use", "in use (GiB)", None, ",.2f",
         [(name, groups[c].to_numpy(float) / GIB) for c, name in (("vram_used_bytes", "VRAM"),
                                                                  ("ram_used_bytes", "RAM")) if c in groups]),
    ]
    panels = [(*head, [(n, v) for n, v in series if np.nansum(np.abs(v)) > 0]) for *head, series in candidates]
    panels = [p for p in panels if p[-1]]
    height = len(panels) * (TIMELINE_PANEL_PX + TIMELINE_GAP_PX) + 120
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=TIMELINE_GAP_PX / height,
                        subplot_titles=[name for name, *_ in panels])
    for row, (_, y_title, tick_format, hover_format, series) in enumerate(panels, start=1):
        legend = "legend" if row == 1 else f"legend{row}"
        for i, (name, values) in enumerate(series):  # colours restart per panel: each has its own legend
            x, y, simulated = _step_line(groups, values)
            style = {"line": {"shape": "hv", "color": qualitative.Plotly[i % len(qualitative.Plotly)]},
                     "hovertemplate": f"{name}: %{{y}}<extra></extra>"}
            if name == "step wall":  # drawn last and dotted: a link busy all step long lies under it, not over it;
                # its hover, in the panel's unified hover, also gives the step's simulated time
                style = {"line": {"shape": "hv", "color": "black", "dash": "dot"}, "customdata": simulated,
                         "hovertemplate": f"{name}: %{{y}} (simulated time %{{customdata:.4f}} s)<extra></extra>"}
            fig.add_trace(go.Scatter(x=x, y=y, name=name, mode="lines", legend=legend, **style), row, 1)
        fig.update_yaxes(title_text=y_title, tickformat=tick_format, hoverformat=hover_format, row=row, col=1)
        top = fig.layout[f"yaxis{'' if row == 1 else row}"].domain[1]
        fig.update_layout({legend: {"x": 1.01, "xanchor": "left", "y": top, "yanchor": "top"}})
    request = groups["request"].to_numpy()
    changes = np.flatnonzero(np.r_[False, request[1:] != request[:-1]])
    if len(changes):
        clock = _phase_clock(groups)
        for i in np.r_[0, changes]:
            if i:
                fig.add_vline(x=float(clock[i]), line={"dash": "dot", "color": "grey", "width": 1}, row="all", col=1)
            fig.add_annotation(x=float(clock[i]), y=1, xref="x", yref="y domain", text=f"request {request[i]}",
                               showarrow=False, xanchor="left", yanchor="top", font={"size": 10},
                               bgcolor="rgba(255,255,255,0.7)")
    # every panel keeps its own tick labels and axis title: it reads alone, zooming moves them all
    fig.update_xaxes(showticklabels=True, title_text=f"{phase} time (s)")
    fig.update_layout(title=title, height=height, margin={"r": TIMELINE_LEGEND_PX}, hovermode="x unified")
    return fig


def _run_figures(summary: dict, steps: pd.DataFrame, intervals: pd.DataFrame | None = None,
                 routing=None) -> list[tuple[str, object]]:
    import plotly.graph_objects as go

    figures: list[tuple[str, object]] = []
    rows = [(k, v) for k, v in summary.items() if not isinstance(v, (dict, list))]
    figures.append(("Headline", go.Figure(go.Table(
        header={"values": ["key", "value"]},
        cells={"values": [[k for k, _ in rows], [with_unit(k, v) for k, v in rows]], "align": "left"}),
        layout={"title": "Headline metrics", **_table_size(len(rows))})))
    state = summary.get("engine_state", {})
    per_class = state.get("cache_slots_per_class")
    if per_class:
        sizes = state.get("class_expert_bytes") or [None] * len(per_class)
        figures.append(("Cache per size class", go.Figure(go.Table(
            header={"values": ["size class", "slots", "expert size", "cache"]},
            cells={"values": [list(range(len(per_class))), [f"{n:,}" for n in per_class],
                              [with_unit("x_bytes", b) for b in sizes],
                              [with_unit("x_bytes", n * b) if b else "" for n, b in zip(per_class, sizes)]]}),
            layout={"title": "Expert cache per size class", **_table_size(len(per_class))})))
    notes = [("engine", n) for n in state.get("notices", [])] + \
        [("out of domain", n) for n in summary.get("out_of_domain", [])]
    if notes:  # what the engine decided on its own (a capped cache, say) and figures used beyond their record
        figures.append(("Notices", go.Figure(go.Table(
            header={"values": ["from", "notice"]}, columnwidth=[1, 8],
            cells={"values": [[a for a, _ in notes], [b for _, b in notes]], "align": "left"}),
            layout={"title": "What the engine reported, and where the model is outside its records",
                    **_table_size(2 * len(notes))})))

    links = summary.get("links", [])
    if links:
        figures.append(("Links", go.Figure(go.Table(
            header={"values": ["link", "busy", "bytes", "ops", "utilisation"]},
            cells={"values": [[_cell(link.get("link")) for link in links],
                              *[[with_unit(key, link.get(c)) for link in links]
                                for c, key in (("busy_s", "busy_s"), ("bytes", "link_bytes"), ("ops", "ops"))],
                              [f"{100 * link['utilisation']:.1f} %" if link.get("utilisation") is not None else ""
                               for link in links]]}),
            layout={"title": "Links (whole run)", **_table_size(len(links))})))

    # timelines: per step group (a decode token or a prefill chunk) over simulated time, one figure per phase: a
    # prefill chunk takes seconds and a decode token tens of ms, so on one scale the decode steps are a flat line
    g = _groups(steps)
    if intervals is not None:
        link_title, lanes = "link busy per step", _link_busy_per_group(intervals, g)
    else:
        link_title = "link busy per step (apportioned)"
        position = pd.MultiIndex.from_frame(g[["request", "phase", "step"]]).get_indexer(
            steps.set_index(["request", "phase", "step"]).index)
        lanes = {name: np.bincount(position, weights=busy, minlength=len(g))
                 for name, busy in link_busy_per_step(steps, summary).items()}
    for phase, unit in (("prefill", "prefill chunk"), ("decode", "decode token")):
        mine = (g["phase"] == phase).to_numpy()
        if mine.any():
            timeline = _timeline(g[mine], {name: busy[mine] for name, busy in lanes.items()}, link_title, phase,
                                 f"{phase.capitalize()} timeline: one step per {unit}, on the phase's own clock "
                                 "(simulated time, other phases cut out)")
            figures.append((f"{phase.capitalize()} timeline", timeline))

    labels, layers, z = hit_heatmap_matrix(steps)
    heat = go.Figure(go.Heatmap(x=labels, y=layers, z=z, zmin=0, zmax=1, colorscale="Viridis",
                                colorbar={"title": {"text": "hit rate (%)"}, "tickformat": ".0%"},
                                hoverongaps=False,
                                hovertemplate="%{x}<br>layer %{y}<br>hit rate %{z:.1%}<extra></extra>"))
    heat.update_layout(title="Per-layer hit rate (hits / lookups) per step",
                       xaxis_title="step (request, phase, index)", yaxis_title="layer (index)", height=600)
    figures.append(("Hit heatmap", heat))
    if routing is not None:
        figures.append(("Miss-ratio curves", _mrc_figure(summary, steps, *routing)))
    if summary.get("uncertainty"):
        figures += _uncertainty_figures(summary)
    return figures


def _uncertainty_figures(summary: dict) -> list[tuple[str, object]]:
    """`run --uncertainty N`: the metrics' p10 / median / p90, and a tornado chart of what moves the headline
    rate most (each estimated input alone at the ends of its range, against the run's own figure)."""
    import plotly.graph_objects as go

    from sim.explore.uncertainty import rank_sensitivity

    u = summary["uncertainty"]
    bands = [(k, b) for k, b in u["bands"].items() if b["n"] and summary.get(k) is not None]
    table = go.Figure(go.Table(
        header={"values": ["metric", "this run", "p10", "median", "p90"]},
        cells={"values": [[k for k, _ in bands], [_cell(summary[k]) for k, _ in bands],
                          *[[_cell(b[q]) for _, b in bands] for q in ("p10", "median", "p90")]]}),
        layout={"title": f"Under uncertainty: {u['n']} samples of {len(u['inputs'])} estimated inputs",
                **_table_size(len(bands))})
    metric = "decode_tok_s" if summary.get("decode_tok_s") else "prefill_tok_s"
    base = summary.get(metric) or 0.0
    top = [r for r in rank_sensitivity(u["sensitivity"], metric)[:12]
           if r.get(f"{metric}@low") is not None and r.get(f"{metric}@high") is not None][::-1]
    fig = go.Figure()
    for end, colour in (("low", "#4c78a8"), ("high", "#f58518")):
        fig.add_trace(go.Bar(y=[r["input"] for r in top], x=[r[f"{metric}@{end}"] - base for r in top],
                             base=[base] * len(top), orientation="h", name=f"input at its {end} end",
                             marker_color=colour))
    fig.update_layout(title=f"What moves {metric} most (tornado: each input alone at the ends of its range)",
                      barmode="overlay", xaxis_title=f"{_metric_title(metric)}, this run {base:,.2f}",
                      yaxis_title="estimated input",
                      height=120 + 28 * len(top), margin={"l": 260})
    return [("Uncertainty", table), ("Sensitivity", fig)]


def _table_size(rows: int) -> dict:
    """A table figure tall enough to show every row without scrolling: plotly draws a 28 px header and 20 px rows
    (a long value wraps onto a second line: 24 px a row of slack), under a 60 px title margin."""
    return {"height": 60 + 20 + 28 + 24 * rows, "margin": {"t": 60, "b": 20}}


def with_unit(key: str, value) -> str:
    """A headline figure as a reader wants it: tok/s, %, GiB or MiB, s, counts with separators."""
    if value is None or isinstance(value, (bool, str)):
        return _cell(value)
    if isinstance(value, float) and np.isnan(value):
        return "-"
    if key.endswith("_tok_s"):
        return f"{value:,.1f} tok/s"
    if _is_rate(key):
        return f"{100 * value:.1f} %"
    if key.endswith("_mib"):
        return f"{value / 1024:,.2f} GiB" if value >= 1024 else f"{value:,.1f} MiB"
    if key.endswith("_bytes"):
        return f"{value / GIB:,.2f} GiB" if value >= GIB else f"{value / MIB:,.2f} MiB"
    if key.endswith("_s"):
        return f"{value:,.3f} s"
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}"
    return _cell(value)


def _cell(value) -> str:
    if isinstance(value, float):
        return "-" if np.isnan(value) else f"{value:.4g}"
    if value is None or value is pd.NA or value is pd.NaT:  # a point without an error has none, not "<NA>"
        return ""
    return str(value)


def _sorted_by(frame: pd.DataFrame, dims: list[str]) -> pd.DataFrame:
    """Rows in grid order: by each dimension in turn, numbers by value (2048 before 10240), text as text."""
    keys = {d: pd.to_numeric(frame[d], errors="coerce") if _numeric(frame[d]) else frame[d].astype(str)
            for d in dims}
    if not keys:
        return frame
    return frame.assign(**{f"_sort_{i}": k for i, k in enumerate(keys.values())}) \
        .sort_values([f"_sort_{i}" for i in range(len(keys))], kind="stable")


# --------------------------------------------------------------------------------------- sweep figures


def _sweep_dims(results: Path, frame: pd.DataFrame) -> list[str]:
    try:
        manifest = json.loads((results / "manifest.json").read_text())
    except (OSError, ValueError):
        raise InputError(str(results), "manifest.json", str(results / "manifest.json"), "unreadable") from None
    keys: list[str] = []
    for grid in manifest.get("grids", []):
        keys += [k for k in grid if k not in keys]
    return [k for k in keys if k in frame.columns and frame[k].nunique(dropna=True) > 1]


def _numeric(series: pd.Series) -> bool:
    return pd.to_numeric(series, errors="coerce").notna().all()


def _order(dims: list[str], frame: pd.DataFrame) -> list[str]:
    """Numeric dimensions first, cache-size keys before reserve keys before the rest."""
    def rank(k: str) -> tuple:
        low = k.lower()
        return (not _numeric(frame[k]), 1 if "reserve" in low else 0 if "cache" in low else 2)
    return sorted(dims, key=rank)


def _slider(names: list[str], per_value: int) -> dict:
    """Steps over the slices, each labelled with its settings ("reserve 8 GiB")."""
    steps = []
    for i, name in enumerate(names):
        visible = [j // per_value == i for j in range(len(names) * per_value)]
        steps.append({"method": "restyle", "args": [{"visible": visible}], "label": name})
    return {"active": 0, "currentvalue": {"prefix": "at "}, "steps": steps, "pad": {"t": 50}}


def _successful(frame: pd.DataFrame, dims: list[str]) -> pd.DataFrame:
    """The points without an error, in grid order, numeric grid values as numbers (flags and environment values
    are kept as text: "9472" -> 9472)."""
    ok = (frame[frame["error"].isna()] if "error" in frame else frame).copy()
    for d in dims:
        if _numeric(ok[d]):
            ok[d] = pd.to_numeric(ok[d])
    return _sorted_by(ok, dims)


def _plotted_metrics(ok: pd.DataFrame) -> list[str]:
    return [m for m in SWEEP_METRICS if m in ok and ok[m].notna().any()]


def _categorical(series: pd.Series) -> bool:
    return not _numeric(series) or series.nunique(dropna=True) <= CATEGORY_MAX_VALUES


def _axis(key: str, series: pd.Series) -> dict:
    return {"title": {"text": _dimension_title(key)}, **({"type": "category"} if _categorical(series) else {})}


def _sweep_figures(results: Path, frame: pd.DataFrame) -> list[tuple[str, object]]:
    import plotly.graph_objects as go

    dims = _order(_sweep_dims(results, frame), frame)
    ok = _successful(frame, dims)
    figures: list[tuple[str, object]] = []
    table_cols = list(dict.fromkeys(c for c in (*dims, *SWEEP_METRICS, "decode_hit_rate", "cache_slots", "error")
                                    if c in frame.columns))
    shown = _sorted_by(frame, dims)
    # grid keys by their short name and unit, metrics by their column name with each value in its unit
    figures.append(("Points", go.Figure(go.Table(
        header={"values": [_dimension_title(c) if c in dims else c for c in table_cols]},
        cells={"values": [[(_cell if c in dims or c == "error" else partial(with_unit, c))(v)
                           for v in shown[c].tolist()] for c in table_cols]}),
        layout={"title": f"Sweep points ({len(frame)}, {len(frame) - len(ok)} failed)",
                **_table_size(len(shown))})))
    if ok.empty or not dims:
        return figures
    numeric = [d for d in dims if _numeric(ok[d])]
    rest_of = (lambda used: [d for d in dims if d not in used])
    for metric in _plotted_metrics(ok):
        title, fmt = _metric_title(metric), _value_format(metric)
        if len(numeric) >= 2:
            xk, yk = numeric[0], numeric[1]
            rest = rest_of((xk, yk))
            slices = _slices(ok, rest)
            fig = go.Figure()
            for i, (name, part) in enumerate(slices):
                table = part.pivot_table(index=yk, columns=xk, values=metric, aggfunc="mean")
                fig.add_trace(go.Heatmap(
                    x=[_num(v) for v in table.columns], y=[_num(v) for v in table.index],
                    z=[[None if pd.isna(v) else float(v) for v in r] for r in table.to_numpy()],
                    colorscale="Viridis", colorbar={"title": {"text": title}, "tickformat": fmt}, visible=i == 0,
                    name=name, texttemplate=f"%{{z:{fmt}}}",
                    hovertemplate=f"{_dimension_title(xk)} %{{x}}<br>{_dimension_title(yk)} %{{y}}<br>"
                                  f"{title} %{{z:{fmt}}}<extra></extra>"))
            layout = {"title": f"{title} vs {_dimension_title(xk)} and {_dimension_title(yk)}",
                      "xaxis": _axis(xk, ok[xk]), "yaxis": _axis(yk, ok[yk]), "height": 550}
            if len(slices) > 1:
                layout["sliders"] = [_slider([n for n, _ in slices], 1)]
            fig.update_layout(**layout)
        else:
            xk = numeric[0] if numeric else dims[0]
            rest = rest_of((xk,))
            slices = _slices(ok, rest[:1])
            series = rest[1:]
            fig = go.Figure()
            per_slice = max(len(_slices(ok, series)), 1)
            for i, (name, part) in enumerate(slices):
                lines = _slices(part, series)
                for line_name, line in lines:
                    fig.add_trace(go.Scatter(x=[_num(v) for v in line[xk]], y=line[metric].tolist(),
                                             mode="lines+markers", name=line_name or title, visible=i == 0,
                                             hovertemplate=f"{_dimension_title(xk)} %{{x}}<br>{title} "
                                                           f"%{{y:{fmt}}}<extra></extra>"))
                for _ in range(per_slice - len(lines)):  # keep the slider's trace blocks aligned
                    fig.add_trace(go.Scatter(x=[], y=[], visible=False, showlegend=False))
            layout = {"title": f"{title} vs {_dimension_title(xk)}", "xaxis": _axis(xk, ok[xk]),
                      "yaxis": {"title": {"text": title}, "tickformat": fmt}, "height": 500}
            if len(slices) > 1:
                layout["sliders"] = [_slider([n for n, _ in slices], per_slice)]
            fig.update_layout(**layout)
        figures.append((f"{metric} sweep", fig))
    return figures


def _setting(key: str, value) -> str:
    """One grid setting as prose: "cache 9472 experts"."""
    name, unit = _dimension_name(key)
    return f"{name} {_cell(_num(value))}" + (f" {unit}" if unit else "")


def _difference(metric: str, delta: float) -> str:
    """A change of a metric with its unit; hit rates in percentage points."""
    return f"{100 * delta:.1f} pt" if _is_rate(metric) else with_unit(metric, delta)


def what_changed_most(frame: pd.DataFrame, dims: list[str]) -> str:
    """One paragraph over the successful points: per plotted metric, its lowest and highest point with their
    settings, and the grid dimensions ranked by how much they move it, a dimension's effect being the range of
    the metric's mean per value of that dimension (averaged over the other dimensions), largest first.
    Empty when no point succeeded or no dimension varies."""
    ok = _successful(frame, dims)
    if ok.empty or not dims:
        return ""
    sentences = []
    for metric in _plotted_metrics(ok):
        rows = ok[ok[metric].notna()]
        low, high = rows.loc[rows[metric].idxmin()], rows.loc[rows[metric].idxmax()]
        if low[metric] == high[metric]:
            sentences.append(f"{metric} is {with_unit(metric, low[metric])} at every point.")
            continue
        effects = []
        for d in dims:
            means = rows.groupby(d, sort=False)[metric].mean()
            effects.append((means.max() - means.min(), d, means))
        effects.sort(key=lambda e: -e[0])  # stable: a tie keeps the grid's order
        at = (lambda row: ", ".join(_setting(d, row[d]) for d in dims))
        text = (f"{metric} goes from {with_unit(metric, low[metric])} ({at(low)}) to "
                f"{with_unit(metric, high[metric])} ({at(high)}).")
        size, d, means = effects[0]
        if size == 0:
            text += " No grid dimension alone moves its mean: the settings only act together."
        else:
            text += (f" {_dimension_name(d)[0].capitalize()} moves it most, by {_difference(metric, size)}: its "
                     f"mean is {with_unit(metric, means.min())} at {_setting(d, means.idxmin())} and "
                     f"{with_unit(metric, means.max())} at {_setting(d, means.idxmax())}")
            others = [f"{_dimension_name(d)[0]} by {_difference(metric, size)}" if size else
                      f"{_dimension_name(d)[0]} not at all" for size, d, _ in effects[1:]]
            text += f"; then {', '.join(others)}." if others else "."
        sentences.append(text)
    if not sentences:
        return ""
    grid = " x ".join(f"{ok[d].nunique()} {_dimension_name(d)[0]}" for d in dims)
    return f"Over {len(ok)} successful points ({grid}): " + " ".join(sentences)


def _num(value):
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    return value


def _slices(frame: pd.DataFrame, keys: list[str]) -> list[tuple[str, pd.DataFrame]]:
    if not keys:
        return [("", frame)]
    out = []
    for values, part in frame.groupby(keys, sort=True, dropna=False):
        values = values if isinstance(values, tuple) else (values,)
        out.append((", ".join(_setting(k, v) for k, v in zip(keys, values)), part))
    return out


# ------------------------------------------------------------------------------------------------ html


def _plotly_loader(plotly_js: str) -> str:
    """The <script> that loads plotly.js: the bundle inline, or the tag plotly's own `to_html(include_plotlyjs=
    "cdn")` writes (its CDN URL for this plotly version, with the bundle's subresource integrity hash)."""
    import plotly.graph_objects as go
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    if plotly_js not in PLOTLY_JS_MODES:
        raise InputError("report", "plotly_js", plotly_js, f"expected one of {', '.join(PLOTLY_JS_MODES)}")
    if plotly_js == "inline":
        return f"<script type=\"text/javascript\">{get_plotlyjs()}</script>"
    fragment = pio.to_html(go.Figure(), include_plotlyjs="cdn", full_html=False)
    return re.search(r"<script[^>]*\bsrc=[^>]*></script>", fragment).group(0)


def _script_json(value) -> str:
    """JSON to sit in a <script> element: a "</" inside a string would end the element."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")


def _page(title: str, figures: list[tuple[str, object]], loader: str, summary: str = "") -> str:
    """The page: `loader` (`_plotly_loader`), the summary paragraph if any, then the figures."""
    parts = [f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html_lib.escape(title)}</title>",
             "<style>body{font-family:sans-serif;margin:1em 2em}h2{margin-top:1.5em}"
             "p.expertsim-summary{max-width:70em;line-height:1.45}</style>",
             f"{loader}</head><body>", f"<h1>{html_lib.escape(title)}</h1>"]
    if summary:
        parts.append(f"<h2>What changed most</h2><p class=\"expertsim-summary\">{html_lib.escape(summary)}</p>")
    # plotly.py writes its default template (~6.5 kB) into every figure: the page holds it once, each figure
    # that uses it gets it back when drawn
    specs = [json.loads(fig.to_json()) for _, fig in figures]
    template = specs[0]["layout"].get("template") if specs else None
    for spec in specs:
        if template is not None and spec["layout"].get("template") == template:
            del spec["layout"]["template"]
    parts.append(f"<script type=\"application/json\" id=\"expertsim-template\">{_script_json(template)}</script>")
    for i, ((name, _), spec) in enumerate(zip(figures, specs)):
        parts.append(f"<h2>{html_lib.escape(name)}</h2><div id=\"fig-{i}\" class=\"expertsim-plot\"></div>"
                     f"<script type=\"application/json\" class=\"expertsim-figure\" id=\"fig-{i}-spec\">"
                     f"{_script_json(spec)}</script>")
    parts.append("<script type=\"text/javascript\">var template=JSON.parse("
                 "document.getElementById('expertsim-template').textContent);"
                 "document.querySelectorAll('script.expertsim-figure').forEach(function(el){"
                 "var s=JSON.parse(el.textContent);if(template&&!s.layout.template){s.layout.template=template;}"
                 "Plotly.newPlot(el.id.slice(0,-5),s.data,s.layout,{responsive:true,displaylogo:false});});"
                 "</script></body></html>\n")
    return "\n".join(parts)


def _report(results_dir: str | Path) -> tuple[str, str, list[tuple[str, object]]]:
    """(title, summary paragraph, figures) of a results folder; a run report has no summary paragraph."""
    results = Path(results_dir)
    if _kind(results) == "run":
        summary, steps = load_run(results)
        title = f"expertsim run: {summary.get('engine', '')} {summary.get('variant', '')} on " \
                f"{summary.get('hardware', '')}, {summary.get('model', '')}"
        return title, "", _run_figures(summary, steps, load_links(results), load_routing(results))
    from sim.explore.sweep import load_sweep

    frame = load_sweep(results)
    damaged = frame.attrs.get("damaged", [])
    # a damaged point file (a write cut short) is left out by name; `sweep --resume` recomputes it
    skipped = f" ({len(damaged)} damaged point files skipped: {', '.join(Path(p).name for p in damaged)})" \
        if damaged else ""
    dims = _order(_sweep_dims(results, frame), frame)
    return f"expertsim sweep: {results}{skipped}", what_changed_most(frame, dims), _sweep_figures(results, frame)


def report_figures(results_dir: str | Path) -> tuple[str, list[tuple[str, object]]]:
    title, _, figures = _report(results_dir)
    return title, figures


def build_report(results_dir: str | Path, plotly_js: str = "inline") -> str:
    """The HTML report of a run or sweep results folder (one page; self-contained with plotly_js "inline")."""
    loader = _plotly_loader(plotly_js)  # a bad mode fails before any figure is built
    title, summary, figures = _report(results_dir)
    return _page(title, figures, loader, summary)


def write_report(results_dir: str | Path, output: str | Path, plotly_js: str = "inline") -> dict:
    loader = _plotly_loader(plotly_js)
    title, summary, figures = _report(results_dir)
    page = _page(title, figures, loader, summary)
    try:
        Path(output).write_text(page, encoding="utf-8")
    except OSError as exc:
        raise InputError(str(output), "output", str(output), f"cannot write: {exc.strerror}") from None
    return {"output": str(output), "results": str(results_dir), "title": title, "figures": len(figures),
            "traces": sum(len(fig.data) for _, fig in figures), "bytes": len(page.encode())}


__all__ = ["build_report", "hit_heatmap_matrix", "hit_rate_curves", "link_busy_per_step",
           "load_links", "load_routing", "perfetto_trace", "report_figures", "run_class_points", "what_changed_most",
           "with_unit", "write_perfetto", "write_report"]
