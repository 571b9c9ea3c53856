"""A run's steps over time: the step groups (a decode token or a prefill chunk) and a phase's timeline figure of
them, panels of link busy time, hit rate, bytes copied, lent slots and memory in use on the phase's own clock."""

from __future__ import annotations

import numpy as np
import pandas as pd

from sim.units import GIB, MIB

TIMELINE_PANEL_PX = 220  # height of one timeline panel
TIMELINE_GAP_PX = 95  # between panels: the x tick labels and title of one, the subplot title of the next
TIMELINE_LEGEND_PX = 230  # right margin, where each panel's legend sits
STEP_BYTES = (("file_read_bytes", "file read"), ("h2d_bytes", "H2D"), ("d2d_bytes", "D2D"), ("d2h_bytes", "D2H"))


def step_groups(steps: pd.DataFrame) -> pd.DataFrame:
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


def timeline_figure(groups: pd.DataFrame, lanes: dict[str, np.ndarray], link_title: str, phase: str, title: str):
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
