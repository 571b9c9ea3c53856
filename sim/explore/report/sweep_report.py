"""The figures of a sweep's report: the table of its points, then per metric a heatmap over two grid dimensions
or lines along one (`sweep_figures`); and the "what changed most" paragraph the report opens with
(`what_changed_most`).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd

from sim.explore.report.inputs import grid_values, sweep_dims
from sim.explore.report.labels import (cell_text, dimension_name, dimension_title, is_rate, metric_title, table_size,
                                       value_format, with_unit)

# One figure per metric a sweep's rows hold (all-null metrics are skipped: a cache-only replay has no tok/s,
# an engine run no overall hit_rate).
SWEEP_METRICS = ("decode_tok_s", "prefill_tok_s", "decode_hit_rate", "prefill_hit_rate", "hit_rate")
# A grid dimension with at most this many values (or any text value) is drawn on a categorical axis: one tick per
# value, evenly spaced, and in a heatmap one labelled cell each. Longer numeric ranges keep a linear axis.
CATEGORY_MAX_VALUES = 12


def _numeric(series: pd.Series) -> bool:
    return pd.to_numeric(series, errors="coerce").notna().all()


def _sorted_by(frame: pd.DataFrame, dims: list[str], given: dict[str, list[str]] | None = None) -> pd.DataFrame:
    """Rows in grid order: by each dimension in turn, numbers by value (2048 before 10240), text in the order the
    grid gave it (`given`, the manifest's) and as text where the grid's order is not known."""
    def key(d: str) -> pd.Series:
        if _numeric(frame[d]):
            return pd.to_numeric(frame[d], errors="coerce")
        text = frame[d].astype(str)
        order = {v: i for i, v in enumerate((given or {}).get(d, []))}
        return text.map(lambda v: (order.get(v, len(order)), v))

    keys = {d: key(d) for d in dims}
    if not keys:
        return frame
    return frame.assign(**{f"_sort_{i}": k for i, k in enumerate(keys.values())}) \
        .sort_values([f"_sort_{i}" for i in range(len(keys))], kind="stable")


def order_dims(dims: list[str], frame: pd.DataFrame) -> list[str]:
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


def _successful(frame: pd.DataFrame, dims: list[str], given: dict[str, list[str]] | None = None) -> pd.DataFrame:
    """The points without an error, in grid order (`_sorted_by`), numeric grid values as numbers (flags and
    environment values are kept as text: "9472" -> 9472)."""
    ok = (frame[frame["error"].isna()] if "error" in frame else frame).copy()
    for d in dims:
        if _numeric(ok[d]):
            ok[d] = pd.to_numeric(ok[d])
    return _sorted_by(ok, dims, given)


def _plotted_metrics(ok: pd.DataFrame) -> list[str]:
    return [m for m in SWEEP_METRICS if m in ok and ok[m].notna().any()]


def _categorical(series: pd.Series) -> bool:
    return not _numeric(series) or series.nunique(dropna=True) <= CATEGORY_MAX_VALUES


def _axis(key: str, series: pd.Series) -> dict:
    return {"title": {"text": dimension_title(key)}, **({"type": "category"} if _categorical(series) else {})}


def _python_value(value):
    """A numpy scalar as the Python number it holds (as plotly's axes and the labels take it), else the value."""
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    return value


def _setting(key: str, value) -> str:
    """One grid setting as prose: "cache 9472 experts"."""
    name, unit = dimension_name(key)
    return f"{name} {cell_text(_python_value(value))}" + (f" {unit}" if unit else "")


def _slices(frame: pd.DataFrame, keys: list[str]) -> list[tuple[str, pd.DataFrame]]:
    """The rows split by their values of `keys`, each part named by its settings (`_setting`); without keys, one
    part of every row, unnamed."""
    if not keys:
        return [("", frame)]
    out = []
    for values, part in frame.groupby(keys, sort=True, dropna=False):
        values = values if isinstance(values, tuple) else (values,)
        out.append((", ".join(_setting(k, v) for k, v in zip(keys, values)), part))
    return out


def sweep_figures(results: Path, frame: pd.DataFrame) -> list[tuple[str, object]]:
    """The table of every point, then per plotted metric a heatmap over the first two numeric grid dimensions
    with a slider through the other dimensions' values or, where fewer are numeric, lines along the first
    dimension with a slider through the second's values and a line per value of the rest."""
    import plotly.graph_objects as go

    dims = order_dims(sweep_dims(results, frame), frame)
    given = grid_values(results)
    ok = _successful(frame, dims, given)
    figures: list[tuple[str, object]] = []
    table_cols = list(dict.fromkeys(c for c in (*dims, *SWEEP_METRICS, "decode_hit_rate", "cache_slots", "error",
                                                "error_kind") if c in frame.columns))
    shown = _sorted_by(frame, dims, given)
    # grid keys by their short name and unit, metrics by their column name with each value in its unit
    figures.append(("Points", go.Figure(go.Table(
        header={"values": [dimension_title(c) if c in dims else c for c in table_cols]},
        cells={"values": [[(cell_text if c in dims or c.startswith("error") else partial(with_unit, c))(v)
                           for v in shown[c].tolist()] for c in table_cols]}),
        layout={"title": f"Sweep points ({len(frame)}, {len(frame) - len(ok)} failed)",
                **table_size(len(shown))})))
    if ok.empty or not dims:
        return figures
    numeric = [d for d in dims if _numeric(ok[d])]
    rest_of = (lambda used: [d for d in dims if d not in used])
    for metric in _plotted_metrics(ok):
        title, fmt = metric_title(metric), value_format(metric)
        if len(numeric) >= 2:
            xk, yk = numeric[0], numeric[1]
            rest = rest_of((xk, yk))
            slices = _slices(ok, rest)
            fig = go.Figure()
            for i, (name, part) in enumerate(slices):
                table = part.pivot_table(index=yk, columns=xk, values=metric, aggfunc="mean")
                fig.add_trace(go.Heatmap(
                    x=[_python_value(v) for v in table.columns], y=[_python_value(v) for v in table.index],
                    z=[[None if pd.isna(v) else float(v) for v in r] for r in table.to_numpy()],
                    colorscale="Viridis", colorbar={"title": {"text": title}, "tickformat": fmt}, visible=i == 0,
                    name=name, texttemplate=f"%{{z:{fmt}}}",
                    hovertemplate=f"{dimension_title(xk)} %{{x}}<br>{dimension_title(yk)} %{{y}}<br>"
                                  f"{title} %{{z:{fmt}}}<extra></extra>"))
            layout = {"title": f"{title} vs {dimension_title(xk)} and {dimension_title(yk)}",
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
            # a line joins values in order; text values (variants) have none, so they get points only
            mode = "lines+markers" if _numeric(ok[xk]) else "markers"
            for i, (name, part) in enumerate(slices):
                lines = _slices(part, series)
                for line_name, line in lines:
                    fig.add_trace(go.Scatter(x=[_python_value(v) for v in line[xk]], y=line[metric].tolist(),
                                             mode=mode, name=line_name or title, visible=i == 0,
                                             hovertemplate=f"{dimension_title(xk)} %{{x}}<br>{title} "
                                                           f"%{{y:{fmt}}}<extra></extra>"))
                for _ in range(per_slice - len(lines)):  # keep the slider's trace blocks aligned
                    fig.add_trace(go.Scatter(x=[], y=[], visible=False, showlegend=False))
            layout = {"title": f"{title} vs {dimension_title(xk)}", "xaxis": _axis(xk, ok[xk]),
                      "yaxis": {"title": {"text": title}, "tickformat": fmt}, "height": 500}
            if len(slices) > 1:
                layout["sliders"] = [_slider([n for n, _ in slices], per_slice)]
            fig.update_layout(**layout)
        figures.append((f"{metric} sweep", fig))
    return figures


def _difference(metric: str, delta: float) -> str:
    """A change of a metric with its unit; hit rates in percentage points."""
    return f"{100 * delta:.1f} pt" if is_rate(metric) else with_unit(metric, delta)


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
            text += (f" {dimension_name(d)[0].capitalize()} moves it most, by {_difference(metric, size)}: its "
                     f"mean is {with_unit(metric, means.min())} at {_setting(d, means.idxmin())} and "
                     f"{with_unit(metric, means.max())} at {_setting(d, means.idxmax())}")
            others = [f"{dimension_name(d)[0]} by {_difference(metric, size)}" if size else
                      f"{dimension_name(d)[0]} not at all" for size, d, _ in effects[1:]]
            text += f"; then {', '.join(others)}." if others else "."
        sentences.append(text)
    if not sentences:
        return ""
    grid = " x ".join(f"{ok[d].nunique()} {dimension_name(d)[0]}" for d in dims)
    return f"Over {len(ok)} successful points ({grid}): " + " ".join(sentences)
