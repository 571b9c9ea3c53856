"""Reports: one self-contained, offline HTML file from a run or sweep results folder, and a Perfetto trace.

    html = build_report("out/ds4run")          # a run folder: summary.json + steps.parquet ...
    html = build_report("out/sweep")           # a sweep folder: manifest.json + points/
    trace = perfetto_trace(steps, summary)     # Chrome trace-event JSON of a run

The HTML embeds the plotly.js bundle inline (no CDN, no network) and each figure's spec as a JSON
`<script type="application/json" class="expertsim-figure">` block, drawn by a small inline script.

Link lanes (timeline figure and Perfetto trace): steps.parquet records each step's bytes and its start and end,
not each link's busy intervals, so a link's busy time (summary `links`) is apportioned over the steps: byte links
by the step's share of the bytes they move (PCIe H2D and host memcpy by h2d_bytes, D2D by d2d_bytes, D2H by
d2h_bytes, file/SSD by file_read_bytes), the others (GPU compute, host calls, stream syncs) by the step's share of
the stepped time. Per lane the totals are exact; the placement within the run is an estimate.
"""

from __future__ import annotations

import html as html_lib
import json
from pathlib import Path

import numpy as np
import pandas as pd

from sim.errors import InputError

RUN_FILES = ("summary.json", "steps.parquet")
SWEEP_METRICS = ("decode_tok_s", "prefill_tok_s")


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


def perfetto_trace(steps: pd.DataFrame, summary: dict) -> dict:
    """Chrome trace-event JSON of a run: "X" events in µs; threads: one per busy link, the steps, per-request phases.

    A link lane's events are laid one after another from each step's start (never overlapping), durations as
    apportioned by `link_busy_per_step`, so each lane's durations sum to the link's busy time."""
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
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "metadata": {"scenario": summary.get("scenario"), "simulated_s": summary.get("simulated_s")}}


def write_perfetto(steps: pd.DataFrame, summary: dict, path: str | Path) -> int:
    trace = perfetto_trace(steps, summary)
    try:
        Path(path).write_text(json.dumps(trace))
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


def _run_figures(summary: dict, steps: pd.DataFrame) -> list[tuple[str, object]]:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    figures: list[tuple[str, object]] = []
    rows = [(k, v) for k, v in summary.items() if not isinstance(v, (dict, list))]
    figures.append(("Headline", go.Figure(go.Table(
        header={"values": ["key", "value"]},
        cells={"values": [[k for k, _ in rows], [_cell(v) for _, v in rows]], "align": "left"}),
        layout={"title": "Headline metrics", "height": 40 + 24 * len(rows)})))

    links = summary.get("links", [])
    if links:
        figures.append(("Links", go.Figure(go.Table(
            header={"values": ["link", "busy_s", "bytes", "ops", "utilisation"]},
            cells={"values": [[_cell(link.get(c)) for link in links]
                              for c in ("link", "busy_s", "bytes", "ops", "utilisation")]}),
            layout={"title": "Links (whole run)", "height": 80 + 24 * len(links)})))

    # timeline: per step group (a decode token or a prefill chunk) over simulated time
    g = _groups(steps)
    row_of = steps.set_index(["request", "phase", "step"]).index
    group_index = pd.MultiIndex.from_frame(g[["request", "phase", "step"]])
    position = group_index.get_indexer(row_of)
    x = g["start_s"].to_numpy()
    fig = make_subplots(rows=4, cols=1, shared_xaxes=True, vertical_spacing=0.04,
                        subplot_titles=("link busy per step (s, apportioned)", "copied per step (MiB)",
                                        "lent slots", "memory in use (GiB)"))
    step_time = (g["end_s"] - g["start_s"]).to_numpy()
    fig.add_trace(go.Scatter(x=x, y=step_time, name="step wall", mode="lines", line={"shape": "hv"}), 1, 1)
    for name, busy in link_busy_per_step(steps, summary).items():
        per_group = np.bincount(position, weights=busy, minlength=len(g))
        fig.add_trace(go.Scatter(x=x, y=per_group, name=name, mode="lines", line={"shape": "hv"}), 1, 1)
    for c in ("file_read_bytes", "h2d_bytes", "d2d_bytes", "d2h_bytes"):
        if c in g and g[c].sum() > 0:
            fig.add_trace(go.Scatter(x=x, y=g[c] / 2**20, name=c, mode="lines", line={"shape": "hv"}), 2, 1)
    if "lent_slots" in g:
        fig.add_trace(go.Scatter(x=x, y=g["lent_slots"], name="lent slots", mode="lines",
                                 line={"shape": "hv"}), 3, 1)
    for c, name in (("vram_used_bytes", "VRAM"), ("ram_used_bytes", "RAM")):
        if c in g and g[c].sum() > 0:
            fig.add_trace(go.Scatter(x=x, y=g[c] / 2**30, name=name, mode="lines", line={"shape": "hv"}), 4, 1)
    fig.update_xaxes(title_text="simulated time (s)", row=4, col=1)
    fig.update_layout(title="Run timeline", height=900)
    figures.append(("Timeline", fig))

    labels, layers, z = hit_heatmap_matrix(steps)
    heat = go.Figure(go.Heatmap(x=labels, y=layers, z=z, zmin=0, zmax=1, colorscale="Viridis",
                                colorbar={"title": "hit rate"}, hoverongaps=False))
    heat.update_layout(title="Per-layer hit rate (hits / lookups) per step", xaxis_title="step",
                       yaxis_title="layer", height=600)
    figures.append(("Hit heatmap", heat))
    return figures


def _cell(value) -> str:
    if isinstance(value, float):
        return "-" if np.isnan(value) else f"{value:.4g}"
    return "" if value is None else str(value)


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


def _slider(names: list[str], per_value: int, key: str) -> dict:
    steps = []
    for i, name in enumerate(names):
        visible = [j // per_value == i for j in range(len(names) * per_value)]
        steps.append({"method": "restyle", "args": [{"visible": visible}], "label": name})
    return {"active": 0, "currentvalue": {"prefix": f"{key} = "}, "steps": steps, "pad": {"t": 50}}


def _sweep_figures(results: Path, frame: pd.DataFrame) -> list[tuple[str, object]]:
    import plotly.graph_objects as go

    ok = frame[frame["error"].isna()] if "error" in frame else frame
    dims = _order(_sweep_dims(results, frame), frame)
    figures: list[tuple[str, object]] = []
    table_cols = [*dims, *SWEEP_METRICS, "decode_hit_rate", "cache_slots", "error"]
    table_cols = [c for c in table_cols if c in frame.columns]
    figures.append(("Points", go.Figure(go.Table(
        header={"values": table_cols},
        cells={"values": [[_cell(v) for v in frame[c].tolist()] for c in table_cols]}),
        layout={"title": f"Sweep points ({len(frame)}, {len(frame) - len(ok)} failed)",
                "height": 80 + 24 * min(len(frame), 30)})))
    if ok.empty or not dims:
        return figures
    numeric = [d for d in dims if _numeric(ok[d])]
    ok = ok.copy()
    for d in numeric:  # flags and environment values are kept as text: "9472" -> 9472
        ok[d] = pd.to_numeric(ok[d])
    rest_of = (lambda used: [d for d in dims if d not in used])
    for metric in SWEEP_METRICS:
        if metric not in ok or ok[metric].isna().all():
            continue
        if len(numeric) >= 2:
            xk, yk = numeric[0], numeric[1]
            rest = rest_of((xk, yk))
            slices = _slices(ok, rest)
            fig = go.Figure()
            for i, (name, part) in enumerate(slices):
                table = part.pivot_table(index=yk, columns=xk, values=metric, aggfunc="mean")
                fig.add_trace(go.Heatmap(x=[_num(v) for v in table.columns], y=[_num(v) for v in table.index],
                                         z=[[None if pd.isna(v) else float(v) for v in r] for r in table.to_numpy()],
                                         colorscale="Viridis", colorbar={"title": metric}, visible=i == 0,
                                         name=name, hovertemplate=f"{xk}=%{{x}}<br>{yk}=%{{y}}<br>{metric}=%{{z}}"
                                                                  "<extra></extra>"))
            layout = {"title": f"{metric} vs {xk} and {yk}", "xaxis_title": xk, "yaxis_title": yk, "height": 550}
            if len(slices) > 1:
                layout["sliders"] = [_slider([n for n, _ in slices], 1, ", ".join(rest))]
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
                    line = line.sort_values(xk) if numeric else line
                    fig.add_trace(go.Scatter(x=[_num(v) for v in line[xk]], y=line[metric].tolist(),
                                             mode="lines+markers", name=line_name or metric, visible=i == 0))
                for _ in range(per_slice - len(lines)):  # keep the slider's trace blocks aligned
                    fig.add_trace(go.Scatter(x=[], y=[], visible=False, showlegend=False))
            layout = {"title": f"{metric} vs {xk}", "xaxis_title": xk, "yaxis_title": metric, "height": 500}
            if len(slices) > 1:
                layout["sliders"] = [_slider([n for n, _ in slices], per_slice, rest[0])]
            fig.update_layout(**layout)
        figures.append((f"{metric} sweep", fig))
    return figures


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
        out.append((", ".join(f"{k.rsplit('.', 1)[-1]}={_num(v)}" for k, v in zip(keys, values)), part))
    return out


# ------------------------------------------------------------------------------------------------ html


def _page(title: str, figures: list[tuple[str, object]]) -> str:
    from plotly.offline import get_plotlyjs

    parts = [f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html_lib.escape(title)}</title>",
             "<style>body{font-family:sans-serif;margin:1em 2em}h2{margin-top:1.5em}</style>",
             f"<script type=\"text/javascript\">{get_plotlyjs()}</script></head><body>",
             f"<h1>{html_lib.escape(title)}</h1>"]
    for i, (name, fig) in enumerate(figures):
        spec = fig.to_json().replace("</", "<\\/")
        parts.append(f"<h2>{html_lib.escape(name)}</h2><div id=\"fig-{i}\" class=\"expertsim-plot\"></div>"
                     f"<script type=\"application/json\" class=\"expertsim-figure\" id=\"fig-{i}-spec\">"
                     f"{spec}</script>")
    parts.append("<script type=\"text/javascript\">document.querySelectorAll('script.expertsim-figure')"
                 ".forEach(function(el){var s=JSON.parse(el.textContent);"
                 "Plotly.newPlot(el.id.slice(0,-5),s.data,s.layout,{responsive:true,displaylogo:false});});"
                 "</script></body></html>\n")
    return "\n".join(parts)


def report_figures(results_dir: str | Path) -> tuple[str, list[tuple[str, object]]]:
    results = Path(results_dir)
    if _kind(results) == "run":
        summary, steps = load_run(results)
        title = f"expertsim run: {summary.get('engine', '')} {summary.get('variant', '')} on " \
                f"{summary.get('hardware', '')}, {summary.get('model', '')}"
        return title, _run_figures(summary, steps)
    from sim.explore.sweep import load_sweep

    frame = load_sweep(results)
    return f"expertsim sweep: {results}", _sweep_figures(results, frame)


def build_report(results_dir: str | Path) -> str:
    """The HTML report of a run or sweep results folder (one self-contained page)."""
    title, figures = report_figures(results_dir)
    return _page(title, figures)


def write_report(results_dir: str | Path, output: str | Path) -> dict:
    title, figures = report_figures(results_dir)
    page = _page(title, figures)
    try:
        Path(output).write_text(page, encoding="utf-8")
    except OSError as exc:
        raise InputError(str(output), "output", str(output), f"cannot write: {exc.strerror}") from None
    return {"output": str(output), "results": str(results_dir), "figures": len(figures),
            "traces": sum(len(fig.data) for _, fig in figures), "bytes": len(page.encode())}


__all__ = ["build_report", "hit_heatmap_matrix", "link_busy_per_step", "perfetto_trace", "report_figures",
           "write_perfetto", "write_report"]
