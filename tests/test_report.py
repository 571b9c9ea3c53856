"""The HTML report (structure, offline, figure specs), its miss-ratio curves and the Perfetto trace export.

Oracles of the miss-ratio figure: an OrderedDict LRU replay and a brute-force search over every cache decision
(load or bypass, which resident to evict) for the most decode hits, both over the pool's accesses written out
token by token, layer by layer, k in order."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.cache.replay import Geometry
from sim.simulate import run_scenario
from sim.results import write_results
from sim.workload import workload_routing
from sim.errors import InputError
from sim.explore.report import (build_report, hit_rate_curves, load_links, load_routing, perfetto_trace,
                                report_figures)
from sim.scenario import load_scenario
from sim.trace.format import MISSING, Trace, TraceHeader
from sim.units import GIB, MIB

PER_CLASS = "scenarios/ds4-504-per-class.toml"
CACHE = "engine.flags.ssd-streaming-cache-experts"
RESERVE = "engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    result = run_scenario(load_scenario(PER_CLASS))
    write_results(result, out)
    return out


def _values(array) -> list:
    """A trace's x or y as plotly.py writes it into a spec: a list, or a typed array {"dtype", "bdata"}."""
    if isinstance(array, dict):
        import base64

        return np.frombuffer(base64.b64decode(array["bdata"]), dtype=np.dtype(array["dtype"])).tolist()
    return list(array)


def _group_values(trace: dict) -> list[float]:
    """A timeline trace's value per step group: each request's run of points ends with a closing point at its
    last group's end (then a NaN gap), which is no group of its own."""
    values = np.asarray(_values(trace["y"]), float)
    gap = np.isnan(values)
    closing = np.r_[gap[1:], True]
    return values[~gap & ~closing].tolist()


def _specs(page: str) -> list[dict]:
    blocks = re.findall(r'<script type="application/json" class="expertsim-figure" id="fig-\d+-spec">(.*?)</script>',
                        page, flags=re.S)
    return [json.loads(b) for b in blocks]


def _assert_offline(page: str) -> None:
    assert page.count("<html") == 1 and page.rstrip().endswith("</html>")
    assert len(page) > 3_000_000  # the plotly.js bundle is inline
    assert "Plotly" in page and re.search(r"window\.Plotly\s*=|\.Plotly\s*=|Plotly=", page)
    assert not re.search(r"<script[^>]*\bsrc\s*=", page, flags=re.I)
    assert not re.search(r"<link[^>]*href\s*=\s*[\"']https?:", page, flags=re.I)


def test_run_report(run_dir):
    page = build_report(run_dir)
    _assert_offline(page)
    specs = _specs(page)
    # headline, cache per size class, notices, links tables; prefill and decode timelines, hit heatmap, miss-ratio
    # curves
    assert len(specs) == 8
    assert page.count('class="expertsim-plot"') == 8
    types = [[t["type"] for t in s["data"]] for s in specs]
    assert types[:4] == [["table"]] * 4 and types[6] == ["heatmap"]
    assert set(types[4]) == set(types[5]) == set(types[7]) == {"scatter"}
    assert [s["layout"]["title"]["text"].split(":")[0] for s in specs[4:6]] == ["Prefill timeline", "Decode timeline"]
    summary = json.loads((run_dir / "summary.json").read_text())
    headline = dict(zip(*specs[0]["data"][0]["cells"]["values"]))
    assert headline["decode_tok_s"] == f"{summary['decode_tok_s']:,.1f} tok/s"
    assert headline["decode_hit_rate"] == f"{100 * summary['decode_hit_rate']:.1f} %"
    assert headline["cache_mib"] == f"{summary['cache_mib']:,.1f} MiB"  # issue 34: in the unit its key names
    assert headline["cache_slots"] == f"{summary['cache_slots']:,}"
    per_class = specs[1]["data"][0]["cells"]["values"]
    assert per_class[1] == [f"{n:,}" for n in summary["engine_state"]["cache_slots_per_class"]]
    notices = specs[2]["data"][0]["cells"]["values"][1]
    assert notices == [*summary["engine_state"]["notices"], *summary["out_of_domain"]]
    busy = {link["link"]: link["busy_s"] for link in summary["links"] if link["busy_s"] > 0}
    per_phase = [{t.get("name"): t for t in spec["data"]} for spec in specs[4:6]]
    lanes = {name for phase in per_phase for name in phase}
    # ds4 never lends slots: its all-zero lent-slots panel is left out
    assert set(busy) <= lanes and "lent slots" not in lanes and "VRAM" in lanes
    for name, seconds in busy.items():  # the lanes are the booked intervals: over both phases they sum to busy_s
        total_ms = sum(sum(_group_values(phase[name])) for phase in per_phase if name in phase)
        assert total_ms / 1e3 == pytest.approx(seconds, rel=1e-9)
    # the heatmap's z is hits / lookups of steps.parquet, per layer and step
    steps = pd.read_parquet(run_dir / "steps.parquet")
    heat = specs[6]["data"][0]
    layer = 7
    row = heat["y"].index(layer)
    mine = steps[steps["layer"] == layer]
    for col, label in enumerate(heat["x"]):
        request, phase, step = label[1:].split()
        cell = mine[(mine["request"] == int(request)) & (mine["phase"] == phase) & (mine["step"] == int(step))]
        expected = cell["hits"].sum() / cell["lookups"].sum() if cell["lookups"].sum() else None
        if expected is None:
            assert heat["z"][row][col] is None
        else:
            assert heat["z"][row][col] == pytest.approx(expected)
    assert len(heat["x"]) == steps.groupby(["request", "phase", "step"]).ngroups


def test_perfetto_lanes_sum_to_busy(run_dir, tmp_path):
    out = tmp_path / "trace.json"
    proc = subprocess.run([sys.executable, "-m", "sim", "run", PER_CLASS, "--perfetto", str(out), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    events = json.loads(out.read_text())["traceEvents"]
    steps = pd.read_parquet(run_dir / "steps.parquet")
    links = load_links(run_dir)
    # the link lanes are links.parquet's intervals, one event each (the run is deterministic: the fixture's
    # in-process run and this command's run book the same intervals)
    per_lane = _check_lanes(events, summary, steps)
    for name, lane in links.groupby("link"):
        if (lane["end_s"] > lane["start_s"]).any():
            assert per_lane[name][1] == len(lane)
    assert len(perfetto_trace(steps, summary, links)["traceEvents"]) == len(events)


def test_perfetto_apportioned_without_links(run_dir):
    """A results folder without links.parquet: each link's busy time spread over the steps, still per lane."""
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = pd.read_parquet(run_dir / "steps.parquet")
    per_lane = _check_lanes(perfetto_trace(steps, summary)["traceEvents"], summary, steps)
    assert per_lane["H2D copy engine (PCIe)"][1] == int((steps["h2d_bytes"] > 0).sum())  # one event per step that copies


def _check_lanes(events: list[dict], summary: dict, steps: pd.DataFrame) -> dict[str, tuple[float, int]]:
    """Every lane: events never overlap; link lanes sum to the link's busy_s, the steps lane to the steps' time.
    Returns per lane (summed seconds, events)."""
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    complete = [e for e in events if e["ph"] == "X"]
    assert complete and all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    per_lane: dict[str, tuple[float, int]] = {}
    for e in complete:
        seconds, n = per_lane.get(threads[e["tid"]], (0.0, 0))
        per_lane[threads[e["tid"]]] = (seconds + e["dur"] / 1e6, n + 1)
    assert "steps" in per_lane and "request 0" in per_lane
    for link in summary["links"]:
        if link["busy_s"] > 0:
            assert per_lane[link["link"]][0] == pytest.approx(link["busy_s"], rel=1e-9)
    assert per_lane["steps"][0] == pytest.approx((steps["end_s"] - steps["start_s"]).sum(), rel=1e-9)
    for tid in threads:  # one thread: its events never overlap (1 ns of slack for µs rounding)
        lane = sorted((e["ts"], e["dur"]) for e in complete if e["tid"] == tid)
        assert all(a[0] + a[1] <= b[0] + 1e-3 for a, b in zip(lane, lane[1:]))
    return per_lane


def test_sweep_report(tmp_path):
    from sim.explore.sweep import expand_grid, run_sweep

    points = expand_grid(PER_CLASS, [f"{CACHE}=4096,9472", f"{RESERVE}=8,12"])
    run_sweep(points, tmp_path / "sweep", executor="processes", workers=1)
    page = build_report(tmp_path / "sweep")
    _assert_offline(page)
    specs = _specs(page)
    types = [[t["type"] for t in s["data"]] for s in specs]
    assert types[0] == ["table"]
    heatmaps = [s for s in specs if s["data"][0]["type"] == "heatmap"]
    # decode and prefill tok/s and hit rates vs cache size and reserve (the overall hit rate is a column of
    # cache-only replays only)
    assert [h["data"][0]["colorbar"]["title"]["text"] for h in heatmaps] == [
        "decode (tok/s)", "prefill (tok/s)", "decode hit rate (%)", "prefill hit rate (%)"]
    heat = heatmaps[0]["data"][0]
    assert sorted(heat["x"]) == [4096, 9472] and sorted(heat["y"]) == [8, 12]
    assert all(v is not None and v > 0 for row in heat["z"] for v in row)
    assert heatmaps[0]["layout"]["xaxis"]["title"]["text"] == "expert budget (experts)"
    assert heatmaps[0]["layout"]["yaxis"]["title"]["text"] == "VRAM reserve (GiB)"
    assert '<p class="expertsim-summary">Over 4 successful points (2 expert budget x 2 VRAM reserve): decode_tok_s' in page


def test_replay_sweep_report_plots_hit_rates_against_slots(tmp_path):
    from sim.explore.sweep import expand_grid, load_sweep, run_sweep

    scenario = "scenarios/replay-qwen3.8-lru.toml"  # run from the repo root, like PER_CLASS
    run_sweep(expand_grid(scenario, ["engine.flags.slots=32:128:32"]), tmp_path / "sweep", workers=1)
    specs = _specs(build_report(tmp_path / "sweep"))
    lines = {s["layout"]["title"]["text"]: s for s in specs if s["data"][0]["type"] == "scatter"}
    assert sorted(lines) == ["decode hit rate (%) vs cache (slots)", "hit rate (%) vs cache (slots)",
                             "prefill hit rate (%) vs cache (slots)"]
    rows = load_sweep(tmp_path / "sweep").sort_values("engine.flags.slots")
    line = lines["hit rate (%) vs cache (slots)"]
    assert line["data"][0]["x"] == [32, 64, 96, 128] and line["layout"]["xaxis"]["type"] == "category"
    # a fraction on the data side, drawn in % by the axis' tick format
    assert line["data"][0]["y"] == rows["hit_rate"].tolist() and line["layout"]["yaxis"]["tickformat"] == ".1%"


def test_sweep_report_lines_and_slider(tmp_path):
    from sim.explore.report.sweep_report import sweep_figures as _sweep_figures

    out = tmp_path / "sweep"
    (out / "points").mkdir(parents=True)
    (out / "manifest.json").write_text(json.dumps({"grids": [[CACHE, "engine.variant"]]}))
    frame = pd.DataFrame({CACHE: [1, 2, 1, 2], "engine.variant": ["a", "a", "b", "b"],
                          "decode_tok_s": [1.0, 2.0, 3.0, 4.0], "prefill_tok_s": [5.0, 6.0, 7.0, 8.0],
                          "error": [None] * 4})
    figures = _sweep_figures(out, frame)
    lines = figures[1][1]
    assert [t.type for t in lines.data] == ["scatter", "scatter"]
    assert len(lines.layout.sliders[0].steps) == 2  # move along engine.variant
    assert list(lines.data[1].y) == [3.0, 4.0]


def test_sweep_points_table_is_sorted_sized_to_its_rows_and_has_each_column_once(tmp_path):
    from sim.explore.report.sweep_report import sweep_figures as _sweep_figures

    out = tmp_path / "sweep"
    (out / "points").mkdir(parents=True)
    (out / "manifest.json").write_text(json.dumps({"grids": [[CACHE]]}))
    frame = pd.DataFrame({CACHE: ["9472", "10240", "2048"], "decode_tok_s": [3.0, 4.0, 1.0],
                          "decode_hit_rate": [0.9, 0.95, 0.5], "error": pd.array([None, None, "boom"], "string"),
                          "error_kind": pd.array([None, None, "crashed"], "string")})
    table = _sweep_figures(out, frame)[0][1]
    header = list(table.data[0].header.values)
    assert len(header) == len(set(header)) and header.count("decode_hit_rate") == 1
    cells = dict(zip(header, table.data[0].cells.values))
    assert list(cells["expert budget (experts)"]) == ["2048", "9472", "10240"]  # by value, not as text
    assert list(cells["decode_tok_s"]) == ["1.0 tok/s", "3.0 tok/s", "4.0 tok/s"]
    assert list(cells["decode_hit_rate"]) == ["50.0 %", "90.0 %", "95.0 %"]
    assert list(cells["error"]) == ["boom", "", ""] and "<NA>" not in str(table.data[0].cells.values)
    assert list(cells["error_kind"]) == ["crashed", "", ""]  # whether running it again can help
    # plotly draws a 28 px header and 20 px rows (up to 24 px with a wrapped value) under the title margin
    assert table.layout.height >= table.layout.margin.t + 28 + 24 * len(frame) + table.layout.margin.b


def _axis_titles(fig) -> dict[str, str]:
    """Every x/y axis of a figure's layout -> its title text ("" when it has none)."""
    layout = fig.to_plotly_json()["layout"]
    return {k: ((v.get("title") or {}).get("text") or "") for k, v in layout.items()
            if re.fullmatch(r"[xy]axis\d*", k)}


def test_timelines_per_phase_leave_out_all_zero_series_and_panels():
    """A hand-made steps frame: D2H, file reads and lent slots are zero throughout, so neither their series nor the
    lent-slots panel is drawn; prefill and decode get a figure each, on their own clock, one legend per panel,
    and every axis a title with its unit."""
    from sim.explore.report.run_report import run_figures as _run_figures

    steps = pd.DataFrame({
        "request": 0, "phase": ["prefill", "prefill", "decode", "decode", "decode"], "step": [0, 1, 0, 1, 2],
        "layer": 0, "start_s": [0.0, 2.0, 4.0, 4.05, 4.1], "end_s": [2.0, 4.0, 4.05, 4.1, 4.15],
        "tokens": [512, 512, 1, 1, 1], "lookups": [8, 8, 4, 4, 0], "hits": [2, 4, 3, 4, 0],
        "h2d_bytes": [4 * MIB, 2 * MIB, MIB, 0, 0], "d2d_bytes": 0, "d2h_bytes": 0, "file_read_bytes": 0,
        "lent_slots": 0, "vram_used_bytes": 10 * GIB, "ram_used_bytes": [GIB, GIB, 2 * GIB, 2 * GIB, 2 * GIB]})
    figures = dict(_run_figures({"engine": "hand"}, steps))
    for phase in ("Prefill", "Decode"):
        fig = figures[f"{phase} timeline"]
        panels = [a.text for a in fig.layout.annotations]
        assert panels == ["link busy per step (apportioned)", "hits / lookups per step", "copied per step",
                          "memory in use"]  # no lent-slots panel
        assert {t.name for t in fig.data} == {"step wall", "hit rate", "H2D", "VRAM", "RAM"}  # no D2H, file read
        titles = _axis_titles(fig)
        assert len(titles) == 2 * len(panels) and all(re.search(r"\(.+\)$", t) for t in titles.values()), titles
        assert titles["xaxis"] == f"{phase.lower()} time (s)" and titles["yaxis3"] == "bytes (MiB)"
        # one legend per panel: a panel's traces name the legend of their own y axis
        for trace in fig.data:
            assert trace.legend == ("legend" if trace.yaxis == "y" else f"legend{trace.yaxis[1:]}")
    decode = figures["Decode timeline"]
    wall = next(t for t in decode.data if t.name == "step wall")
    assert list(wall.x) == pytest.approx([0.0, 0.05, 0.1, 0.15])  # the phase's own clock, from 0
    assert list(wall.y) == pytest.approx([50.0, 50.0, 50.0, 50.0])  # ms
    rate = next(t for t in decode.data if t.name == "hit rate")
    assert list(rate.y)[:2] == [0.75, 1.0] and np.isnan(rate.y[2])  # no lookups: a gap, not 0


def test_sweep_heatmap_is_categorical_and_labelled(tmp_path):
    from sim.explore.report.sweep_report import sweep_figures as _sweep_figures

    out = tmp_path / "sweep"
    (out / "points").mkdir(parents=True)
    (out / "manifest.json").write_text(json.dumps({"grids": [[CACHE, RESERVE]]}))
    frame = pd.DataFrame({CACHE: ["2048", "9472", "2048", "9472"], RESERVE: ["8", "8", "12", "12"],
                          "decode_tok_s": [10.0, 30.0, 12.0, 31.0], "decode_hit_rate": [0.5, 0.9, 0.55, 0.95],
                          "error": [None] * 4})
    figures = dict(_sweep_figures(out, frame))
    for metric, label in (("decode_tok_s", "%{z:,.1f}"), ("decode_hit_rate", "%{z:.1%}")):
        fig = figures[f"{metric} sweep"]
        heat = fig.data[0]
        assert fig.layout.xaxis.type == "category" and fig.layout.yaxis.type == "category"
        assert fig.layout.xaxis.title.text == "expert budget (experts)" and fig.layout.yaxis.title.text == "VRAM reserve (GiB)"
        assert list(heat.x) == [2048, 9472] and list(heat.y) == [8, 12]  # in value order, not text order
        assert heat.texttemplate == label  # every cell shows its value
    assert figures["decode_tok_s sweep"].data[0].colorbar.title.text == "decode (tok/s)"
    assert [list(r) for r in figures["decode_tok_s sweep"].data[0].z] == [[10.0, 30.0], [12.0, 31.0]]


def test_a_sweep_over_text_values_draws_points_not_a_line(tmp_path):
    """Issue 34: a 1-D sweep over variants was drawn as a line through its alphabetically sorted names, a trend
    that is not there. Text values get points; a numeric dimension keeps its line."""
    from sim.explore.report.sweep_report import sweep_figures as _sweep_figures

    out = tmp_path / "sweep"
    (out / "points").mkdir(parents=True)
    variant = "engine.variant"
    (out / "manifest.json").write_text(json.dumps({"grids": [[variant]]}))
    frame = pd.DataFrame({variant: ["pr504", "pr1082", "main-0728"], "decode_tok_s": [10.0, 30.0, 20.0],
                          "error": [None] * 3})
    trace = dict(_sweep_figures(out, frame))["decode_tok_s sweep"].data[0]
    assert trace.mode == "markers" and sorted(trace.x) == ["main-0728", "pr1082", "pr504"]
    (out / "manifest.json").write_text(json.dumps({"grids": [[CACHE]]}))
    frame = pd.DataFrame({CACHE: ["2048", "9472"], "decode_tok_s": [10.0, 30.0], "error": [None] * 2})
    assert dict(_sweep_figures(out, frame))["decode_tok_s sweep"].data[0].mode == "lines+markers"


def test_a_sweep_over_text_values_is_drawn_in_the_order_the_grid_gave(tmp_path):
    """Issue 34: the variants come along the axis, in the table and in the legend as the user listed them in
    --grid, which the sweep's manifest keeps (open_results), not sorted by name."""
    from sim.explore.report.sweep_report import sweep_figures as _sweep_figures
    from sim.explore.sweep import expand_grid, open_results

    variant = "engine.variant"
    listed = ["pr504", "pre-504"]  # as typed: by name, pre-504 would come first
    points = expand_grid(PER_CLASS, [f"{variant}={','.join(listed)}"])
    out = tmp_path / "sweep"
    open_results(out, points, resume=False)
    assert json.loads((out / "manifest.json").read_text())["values"] == {variant: listed}
    frame = pd.DataFrame({variant: ["pre-504", "pr504"], "decode_tok_s": [0.9, 25.0], "error": [None] * 2})
    figures = dict(_sweep_figures(out, frame))
    assert list(figures["decode_tok_s sweep"].data[0].x) == listed
    assert list(figures["Points"].data[0].cells.values[0]) == listed


def test_what_changed_most_known_answer():
    """By hand: the cache's per-value means are (10 + 12) / 2 = 11 and (30 + 31) / 2 = 30.5 (a 19.5 tok/s range),
    the reserve's (10 + 30) / 2 = 20 and (12 + 31) / 2 = 21.5 (1.5); the hit rate is the same everywhere. The
    failed point is left out."""
    from sim.explore.report import what_changed_most

    frame = pd.DataFrame({CACHE: ["2048", "9472", "2048", "9472", "4096"], RESERVE: ["8", "8", "12", "12", "8"],
                          "decode_tok_s": [10.0, 30.0, 12.0, 31.0, None], "decode_hit_rate": [0.5] * 4 + [None],
                          "error": pd.array([None] * 4 + ["boom"], "string")})
    assert what_changed_most(frame, [CACHE, RESERVE]) == (
        "Over 4 successful points (2 expert budget x 2 VRAM reserve): decode_tok_s goes from 10.0 tok/s (expert "
        "budget 2048 experts, VRAM reserve 8 GiB) to 31.0 tok/s (expert budget 9472 experts, VRAM reserve 12 GiB). "
        "Expert budget moves it most, by 19.5 tok/s: its mean is 11.0 tok/s at expert budget 2048 experts and "
        "30.5 tok/s at expert budget 9472 experts; then VRAM reserve by 1.5 tok/s. decode_hit_rate is 50.0 % at "
        "every point.")
    assert what_changed_most(frame.iloc[4:], [CACHE, RESERVE]) == ""  # no point succeeded


def test_plotly_js_cdn_and_inline(run_dir, tmp_path):
    from plotly.offline import get_plotlyjs, get_plotlyjs_version

    inline, cdn = build_report(run_dir), build_report(run_dir, plotly_js="cdn")
    bundle = get_plotlyjs()
    # the page without the bundle: a tenth of the bundle's size or less, whichever plotly release writes it
    assert len(inline.encode()) > len(bundle) > 3_000_000 and len(cdn.encode()) < len(bundle) / 10
    assert bundle[:2000] in inline and bundle[:2000] not in cdn and bundle[-2000:] not in cdn
    [tag] = re.findall(r"<script[^>]*\bsrc=[^>]*>", cdn)
    assert f'src="https://cdn.plot.ly/plotly-{get_plotlyjs_version()}.min.js"' in tag
    import plotly.graph_objects as go

    # plotly's own tag, whatever its release adds to it (an integrity hash since 5.2x)
    assert [tag] == re.findall(r"<script[^>]*\bsrc=[^>]*>", go.Figure().to_html(include_plotlyjs="cdn"))
    assert _specs(cdn) == _specs(inline)  # the same figures either way
    with pytest.raises(InputError, match="plotly_js"):
        build_report(run_dir, plotly_js="bundle")
    target = tmp_path / "r.html"
    proc = subprocess.run([sys.executable, "-m", "sim", "report", str(run_dir), "-o", str(target), "--plotly-js",
                           "cdn", "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["bytes"] == target.stat().st_size < len(bundle) / 10
    proc = subprocess.run([sys.executable, "-m", "sim", "report", str(run_dir), "-o", str(target), "--force",
                           "--plotly-js", "bundle"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Usage:" in proc.stderr and "--plotly-js" in proc.stderr
    from sim.cli.explore import PlotlyJs
    from sim.explore.report import PLOTLY_JS_MODES

    assert [m.value for m in PlotlyJs] == list(PLOTLY_JS_MODES)  # the command's choices are the report's modes


def test_perfetto_counters_follow_the_steps(run_dir):
    """The trace's "C" tracks against steps.parquet: at every step's start the VRAM, RAM and lent-slots counters
    hold what its row records (a counter holds its last sample), the hit-rate counter is its hits / lookups."""
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = pd.read_parquet(run_dir / "steps.parquet")
    trace = json.loads(json.dumps(perfetto_trace(steps, summary, load_links(run_dir)), allow_nan=False))
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert {e["name"] for e in counters} == {"VRAM in use", "RAM in use", "lent slots", "hit rate"}
    start_us = steps["start_s"].to_numpy() * 1e6
    for name, column, key, unit in (("VRAM in use", "vram_used_bytes", "GiB", GIB),
                                    ("RAM in use", "ram_used_bytes", "GiB", GIB),
                                    ("lent slots", "lent_slots", "slots", 1)):
        track = sorted((e["ts"], e["args"][key]) for e in counters if e["name"] == name)
        ts = np.array([t for t, _ in track])
        held = np.array([v for _, v in track])[np.searchsorted(ts, start_us, side="right") - 1]
        assert held == pytest.approx(steps[column].to_numpy() / unit, rel=1e-12)
    rate = {e["ts"]: e["args"]["%"] for e in counters if e["name"] == "hit rate"}
    looked = steps[steps["lookups"] > 0]
    assert len(rate) == len(looked)
    for start, hits, lookups in zip(looked["start_s"], looked["hits"], looked["lookups"]):
        assert rate[start * 1e6] == pytest.approx(100 * hits / lookups)


def test_bad_folders(tmp_path, run_dir):
    with pytest.raises(InputError, match="neither a run"):
        build_report(tmp_path)
    with pytest.raises(InputError, match="not a folder"):
        build_report(tmp_path / "nope")
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "summary.json").write_text((run_dir / "summary.json").read_text())
    with pytest.raises(InputError, match="steps.parquet"):
        build_report(partial)
    proc = subprocess.run([sys.executable, "-m", "sim", "report", str(tmp_path), "-o", str(tmp_path / "r.html")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and str(tmp_path) in proc.stderr


def test_report_cli(run_dir, tmp_path):
    target = tmp_path / "report.html"
    proc = subprocess.run([sys.executable, "-m", "sim", "report", str(run_dir), "-o", str(target), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout)
    assert payload["figures"] == 8 and target.is_file() and payload["bytes"] == target.stat().st_size


# ----------------------------------------------------------------------------------- miss-ratio curves


def _pool_accesses(experts: np.ndarray, phase: np.ndarray, class_of_layer: np.ndarray, c: int) -> list[tuple]:
    """(key, is_decode) of class c's pool in lookup order: token by token, layer by layer, k in order."""
    n_experts = int(experts.max()) + 1
    out = []
    for row in range(experts.shape[0]):
        for layer in range(experts.shape[1]):
            if class_of_layer[layer] == c and experts[row, layer, 0] != MISSING:
                out += [(layer * n_experts + int(e), bool(phase[row])) for e in experts[row, layer]]
    return out


def _lru_decode_hits(accesses: list[tuple], capacity: int) -> int:
    cache: OrderedDict = OrderedDict()
    hits = 0
    for key, decode in accesses:
        if key in cache:
            cache.move_to_end(key)
            hits += decode
        elif capacity:
            if len(cache) == capacity:
                cache.popitem(last=False)
            cache[key] = True
    return hits


def _best_decode_hits(accesses: list[tuple], capacity: int) -> int:
    """Brute force: every cache's choices on a miss (bypass, load into a free slot, or evict any resident),
    the most decode hits over all of them."""
    best = {frozenset(): 0}  # cache contents -> most decode hits so far
    for key, decode in accesses:
        after: dict = {}
        for held, hits in best.items():
            if key in held:
                options = [(held, hits + decode)]
            else:
                options = [(held, hits)]
                if len(held) < capacity:
                    options.append((held | {key}, hits))
                options += [((held - {old}) | {key}, hits) for old in held]
            for state, h in options:
                after[state] = max(after.get(state, -1), h)
        best = after
    return max(best.values())


def _routing_folder(folder, experts, phase, class_of_layer, expert_bytes, summary, steps) -> None:
    """A run results folder by hand: routing.parquet cell by cell in the format write_results documents."""
    folder.mkdir()
    rows, layers = np.nonzero(experts[:, :, 0] != MISSING)
    is_decode = phase[rows] == 1
    token = np.where(is_decode, rows - int((phase == 0).sum()), rows)
    pq.write_table(pa.table({
        "phase": np.where(is_decode, "decode", "prefill"), "token": token.astype(np.int32),
        "layer": layers.astype(np.int16), "class": class_of_layer[layers].astype(np.int16),
        "expert_bytes": expert_bytes[layers].astype(np.int64),
        "experts": pa.FixedSizeListArray.from_arrays(pa.array(experts[rows, layers].reshape(-1)), experts.shape[2]),
    }), folder / "routing.parquet")
    (folder / "summary.json").write_text(json.dumps(summary))
    steps.to_parquet(folder / "steps.parquet", index=False)


# 3 layers of 4 experts, top-2: layers 0 and 1 are size class 0, layer 2 class 1; 3 prompt tokens, then 4 decode
TINY = np.array([
    [[0, 1], [2, 3], [0, 1]],
    [[1, 2], [2, 3], [1, 2]],
    [[3, 0], [0, 1], [3, 0]],
    [[0, 1], [2, 3], [1, 2]],
    [[2, 3], [3, 0], [0, 1]],
    [[0, 1], [2, 3], [3, 0]],
    [[1, 2], [1, 0], [0, 1]],
], np.uint16)
TINY_PHASE = np.array([0, 0, 0, 1, 1, 1, 1], np.uint8)
TINY_CLASS = np.array([0, 0, 1], np.int16)


def test_mrc_figure_known_answers(tmp_path):
    """The plotted LRU points equal an OrderedDict LRU at every size, the Belady points the brute-force best, and
    the run's marker is its per-class decode hits / lookups from steps.parquet, at its per-class slots."""
    steps = pd.DataFrame({"request": 0, "phase": ["decode"] * 3 + ["prefill"], "step": [0, 0, 0, 0],
                          "layer": [0, 1, 2, 0], "start_s": 0.0, "end_s": 1.0, "lookups": [8, 8, 8, 6],
                          "hits": [3, 5, 1, 6]})
    summary = {"engine": "hand", "measured_request": 0, "engine_state": {"cache_slots_per_class": [3, 2]}}
    _routing_folder(tmp_path / "run", TINY, TINY_PHASE, TINY_CLASS, np.array([1000, 1000, 3000]), summary, steps)
    figure = dict(report_figures(tmp_path / "run")[1])["Miss-ratio curves"]
    seen = set()
    for trace in figure.data:
        c = int(trace.name.split(":")[0].split()[1])
        accesses = _pool_accesses(TINY, TINY_PHASE, TINY_CLASS, c)
        lookups = sum(decode for _, decode in accesses)
        kind = trace.name.rsplit(", ", 1)[1]
        seen.add((c, kind))
        for slots, y in zip(trace.x, trace.y):
            # row 1 plots the hit rate; row 2 the miss ratio, with a gap (None) where it is 0 (a log axis)
            rate = y if trace.yaxis == "y" else 1 if y is None else 1 - y
            if kind == "LRU":
                assert rate == pytest.approx(_lru_decode_hits(accesses, slots) / lookups)
            elif kind == "Belady bound":
                assert rate == pytest.approx(_best_decode_hits(accesses, slots) / lookups)
            else:
                assert kind == "this run" and slots == [3, 2][c]
                assert rate == pytest.approx([(3 + 5) / 16, 1 / 8][c])
    assert seen == {(c, k) for c in (0, 1) for k in ("LRU", "Belady bound", "this run")}
    # by hand, class 1 (layer 2) with 1 slot, decode lookups 1 2 | 0 1 | 3 0 | 0 1: LRU hits only the 0 of the last
    # token (after 3 0); the bound keeps 0 from the prompt and hits it in tokens 1, 2 and 3: 3 of 8
    lru = [t for t in figure.data if t.name.startswith("class 1") and t.name.endswith("LRU") and t.yaxis == "y"][0]
    bound = [t for t in figure.data if t.name.startswith("class 1") and "Belady" in t.name and t.yaxis == "y"][0]
    assert lru.y[list(lru.x).index(1)] == 1 / 8 and bound.y[list(bound.x).index(1)] == 3 / 8


def _random_routing(draw):
    n_layers = draw(st.integers(1, 3))
    n_experts = draw(st.integers(2, 4))
    top_k = draw(st.integers(1, min(2, n_experts)))
    prompt, decode = draw(st.integers(0, 5)), draw(st.integers(1, 5))
    rows = [[sorted(draw(st.sets(st.integers(0, n_experts - 1), min_size=top_k, max_size=top_k)))
             for _ in range(n_layers)] for _ in range(prompt + decode)]
    classes = np.array([draw(st.integers(0, n_layers - 1)) for _ in range(n_layers)], np.int16)
    classes = np.unique(classes, return_inverse=True)[1].astype(np.int16)  # classes 0..n-1, each used
    return np.array(rows, np.uint16), np.r_[np.zeros(prompt), np.ones(decode)].astype(np.uint8), classes


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_mrc_curves_against_oracles(data):
    """Random small routings: LRU = OrderedDict at every size, Belady = brute force, and never below the LRU."""
    experts, phase, classes = _random_routing(data.draw)
    header = TraceHeader("hand", experts.shape[1], int(experts.max()) + 1, experts.shape[2], "test", "")
    trace = Trace(header, np.zeros(len(phase)), np.arange(len(phase)), phase, experts)
    ones = np.ones(experts.shape[1], np.int64)
    geometry = Geometry(experts.shape[1], header.n_experts, ones, classes, ones[: int(classes.max()) + 1])
    curves = hit_rate_curves(trace, geometry)
    for (c, policy), part in curves.groupby(["class", "policy"]):
        accesses = _pool_accesses(experts, phase, classes, c)
        oracle = _lru_decode_hits if policy == "lru" else _best_decode_hits
        assert part["hits"].tolist() == [oracle(accesses, s) for s in part["slots"]]
    lru = curves[curves["policy"] == "lru"].set_index(["class", "slots"])["hit_rate"]
    belady = curves[curves["policy"] == "belady"].set_index(["class", "slots"])["hit_rate"]
    assert (belady >= lru.loc[belady.index]).all()


def test_routing_file_keeps_what_the_curves_need(run_dir, tmp_path):
    """routing.parquet keeps the decode cells and, of the prompt, the cells of each key's last access: the curves
    equal those of the whole prompt, written here from the scenario's routing."""
    scenario = load_scenario(PER_CLASS)
    request = workload_routing(scenario).requests[0]
    trace, geometry = load_routing(run_dir)
    assert (trace.experts[trace.phase == 1] == request.decode).all()
    assert (trace.phase == 0).sum() < len(request.prompt) / 2
    experts = np.concatenate([request.prompt, request.decode])
    phase = np.r_[np.zeros(len(request.prompt)), np.ones(len(request.decode))].astype(np.uint8)
    summary = json.loads((run_dir / "summary.json").read_text())
    _routing_folder(tmp_path / "whole", experts, phase, geometry.class_of_layer, geometry.expert_bytes, summary,
                    pd.read_parquet(run_dir / "steps.parquet"))
    whole = hit_rate_curves(*load_routing(tmp_path / "whole"))
    pd.testing.assert_frame_equal(hit_rate_curves(trace, geometry), whole)


def test_run_marker_and_bound_on_the_run(run_dir):
    """On the ds4 run: the marker sits at the engine's per-class slots, at the steps' per-class decode hit rate;
    the bound there is at least the run's hit rate (no cache of that size can beat it)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    figure = dict(report_figures(run_dir)[1])["Miss-ratio curves"]
    steps = pd.read_parquet(run_dir / "steps.parquet")
    decode = steps[(steps["phase"] == "decode") & (steps["request"] == summary["measured_request"])]
    _, geometry = load_routing(run_dir)
    for c, slots in enumerate(summary["engine_state"]["cache_slots_per_class"]):
        mine = decode[np.isin(decode["layer"], np.flatnonzero(geometry.class_of_layer == c))]
        [marker] = [t for t in figure.data if t.name.startswith(f"class {c}:") and t.name.endswith("this run")
                    and t.yaxis == "y"]
        assert list(marker.x) == [slots] and marker.y[0] == pytest.approx(mine["hits"].sum() / mine["lookups"].sum())
        [bound] = [t for t in figure.data if t.name.startswith(f"class {c}:") and "Belady" in t.name
                   and t.yaxis == "y"]
        assert bound.y[list(bound.x).index(slots)] >= marker.y[0]


def test_bad_routing_file(run_dir, tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    for name in ("summary.json", "steps.parquet"):
        (folder / name).write_bytes((run_dir / name).read_bytes())
    table = pq.read_table(run_dir / "routing.parquet")
    pq.write_table(table.drop_columns(["class"]), folder / "routing.parquet")
    with pytest.raises(InputError, match="class"):
        build_report(folder)
    frame = table.to_pandas()
    frame.loc[0, "phase"] = "decode"  # a decode row before prompt rows
    pq.write_table(pa.Table.from_pandas(frame.astype({"phase": str})), folder / "routing.parquet")
    with pytest.raises(InputError, match="prompt's rows come before"):
        build_report(folder)
