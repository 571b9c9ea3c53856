"""GPU calibration without a GPU: the gather kernel in Numba's CUDA simulator on small plans (every byte
compared), the fit on the committed H200 samples, the calibration file, the replay's placement and launch
grouping, one-line errors. One test needs a real GPU and is skipped, not faked, without one."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

# The simulator must be chosen before numba.cuda is first imported (sim.calibrate.cudaenv imports it
# lazily and re-reads numba's configuration): these tests never touch a real GPU in this process.
os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

from sim.calibrate import cudaenv, fileformat, fit  # noqa: E402
from sim.calibrate.backend import MEMORIES, PROBE_COPIES, PROBE_REPS, Backend  # noqa: E402
from sim.calibrate.kernel import Variant  # noqa: E402
from sim.calibrate.selftest import random_plan, reference_apply, self_test  # noqa: E402
from sim.calibrate import replay as replay_module  # noqa: E402
from sim.calibrate.replay import (ANCHOR_COPIES, Anchor, Placement, anchor_shifts, choose_anchors,  # noqa: E402
                                  gather_launches, replay)
from sim.calibrate.sweep import PROBE_POINTS  # noqa: E402
from sim.calibrate.replay import PLAN_COLUMNS  # noqa: E402
from sim.errors import InputError  # noqa: E402
from sim.units import GIB, MIB

try:  # numba-cuda's simulator (expertsim[cuda]), else the one numba 0.68 still ships
    cuda = cudaenv.load()
except ImportError as exc:  # pragma: no cover - neither is importable
    pytest.skip(f"no Numba CUDA simulator: {exc}", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
CAL_DIR = REPO / "scenarios" / "hardware" / "calibration"
H200 = CAL_DIR / "h200.json"
H200_REPLAY = CAL_DIR / "h200-replay-ds4-504-per-class.json"
SMALL_CACHE = {"dev": 1 << 16, "host": 1 << 16}


def expertsim(*args, env=None):
    env = {**os.environ, "COLUMNS": "160", **(env or {})}
    return subprocess.run([sys.executable, "-m", "sim", *map(str, args)], capture_output=True, text=True, env=env)


def assert_one_line_error(proc, needle):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == ""


# ------------------------------------------------------------------------------------- kernel (simulator)


@pytest.mark.parametrize("seed, unroll, threads", [(0, 4, 8), (1, 8, 8), (2, 4, 32)])
def test_gather_and_engine_way_copy_every_byte_of_random_plans(seed, unroll, threads):
    backend = Backend(dev_words=6000, host_words=3000,
                      variants={p: Variant(threads, unroll, 2) for p in MEMORIES})
    result = self_test(backend, np.random.default_rng(seed), steps=2, n_desc=12, max_words=400)
    assert result["steps"] == 2 and result["descriptors"] >= 20
    # three ways x two steps x both arenas, every word compared
    assert result["bytes_compared"] == 3 * 2 * (6000 + 3000) * 8


def _short_by_one(src, dst, desc):  # a broken gather: every descriptor's last word is left out
    d = cuda.blockIdx.y
    i = cuda.threadIdx.x
    while i < desc[3 * d + 2] - 1:
        dst[desc[3 * d + 1] + i] = src[desc[3 * d] + i]
        i += cuda.blockDim.x


def test_self_test_catches_a_kernel_that_skips_a_word():
    backend = Backend(dev_words=4000, host_words=2000)
    broken = cuda.jit(_short_by_one)
    for unroll in backend.kernels:
        backend.kernels[unroll] = broken
    with pytest.raises(AssertionError, match="still poisoned"):
        self_test(backend, np.random.default_rng(5), steps=1, n_desc=6, max_words=50)


def test_random_plans_are_hazard_free():
    rng = np.random.default_rng(3)
    for _ in range(20):
        plan = random_plan(rng, 5000, 2000, 30, 300)
        dst = {"dev": np.zeros(5000, int), "host": np.zeros(2000, int)}
        src = {"dev": np.zeros(5000, int), "host": np.zeros(2000, int)}
        for path, desc in plan:
            s_mem, d_mem = MEMORIES[path]
            for s, d, n in desc:
                dst[d_mem][d: d + n] += 1
                src[s_mem][s: s + n] += 1
        for mem in ("dev", "host"):
            assert dst[mem].max() <= 1 and not np.any((dst[mem] > 0) & (src[mem] > 0))


@pytest.mark.parametrize("bad, why", [
    (np.array([[0, 5990, 20]]), "out of range"),
    (np.array([[-1, 0, 4]]), "out of range"),
    (np.array([[0, 0, 0]]), "length must be > 0"),
])
def test_out_of_range_descriptors_are_one_line_errors(bad, why):
    backend = Backend(dev_words=6000, host_words=3000)
    for make in (lambda: backend.gather_step([("d2d", bad)]),
                 lambda: backend.ce_step("d2d", bad[:, 0], bad[:, 1], bad[:, 2])):
        with pytest.raises(InputError, match=why) as err:
            make()
        assert "\n" not in str(err.value)
    with pytest.raises(InputError, match="must be one of"):
        backend.gather_step([("h2h", np.array([[0, 0, 1]]))])


# ------------------------------------------------------------------------------------------------- fit


def synthetic_samples(rng, params, noise=0.02):
    rows = []
    for path in ("d2d", "h2d", "d2h"):
        for way in fit.WAYS:
            for size in (MIB, 4 * MIB, 16 * MIB):
                for n in (1, 4, 16, 64, 256):
                    for launches in ((1, 3) if way == "gather" and n >= 3 else (1,)):
                        t = float(fit.predict_config(params, path, way, n, size, launches))
                        for rep in range(3):
                            rows.append((path, way, size, n, launches, rep, t * (1 + noise * rng.standard_normal()),
                                         0.4 * t))
    return pd.DataFrame.from_records(rows, columns=list(fit.SAMPLE_COLUMNS))


def test_fit_recovers_known_parameters():
    truth = {"paths": {p: {"ce_sync": {"fixed_us": 10.0, "per_copy_us": 9.0, "gbps": g},
                           "ce_batch": {"fixed_us": 6.0, "per_copy_us": 3.0, "gbps": g},
                           "gather": {"fixed_us": 8.0, "per_launch_us": 6.0, "per_descriptor_us": 0.05,
                                      "gbps": 0.95 * g}}
                       for p, g in (("d2d", 1900.0), ("h2d", 55.0), ("d2h", 55.0))}}
    got = fit.fit(synthetic_samples(np.random.default_rng(0), truth, noise=0.01))
    for path, ways in truth["paths"].items():
        for way, terms in ways.items():
            assert got["paths"][path][way]["gbps"] == pytest.approx(terms["gbps"], rel=0.03)
            assert got["fit_error"][f"{path}/{way}"]["median"] < 0.02
    assert got["paths"]["h2d"]["ce_sync"]["per_copy_us"] == pytest.approx(9.0, rel=0.1)
    assert got["paths"]["d2d"]["gather"]["per_launch_us"] == pytest.approx(6.0, rel=0.25)
    assert all(v >= 0 for ways in got["paths"].values() for terms in ways.values() for v in terms.values())


def test_nnls_keeps_coefficients_non_negative():
    x = np.column_stack([np.ones(5), np.arange(1, 6.0)])
    t = 10.0 - np.arange(1, 6.0)  # best unconstrained slope is negative
    c = fit.nnls_relative(x, t)
    assert np.all(c >= 0)


def test_fit_of_committed_h200_samples_matches_the_shipped_file():
    record = json.loads(H200.read_text())  # the one committed real sample set: the H200 file's raw samples
    samples = fileformat.samples_frame(record, str(H200))
    assert len(samples) > 1000
    params = fit.fit(samples)
    shipped = fileformat.plain_parameters(fileformat.load(H200))
    for path, ways in shipped["paths"].items():
        for way, terms in ways.items():
            for term, value in terms.items():
                assert params["paths"][path][way][term] == pytest.approx(value, rel=1e-3, abs=1e-3), (path, way, term)
    # a real GPU's copies: bandwidths in the right ballpark, a good fit overall
    assert 1000 < params["paths"]["d2d"]["ce_sync"]["gbps"] < 5000
    assert 40 < params["paths"]["h2d"]["ce_sync"]["gbps"] < 64
    assert params["fit_error"]["all"]["median"] < 0.10


# ------------------------------------------------------------------------------------------ the file


def test_calibration_file_of_another_schema_version_is_one_line_error(tmp_path):
    record = json.loads(H200.read_text())
    record["schema_version"] = 99
    bad = tmp_path / "cal.json"
    bad.write_text(json.dumps(record))
    with pytest.raises(InputError, match="schema_version = 99") as err:
        fileformat.load(bad)
    assert "\n" not in str(err.value)
    assert_one_line_error(expertsim("calibrate", "--from-samples", bad), "schema_version")


@pytest.mark.parametrize("mutate, needle", [
    (lambda r: r.pop("schema"), "schema"),
    (lambda r: r["parameters"]["paths"]["d2d"]["ce_sync"]["gbps"].update(value=-1), "must be > 0"),
    (lambda r: r["parameters"]["paths"]["d2d"]["ce_sync"]["gbps"].update(unit="MB/s"), "unit"),
    (lambda r: r.update(status="guessed"), "status"),
])
def test_damaged_calibration_files_are_refused(tmp_path, mutate, needle):
    record = _published_record()
    mutate(record)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(record))
    with pytest.raises(InputError, match=needle):
        fileformat.load(path)


def test_missing_calibration_file_is_one_line_error(tmp_path):
    with pytest.raises(InputError, match="no such calibration file"):
        fileformat.load(tmp_path / "nope.json")


def _published_record():
    return json.loads((CAL_DIR / "rtx-5090.json").read_text())


@pytest.mark.parametrize("name", ["rtx-5090.json", "rtx-pro-6000.json"])
def test_sm120_files_are_published_figures(name):
    record = fileformat.load(CAL_DIR / name)
    assert record["status"] == "published" and fileformat.PUBLISHED_NOTE in record["note"]
    assert record["gpu"]["compute_capability"] == "12.0"
    assert not record["samples"]["rows"]
    params = fileformat.plain_parameters(record)
    assert 50 < params["paths"]["h2d"]["ce_sync"]["gbps"] < 60


def test_published_files_match_their_builder():
    from sim.calibrate.published import build

    for name, record in build(fileformat.load(H200)).items():
        assert json.loads(fileformat.dumps(record)) == json.loads((CAL_DIR / f"{name}.json").read_text()), name


def test_h200_file_meets_the_speed_rows_and_its_replay_the_goal():
    record = fileformat.load(H200)
    assert record["status"] == "measured" and record["gpu"]["compute_capability"] == "9.0"
    assert record["software"]["driver_version"] and record["software"]["numba-cuda"]
    speed = {row["target"]: row for row in record["references"]["speed"] if row["target"]}
    assert speed[">= 0.85"]["met"] and speed[">= 0.85"]["value"] >= 0.85  # gather vs one large device copy
    assert speed[">= 0.9"]["met"] and speed[">= 0.9"]["value"] >= 0.90  # mapped H2D vs pinned cudaMemcpy
    replayed = json.loads(H200_REPLAY.read_text())
    for row in replayed["summary"]:
        if row["phase"] == "all":
            assert row["median_error"] <= 0.10, row


@pytest.mark.parametrize("profile, cal", [("h200", "h200.json"), ("rtx-pro-6000-96gb", "rtx-pro-6000.json"),
                                          ("rtx-5090-48gb-windows", "rtx-5090.json")])
def test_hardware_profiles_reference_valid_calibration_files(profile, cal):
    pytest.importorskip("pydantic")
    from sim.hardware import load_hardware

    hw = load_hardware(profile)
    assert hw.calibration_path == (CAL_DIR / cal).resolve() and len(hw.calibration_sha256) == 64
    assert fileformat.load_for_profile(hw)["gpu"]["name"]


def test_profile_pointing_at_missing_calibration_is_one_line_error(tmp_path):
    pytest.importorskip("pydantic")
    from sim.hardware import load_hardware

    text = (REPO / "scenarios" / "hardware" / "h200.toml").read_text()
    text = text.replace('calibration = "calibration/h200.json"', 'calibration = "calibration/none.json"')
    assert "calibration/none.json" in text
    (tmp_path / "hw.toml").write_text(text)
    with pytest.raises(InputError, match="none.json") as err:
        load_hardware(tmp_path / "hw.toml")
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------- replay


def ds4_like_plan(steps=4, hits=5, loaded=2, direct=1):
    rows = []
    for step in range(steps):
        for part, b in (("gate", 1000), ("up", 1000), ("down", 1304)):
            rows.append((step, "H2D", loaded, b, "file", f"slab:{part}"))
            rows.append((step, "H2D", direct, b, "file", f"staging:{part}"))
            rows.append((step, "D2D", hits + loaded, b, f"slab:{part}", f"staging:{part}"))
        rows.append((step, "D2H", 1, 2048, "session", "parked"))
    return pd.DataFrame(rows, columns=["step_id", "kind", "count", "bytes_each", "src", "dst"])


def test_placement_reads_freshly_loaded_slots_and_packs_staging():
    placement = Placement(ds4_like_plan(), min_cache_bytes=SMALL_CACHE)
    assert placement.arenas[("dev", "slab:gate")].cache and not placement.arenas[("dev", "staging:gate")].cache
    descs = placement.step_descriptors(placement.rows[placement.rows["step_id"] == 0], np.random.default_rng(0))
    loads, direct, d2d = descs[0][1], descs[1][1], descs[2][1]
    assert list(d2d[:2, 0]) == list(loads[:, 1])  # the two loaded experts are copied on from their slots
    stage = placement.arenas[("dev", "staging:gate")]
    assert sorted(np.concatenate([direct[:, 1], d2d[:, 1]]) - stage.base) == [stage.slot_words * i for i in range(8)]


def test_gather_launches_respect_dependencies_and_stay_few():
    placement = Placement(ds4_like_plan(), min_cache_bytes=SMALL_CACHE)
    descs = placement.step_descriptors(placement.rows[placement.rows["step_id"] == 1], np.random.default_rng(1))
    launches = gather_launches(descs)
    assert [p for p, _ in launches] == ["h2d", "d2d", "d2h"]  # loads, then every slab->staging copy
    rng = np.random.default_rng(2)
    arenas = {m: rng.integers(0, 2**63, placement.words[m], dtype=np.uint64) for m in ("dev", "host")}
    in_order = {k: v.copy() for k, v in arenas.items()}
    reference_apply(in_order, [(p, d) for p, d, _, _ in descs])
    grouped = {k: v.copy() for k, v in arenas.items()}
    reference_apply(grouped, launches)
    for m in arenas:
        assert np.array_equal(in_order[m], grouped[m])


def _results(tmp_path, steps: int) -> Path:
    results = tmp_path / "run"
    results.mkdir()
    ds4_like_plan(steps=steps).to_parquet(results / "copy_plan.parquet", index=False)
    (results / "summary.json").write_text(json.dumps({"engine": "ds4", "variant": "pr504"}))
    return results


def test_replay_in_simulator_verifies_bytes_and_reports_errors(tmp_path):
    results = _results(tmp_path, steps=5)
    calibration = fileformat.load(H200)
    report = replay(results, calibration, verify_every=2, min_cache_bytes=SMALL_CACHE)
    assert report["simulator"] and report["steps"] == 5 and report["verified_bytes"] > 0
    ways = {row["way"] for row in report["summary"]}
    assert ways == {"ce_sync", "gather"}
    per = pd.DataFrame(report["per_step"])
    assert len(per) == 10 and (per["predicted_us"] > 0).all()
    assert set(per.loc[per["way"] == "gather", "calls"]) == {3}


def _record_calls(monkeypatch) -> list:
    """Log Backend.settle and the timed runs, in order (the run methods keep working)."""
    calls = []
    for name in ("settle", "run_gather", "run_ce"):
        original = getattr(Backend, name)

        def logged(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(Backend, name, logged)
    return calls


def _timed_runs_after_settle(calls: list) -> int:
    """How many runs follow a settle directly; fails if a settle is followed by anything but one run."""
    follows = [calls[i + 1] for i, c in enumerate(calls) if c == "settle"]
    assert all(c in ("run_gather", "run_ce") for c in follows), calls
    return len(follows)


def test_every_timed_replay_step_runs_right_after_a_settle(tmp_path, monkeypatch):
    results = _results(tmp_path, steps=4)
    calls = _record_calls(monkeypatch)
    report = replay(results, fileformat.load(H200), repeats=3, verify_every=2, min_cache_bytes=SMALL_CACHE)
    assert len(report["per_step"]["step_id"]) == 8  # 4 steps, two ways
    probes = len(report["host_probe"]["replay_us"])  # before each way and after each quarter of its steps
    assert probes == 2 * (PROBE_POINTS + 1) and report["repeats"] == 3
    assert _timed_runs_after_settle(calls) == 3 * 8 + probes * PROBE_REPS


def test_replay_compares_the_median_of_a_steps_runs_and_reports_their_noise(tmp_path, monkeypatch):
    """Known answer: the timed runs (those right after a settle) take 10, 30, 20, 10, 30, 20 ... us in turn, so
    every step's measured time is 20 us, and its runs lie 1/2, 1/2 and 0 away from that median: noise floor 1/2.
    The host probe reads 150 us where the calibration's read 100 (the median of its readings): a drift of +50 %."""
    results = _results(tmp_path, steps=3)
    monkeypatch.setattr(Backend, "host_probe", lambda self, reps=PROBE_REPS: 150.0)
    calibration = {**fileformat.load(H200), "host_probe": {"through_sweep_us": [100.0, 120.0, 100.0, 90.0, 100.0]}}
    durations = iter([10.0, 30.0, 20.0] * 100)
    settled = []
    for name in ("run_ce", "run_gather"):
        original = getattr(Backend, name)

        def timed(self, *args, _original=original, **kwargs):
            timing = _original(self, *args, **kwargs)
            if settled:
                settled.clear()
                timing.wall_us = next(durations)
            return timing
        monkeypatch.setattr(Backend, name, timed)
    settle = Backend.settle
    monkeypatch.setattr(Backend, "settle", lambda self: (settle(self), settled.append(True)))
    report = replay(results, calibration, repeats=3, verify_every=2, min_cache_bytes=SMALL_CACHE)
    per = pd.DataFrame(report["per_step"])
    # three steps: each way reads the probe before its first step and after each step (fewer than PROBE_POINTS)
    assert report["host_probe"] == {"calibration_us": 100.0, "replay_us": [150.0] * 2 * 4}
    assert report["host_drift"] == pytest.approx(0.5)
    # the engines' way moved to the replay's host state: each call 50 / PROBE_COPIES us slower; gather unmoved
    engines = per[per["way"] == "ce_sync"]
    assert engines["host_adjusted_us"].tolist() == pytest.approx(
        (engines["predicted_us"] + engines["calls"] * 50.0 / PROBE_COPIES).tolist())
    assert per.loc[per["way"] == "gather", "host_adjusted_us"].isna().all()
    assert (per["measured_us"] == 20.0).all() and all(sorted(r) == [10.0, 20.0, 30.0] for r in per["runs_us"])
    assert {row["way"]: row["noise_floor"] for row in report["summary"]} == {"ce_sync": 0.5, "gather": 0.5}
    once = replay(results, fileformat.load(H200), repeats=1, verify_every=2, min_cache_bytes=SMALL_CACHE)
    assert all(row["noise_floor"] is None for row in once["summary"])  # one run per step: no spread to measure
    assert once["host_drift"] is None  # h200.json predates the probe
    with pytest.raises(InputError, match="--repeats"):
        replay(results, fileformat.load(H200), repeats=0, min_cache_bytes=SMALL_CACHE)


def test_a_steps_host_state_is_the_probe_interpolated_between_the_readings_around_it(tmp_path, monkeypatch):
    """Known answer: the probe reads 100, 200, 300, ... us in turn; with four steps a way reads it before the
    first step and after each one (PROBE_POINTS = 4), so step k of the first way lies between readings k and
    k + 1: 150, 250, 350, 450 us; the second way's readings go on from 600."""
    assert PROBE_POINTS == 4
    readings = iter(range(100, 10_000, 100))
    monkeypatch.setattr(Backend, "host_probe", lambda self, reps=PROBE_REPS: float(next(readings)))
    calibration = {**fileformat.load(H200), "host_probe": {"through_sweep_us": [100.0]}}
    report = replay(_results(tmp_path, steps=4), calibration, repeats=1, verify_every=2,
                    min_cache_bytes=SMALL_CACHE)
    per = pd.DataFrame(report["per_step"])
    assert per["host_probe_us"].tolist() == [150.0, 250.0, 350.0, 450.0, 650.0, 750.0, 850.0, 950.0]
    assert report["host_probe"]["replay_us"] == [100.0 * k for k in range(1, 11)]
    by_way = {row["way"]: row["host_adjusted_median_error"] for row in report["summary"]}
    assert by_way["ce_sync"] is not None and by_way["gather"] is None


def test_anchors_are_the_grid_configurations_around_the_plans_mean_copy_size():
    """Known answer: d2d copies average (3 x 2.0 + 1 x 4.4) / 4 = 2.6 MiB, between the grid's 2 and 3 MiB; h2d copies
    of 20 MiB lie past the grid's largest (16 MiB), so its two largest sizes. Each anchor carries the median of the
    calibration's own samples of it, read here from the file's rows without the package."""
    plan = pd.DataFrame([(0, "D2D", 3, 2 * MIB, "slab", "staging"), (0, "D2D", 1, int(4.4 * MIB), "slab", "staging"),
                         (1, "H2D", 2, 20 * MIB, "file", "slab")], columns=PLAN_COLUMNS)
    calibration = fileformat.load(H200)
    anchors = choose_anchors(plan, calibration)
    expected = [(path, size * MIB, n) for path, sizes in (("d2d", (2, 3)), ("h2d", (12, 16)))
                for size in sizes for n in ANCHOR_COPIES]
    assert [(a.path, a.size_bytes, a.copies) for a in anchors] == expected
    columns = calibration["samples"]["columns"]
    rows = [dict(zip(columns, r)) for r in calibration["samples"]["rows"]]
    for a in anchors:
        times = [r["wall_us"] for r in rows if (r["path"], r["way"], r["size_bytes"], r["n"])
                 == (a.path, "ce_sync", a.size_bytes, a.copies)]
        assert len(times) >= 5 and a.calibration_us == pytest.approx(float(np.median(times)))
    published = {k: v for k, v in calibration.items() if k != "samples"}
    assert choose_anchors(plan, published) == []  # a file without samples has nothing to compare with


def test_an_anchor_shift_is_the_line_through_the_moves_per_copy():
    """Known answer: every copy takes 1.5 us more plus 2 us more a MiB (a slower call and a slower DMA rate)."""
    anchors = [Anchor("h2d", size * MIB, n, 100.0 * n) for size in (2, 3) for n in ANCHOR_COPIES]
    medians = [a.calibration_us + a.copies * (1.5 + 2.0 * a.size_bytes / MIB) for a in anchors]
    per_copy, per_byte = anchor_shifts(anchors, medians)["h2d"]
    assert per_copy == pytest.approx(1.5) and per_byte * MIB == pytest.approx(2.0)
    one_size = [Anchor("d2d", 2 * MIB, n, 50.0) for n in (8, 16)]
    assert anchor_shifts(one_size, [50.0 + 8 * 1.0, 50.0 + 16 * 3.0])["d2d"] == (2.0, 0.0)


def test_the_engines_way_moves_by_the_anchors_timed_around_each_step(tmp_path, monkeypatch):
    """Known answer: the anchors read 1 us a copy slower than the calibration's samples before the way, then 2, 3,
    4, 5 us after each of its four steps, so step k lies halfway between readings: 1.5, 2.5, 3.5, 4.5 us a copy
    more than predicted. The gather way is not moved; the report keeps every reading and its shift."""
    readings = iter(range(1, 100))

    def fake_time_anchors(backend, anchors, layout, rng):
        slower = float(next(readings))
        return [a.calibration_us + a.copies * slower for a in anchors]
    monkeypatch.setattr(replay_module, "time_anchors", fake_time_anchors)
    report = replay(_results(tmp_path, steps=4), fileformat.load(H200), repeats=1, verify_every=2,
                    min_cache_bytes=SMALL_CACHE)
    per = pd.DataFrame(report["per_step"])
    engines = per[per["way"] == "ce_sync"]
    assert engines["anchor_adjusted_us"].tolist() == pytest.approx(
        (engines["predicted_us"] + engines["copies"] * np.array([1.5, 2.5, 3.5, 4.5])).tolist())
    assert per.loc[per["way"] == "gather", "anchor_adjusted_us"].isna().all()
    timed = report["host_anchors"]
    assert len(timed["replay_us"]) == PROBE_POINTS + 1 and len(timed["configurations"]) == 2 * 3 * len(ANCHOR_COPIES)
    assert [s["d2d"]["us_a_copy"] for s in timed["shifts"]] == pytest.approx([1.0, 2.0, 3.0, 4.0, 5.0])
    by_way = {row["way"]: row["anchor_adjusted_median_error"] for row in report["summary"]}
    assert by_way["ce_sync"] is not None and by_way["gather"] is None


def test_anchors_that_the_simulators_arenas_cannot_hold_are_left_out(tmp_path):
    report = replay(_results(tmp_path, steps=2), fileformat.load(H200), repeats=1, min_cache_bytes=SMALL_CACHE)
    assert report["host_anchors"] is None
    assert all(row["anchor_adjusted_median_error"] is None for row in report["summary"])


def test_calibration_file_records_the_host_probe():
    record = {"host_probe": fileformat.host_probe_record([100.0, 120.5, 90.0])}
    assert record["host_probe"]["through_sweep_us"] == [100.0, 120.5, 90.0]
    assert fileformat.probe_us(record) == 100.0  # the median reading
    assert fileformat.host_probe_record([]) is None and fileformat.probe_us(fileformat.load(H200)) is None
    measured = fileformat.load(CAL_DIR / "h200-i.json")  # the first H200 calibrated with the probe
    assert len(measured["host_probe"]["through_sweep_us"]) == 5 and fileformat.probe_us(measured) > 0


def test_every_timed_grid_sample_runs_right_after_a_settle(monkeypatch):
    from sim.calibrate import sweep

    grid = sweep.Grid(sizes_bytes=(4096,), experts=(1, 4), repeats=1, tune=False)
    layout = sweep.Layout.for_grid(grid)
    backend = Backend(dev_words=layout.dev_words, host_words=layout.host_words)
    calls = _record_calls(monkeypatch)
    samples, probes = sweep.sweep(backend, layout, np.random.default_rng(0), grid, log=lambda m: None)
    assert len(samples) > 0 and len(probes) == sweep.PROBE_POINTS + 1  # before the sweep, after each quarter
    assert _timed_runs_after_settle(calls) == len(samples) + len(probes) * PROBE_REPS


@pytest.mark.parametrize("mutate, needle", [
    (lambda f: f.drop(columns=["bytes_each"]), "columns"),
    (lambda f: f.assign(kind="P2P"), "kind = P2P"),
    (lambda f: f.assign(count=-1), "count"),
])
def test_bad_copy_plans_are_one_line_errors(tmp_path, mutate, needle):
    results = tmp_path / "run"
    results.mkdir()
    mutate(ds4_like_plan(steps=1)).to_parquet(results / "copy_plan.parquet", index=False)
    proc = expertsim("calibrate", "--replay", results, "--calibration", CAL_DIR / "rtx-5090.json")
    assert_one_line_error(proc, needle)


def test_cli_replays_a_plan_with_runs_per_step_and_refuses_zero_runs(tmp_path):
    results = _results(tmp_path, steps=2)
    proc = expertsim("calibrate", "--replay", results, "--calibration", H200, "--repeats", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["repeats"] == 2 and report["steps"] == 2 and report["host_drift"] is None  # h200.json: no probe
    assert len(report["host_probe"]["replay_us"]) == 2 * 3  # two steps a way: before the first, after each
    assert {r["way"] for r in report["summary"]} == {"ce_sync", "gather"}
    assert_one_line_error(expertsim("calibrate", "--replay", results, "--calibration", H200, "--repeats", "0"),
                          "--repeats")


def test_replay_of_a_missing_folder_is_one_line_error(tmp_path):
    assert_one_line_error(expertsim("calibrate", "--replay", tmp_path / "nope", "--calibration",
                                    CAL_DIR / "rtx-5090.json"), "no such results folder")


def test_not_enough_gpu_memory_is_one_line_error(monkeypatch):
    from sim.calibrate import sweep

    monkeypatch.setattr(cudaenv, "free_memory_bytes", lambda: 8.0 * GIB)
    with pytest.raises(InputError, match=r"8.0 GiB free: the sweep needs 18.1 GiB") as err:
        sweep.check_memory(sweep.Layout.for_grid(sweep.Grid()))
    assert "\n" not in str(err.value)
    sweep.check_memory(sweep.Layout.for_grid(sweep.Grid(experts=(1, 2, 4, 8, 16, 32, 64))))  # 1.3 GiB fits


@pytest.mark.parametrize("args, needle", [
    (["calibrate"], "simulator runs tiny grids only"),
    (["calibrate", "--replay", REPO / "tests" / "golden", "--calibration", CAL_DIR / "h200.json"], "copy_plan"),
    (["calibrate", "--sizes", "1,x"], "--sizes"),
])
def test_cli_refuses_what_it_cannot_do_in_one_line(args, needle):
    assert_one_line_error(expertsim(*args), needle)


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_refits_recorded_samples_as_json(tmp_path):
    out = tmp_path / "refit.json"
    proc = expertsim("calibrate", "--from-samples", H200, "-o", out, "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["gpu"]["name"] == "NVIDIA H200" and data["fit_error"]["all"]["median"] < 0.10
    assert fileformat.load(out)["parameters"] == data["parameters"]


def test_cli_calibrate_without_a_gpu_is_one_line_error():
    if _gpu_present():
        pytest.skip("a GPU is present: the command would measure it")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, "-m", "sim", "calibrate", "--json"], capture_output=True, text=True,
                          env=env)
    assert_one_line_error(proc, "calibrate")


# --------------------------------------------------------------------------------------- real GPU only


def _gpu_present() -> bool:
    return shutil.which("nvidia-smi") is not None or Path("/dev/nvidiactl").exists()


GPU_SCRIPT = r"""
import json, numpy as np
from sim.calibrate import cudaenv, sweep, fileformat
from sim.calibrate.backend import Backend
from sim.calibrate.selftest import self_test
cuda = cudaenv.require_gpu()
assert not cudaenv.simulating()
out = {}
for mode, desc_in in (("raw", "device"), ("raw", "mapped"), ("pointer", "device"), ("dispatch", "device")):
    b = Backend(dev_words=1 << 22, host_words=1 << 21, launch_mode=mode, desc_in=desc_in)
    out[mode + "/" + desc_in] = self_test(b, np.random.default_rng(7), steps=3, n_desc=64, max_words=1 << 18)
g = sweep.Grid(sizes_bytes=(MIB, 3 * MIB), experts=(1, 4, 16), repeats=2, tune=False,
               reference_bytes=64 << 20, event_reps=3)
r = sweep.calibrate(g)
rec = fileformat.build_record(r, "test", "0")
fileformat.check(json.loads(json.dumps(fileformat.finite(rec))), "gpu-test")
out["fit_median"] = rec["fit_error"]["all"]["median"]
out["h2d_gbps"] = rec["parameters"]["paths"]["h2d"]["ce_sync"]["gbps"]["value"]
print(json.dumps(out))
"""


@pytest.mark.skipif(not _gpu_present(), reason="needs an NVIDIA GPU (skipped, never faked, without one)")
def test_on_a_real_gpu_kernel_is_exact_and_calibration_is_sane():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", GPU_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=600)
    if proc.returncode != 0 and "numba-cuda" in proc.stderr and "not installed" in proc.stderr:
        pytest.skip("numba-cuda is not installed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(out[k]["steps"] == 3 for k in ("raw/device", "raw/mapped", "pointer/device", "dispatch/device"))
    assert 20 < out["h2d_gbps"] < 80
