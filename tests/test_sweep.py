"""Sweeps: grid parsing, one-line errors, Parquet points appended at once, resume, failing points, Dask."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from sim.errors import InputError
from sim.explore.sweep import expand_grid, load_sweep, run_sweep

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"
PER_CLASS = SCENARIOS / "ds4-504-per-class.toml"
SLAB = SCENARIOS / "ds4-504-slab.toml"
CACHE = "engine.flags.ssd-streaming-cache-experts"
RESERVE = "engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB"
FOUR = [f"{CACHE}=2048,4096", "engine.variant=pr504,pre-504"]


def test_grid_lists_and_ranges_keep_the_schema_types():
    points = expand_grid(PER_CLASS, [f"{RESERVE}=8:16:4", "workload.requests.0.prompt_tokens=1000,2000",
                                     "engine.flags.prefill-chunk=1024:2048:1024"])
    assert len(points) == 3 * 2 * 2
    first = points[0].overrides
    assert first == {RESERVE: "8", "workload.requests.0.prompt_tokens": 1000, "engine.flags.prefill-chunk": 1024}
    assert [p.overrides[RESERVE] for p in points[::4]] == ["8", "12", "16"]  # env values are strings
    assert points[0].data["engine"]["env"]["DS4_CUDA_NO_DIRECT_IO"] == "1"  # the rest of the file is kept
    assert len({p.point_id for p in points}) == 12 and all(p.error is None for p in points)
    assert len({p.scenario_hash for p in points}) == 12
    words = expand_grid(PER_CLASS, ["engine.variant=pre-504,pr504", "hardware=rtx-pro-6000-96gb",
                                    "engine.env.DS4_CUDA_NO_DIRECT_IO=0,1"])
    assert [p.overrides["engine.variant"] for p in words] == ["pre-504", "pre-504", "pr504", "pr504"]
    assert {p.overrides["engine.env.DS4_CUDA_NO_DIRECT_IO"] for p in words} == {"0", "1"}


@pytest.mark.parametrize("grid, named", [
    ("engine.flags.bogus=1", "engine.flags.bogus"),
    ("bogus=1,2", "bogus"),
    ("engine.flags.prefill-chunk=abc", "engine.flags.prefill-chunk = 'abc'"),
    ("engine.flags.ssd-streaming=maybe", "engine.flags.ssd-streaming = 'maybe'"),
    ("workload.requests.3.prompt_tokens=10", "workload.requests.3.prompt_tokens"),
    (f"{CACHE}=99999999", CACHE),
    ("engine.variant=pr999", "engine.variant"),
    ("engine.flags.prefill-chunk=4:1:1", "engine.flags.prefill-chunk"),
    ("no-equals-sign", "--grid"),
])
def test_bad_grid_is_one_line_naming_key_and_value(grid, named):
    with pytest.raises(InputError) as info:
        expand_grid(PER_CLASS, [grid])
    message = str(info.value)
    assert named in message and "\n" not in message


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """A 4-point sweep on 2 local processes (shared by the tests below)."""
    out = tmp_path_factory.mktemp("sweep") / "four"
    seen = []
    result = run_sweep(expand_grid(PER_CLASS, FOUR), out, workers=2, progress=lambda row, n, total: seen.append(n))
    return out, result, seen


def test_four_point_sweep_writes_one_parquet_row_per_point(four):
    out, result, seen = four
    assert len(result.computed) == 4 and not result.failed and sorted(seen) == [1, 2, 3, 4]
    assert len(list((out / "points").glob("*.parquet"))) == 4
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["grids"] == [sorted([CACHE, "engine.variant"])]
    frame = load_sweep(out)
    assert len(frame) == 4 and frame["error"].isna().all()
    for column in ("cache_slots", "cache_mib", "lent_slots", "prefill_buffer_mib", "file_blob_reads",
                   "prefill_tok_s", "decode_tok_s", "decode_hit_rate", "ttft_s", "simulated_s", "scenario_hash",
                   "wall_s", CACHE, "engine.variant"):
        assert column in frame
    per_class = frame[frame["engine.variant"] == "pr504"].set_index(CACHE)
    assert per_class.loc["4096", "decode_tok_s"] > per_class.loc["2048", "decode_tok_s"]  # more cache, faster
    assert (frame["decode_tok_s"] > 0).all()


def test_resume_recomputes_only_the_missing_point(four, tmp_path):
    out, _, _ = four
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "points").mkdir()
    (copy / "manifest.json").write_bytes((out / "manifest.json").read_bytes())
    files = sorted((out / "points").glob("*.parquet"))
    for f in files[1:]:
        (copy / "points" / f.name).write_bytes(f.read_bytes())
    points = expand_grid(PER_CLASS, FOUR)
    with pytest.raises(InputError, match="--resume"):
        run_sweep(points, copy, workers=1)
    result = run_sweep(points, copy, workers=1, resume=True)
    assert result.computed == [files[0].stem] and len(result.resumed) == 3
    before, after = load_sweep(out), load_sweep(copy)
    metrics = ["point_id", "decode_tok_s", "cache_slots", "ttft_s"]
    assert after[metrics].equals(before[metrics])
    again = run_sweep(points, copy, workers=1, resume=True)
    assert again.computed == [] and len(again.resumed) == 4


def test_failing_point_records_its_error_and_the_others_complete(tmp_path):
    points = expand_grid(SLAB, [f"{CACHE}=2048", "engine.variant=pr504,pr1082"])
    result = run_sweep(points, tmp_path / "fail", workers=2)
    frame = load_sweep(tmp_path / "fail").set_index("engine.variant")
    assert len(result.failed) == 1 and len(result.computed) == 2
    error = frame.loc["pr1082", "error"]
    assert "engine.variant = pr1082" in error and "\n" not in error
    assert frame.loc["pr504", "decode_tok_s"] > 0 and pd.isna(frame.loc["pr504", "error"])


def test_results_of_another_scenario_are_refused(four):
    out, _, _ = four
    with pytest.raises(InputError, match="another scenario") as info:
        run_sweep(expand_grid(SLAB, [f"{CACHE}=2048"]), out, resume=True)
    assert "\n" not in str(info.value)


def test_cli_sweep_json_and_error_exit(four, tmp_path):
    env = {**os.environ, "COLUMNS": "160"}
    cmd = [sys.executable, "-m", "sim", "sweep", str(PER_CLASS), "--grid", f"{CACHE}=2048"]
    proc = subprocess.run([*cmd, "--grid", "engine.variant=pr504", "-o", str(tmp_path / "one"), "--json"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout)
    assert payload["computed"] == 1 and payload["rows"][0][CACHE] == "2048"
    assert payload["rows"][0]["decode_tok_s"] == pytest.approx(
        load_sweep(four[0]).set_index([CACHE, "engine.variant"]).loc[("2048", "pr504"), "decode_tok_s"])
    bad = subprocess.run([*cmd, "--grid", "engine.flags.nope=1", "-o", str(tmp_path / "two")],
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "engine.flags.nope" in bad.stderr
    other = subprocess.run([sys.executable, "-m", "sim", "sweep", str(SLAB), "--grid", f"{CACHE}=2048",
                            "-o", str(four[0]), "--resume"], capture_output=True, text=True, env=env)
    assert other.returncode == 2 and "another scenario" in other.stderr


def test_dask_local_cluster_gives_the_same_rows(four, tmp_path):
    pytest.importorskip("distributed")
    points = expand_grid(PER_CLASS, FOUR)[:3]
    result = run_sweep(points, tmp_path / "dask", executor="dask", workers=2)
    assert len(result.computed) == 3 and not result.failed
    dask_rows = load_sweep(tmp_path / "dask").drop(columns=["wall_s"])
    local = load_sweep(four[0]).drop(columns=["wall_s"])
    local = local[local["point_id"].isin(dask_rows["point_id"])].reset_index(drop=True)
    assert dask_rows.equals(local)
