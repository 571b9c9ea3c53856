"""Reports: one self-contained, offline HTML file from a run or sweep results folder, and a Perfetto trace.

    html = build_report("out/ds4run")          # a run folder: summary.json + steps.parquet ...
    html = build_report("out/sweep")           # a sweep folder: manifest.json + points/
    trace = perfetto_trace(steps, summary)     # Chrome trace-event JSON of a run

- `inputs`: reading a run results folder (summary.json, steps.parquet, links.parquet, routing.parquet) and the
  grid of a sweep's manifest;
- `labels`: axis titles of a short name and unit, value formats, values written with their unit (`with_unit`);
- `lanes`: each link's busy time per step, as links.parquet booked it or apportioned over the steps;
- `timeline`: the steps grouped per decode token or prefill chunk, and a phase's timeline figure;
- `miss_ratio`: decode hit rate vs cache size per size class, LRU and the Belady bound (`hit_rate_curves`);
- `run_report`: the figures of a run's report;
- `sweep_report`: the figures of a sweep's report and its "what changed most" paragraph (`what_changed_most`);
- `perfetto`: a run's Perfetto trace (`perfetto_trace`, `write_perfetto`);
- `page`: the HTML page around the figures (plotly.js inline or from its CDN): `build_report`, `write_report`.
"""

from sim.explore.report.inputs import load_links, load_routing, load_run
from sim.explore.report.labels import with_unit
from sim.explore.report.lanes import link_busy_per_step
from sim.explore.report.miss_ratio import hit_rate_curves, run_class_points
from sim.explore.report.page import PLOTLY_JS_MODES, build_report, report_figures, write_report
from sim.explore.report.perfetto import perfetto_trace, write_perfetto
from sim.explore.report.run_report import hit_heatmap_matrix
from sim.explore.report.sweep_report import what_changed_most

__all__ = ["PLOTLY_JS_MODES", "build_report", "hit_heatmap_matrix", "hit_rate_curves", "link_busy_per_step",
           "load_links", "load_routing", "load_run", "perfetto_trace", "report_figures", "run_class_points",
           "what_changed_most", "with_unit", "write_perfetto", "write_report"]
