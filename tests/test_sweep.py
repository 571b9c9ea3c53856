"""Sweeps: grid parsing, one-line errors, Parquet points appended at once, resume, failing points, Dask, and the
one-pass miss-ratio-curve path of cache-only LRU grids (rows equal to a replay per point)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sim.errors import InputError
from sim.explore.runner import evaluate, evaluate_mrc, plan_tasks
from sim.explore.sweep import expand_grid, load_sweep, run_sweep
from sim.trace.format import Trace, TraceHeader, write_trace

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
    # issue 34: a range of NaN was a ValueError traceback; a NaN or an infinity in a list reached the scenario
    (f"{CACHE}=nan:10:1", "finite"),
    ("engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB=4,nan", "nan"),
    ("engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB=inf", "finite"),
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


def _frame_as_pandas_converts_it(row: dict, overrides: dict) -> pd.DataFrame:
    """The oracle: a one-row frame pandas infers, its metric columns through pd.to_numeric(errors="coerce") and
    astype, its text columns astype("string")."""
    from sim.engines import extra_metrics
    from sim.explore.runner import COUNTS, METRICS

    flat = {**row, "overrides": json.dumps(overrides, sort_keys=True),
            "notices": json.dumps(row.get("notices") or []), "out_of_domain": json.dumps(row.get("out_of_domain") or [])}
    frame = pd.DataFrame([flat])
    for k in (*METRICS, *extra_metrics()):
        if k in frame:
            frame[k] = pd.to_numeric(frame[k], errors="coerce").astype("Int64" if k in COUNTS else "float64")
    for k in ("error", "error_kind", "scenario_hash", "method", "notices", "out_of_domain"):
        frame[k] = frame[k].astype("string")
    return frame


def test_a_point_row_has_the_types_and_file_bytes_pandas_gives_it(tmp_path):
    """The parent builds each point's row typed column by column (issue 33): the same frame as pandas' own
    conversion of an inferred frame, and the same Parquet bytes as DataFrame.to_parquet, for a run's row and a
    failed one with text and missing figures."""
    from sim.explore.sweep import _row_frame, _write_row

    point = expand_grid(PER_CLASS, [f"{CACHE}=2048", "engine.flags.prefill-chunk=512"])[0]
    row = evaluate(point)
    failed = {**row, "cache_slots": None, "decode_tok_s": None, "cache_mib": "12.5", "lent_slots": "none",
              "wall_s": None, "method": None, "error": "boom", "error_kind": "crashed", "notices": ["a notice"]}
    for case in (row, failed):
        ours, oracle = _row_frame(case, point.overrides), _frame_as_pandas_converts_it(case, point.overrides)
        pd.testing.assert_frame_equal(ours, oracle)
        _write_row(ours, tmp_path / "ours.parquet")
        oracle.to_parquet(tmp_path / "oracle.parquet", index=False)
        assert (tmp_path / "ours.parquet").read_bytes() == (tmp_path / "oracle.parquet").read_bytes()
    assert pd.isna(_row_frame(failed, point.overrides)["lent_slots"].iloc[0])  # text that is no number: missing


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
    # at --ctx 1,000,000 ds4's KV cache and context buffers fit the 96 GB card but not the 16 GB one: that point
    # fails when its engine starts, the other runs
    points = expand_grid(SLAB, [f"{CACHE}=2048", "engine.flags.ctx=1000000", "hardware=rtx-pro-6000-96gb,rtx-4060ti-16gb"])
    result = run_sweep(points, tmp_path / "fail", workers=2)
    frame = load_sweep(tmp_path / "fail").set_index("hardware")
    assert len(result.failed) == 1 and len(result.computed) == 2
    error = frame.loc["rtx-4060ti-16gb", "error"]
    assert "before its expert cache" in error and "\n" not in error
    assert frame.loc["rtx-pro-6000-96gb", "decode_tok_s"] > 0 and pd.isna(frame.loc["rtx-pro-6000-96gb", "error"])


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


# ------------------------------------------------------------------------------- the one-pass MRC path

REPLAY = SCENARIOS / "replay-qwen3.8-lru.toml"
SLOTS = "engine.flags.slots"
SHORT = ["workload.requests.0.prompt_tokens=1024", "workload.requests.0.decode_tokens=256"]  # a quick workload


@pytest.fixture(scope="module")
def replay_sweeps(tmp_path_factory):
    """One grid of a cache-only evicting LRU, swept by the one-pass path and by a replay per point."""
    out = tmp_path_factory.mktemp("replay")
    points = expand_grid(REPLAY, ["engine.flags.scope=layer,class,global", f"{SLOTS}=0:512:32", *SHORT])
    results = {mrc: run_sweep(points, out / f"mrc-{mrc}", workers=1, mrc=mrc) for mrc in (True, False)}
    return points, results, out


def test_mrc_rows_equal_a_replay_per_point(replay_sweeps):
    points, results, out = replay_sweeps
    assert len(points) == 3 * 17
    assert all(len(r.computed) == len(points) and not r.failed for r in results.values())
    assert [(t.method, len(t.points)) for t in plan_tasks(points)] == [("mrc", 17)] * 3  # a curve per scope
    fast, slow = load_sweep(out / "mrc-True"), load_sweep(out / "mrc-False")
    assert (fast["method"] == "mrc").all() and (slow["method"] == "run").all()
    same = [c for c in slow.columns if c not in ("method", "wall_s")]
    assert fast[same].equals(slow[same])  # every point, every column, to the bit
    for _, scope in fast.groupby("engine.flags.scope"):
        by_slots = scope.sort_values(SLOTS)
        assert by_slots["hit_rate"].is_monotonic_increasing and by_slots["hit_rate"].iloc[0] == 0
    assert fast["decode_tok_s"].isna().all() and fast["error"].isna().all()


def test_resume_recomputes_the_missing_points_of_a_group(replay_sweeps, tmp_path):
    points, _, out = replay_sweeps
    shutil.copytree(out / "mrc-True", tmp_path / "copy")
    gone = sorted((tmp_path / "copy" / "points").glob("*.parquet"))[:2]
    for f in gone:
        f.unlink()
    result = run_sweep(points, tmp_path / "copy", workers=1, resume=True)
    assert sorted(result.computed) == sorted(f.stem for f in gone) and len(result.resumed) == len(points) - 2
    again = load_sweep(tmp_path / "copy").drop(columns=["wall_s"])
    assert again.equals(load_sweep(out / "mrc-True").drop(columns=["wall_s"]))


@pytest.mark.parametrize("scenario, grid, methods", [
    (REPLAY, [f"{SLOTS}=64,128"], ["mrc", "mrc"]),
    (REPLAY, [f"{SLOTS}=64,128", "engine.flags.policy=lfu"], ["run", "run"]),
    (REPLAY, [f"{SLOTS}=64,128", "engine.flags.prefill-mode=append"], ["run", "run"]),  # not a stack algorithm
    (REPLAY, [f"{SLOTS}=64,128", "engine.flags.policy=opt,lru"], ["run", "mrc", "run", "mrc"]),
    (REPLAY, ["engine.flags.scope=layer,class"], ["run", "run"]),  # the slot count is not a dimension
    (PER_CLASS, [f"{CACHE}=2048,4096"], ["run", "run"]),  # an engine, not a pure LRU
])
def test_only_an_evicting_lru_over_slot_counts_takes_the_one_pass_path(scenario, grid, methods):
    points = expand_grid(scenario, grid)
    method = {p.point_id: task.method for task in plan_tasks(points) for p in task.points}
    assert [method[p.point_id] for p in points] == methods
    assert all(t.method == "run" for t in plan_tasks(points, mrc=False))


def test_a_grid_that_cannot_use_the_curve_runs_each_point(tmp_path):
    points = expand_grid(REPLAY, [f"{SLOTS}=64,128", "engine.flags.prefill-mode=evict,append", *SHORT])
    result = run_sweep(points, tmp_path / "mixed", workers=1)
    frame = load_sweep(tmp_path / "mixed").set_index(["engine.flags.prefill-mode", SLOTS])
    assert len(result.computed) == 4 and not result.failed
    assert list(frame.sort_index()["method"]) == ["run", "run", "mrc", "mrc"]  # append, then evict
    # another cache than the evicting LRU the curve describes: its figures are its own
    assert (frame.loc["append", "misses"].to_numpy() != frame.loc["evict", "misses"].to_numpy()).all()


def test_a_point_that_does_not_load_fails_alone_and_its_group_completes(tmp_path):
    # 600 slots fit the global pool (48 x 512 experts) but no single layer's 512
    points = expand_grid(REPLAY, ["engine.flags.scope=layer,global", f"{SLOTS}=256,600", *SHORT])
    result = run_sweep(points, tmp_path / "fail", workers=1)
    frame = load_sweep(tmp_path / "fail").set_index(["engine.flags.scope", SLOTS])
    assert len(result.failed) == 1 and len(result.computed) == 4
    assert "engine.flags.slots = 600: 600 slots in pool 0" in frame.loc[("layer", 600), "error"]
    assert pd.isna(frame.loc[("layer", 600), "method"])
    assert (frame.drop(index=("layer", 600))["method"] == "mrc").all()


def test_a_group_that_fails_at_run_time_gives_each_point_the_error_a_run_gives(tmp_path):
    shutil.copytree(SCENARIOS / "hardware", tmp_path / "hardware")
    rng = np.random.default_rng(0)
    experts = np.stack([rng.permutation(512)[:10] for _ in range(4 * 48)]).reshape(4, 48, 10)
    write_trace(Trace(TraceHeader("qwen3.8-flash-next-iq3s", 48, 512, 10, "test", "0" * 64), np.zeros(4),
                      np.arange(4), np.zeros(4), experts), tmp_path / "short.parquet")
    text = REPLAY.read_text().replace('generator = "qwen3.8-flash-next-iq3s"\nseed = 0', 'path = "short.parquet"')
    (tmp_path / "s.toml").write_text(text)  # the trace has 4 prompt rows and no decode; the workload asks for more
    points = expand_grid(tmp_path / "s.toml", [f"{SLOTS}=64,128"])
    group = evaluate_mrc(points)
    each = [evaluate(p) for p in points]
    assert "request 0 decode = 0: the workload needs 1024 tokens" in group[0]["error"]
    for mrc_row, run_row in zip(group, each):
        assert {k: v for k, v in mrc_row.items() if k not in ("method", "wall_s")} == \
               {k: v for k, v in run_row.items() if k not in ("method", "wall_s")}


def test_cli_sweep_json_says_which_path_made_each_row(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sim", "sweep", str(REPLAY), "--grid", f"{SLOTS}=64,128",
                           *[a for g in SHORT for a in ("--grid", g)], "-o", str(tmp_path / "cli"), "--json"],
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "160"})
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["rows"]
    assert [r["method"] for r in rows] == ["mrc", "mrc"] and rows[0]["hit_rate"] < rows[1]["hit_rate"]
    assert rows[0]["decode_tok_s"] is None and rows[0]["misses"] > rows[1]["misses"]


def test_bench_rows_of_the_one_pass_sweep_on_a_tiny_grid():
    from sim.explore.bench import mrc_sweep_rows

    rows = {r["name"]: r for r in mrc_sweep_rows((f"{SLOTS}=64,128", *SHORT))}
    assert set(rows) == {"sweep_mrc_cache_sizes", "sweep_per_point_cache_sizes", "sweep_mrc_speedup",
                         "sweep_mrc_compute_speedup"}
    assert rows["sweep_mrc_cache_sizes"]["value"] > 0 and rows["sweep_per_point_cache_sizes"]["value"] > 0
    assert "2 cache sizes" in rows["sweep_mrc_cache_sizes"]["unit"]
    assert all(set(r) == {"name", "value", "unit", "target", "met"} for r in rows.values())


# ------------------------------------------------------------------------- damaged, failed, interrupted

FAILING = [f"{CACHE}=2048", "engine.flags.ctx=1000000", "hardware=rtx-pro-6000-96gb,rtx-4060ti-16gb"]


def test_a_damaged_point_file_is_skipped_by_name_and_recomputed_on_resume(four, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(four[0], copy)
    victim = sorted((copy / "points").glob("*.parquet"))[0]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # a write cut short by a full disk
    frame = load_sweep(copy)
    assert len(frame) == 3 and frame.attrs["damaged"] == [str(victim)]
    result = run_sweep(expand_grid(PER_CLASS, FOUR), copy, workers=1, resume=True)
    assert result.computed == [victim.stem] and result.damaged == [str(victim)] and len(result.resumed) == 3
    repaired = load_sweep(copy)
    assert repaired.attrs["damaged"] == [] and repaired.drop(columns="wall_s").equals(
        load_sweep(four[0]).drop(columns="wall_s"))


def test_cli_sweep_with_failed_points_exits_1_and_retry_failed_recomputes_only_them(tmp_path):
    out = tmp_path / "fail"
    cmd = [sys.executable, "-m", "sim", "sweep", str(SLAB), *(a for g in FAILING for a in ("--grid", g)),
           "-o", str(out), "--workers", "1"]
    first = subprocess.run(cmd, capture_output=True, text=True)
    assert first.returncode == 1 and "Traceback" not in first.stderr
    assert "1 of 2 points failed" in first.stderr and "--resume --retry-failed" in first.stderr
    assert "1 refused (the engine's refusal, or a setting out of range: they fail again)" in first.stderr
    resumed = subprocess.run([*cmd, "--resume", "--json"], capture_output=True, text=True)
    payload = json.loads(resumed.stdout)
    assert resumed.returncode == 1 and payload["computed"] == 0 and payload["failed"] == 1  # not "failed: 0"
    assert [r["error_kind"] for r in payload["rows"] if r["error"]] == ["refused"]  # kept in the point's file
    # issue 34: the table kept only the error's last 57 characters; its whole text is listed under the table
    error = next(r["error"] for r in payload["rows"] if r["error"])
    assert any(line.startswith("failed: ") and line.endswith(error) for line in first.stdout.splitlines())
    retried = subprocess.run([*cmd, "--resume", "--retry-failed", "--json"], capture_output=True, text=True)
    payload = json.loads(retried.stdout)
    assert retried.returncode == 1 and payload["computed"] == 1 and payload["resumed"] == 1 and payload["failed"] == 1
    alone = subprocess.run([*cmd, "--retry-failed"], capture_output=True, text=True)
    assert alone.returncode == 2 and "--resume" in alone.stderr


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start_long_sweep(out: Path):
    import time

    proc = subprocess.Popen([sys.executable, "-m", "sim", "sweep", str(PER_CLASS), "--grid",
                             f"{CACHE}=1024:9472:64", "-o", str(out), "--workers", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list((out / "points").glob("*.parquet")) if (out / "points").is_dir() else True:
        assert proc.poll() is None and time.monotonic() < deadline, "the sweep ended before it could be stopped"
        time.sleep(0.2)
    workers = _children(proc.pid)
    assert len([w for w in workers if _alive(w)]) >= 2
    return proc, workers


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads worker processes from /proc (Linux)")
@pytest.mark.parametrize("signum, code", [(2, 130), (15, 143)], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_on_a_sweep_says_what_is_saved_and_stops_its_workers(tmp_path, signum, code):
    """Ctrl-C, and SIGTERM (issue 34: exit 143 without the message, a leaked-semaphore warning): the points saved
    and the command that resumes, the workers gone, nothing leaked."""
    import time

    out = tmp_path / "long"
    proc, workers = _start_long_sweep(out)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code and "Traceback" not in stderr and "leaked" not in stderr, stderr
    saved = len(list((out / "points").glob("*.parquet")))
    line = stderr.strip().splitlines()[-1]
    assert f"{saved} of {(9472 - 1024) // 64 + 1} points are saved in {out}" in line and line.endswith("--resume")
    time.sleep(2)
    assert not [w for w in workers if _alive(w)]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads worker processes from /proc (Linux)")
def test_workers_of_a_killed_sweep_leave_with_it(tmp_path):
    import time

    proc, workers = _start_long_sweep(tmp_path / "killed")
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while [w for w in workers if _alive(w)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [w for w in workers if _alive(w)]


def test_report_names_and_skips_a_damaged_point_file(four, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(four[0], copy)
    victim = sorted((copy / "points").glob("*.parquet"))[1]
    victim.write_bytes(b"PAR1 cut short")
    proc = subprocess.run([sys.executable, "-m", "sim", "report", str(copy), "-o", str(tmp_path / "r.html"), "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert f"1 damaged point files skipped: {victim.name}" in json.loads(proc.stdout)["title"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dask_scheduler_and_workers_elsewhere_run_a_relative_scenario_path(four, tmp_path):
    """`dask scheduler` + 2 `dask worker` processes started in another folder, as on a cluster: the sweep names
    its scenario relative to where it runs, and gets the rows the process executor gives."""
    import time

    pytest.importorskip("distributed")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    address = f"tcp://127.0.0.1:{_free_port()}"
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=elsewhere)
    processes = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                   "--port", address.rsplit(":", 1)[1], "--dashboard-address", ":0"], **quiet)]
    time.sleep(3)
    processes += [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1",
                                    "--nworkers", "1", "--dashboard-address", ":0"], **quiet) for _ in range(2)]
    try:
        relative = PER_CLASS.relative_to(PER_CLASS.parents[1])
        grids = [a for g in FOUR for a in ("--grid", g)]
        proc = subprocess.run([sys.executable, "-m", "sim", "sweep", str(relative), *grids, "-o", str(tmp_path / "dask"),
                               "--executor", "dask", "--scheduler", address, "--json"],
                              capture_output=True, text=True, cwd=PER_CLASS.parents[1], timeout=300)
    finally:
        for p in processes:
            p.terminate()
        for p in processes:
            p.wait(timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["failed"] == 0
    dask_rows = load_sweep(tmp_path / "dask").drop(columns=["wall_s"])
    assert dask_rows.equals(load_sweep(four[0]).drop(columns=["wall_s"]))
