"""The calibration file: one JSON document per GPU, written by `expertsim calibrate`, read by `--replay` and
referenced by hardware profiles (`calibration = "calibration/h200.json"`).

    schema            "expertsim-calibration"
    schema_version    1 (a file of another version is refused with one line)
    status            "measured" (by expertsim calibrate) | "published" (public figures, not measured here)
    note              free text; published files say "published figures, not measured by expertsim"
    date, command, expertsim
    gpu               name, compute_capability, multiprocessors, memory_total_bytes, l2_bytes
    software          driver_version, cuda_driver_api, cuda_runtime, python, numpy, numba, numba-cuda, platform
    grid              sizes_bytes, experts, repeats, paths, ways, seed
    kernel            launch mode and the launch shape per path, tuning results
    host_probe        what the probe step is and its median host time before the sweep and after each quarter
    parameters        paths.<d2d|h2d|d2h>.<ce_sync|ce_batch|gather>.<term>, call_us.<path>, sync_us,
                      sync_idle_us: each a table { value, unit, source } as in the hardware profiles
    fit_error         per "path/way" and "all": n, median, p95, max relative error (null when published)
    references        event-timed large copies and gathers per path; speed rows; engines' way vs gather
    simulator_profile the hardware-profile fields these numbers stand for (see docs/calibration.md)
    samples           raw samples: { columns: [...], rows: [[...], ...] } (empty when published)
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from sim.calibrate import fit
from sim.errors import InputError
from sim.hardware import CALIBRATION_SCHEMA as SCHEMA, CALIBRATION_SCHEMA_VERSION as SCHEMA_VERSION

PUBLISHED_NOTE = "published figures, not measured by expertsim"
UNITS = {"gbps": "GB/s"}  # every other term is in microseconds


def _leaf(value: float | None, unit: str, source: str) -> dict:
    return {"value": None if value is None or not math.isfinite(value) else round(float(value), 4), "unit": unit,
            "source": source}


def _unit(term: str) -> str:
    return UNITS.get(term, "us")


def parameters_record(params: dict, source: str, sync_idle_us: float | None = None) -> dict:
    """The fit's plain numbers as { value, unit, source } tables."""
    paths = {}
    for path, ways in params["paths"].items():
        paths[path] = {way: {term: _leaf(v, _unit(term), source) for term, v in coeffs.items()}
                       for way, coeffs in ways.items()}
    out = {"paths": paths,
           "call_us": {p: _leaf(v, "us", source.replace("fit of", "median over")) for p, v in params["call_us"].items()},
           "sync_us": _leaf(params.get("sync_us"), "us", source + "; (t_ce_sync - t_ce_batch)/(n-1) - call_us, "
                                                                  "h2d, n >= 8")}
    if sync_idle_us is not None:
        out["sync_idle_us"] = _leaf(sync_idle_us, "us", "[H] median cuStreamSynchronize on an idle stream")
    return out


def plain_parameters(record: dict) -> dict:
    """Back to the plain numbers that sim.calibrate.fit predicts with."""
    p = record["parameters"]
    return {"paths": {path: {way: {term: leaf["value"] for term, leaf in terms.items()}
                             for way, terms in ways.items()} for path, ways in p["paths"].items()},
            "call_us": {k: v["value"] for k, v in p.get("call_us", {}).items()},
            "sync_us": (p.get("sync_us") or {}).get("value")}


def simulator_profile(params: dict) -> dict:
    """Hardware-profile fields these parameters stand for (what a profile would copy, with this file as
    source): PCIe rates and fixed cost from the copy engine with a sync per copy, as ds4 copies."""
    paths = params["paths"]
    sync = params.get("sync_us") or 0.0
    out = {}
    if "h2d" in paths and "ce_sync" in paths["h2d"]:
        out["pcie.h2d_pinned_gbps"] = paths["h2d"]["ce_sync"]["gbps"]
        out["pcie.copy_fixed_latency_us"] = max(0.0, paths["h2d"]["ce_sync"]["per_copy_us"] - sync)
    if "d2h" in paths and "ce_sync" in paths["d2h"]:
        out["pcie.d2h_pinned_gbps"] = paths["d2h"]["ce_sync"]["gbps"]
    if "d2d" in paths and "ce_sync" in paths["d2d"]:
        out["d2d.copy_gbps"] = paths["d2d"]["ce_sync"]["gbps"]
        out["latency.memcpy_call_us"] = paths["d2d"]["ce_sync"]["per_copy_us"]
    if params.get("sync_us") is not None:
        out["latency.device_sync_us"] = params["sync_us"]
    if "d2d" in paths and "gather" in paths["d2d"]:
        g = paths["d2d"]["gather"]
        out["latency.kernel_launch_us"] = g["fixed_us"] + g["per_launch_us"]
    return {k: round(float(v), 4) for k, v in out.items()}


def host_probe_record(probes: list | None) -> dict | None:
    """The host probe's step and its medians through the sweep (None when none were taken)."""
    from sim.calibrate.backend import PROBE_BYTES, PROBE_COPIES, PROBE_REPS

    if not probes:
        return None
    return {"step": f"{PROBE_COPIES} device copies of {PROBE_BYTES} B, a stream sync after each (Backend.host_probe)",
            "median_of": PROBE_REPS, "unit": "us", "through_sweep_us": [round(float(p), 3) for p in probes]}


def probe_us(record: dict) -> float | None:
    """The calibration's host probe: the median of its readings through the sweep (None in older files)."""
    readings = ((record.get("host_probe") or {}).get("through_sweep_us")) or []
    return float(pd.Series(readings).median()) if readings else None


def samples_record(samples: pd.DataFrame) -> dict:
    cols = list(fit.SAMPLE_COLUMNS)
    frame = samples[cols].copy()
    frame["wall_us"] = frame["wall_us"].round(3)
    frame["enqueue_us"] = frame["enqueue_us"].round(3)
    return {"columns": cols, "rows": frame.values.tolist()}


def samples_frame(record: dict, where: str = "calibration") -> pd.DataFrame:
    s = record.get("samples") or {}
    cols, rows = s.get("columns"), s.get("rows")
    if cols is None or rows is None:
        raise InputError(where, "samples", "(missing)", "needs columns and rows")
    if list(cols) != list(fit.SAMPLE_COLUMNS):
        raise InputError(where, "samples.columns", cols, f"must be {list(fit.SAMPLE_COLUMNS)}")
    frame = pd.DataFrame(rows, columns=cols)
    for c in ("size_bytes", "n", "launches", "repeat"):
        frame[c] = frame[c].astype("int64")
    return frame


def build_record(result, command: str, version: str) -> dict:
    """The calibration file's content for a sweep result (sim.calibrate.sweep.SweepResult)."""
    dev = result.device
    date = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    source = f"[H] fit of {result.params['configs']} configurations (expertsim calibrate, {date[:10]})"
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "status": "measured",
        "note": "measured by expertsim calibrate" + (" in Numba's CUDA simulator: the timings mean nothing"
                                                     if dev.get("simulator") else ""),
        "date": date,
        "command": command,
        "expertsim": version,
        "gpu": {k: dev.get(k) for k in ("name", "compute_capability", "multiprocessors", "memory_total_bytes",
                                        "l2_bytes")},
        "software": {"driver_version": dev.get("driver_version"), "cuda_driver_api": dev.get("cuda_driver_api"),
                     "cuda_runtime": dev.get("cuda_runtime"), "platform": dev.get("platform"),
                     **dev.get("software", {})},
        "grid": result.grid.as_dict(),
        "kernel": {"launch_mode": result.extra.get("launch_mode"), "desc_in": result.extra.get("desc_in"),
                   "launch_ways": result.extra.get("launch_ways"), "variants": result.extra.get("variants"),
                   "tuning": result.tuning, "self_test": result.self_test, "notes": result.notes},
        "host_probe": host_probe_record(result.extra.get("host_probe_us")),
        "parameters": parameters_record(result.params, source, result.extra.get("sync_idle_us")),
        "fit_error": result.params["fit_error"],
        "references": {"copies": result.references, "speed": result.speed, "engine_vs_gather": result.comparison},
        "simulator_profile": simulator_profile(result.params),
        "seconds": round(result.seconds, 1),
        "samples": samples_record(result.samples),
    }


def finite(obj):
    """The same structure with every NaN or infinity replaced by null (JSON has neither)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):  # numpy scalars
        return finite(obj.item())
    return obj


def dumps(record: dict) -> str:
    """JSON text: indented, except the raw samples, one row per line (a file of 10,000 samples stays
    readable and diffs line by line)."""
    record = finite(record)
    samples = record.get("samples") if isinstance(record.get("samples"), dict) else None
    body = {k: v for k, v in record.items() if k != "samples"}
    text = json.dumps(body, indent=1, allow_nan=False)
    if samples is None:
        return text + "\n"
    rows = ",\n  ".join(json.dumps(r, allow_nan=False) for r in samples.get("rows", []))
    tail = (f' "samples": {{\n  "columns": {json.dumps(samples.get("columns"))},\n  "rows": [\n  {rows}\n  ]\n }}'
            if rows else f' "samples": {{"columns": {json.dumps(samples.get("columns"))}, "rows": []}}')
    return text[:-2] + (",\n" if body else "\n") + tail + "\n}\n"


def write(record: dict, path: str | Path) -> Path:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dumps(record))
    except OSError as exc:
        raise InputError(str(path), "output", str(path), f"cannot write: {exc.strerror}") from None
    return path


def load(path: str | Path, where: str | None = None) -> dict:
    """A calibration file, checked: schema and version, and every parameter a finite number with a unit."""
    path = Path(path)
    where = where or str(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InputError(where, "path", str(path), "no such calibration file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(where, "path", str(path), f"unreadable: {type(exc).__name__}") from None
    try:
        record = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InputError(where, "json", getattr(exc, "msg", "nesting"), "not valid JSON") from None
    return check(record, where)


def check(record: object, where: str) -> dict:
    if not isinstance(record, dict):
        raise InputError(where, "(file)", type(record).__name__, "a calibration file is a JSON object")
    if record.get("schema") != SCHEMA:
        raise InputError(where, "schema", record.get("schema", "(missing)"), f"not an {SCHEMA} file")
    version = record.get("schema_version")
    if version != SCHEMA_VERSION:
        raise InputError(where, "schema_version", version if version is not None else "(missing)",
                         f"this expertsim reads calibration schema version {SCHEMA_VERSION}: run expertsim "
                         f"calibrate again on that GPU")
    if record.get("status") not in ("measured", "published"):
        raise InputError(where, "status", record.get("status", "(missing)"), "must be measured or published")
    gpu = record.get("gpu")
    if not isinstance(gpu, dict) or not isinstance(gpu.get("name"), str) or not gpu["name"]:
        raise InputError(where, "gpu.name", (gpu or {}).get("name", "(missing)") if isinstance(gpu, dict) else gpu,
                         "needs the GPU's name")
    params = record.get("parameters")
    if not isinstance(params, dict) or not isinstance(params.get("paths"), dict) or not params["paths"]:
        raise InputError(where, "parameters.paths", "(missing)", "needs at least one path")
    for path, ways in params["paths"].items():
        if path not in ("d2d", "h2d", "d2h") or not isinstance(ways, dict):
            raise InputError(where, f"parameters.paths.{path}", path, "paths are d2d, h2d and d2h, each a table")
        for way, terms in ways.items():
            if way not in fit.TERMS or not isinstance(terms, dict):
                raise InputError(where, f"parameters.paths.{path}.{way}", way, f"ways are {', '.join(fit.TERMS)}")
            wanted = ["gbps" if t == "bytes" else t for t in fit.TERMS[way]]
            for term in wanted:
                key = f"parameters.paths.{path}.{way}.{term}"
                leaf = terms.get(term)
                if not isinstance(leaf, dict) or "value" not in leaf:
                    raise InputError(where, key, "(missing)", "needs { value, unit, source }")
                value = leaf["value"]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise InputError(where, key, value, "must be a finite number")
                if value < 0 or (term == "gbps" and value <= 0):
                    raise InputError(where, key, value, "must be > 0" if term == "gbps" else "must be >= 0")
                if leaf.get("unit") != _unit(term):
                    raise InputError(where, f"{key}.unit", leaf.get("unit"), f"must be {_unit(term)!r}")
                if not isinstance(leaf.get("source"), str) or not leaf["source"].startswith("["):
                    raise InputError(where, f"{key}.source", leaf.get("source"), "needs a [S|M|H|E] source")
    if record["status"] == "published" and PUBLISHED_NOTE not in str(record.get("note", "")):
        raise InputError(where, "note", record.get("note"), f"a published file must say '{PUBLISHED_NOTE}'")
    return record


def load_for_profile(profile) -> dict:
    """The calibration file a hardware profile references (its path was resolved and hashed on load)."""
    if profile.calibration_path is None:
        raise InputError(str(profile.path or profile.name), "calibration", "(none)",
                         "this hardware profile references no calibration file: pass --calibration FILE")
    return load(profile.calibration_path, f"{profile.path or profile.name}: calibration")
