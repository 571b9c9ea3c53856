"""The report page: one self-contained, offline HTML file of a run or sweep results folder.

The HTML embeds the plotly.js bundle inline (no CDN, no network; `plotly_js="cdn"`: plotly's own <script src> to
its CDN instead) and each figure's spec as a JSON `<script type="application/json" class="expertsim-figure">`
block, plotly's default template once for all of them, drawn by a small inline script. A sweep report opens with
a "what changed most" paragraph (`what_changed_most`).
"""

from __future__ import annotations

import html as html_lib
import json
import re
from pathlib import Path

from sim.errors import InputError
from sim.explore.report.inputs import load_links, load_routing, load_run, results_kind, sweep_dims
from sim.explore.report.run_report import run_figures
from sim.explore.report.sweep_report import order_dims, sweep_figures, what_changed_most

PLOTLY_JS_MODES = ("inline", "cdn")  # plotly.js in the page (works offline) or a <script src> to plotly's CDN


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
    # A table figure is sized in Python for its rows with slack for wrapped text (table_size); once drawn, it is
    # cut to the rows plotly drew, so no empty band follows it. Each figure is then marked data-drawn.
    parts.append("<script type=\"text/javascript\">var template=JSON.parse("
                 "document.getElementById('expertsim-template').textContent);"
                 "function fitTable(gd){if(gd.data.length&&gd.data[0].type==='table'){"
                 "var top=gd.getBoundingClientRect().top,bottom=0;"
                 "gd.querySelectorAll('rect.cell-rect').forEach(function(c){var r=c.getBoundingClientRect();"
                 "if(r.height>0){bottom=Math.max(bottom,r.bottom);}});"
                 "var want=Math.ceil(bottom-top+gd._fullLayout.margin.b);"
                 "if(bottom>0&&want<gd._fullLayout.height-4){return Plotly.relayout(gd,{height:want});}}"
                 "return gd;}"
                 "document.querySelectorAll('script.expertsim-figure').forEach(function(el){"
                 "var s=JSON.parse(el.textContent);if(template&&!s.layout.template){s.layout.template=template;}"
                 "Plotly.newPlot(el.id.slice(0,-5),s.data,s.layout,{responsive:true,displaylogo:false})"
                 ".then(fitTable).then(function(){document.getElementById(el.id.slice(0,-5)).dataset.drawn='1';});});"
                 "</script></body></html>\n")
    return "\n".join(parts)


def _report(results_dir: str | Path) -> tuple[str, str, list[tuple[str, object]]]:
    """(title, summary paragraph, figures) of a results folder; a run report has no summary paragraph."""
    results = Path(results_dir)
    if results_kind(results) == "run":
        summary, steps = load_run(results)
        title = f"expertsim run: {summary.get('engine', '')} {summary.get('variant', '')} on " \
                f"{summary.get('hardware', '')}, {summary.get('model', '')}"
        return title, "", run_figures(summary, steps, load_links(results), load_routing(results))
    from sim.explore.sweep import load_sweep

    frame = load_sweep(results)
    damaged = frame.attrs.get("damaged", [])
    # a damaged point file (a write cut short) is left out by name; `sweep --resume` recomputes it
    skipped = f" ({len(damaged)} damaged point files skipped: {', '.join(Path(p).name for p in damaged)})" \
        if damaged else ""
    dims = order_dims(sweep_dims(results, frame), frame)
    return f"expertsim sweep: {results}{skipped}", what_changed_most(frame, dims), sweep_figures(results, frame)


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
