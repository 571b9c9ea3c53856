"""`expertsim bench`: speed and memory of the cache core, each row against its target.

The benchmark trace is Qwen3-Next-like (48 layers x 512 experts, top-10; the Qwen3.8-Flash-Next IQ3_S
layout, 4 size classes) from the built-in generator. Timings are the best of several runs after a
warm-up, so numba's compilation is not counted. Targets are the foundation issue's, on a 2-core machine.
"""

from __future__ import annotations

import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from sim.cache.replay import Geometry, lru_mrc, replay
from sim.model.presets import get_preset
from sim.trace.generate import generate_trace

MODEL = "qwen3.8-flash-next-iq3s"
PROMPT_TOKENS = 512
SEED = 0
SLOTS_PER_LAYER = 128  # a quarter of each layer's 512 experts: a cache with real eviction traffic
REPEATS = 3


def _best_seconds(fn, repeats: int = REPEATS) -> float:
    fn()  # warm-up: compile or load numba's cache
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _row(name, value, unit, target=None, met=None) -> dict:
    return {"name": name, "value": value, "unit": unit, "target": target, "met": met}


def _libcachesim_lru_seconds(trace, capacity: int) -> tuple[float, float] | None:
    try:
        import libcachesim as lcs
    except ImportError:
        return None
    from sim.cache.libcachesim_io import write_oracle_general

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.oracleGeneral.bin"
        write_oracle_general(trace, path)

        def run():
            reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
            return lcs.LRU(capacity).process_trace(reader)[0]

        run()
        start = time.perf_counter()
        miss_ratio = run()
        return time.perf_counter() - start, miss_ratio


SEED_SCENARIOS = ("ds4-504-slab", "ds4-504-per-class", "strata-658-borrow", "strata-658-own",
                  "strata-658-auto-borrow", "strata-658-auto-own")


def _scenario_rows() -> list[dict]:
    """Wall time of each seed scenario (routing built, engine simulated, summary made), best of 2, and
    the routed expert selections it simulated per second of wall time."""
    from sim.engine.run import run_scenario
    from sim.scenario import load_scenario

    folder = Path(__file__).resolve().parents[2] / "scenarios"
    rows = []
    for name in SEED_SCENARIOS:
        path = folder / f"{name}.toml"
        if not path.is_file():
            continue
        scenario = load_scenario(path)
        result = {}
        seconds = _best_seconds(lambda: result.update(r=run_scenario(scenario)), repeats=2)
        # accesses simulated: every routed (token, layer, k) selection the engine model processed
        lookups = int(result["r"].steps["tokens"].sum()) * scenario.layout.top_k
        rows.append(_row(f"run_{name}", round(seconds, 3), "s wall", "< 1", seconds < 1))
        rate = lookups / seconds
        rows.append(_row(f"run_{name}_accesses", round(rate / 1e6, 2), "M simulated expert accesses/s", ">= 1",
                         rate >= 1e6))
    return rows


def run_bench(decode_tokens: int = 100_000) -> list[dict]:
    rows = []
    start = time.perf_counter()
    trace = generate_trace(MODEL, PROMPT_TOKENS, decode_tokens, SEED)
    rows.append(_row("trace_generate", round(time.perf_counter() - start, 2), "s"))
    lookups = trace.n_lookups
    rows.append(_row("trace_tokens", trace.n_rows, "tokens", ">= 100000", trace.n_rows >= 100_000))
    rows.append(_row("lookups", lookups, "expert lookups"))
    per_id = trace.nbytes() / trace.experts.size
    rows.append(_row("trace_memory", round(per_id, 3), "bytes per expert id", "<= 2.2", per_id <= 2.2))

    geometry = Geometry.of(trace, get_preset(MODEL))
    layer_cap = np.full(geometry.n_layers, SLOTS_PER_LAYER)
    class_cap = np.bincount(geometry.class_of_layer, minlength=geometry.n_classes) * SLOTS_PER_LAYER
    global_cap = np.array([geometry.n_layers * SLOTS_PER_LAYER])
    timings = {}
    for scope, cap in (("layer", layer_cap), ("class", class_cap), ("global", global_cap)):
        seconds = _best_seconds(lambda: replay(trace, geometry, "lru", scope, cap))
        timings[scope] = seconds
        rate = lookups / seconds
        rows.append(_row(f"lru_replay_{scope}", round(rate / 1e6, 1), "M lookups/s (1 core)", ">= 150",
                         rate >= 150e6))
    for scope in ("layer", "class"):
        seconds = _best_seconds(lambda: lru_mrc(trace, geometry, scope), repeats=2)
        ratio = seconds / timings[scope]
        rows.append(_row(f"mrc_{scope}_time_over_replay", round(ratio, 2), "x one LRU replay", "<= 3",
                         ratio <= 3))
    oracle = _libcachesim_lru_seconds(trace, int(global_cap[0]))
    if oracle is None:
        rows.append(_row("libcachesim_lru", None, "not installed (pip install 'expertsim[test]')"))
    else:
        seconds, miss_ratio = oracle
        ours = replay(trace, geometry, "lru", "global", global_cap).summary()
        rows.append(_row("libcachesim_lru", round(lookups / seconds / 1e6, 1), "M lookups/s (process_trace)"))
        speedup = seconds / timings["global"]
        rows.append(_row("lru_speedup_over_libcachesim", round(speedup, 1), "x, same trace, global pool",
                         ">= 5", speedup >= 5))
        same = round(miss_ratio * lookups) == ours["misses"]
        rows.append(_row("libcachesim_same_misses", same, "bool", "True", same))
    rows += _scenario_rows()
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rows.append(_row("peak_rss", round(peak_mib, 1), "MiB"))
    return rows
