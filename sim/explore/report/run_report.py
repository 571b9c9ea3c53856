"""The figures of a run's report: tables of the headline metrics, the cache per size class, the engine's notices
and the links; a timeline per phase; the per-layer hit heatmap; the miss-ratio curves where the run wrote its
routing; and after `run --uncertainty N` the metrics' bands and what moves them most.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from sim.explore.report.labels import cell_text, metric_title, table_size, with_unit
from sim.explore.report.lanes import link_busy_per_group, link_busy_per_step
from sim.explore.report.miss_ratio import miss_ratio_figure
from sim.explore.report.timeline import step_groups, timeline_figure


def hit_heatmap_matrix(steps: pd.DataFrame) -> tuple[list[str], list[int], list[list[float | None]]]:
    """Per-layer hit rate: columns are the step groups (r0 prefill 0, r0 decode 0...), rows the layers."""
    groups = step_groups(steps)
    table = steps.groupby(["layer", "request", "phase", "step"], sort=False)[["hits", "lookups"]].sum()
    rate = (table["hits"] / table["lookups"].where(table["lookups"] > 0)).unstack("layer")
    index = pd.MultiIndex.from_frame(groups[["request", "phase", "step"]])
    rate = rate.reindex(index)
    layers = sorted(int(x) for x in rate.columns)
    z = [[None if pd.isna(v) else float(v) for v in rate[layer].to_numpy()] for layer in layers]
    return list(groups["label"]), layers, z


def run_figures(summary: dict, steps: pd.DataFrame, intervals: pd.DataFrame | None = None,
                routing=None) -> list[tuple[str, object]]:
    """The figures of a run's report, (name, figure) in page order: `intervals` is links.parquet (`load_links`),
    `routing` routing.parquet as `load_routing` returns it; None where the run wrote neither."""
    import plotly.graph_objects as go

    figures: list[tuple[str, object]] = []
    rows = [(k, v) for k, v in summary.items() if not isinstance(v, (dict, list))]
    figures.append(("Headline", go.Figure(go.Table(
        header={"values": ["key", "value"]},
        cells={"values": [[k for k, _ in rows], [with_unit(k, v) for k, v in rows]], "align": "left"}),
        layout={"title": "Headline metrics", **table_size(len(rows))})))
    state = summary.get("engine_state", {})
    per_class = state.get("cache_slots_per_class")
    if per_class:
        sizes = state.get("class_expert_bytes") or [None] * len(per_class)
        figures.append(("Cache per size class", go.Figure(go.Table(
            header={"values": ["size class", "slots", "expert size", "cache"]},
            cells={"values": [list(range(len(per_class))), [f"{n:,}" for n in per_class],
                              [with_unit("x_bytes", b) for b in sizes],
                              [with_unit("x_bytes", n * b) if b else "" for n, b in zip(per_class, sizes)]]}),
            layout={"title": "Expert cache per size class", **table_size(len(per_class))})))
    notes = [("engine", n) for n in state.get("notices", [])] + \
        [("out of domain", n) for n in summary.get("out_of_domain", [])]
    if notes:  # what the engine decided on its own (a capped cache, say) and figures used beyond their record
        figures.append(("Notices", go.Figure(go.Table(
            header={"values": ["from", "notice"]}, columnwidth=[1, 8],
            cells={"values": [[a for a, _ in notes], [b for _, b in notes]], "align": "left"}),
            layout={"title": "What the engine reported, and where the model is outside its records",
                    **table_size(2 * len(notes))})))

    links = summary.get("links", [])
    if links:
        figures.append(("Links", go.Figure(go.Table(
            header={"values": ["link", "busy", "bytes", "ops", "utilisation"]},
            cells={"values": [[cell_text(link.get("link")) for link in links],
                              *[[with_unit(key, link.get(c)) for link in links]
                                for c, key in (("busy_s", "busy_s"), ("bytes", "link_bytes"), ("ops", "ops"))],
                              [f"{100 * link['utilisation']:.1f} %" if link.get("utilisation") is not None else ""
                               for link in links]]}),
            layout={"title": "Links (whole run)", **table_size(len(links))})))

    # timelines: per step group (a decode token or a prefill chunk) over simulated time, one figure per phase: a
    # prefill chunk takes seconds and a decode token tens of ms, so on one scale the decode steps are a flat line
    g = step_groups(steps)
    if intervals is not None:
        link_title, lanes = "link busy per step", link_busy_per_group(intervals, g)
    else:
        link_title = "link busy per step (apportioned)"
        position = pd.MultiIndex.from_frame(g[["request", "phase", "step"]]).get_indexer(
            steps.set_index(["request", "phase", "step"]).index)
        lanes = {name: np.bincount(position, weights=busy, minlength=len(g))
                 for name, busy in link_busy_per_step(steps, summary).items()}
    for phase, unit in (("prefill", "prefill chunk"), ("decode", "decode token")):
        mine = (g["phase"] == phase).to_numpy()
        if mine.any():
            timeline = timeline_figure(g[mine], {name: busy[mine] for name, busy in lanes.items()}, link_title,
                                       phase, f"{phase.capitalize()} timeline: one step per {unit}, on the "
                                       "phase's own clock (simulated time, other phases cut out)")
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
        figures.append(("Miss-ratio curves", miss_ratio_figure(summary, steps, *routing)))
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
        cells={"values": [[k for k, _ in bands], [cell_text(summary[k]) for k, _ in bands],
                          *[[cell_text(b[q]) for _, b in bands] for q in ("p10", "median", "p90")]]}),
        layout={"title": f"Under uncertainty: {u['n']} samples of {len(u['inputs'])} estimated inputs",
                **table_size(len(bands))})
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
                      barmode="overlay", xaxis_title=f"{metric_title(metric)}, this run {base:,.2f}",
                      yaxis_title="estimated input",
                      height=120 + 28 * len(top), margin={"l": 260})
    return [("Uncertainty", table), ("Sensitivity", fig)]
