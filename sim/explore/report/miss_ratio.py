"""Miss-ratio curves (routing.parquet, the measured request's routing): per size class, the decode hit rate of an
evicting LRU at every cache size from one Mattson pass (sim.cache.replay.lru_mrc) and the Belady bound at a few
sizes from the OPT kernel, next to the run's own capacity and hit rate (see `hit_rate_curves`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from sim.trace.format import PHASE_DECODE
from sim.units import MIB

# Cache sizes per size class of the miss-ratio figure, log-spaced from 1 slot to every key the request touches.
# The exact LRU curve has one value per slot count (up to 37 x 256 = 9,472 for ds4's q2 class): 200 points keep
# its shape and the figure's JSON to a few tens of kB. The Belady bound costs one OPT replay per size: 12.
LRU_POINTS = 200
BELADY_POINTS = 12


def _log_sizes(upper: int, n: int) -> np.ndarray:
    return np.unique(np.round(np.geomspace(1, max(int(upper), 1), n)).astype(np.int64))


def hit_rate_curves(trace, geometry, run_slots: dict[int, int] | None = None) -> pd.DataFrame:
    """Per size class with decode lookups, the decode hit rate vs cache slots of that class (one pool per class):
    policy "lru" at LRU_POINTS log-spaced sizes (exact, from one stack-distance pass: an evicting LRU, the prompt
    rows warming it token by token) and "belady" (`sim.cache.replay.decode_bound_hits`) at BELADY_POINTS of them,
    each up to every key the request touches in the class (or the run's slots, when larger), the run's slots
    (class -> slots) included.
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


def miss_ratio_figure(summary: dict, steps: pd.DataFrame, trace, geometry):
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
