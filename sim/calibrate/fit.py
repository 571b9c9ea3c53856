"""The copy cost model, fitted to measured samples, and its predictions.

Times are microseconds, sizes bytes, bandwidths GB/s (1e9 B/s; a D2D rate counts bytes copied, not read +
written). Per path (d2d, h2d, d2h) and way of copying:

    ce_sync   t = fixed_us + n * per_copy_us + bytes / gbps               one cudaMemcpyAsync + sync per part
    ce_batch  t = fixed_us + n * per_copy_us + bytes / gbps               n cudaMemcpyAsync, one sync
    gather    t = fixed_us + launches * per_launch_us + n * per_descriptor_us + bytes / gbps

`n` counts copies (descriptors); fixed_us is paid once per step (the first call after the host did other
work costs more than the next ones), per_launch_us once per kernel launch. The coefficients are non-negative and minimise the squared *relative*
error over the per-configuration medians, so a 10 us step weighs as much as a 100 ms one. Also derived:
`call_us[path]`, the host time of one cudaMemcpyAsync call (enqueue only), and `sync_us`, what a stream
sync after each copy adds per copy: (t_ce_sync - t_ce_batch) / (n - 1) - call_us over host-to-device
configurations with n >= 8, where the batched copies keep the GPU busy and hide every call but the first.
"""

from __future__ import annotations

from itertools import combinations

import numpy as np
import pandas as pd

WAYS = ("ce_sync", "ce_batch", "gather")
TERMS = {
    "ce_sync": ("fixed_us", "per_copy_us", "bytes"),
    "ce_batch": ("fixed_us", "per_copy_us", "bytes"),
    "gather": ("fixed_us", "per_launch_us", "per_descriptor_us", "bytes"),
}
SAMPLE_COLUMNS = ("path", "way", "size_bytes", "n", "launches", "repeat", "wall_us", "enqueue_us")
# The goal a replay of a copy plan is held to (issue 11): a median relative error per step of at most 10 %.
REPLAY_GOAL_MEDIAN_ERROR = 0.10
CONFIG = ["path", "way", "size_bytes", "n", "launches"]


def _design(frame: pd.DataFrame, way: str) -> np.ndarray:
    cols = []
    for term in TERMS[way]:
        if term == "fixed_us":
            cols.append(np.ones(len(frame)))
        elif term == "per_launch_us":
            cols.append(frame["launches"].to_numpy(float))
        elif term in ("per_copy_us", "per_descriptor_us"):
            cols.append(frame["n"].to_numpy(float))
        else:
            cols.append((frame["n"] * frame["size_bytes"]).to_numpy(float))
    return np.column_stack(cols)


def nnls_relative(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Non-negative least squares of (x @ c - t) / t, by trying every set of free coefficients (there are
    at most four): the best solution whose free coefficients are all >= 0."""
    a = x / t[:, None]
    b = np.ones(len(t))
    k = x.shape[1]
    best, best_err = np.zeros(k), float(np.sum(b**2))
    for size in range(1, k + 1):
        for free in combinations(range(k), size):
            sol, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
            if np.any(sol < 0):
                continue
            c = np.zeros(k)
            c[list(free)] = sol
            err = float(np.sum((a @ c - b) ** 2))
            if err < best_err - 1e-15:
                best, best_err = c, err
    return best


def medians(samples: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration: median wall and enqueue time over the repeats."""
    grouped = samples.groupby(CONFIG, sort=True)
    out = grouped.agg(wall_us=("wall_us", "median"), enqueue_us=("enqueue_us", "median"),
                      repeats=("wall_us", "size"), spread=("wall_us", lambda s: float(s.max() / s.min() - 1)))
    return out.reset_index()


def _coefficients(way: str, c: np.ndarray) -> dict:
    out = {}
    for term, value in zip(TERMS[way], c):
        if term == "bytes":
            out["gbps"] = float(1.0 / (value * 1e3)) if value > 0 else float("inf")
        else:
            out[term] = float(value)
    return out


def predict_config(params: dict, path: str, way: str, n, size_bytes, launches=1):
    """Model time (us) of n copies of size_bytes each (arrays broadcast)."""
    p = params["paths"][path][way]
    n = np.asarray(n, float)
    total = n * np.asarray(size_bytes, float)
    t = total / (p["gbps"] * 1e3)
    if way in ("ce_sync", "ce_batch"):
        return p.get("fixed_us", 0.0) + n * p["per_copy_us"] + t
    return p["fixed_us"] + np.asarray(launches, float) * p["per_launch_us"] + n * p["per_descriptor_us"] + t


def relative_errors(predicted, measured) -> np.ndarray:
    measured = np.asarray(measured, float)
    return np.abs(np.asarray(predicted, float) - measured) / measured


def error_stats(err: np.ndarray) -> dict:
    err = np.asarray(err, float)
    if not len(err):
        return {"n": 0, "median": None, "p95": None, "max": None}
    return {"n": int(len(err)), "median": float(np.median(err)), "p95": float(np.percentile(err, 95)),
            "max": float(err.max())}


def fit(samples: pd.DataFrame) -> dict:
    """Fit every (path, way) present; returns {"paths": {path: {way: coefficients}}, "call_us",
    "sync_us", "fit_error": {"path/way": stats, "all": stats}, "configs": n}."""
    samples = pd.DataFrame(samples)
    missing = [c for c in SAMPLE_COLUMNS if c not in samples.columns]
    if missing:
        raise ValueError(f"samples lack columns {missing}")
    med = medians(samples)
    params: dict = {"paths": {}, "call_us": {}, "fit_error": {}}
    all_err = []
    for (path, way), part in med.groupby(["path", "way"], sort=True):
        if way not in TERMS:
            continue
        t = part["wall_us"].to_numpy(float)
        coeffs = _coefficients(way, nnls_relative(_design(part, way), t))
        params["paths"].setdefault(path, {})[way] = coeffs
        err = relative_errors(predict_config(params, path, way, part["n"], part["size_bytes"], part["launches"]), t)
        params["fit_error"][f"{path}/{way}"] = error_stats(err)
        all_err.append(err)
    params["fit_error"]["all"] = error_stats(np.concatenate(all_err) if all_err else np.array([]))
    batch = med[med["way"] == "ce_batch"]
    for path, part in batch.groupby("path"):
        params["call_us"][path] = float(np.median(part["enqueue_us"] / part["n"]))
    params["sync_us"] = _sync_cost(med, params["call_us"])
    params["configs"] = int(len(med))
    return params


def _sync_cost(med: pd.DataFrame, call_us: dict) -> float | None:
    key = ["size_bytes", "n"]
    h2d = med[(med["path"] == "h2d") & (med["n"] >= 8)]
    s = h2d[h2d["way"] == "ce_sync"].set_index(key)["wall_us"]
    b = h2d[h2d["way"] == "ce_batch"].set_index(key)["wall_us"]
    both = s.index.intersection(b.index)
    if not len(both) or "h2d" not in call_us:
        return None
    n = np.array([i[1] for i in both], float)
    per = (s.loc[both].to_numpy() - b.loc[both].to_numpy()) / (n - 1) - call_us["h2d"]
    return float(max(0.0, np.median(per)))


# --------------------------------------------------------------------------------------------- predictions


def predict_ce_step(params: dict, copies: list[tuple[str, int, int]], sync_each: bool = True) -> float:
    """A step the engines' way: copies = [(path, count, bytes)], issued in order."""
    way = "ce_sync" if sync_each else "ce_batch"
    total = 0.0
    fixed = 0.0
    for path, count, nbytes in copies:
        p = params["paths"][path][way]
        total += count * p["per_copy_us"] + nbytes / (p["gbps"] * 1e3)
        fixed = max(fixed, p.get("fixed_us", 0.0))
    return total + fixed


def predict_gather_step(params: dict, launches: list[tuple[str, int, int]]) -> float:
    """A step as gather launches = [(path, descriptors, bytes)] on one stream, one sync at the end."""
    if not launches:
        return 0.0
    fixed = max(params["paths"][path]["gather"]["fixed_us"] for path, _, _ in launches)
    total = 0.0
    for path, n, nbytes in launches:
        p = params["paths"][path]["gather"]
        total += p["per_launch_us"] + n * p["per_descriptor_us"] + nbytes / (p["gbps"] * 1e3)
    return fixed + total
