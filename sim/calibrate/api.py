"""What `expertsim calibrate` does, as functions the CLI calls: measure, refit recorded samples, replay."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from sim.calibrate import fileformat, fit
from sim.errors import InputError
from sim.units import MIB



def parse_list(text: str | None, option: str, kind=float) -> tuple | None:
    if text is None:
        return None
    try:
        values = tuple(kind(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise InputError("calibrate", option, text, f"must be a comma-separated list of {kind.__name__}s") from None
    if not values or min(values) <= 0:
        raise InputError("calibrate", option, text, "needs positive values")
    return values


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def _version() -> str:
    from sim.version import __version__

    return __version__


def measure(*, sizes_mib=None, experts=None, repeats=None, seed=0, tune=True, output: Path | None = None,
            log=lambda m: None) -> dict:
    """Run the sweep on this GPU, write the calibration file; returns {"file", "record"}."""
    from sim.calibrate import sweep

    kwargs = {"seed": seed, "tune": tune}
    if sizes_mib:
        kwargs["sizes_bytes"] = tuple(int(round(s * MIB)) for s in sizes_mib)
    if experts:
        kwargs["experts"] = tuple(int(n) for n in experts)
    if repeats:
        kwargs["repeats"] = int(repeats)
    grid = sweep.Grid(**kwargs)
    result = sweep.calibrate(grid, log=log)
    record = fileformat.build_record(result, "expertsim " + " ".join(sys.argv[1:]), _version())
    path = output or Path(f"calibration-{_slug(result.device['name'])}.json")
    fileformat.write(record, path)
    return {"file": str(path), "record": record}


def refit(samples_file: Path, output: Path | None) -> dict:
    """Fit the raw samples of a calibration file again (no GPU); writes `output` when given."""
    record = fileformat.load(samples_file)
    samples = fileformat.samples_frame(record, str(samples_file))
    if not len(samples):
        raise InputError(str(samples_file), "samples", 0, "no raw samples to fit (a published file?)")
    params = fit.fit(samples)
    old = record["parameters"]
    source = f"[H] fit of {params['configs']} configurations (expertsim calibrate, {str(record.get('date'))[:10]})"
    idle = (old.get("sync_idle_us") or {}).get("value")
    record = {**record, "parameters": fileformat.parameters_record(params, source, idle),
              "fit_error": params["fit_error"], "simulator_profile": fileformat.simulator_profile(params)}
    if output is not None:
        fileformat.write(record, output)
    return {"file": str(output) if output else None, "record": record}


def calibration_for_results(results: Path, calibration: Path | None) -> dict:
    """--calibration FILE, else the calibration file of the hardware profile the run used."""
    if calibration is not None:
        return fileformat.load(calibration)
    import json

    summary_path = Path(results) / "summary.json"
    try:
        summary = json.loads(summary_path.read_text())
        profile_ref = summary["provenance"]["hardware_profile"]
    except (OSError, ValueError, KeyError, TypeError):
        raise InputError(str(results), "--calibration", "(none)",
                         "give --calibration FILE (the run's summary.json names no hardware profile)") from None
    from sim.hardware import load_hardware

    profile = load_hardware(profile_ref, base=Path(results))
    return fileformat.load_for_profile(profile)


def replay(results: Path, calibration: Path | None, *, max_steps=None, seed=0, repeats=None,
           output: Path | None = None, log=lambda m: None) -> dict:
    from sim.calibrate import replay as replay_mod

    record = calibration_for_results(results, calibration)
    report = replay_mod.replay(results, record, max_steps=max_steps, seed=seed,
                               repeats=replay_mod.REPLAY_REPEATS if repeats is None else repeats, log=log)
    if output is not None:
        fileformat.write(report, output)
        report["file"] = str(output)
    return report


def report_rows(record: dict) -> dict:
    """Tables for the terminal: parameters, fit error, speed rows, engines' way vs gather."""
    params = fileformat.plain_parameters(record)
    rows = []
    for path, ways in params["paths"].items():
        for way, terms in ways.items():
            err = record.get("fit_error", {}).get(f"{path}/{way}") or {}
            rows.append({"path": path, "way": way, **{k: terms.get(k) for k in
                                                      ("fixed_us", "per_launch_us", "per_copy_us",
                                                       "per_descriptor_us", "gbps")},
                         "median_err": err.get("median"), "p95_err": err.get("p95")})
    extra = [{"key": "gpu", "value": record["gpu"]["name"]},
             {"key": "compute capability", "value": record["gpu"].get("compute_capability")},
             {"key": "status", "value": record["status"]},
             {"key": "call_us (host, one cudaMemcpyAsync)", "value": ", ".join(
                 f"{k} {v:.2f}" for k, v in params["call_us"].items() if v is not None)},
             {"key": "sync_us (per copy, ce_sync)", "value": params.get("sync_us")},
             {"key": "fit error, all (median / p95)", "value": _pair(record.get("fit_error", {}).get("all"))}]
    refs = record.get("references", {})
    return {"parameters": rows, "summary": extra, "speed": refs.get("speed", []),
            "engine_vs_gather": refs.get("engine_vs_gather", []),
            "simulator_profile": [{"key": k, "value": v} for k, v in record.get("simulator_profile", {}).items()]}


def _pair(stats: dict | None) -> str:
    if not stats or stats.get("median") is None:
        return "-"
    return f"{100 * stats['median']:.1f} % / {100 * stats['p95']:.1f} %"
