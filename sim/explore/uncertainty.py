"""Uncertainty: what a prediction is worth when some of its inputs are estimates.

    inputs = uncertain_inputs(scenario)                 # the estimated figures a run reads, each with a range
    samples = latin_hypercube(inputs, n=16, seed=0)     # n x k values, one stratum per sample and input
    band = bands(rows)                                  # p10 / median / p90 of every headline metric
    swings = sensitivity(scenario_point, inputs)        # each input alone at its low and high end

Every hardware-profile figure tagged as an estimate ("[E ...]") carries a range: its own `range = [LOW, HIGH]`
where the profile gives one, else its field's rule (RULES: a factor range around the estimate, with the source
that bounds it). Measured and spec figures ([M], [S], [H]) are taken as they are. An engine cost fitted elsewhere
(a calibration record, sim/engine/records.py) that the run reads outside its key is an estimate too: it varies
over the spread of the runs it was fitted on, where the record has one (`record.<id>` inputs). A run under uncertainty is the
same scenario with the inputs set to each sample's values; the routing is the scenario's own (the same seed), so
every sample sees the same tokens (common random numbers) and differences come from the inputs alone.
"""

from __future__ import annotations

import fnmatch
import math
from contextlib import closing
from dataclasses import dataclass

import numpy as np

from sim.explore.runner import RECORD_INPUT
from sim.hardware import INTEGER_INPUTS, SSD_TABLE

# (field pattern, low factor, high factor, why): the range of an estimated figure of that field, as factors of
# the estimate. Patterns are the profile's dotted keys (compute.*.x matches every model class).
RULES: tuple[tuple[str, float, float, str], ...] = (
    ("compute.*.decode_us_per_token_layer", 0.89, 1.14,
     "decode reaches 70-90 % of the DRAM roofline: llama.cpp 76-80 % on a 5090 (ggml-org/llama.cpp#28196), ds4 "
     "85-90 % of the measured 231-234 GB/s on a GB10 = 72-77 % of spec (antirez/ds4#773); the estimates use 80 %"),
    ("compute.*.prefill_us_per_token_layer", 0.67, 1.5,
     "scaled from one measured card by dense FP16 tensor throughput, which ignores the bandwidth-bound parts of a "
     "prompt chunk: a factor of 1.5 either way assumed"),
    ("compute.*.prefill_us_per_chunk_layer", 0.5, 2.0, "no measurement in our notes: a factor of 2 either way assumed"),
    ("d2d.copy_gbps", 0.85, 1.1,
     "device-local copies measured at 42-46 % of spec DRAM bandwidth on a 5090, a 4090 and an RTX PRO 6000 "
     "(hw §1.2-1.4); a card of another die may sit 15 % lower"),
    ("gpu.runtime_reserved_mib", 0.7, 1.5,
     "a line through two measured cards (107 and 555 MiB, ggml-org/llama.cpp#23604); WDDM and driver versions add"),
    ("gpu.dram_bandwidth_gbps", 0.85, 1.07, "laptop memory clocks vary by design (24-30 Gb/s GDDR7)"),
    ("host.dram_bandwidth_gbps", 0.85, 1.3,
     "AIDA64 read reaches 62 of 96 GB/s on one dual-channel DDR5 desktop (hw §2.2); other boards and DIMMs reach "
     "55-85 % of peak"),
    ("host.hardware_threads", 0.5, 2.0, "the CPU is not reported: half to twice the assumed thread count"),
    ("host.physical_cores", 0.5, 2.0, "the CPU is not reported: half to twice the assumed core count"),
    ("host.expert_kernel_gbps", 0.46, 2.16,
     "Strata's pool drains 2.64 GB/s per AVX2 core (an i5, IQ2_XS) to 5.7 per AVX-512 Zen 4 core (Q2_0) in its logs: "
     "either end for a CPU whose kernels are not measured"),
    ("host.memcpy_gbps", 0.58, 1.1,
     "single-thread copies out of the page cache: 8.37 GB/s measured on the H200 host (h200.toml) to 16 GB/s "
     "copied on a desktop DDR5 (JustVugg/colibri#537); the estimates use 14.5"),
    ("host.os_reserved_gib", 0.5, 2.0, "a headless Linux box holds 1-2 GiB, a desktop 4-6, Windows ~9 (MODELS.md)"),
    ("host.ram_gib", 0.5, 2.0, "the RAM size is not reported: half to twice the assumed size"),
    ("latency.*", 0.5, 2.0,
     "host-side costs measured on this project's H200 VM (h200.toml); bare metal is faster, WDDM slower"),
    ("pcie.copy_fixed_latency_us", 0.67, 2.0, "3-6 us per copy (hw §0 rule 2, §1.7): 2 us bare metal to 6 us"),
    ("pcie.h2d_pageable_gbps", 0.67, 1.67, "pageable H2D 10-25 GB/s on Linux (hw §0); WDDM 2-3x slower (hw §1.2)"),
    ("pcie.d2h_pageable_gbps", 0.67, 1.67, "as pageable H2D (hw §0, §1.4)"),
    ("pcie.h2d_pinned_gbps", 0.75, 1.1,
     "pinned copies reach 76-89 % of the link (hw §1.2, §1.4); WDDM's penalty is 2-3x, not one figure"),
    ("pcie.d2h_pinned_gbps", 0.75, 1.1, "as pinned H2D (hw §1.2, §1.4)"),
    ("ssd.read_gbps_by_queue_depth", 0.6, 1.4,
     "no QD1 large-read figure for these drives (hw §5); the other points interpolate between one measurement and "
     "the spec"),
    ("ssd.read_request_kib", 0.5, 2.0, "the request size of the table is assumed"),
    ("ssd.max_request_kib", 0.5, 2.0, "max_sectors_kb is a kernel and drive setting: 256-1024 KiB common"),
    ("ssd.request_latency_us", 0.6, 2.0, "4 KiB QD1 latency of Gen4/Gen5 drives: 30-100 us (hw §2.1)"),
    ("unified.copy_gbps", 0.7, 1.3, "half the pool's read bandwidth, an estimate: copy engines may do better or worse"),
    ("unified.copy_fixed_latency_us", 0.5, 2.0, "3-6 us per copy assumed (hw §0 rule 2)"),
    ("unified.gpu_allocatable_gib", 0.85, 1.0, "the share the GPU may hold is a driver/OS setting, at most the pool"),
)


@dataclass(frozen=True)
class Input:
    path: str  # the profile's dotted key (ssd.read_gbps_by_queue_depth[0] for a table point)
    value: float
    low: float
    high: float
    why: str


def rule_for(path: str) -> tuple[float, float, str] | None:
    for pattern, low, high, why in RULES:
        if fnmatch.fnmatchcase(path, pattern):
            return low, high, why
    return None


def uncertain_inputs(scenario) -> list[Input]:
    """The estimated figures of the scenario's hardware profile a run reads (the machine's, and the compute table
    of its model class), each with its range."""
    profile = scenario.hardware_profile
    own = f"compute.{scenario.compute_key}."
    found = []
    table = [(path, q) for path, q in profile.quantities() if path.startswith(SSD_TABLE + "[")]
    if any(q.source.startswith("[E") for _, q in table):  # the table's estimates move together: one factor
        low, high, why = rule_for(SSD_TABLE)
        # a measured point of the table was measured on another drive than the box's (assumed): all move together
        found.append(Input(SSD_TABLE + "[*]", 1.0, low, high, why + " (the whole table as one factor)"))
    for path, q in profile.quantities():
        if path.startswith("compute.") and not path.startswith(own) or path.startswith(SSD_TABLE + "["):
            continue
        if getattr(q, "range", None):
            found.append(Input(path, q.value, q.range[0], q.range[1], q.range_source or q.source))
            continue
        if not q.source.startswith("[E"):
            continue
        rule = rule_for(path)
        if rule is None:
            continue
        low, high, why = rule
        found.append(Input(path, q.value, q.value * low, q.value * high, why))
    return found + record_inputs(scenario)


def record_inputs(scenario) -> list[Input]:
    """The calibration records the scenario's engine reads outside their key (engine, model, hardware, context),
    each over the spread of the runs it was fitted on; a record fitted on one run has no spread and stays as is."""
    from sim.engines import engine_of
    from sim.engines.records import BY_ID

    engine = engine_of(scenario)
    key = (engine.name, scenario.layout.name, scenario.hardware_profile.name, engine.context_tokens(scenario.engine))
    found = []
    for record_id in engine.records_read(scenario):
        r = BY_ID[record_id]
        if r.spread is not None and r.key_differences(*key):
            found.append(Input(RECORD_INPUT + r.id, r.value, r.spread[0], r.spread[1], r.spread_source))
    return found


def latin_hypercube(inputs: list[Input], n: int, seed: int = 0) -> np.ndarray:
    """n x k values: each input's range cut into n strata, one value drawn in each, the strata of the inputs paired
    at random (numpy's seeded generator; sample i of input j is its permuted stratum's draw)."""
    rng = np.random.default_rng(seed)
    k = len(inputs)
    u = (rng.permuted(np.tile(np.arange(n), (k, 1)), axis=1).T + rng.random((n, k))) / n
    low = np.array([i.low for i in inputs])
    high = np.array([i.high for i in inputs])
    values = low + u * (high - low)
    for j, inp in enumerate(inputs):
        if inp.path in INTEGER_INPUTS:
            values[:, j] = np.maximum(1, np.round(values[:, j]))
    paths = [inp.path for inp in inputs]
    if "host.physical_cores" in paths and "host.hardware_threads" in paths:
        # both estimated from one assumed CPU, drawn apart: a sample never has more cores than threads (a profile
        # refuses that CPU), so its cores are capped at its threads
        cores, threads = paths.index("host.physical_cores"), paths.index("host.hardware_threads")
        values[:, cores] = np.minimum(values[:, cores], values[:, threads])
    return values


def quantiles(values: list[float | None]) -> dict:
    """p10 / median / p90 of a metric over the samples that gave it (None when none did)."""
    good = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not good:
        return {"p10": None, "median": None, "p90": None, "n": 0}
    p10, p50, p90 = np.percentile(good, [10, 50, 90])
    return {"p10": float(p10), "median": float(p50), "p90": float(p90), "n": len(good)}


def sample_points(point, inputs: list[Input], values: np.ndarray) -> list:
    """The point once per sample row, its profile figures set to the row's values."""
    from dataclasses import replace

    return [replace(point, point_id=f"{point.point_id}-s{i}",
                    profile_values={inp.path: float(v) for inp, v in zip(inputs, row)})
            for i, row in enumerate(values)]


def swing_points(point, inputs: list[Input]) -> list:
    """The point with each input alone at its low end, then at its high end (the others at their estimate)."""
    from dataclasses import replace

    return [replace(point, point_id=f"{point.point_id}-{end}{j}", profile_values={inp.path: getattr(inp, end)})
            for j, inp in enumerate(inputs) for end in ("low", "high")]


def propagate(point, scenario, n: int, seed: int = 0, metrics: tuple[str, ...] | None = None,
              executor: str = "inline", workers: int | None = None, swings: bool = True) -> dict:
    """A point's headline metrics under its inputs' uncertainty: p10 / median / p90 over n Latin-hypercube
    samples, and (with `swings`) the sensitivity table: each input alone at either end of its range, sorted by
    how far it moves the first metric."""
    from sim.explore.runner import METRICS, run_points

    metrics = metrics or METRICS
    inputs = uncertain_inputs(scenario)
    values = latin_hypercube(inputs, n, seed)
    samples = sample_points(point, inputs, values)
    extremes = swing_points(point, inputs) if swings else []
    with closing(run_points(samples + extremes, executor, workers, share_routing=True)) as finished:
        rows = {p.point_id: row for p, row in finished}
    sampled = [rows[p.point_id] for p in samples]
    bands = {m: quantiles([r.get(m) for r in sampled]) for m in metrics}
    table = []
    for j, inp in enumerate(inputs if swings else []):
        low, high = rows[f"{point.point_id}-low{j}"], rows[f"{point.point_id}-high{j}"]
        table.append({"input": inp.path, "estimate": inp.value, "low": inp.low, "high": inp.high, "why": inp.why,
                      **{f"{m}@low": low.get(m) for m in metrics}, **{f"{m}@high": high.get(m) for m in metrics}})
    failed = sum(r["error"] is not None for r in sampled)
    return {"n": n, "seed": seed, "inputs": [vars(i) for i in inputs], "bands": bands, "sensitivity": table,
            "failed_samples": failed, "samples": [{k: r.get(k) for k in (*metrics, "error")} for r in sampled]}


def rank_sensitivity(table: list[dict], metric: str) -> list[dict]:
    """The sensitivity rows by the swing they give `metric` (|high - low|), largest first."""
    def swing(row):
        lo, hi = row.get(f"{metric}@low"), row.get(f"{metric}@high")
        return -1.0 if lo is None or hi is None else abs(hi - lo)

    return sorted(table, key=swing, reverse=True)


__all__ = ["Input", "RULES", "latin_hypercube", "propagate", "quantiles", "rank_sensitivity", "record_inputs",
           "rule_for", "sample_points", "swing_points", "uncertain_inputs"]
