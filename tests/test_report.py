"""The HTML report (structure, offline, figure specs) and the Perfetto trace export."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pandas as pd
import pytest

from sim.engine.run import run_scenario, write_results
from sim.errors import InputError
from sim.explore.report import build_report, perfetto_trace
from sim.scenario import load_scenario

PER_CLASS = "scenarios/ds4-504-per-class.toml"
CACHE = "engine.flags.ssd-streaming-cache-experts"
RESERVE = "engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    result = run_scenario(load_scenario(PER_CLASS))
    write_results(result, out)
    return out


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
    assert len(specs) == 4  # headline table, links table, timeline, hit heatmap
    assert page.count('class="expertsim-plot"') == 4
    types = [[t["type"] for t in s["data"]] for s in specs]
    assert types[0] == ["table"] and types[1] == ["table"] and types[3] == ["heatmap"]
    summary = json.loads((run_dir / "summary.json").read_text())
    busy_links = [link["link"] for link in summary["links"] if link["busy_s"] > 0]
    names = [t.get("name") for t in specs[2]["data"]]
    assert set(busy_links) <= set(names) and "lent slots" in names and "VRAM" in names
    # the heatmap's z is hits / lookups of steps.parquet, per layer and step
    steps = pd.read_parquet(run_dir / "steps.parquet")
    heat = specs[3]["data"][0]
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
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    complete = [e for e in events if e["ph"] == "X"]
    assert complete and all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    per_lane: dict[str, float] = {}
    for e in complete:
        per_lane[threads[e["tid"]]] = per_lane.get(threads[e["tid"]], 0.0) + e["dur"]
    assert "steps" in per_lane and "request 0" in per_lane
    for link in summary["links"]:
        if link["busy_s"] > 0:
            assert per_lane[link["link"]] / 1e6 == pytest.approx(link["busy_s"], rel=0.01)
    steps = pd.read_parquet(run_dir / "steps.parquet")
    assert per_lane["steps"] / 1e6 == pytest.approx((steps["end_s"] - steps["start_s"]).sum(), rel=0.01)
    # a lane's events never overlap (one thread)
    for tid in threads:
        lane = sorted((e["ts"], e["dur"]) for e in complete if e["tid"] == tid)
        assert all(a[0] + a[1] <= b[0] + 1e-3 for a, b in zip(lane, lane[1:]))
    # the library function gives the same lanes
    assert len(perfetto_trace(steps, summary)["traceEvents"]) == len(events)


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
    assert len(heatmaps) == 2  # decode and prefill tok/s vs cache size and reserve
    heat = heatmaps[0]["data"][0]
    assert sorted(heat["x"]) == [4096, 9472] and sorted(heat["y"]) == [8, 12]
    assert all(v is not None and v > 0 for row in heat["z"] for v in row)


def test_sweep_report_lines_and_slider(tmp_path):
    from sim.explore.report import _sweep_figures

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
    assert payload["figures"] == 4 and target.is_file() and payload["bytes"] == target.stat().st_size
