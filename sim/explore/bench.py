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
from typing import Callable, Sequence

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
                  "strata-658-auto-borrow", "strata-658-auto-own", "llamacpp-qwen3.8-ncmoe")


def seed_scenario_paths() -> list[Path]:
    # the scenarios/ folder is the repository's: an installed wheel has none, and times no seed
    folder = Path(__file__).resolve().parents[2] / "scenarios"
    return [p for p in (folder / f"{name}.toml" for name in SEED_SCENARIOS) if p.is_file()]


def _load_scenarios(paths: Sequence[Path]) -> list:
    from sim.scenario import load_scenario

    return [(Path(p).stem, load_scenario(p)) for p in paths]


def _scenario_rows(scenarios: list, targets: bool) -> list[dict]:
    """Wall time of each scenario (routing built, engine simulated, summary made), best of 2, and the routed
    expert selections it simulated per second of wall time; with `targets`, against the seed scenarios' targets
    (< 1 s, >= 1 M accesses/s: a user's scenario of a long prompt has no such bound)."""
    from sim.simulate import run_scenario
    from sim.workload import clear_routing_memo

    rows = []
    for name, scenario in scenarios:
        result = {}
        def run():  # the routing memo is emptied first: each timed run generates its routing, as a single run does
            clear_routing_memo()
            result.update(r=run_scenario(scenario))

        seconds = _best_seconds(run, repeats=2)
        # accesses simulated: every routed (token, layer, k) selection the engine model processed
        lookups = int(result["r"].steps["tokens"].sum()) * scenario.layout.top_k
        rate = lookups / seconds
        wall_target, rate_target = (("< 1", seconds < 1), (">= 1", rate >= 1e6)) if targets else ((), ())
        rows.append(_row(f"run_{name}", round(seconds, 3), "s wall", *wall_target))
        rows.append(_row(f"run_{name}_accesses", round(rate / 1e6, 2), "M simulated expert accesses/s", *rate_target))
    return rows


# Issue 10's long-prompt target: a 256K-token prompt through Strata's prompt path (the #658 own arm, its
# context raised to hold the prompt). The engine simulation is timed with the routing already built (the
# routing memo, as every sweep point after a worker's first); generating that routing is its own row.
LONG_PROMPT_SCENARIO = "strata-658-own"
LONG_PROMPT_TOKENS = 262_144


def long_prompt_rows() -> list[dict]:
    from sim.simulate import run_scenario
    from sim.workload import clear_routing_memo, workload_routing
    from sim.scenario import load_scenario
    from sim.schema import read_toml

    path = Path(__file__).resolve().parents[2] / "scenarios" / f"{LONG_PROMPT_SCENARIO}.toml"
    if not path.is_file():
        return []
    data = read_toml(path, str(path))
    data["engine"]["flags"]["max-context"] = 2 * LONG_PROMPT_TOKENS
    data["workload"]["requests"] = [{"prompt_tokens": LONG_PROMPT_TOKENS, "decode_tokens": 16, "measured": True}]
    scenario = load_scenario(path, data)
    clear_routing_memo()
    start = time.perf_counter()
    workload_routing(scenario)
    generate_s = time.perf_counter() - start
    result = {}
    seconds = _best_seconds(lambda: result.update(r=run_scenario(scenario)), repeats=2)
    events = result["r"].summary["simulated_events"]
    return [_row("routing_256k_prompt_generate", round(generate_s, 2), "s wall (trace generator, 1 request)"),
            _row("run_strata_256k_prompt", round(seconds, 2), "s wall, routing built", "< 5", seconds < 5),
            _row("run_strata_256k_prompt_events", events, "SimPy events")]


# Issue 12's memory target: a 1,000,000-token prompt in < 2 GB, the whole `expertsim run` (routing, engine,
# results) in a process of its own. Its peak is the VmHWM of its own address space, which it writes when it
# ends: the rusage of a child (ru_maxrss, os.wait4) starts from the parent's peak on Linux (exec records the
# forked copy's high-water mark), which would report this benchmark's own 2.5 GiB. Both timed engines' seeds, their
# context (Engine.context_key) raised to hold the prompt (each engine refuses a prompt beyond it).
MILLION_PROMPT_TOKENS = 1_000_000
MILLION_PROMPT_LIMIT_BYTES = 2_000_000_000  # "< 2 GB"
MILLION_PROMPT_SCENARIOS = ("ds4-504-per-class", "strata-658-own")
# The child: the console script's main() with the peak written on the way out (argv[1]: where to write it).
_PEAK_CHILD = """import sys
from pathlib import Path
peak_file = sys.argv.pop(1)
sys.argv[0] = "expertsim"
from sim.cli import main
try:
    main()
finally:
    status = Path("/proc/self/status").read_text().splitlines()
    Path(peak_file).write_text(next(line.split()[1] for line in status if line.startswith("VmHWM:")))
"""


def million_prompt_rows() -> list[dict]:
    import subprocess
    import sys

    if not Path("/proc/self/status").is_file():  # VmHWM is Linux's
        return []
    from sim.engines import ENGINES
    from sim.schema import read_toml

    rows = []
    for name in MILLION_PROMPT_SCENARIOS:
        path = Path(__file__).resolve().parents[2] / "scenarios" / f"{name}.toml"
        if not path.is_file():
            continue
        engine = read_toml(path, str(path))["engine"]["name"]
        context_key = ENGINES[engine].context_key
        with tempfile.TemporaryDirectory() as tmp:
            peak_file = Path(tmp) / "peak_kib"
            command = [sys.executable, "-c", _PEAK_CHILD, str(peak_file), "run", str(path), "-o",
                       str(Path(tmp) / "run"), "--json",
                       "--set", f"workload.requests.0.prompt_tokens={MILLION_PROMPT_TOKENS}",
                       "--set", f"{context_key}={2 ** 20}"]
            start = time.perf_counter()
            child = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            seconds = time.perf_counter() - start
            if child.returncode != 0:
                last = child.stderr.strip().splitlines()[-1:] or ["no message"]
                raise RuntimeError(f"bench: expertsim run {path.name} (1M-token prompt) exited {child.returncode}: "
                                   f"{last[0]}")
            peak = int(peak_file.read_text()) * 1024  # /proc reports kB (KiB)
        rows += [_row(f"run_{engine}_1m_prompt_peak_rss", round(peak / 2**20, 1), "MiB (whole expertsim run, VmHWM)",
                      "< 2 GB", peak < MILLION_PROMPT_LIMIT_BYTES),
                 _row(f"run_{engine}_1m_prompt", round(seconds, 1), "s wall (routing, engine, results)")]
    return rows


# The sweep benchmark (issue 5: 1,000 points on 2 cores in < 5 min, >= 1.7x from 1 to 2 workers): the seed
# scenario ds4-504-per-class over 10 cache budgets x 10 VRAM reserves x 10 prefill chunks, each point a full
# engine run (routing from the per-process memo after a worker's first point).
SWEEP_SCENARIO = "ds4-504-per-class"
SWEEP_GRIDS = ("engine.flags.ssd-streaming-cache-experts=1024,2048,3072,4096,5120,6144,7168,8192,9216,9472",
               "engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB=4:13:1",
               "engine.flags.prefill-chunk=512:5120:512")
SWEEP_WORKERS = 2


def _sweep_points(n: int) -> list:
    """n points of the benchmark grid, spread over it (every len/n-th point), in grid order."""
    from sim.explore.sweep import expand_grid

    points = expand_grid(Path(__file__).resolve().parents[2] / "scenarios" / f"{SWEEP_SCENARIO}.toml",
                         list(SWEEP_GRIDS))
    n = max(1, min(n, len(points)))
    return [points[i * len(points) // n] for i in range(n)]


def _sweep_seconds(points: list, workers: int) -> tuple[float, int]:
    """Wall seconds of run_sweep on local processes (pool start-up included), and the failed points."""
    from sim.explore.sweep import run_sweep

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        result = run_sweep(points, Path(tmp) / "sweep", executor="processes", workers=workers)
        return time.perf_counter() - start, len(result.failed)


def sweep_rows(n_points: int = 1000, speedup_points: int = 100) -> list[dict]:
    """Rows of the sweep benchmark: `n_points` on SWEEP_WORKERS processes (target < 300 s for 1,000), and
    the speed-up from 1 to 2 workers on the same `speedup_points` points (target >= 1.7)."""
    start = time.perf_counter()
    points = _sweep_points(n_points)
    rows = [_row("sweep_expand", round(time.perf_counter() - start, 2), f"s to expand and load {len(points)} points")]
    seconds, failed = _sweep_seconds(points, SWEEP_WORKERS)
    rows.append(_row(f"sweep_{len(points)}_points", round(seconds, 1),
                     f"s wall, {SWEEP_WORKERS} worker processes ({SWEEP_SCENARIO})", "< 300", seconds < 300))
    rows.append(_row("sweep_failed_points", failed, "points", "0", failed == 0))
    subset = _sweep_points(speedup_points)
    one, _ = _sweep_seconds(subset, 1)
    two, _ = _sweep_seconds(subset, 2)
    speedup = one / two
    rows.append(_row("sweep_speedup_1_to_2_workers", round(speedup, 2),
                     f"x ({len(subset)} points: {one:.1f} s on 1 worker, {two:.1f} s on 2)", ">= 1.7",
                     speedup >= 1.7))
    return rows


# The one-pass sweep benchmark (issue 5): a cache-only evicting LRU over 64 slot counts per layer, its rows from
# one miss-ratio curve vs a replay per point, same grid, same worker processes (pool start-up included in both).
MRC_SCENARIO = "replay-qwen3.8-lru"
MRC_GRID = "engine.flags.slots=8:512:8"


def mrc_sweep_rows(grid: tuple[str, ...] = (MRC_GRID,)) -> list[dict]:
    """Wall seconds of the grid's sweep by the one-pass path and by a replay per point, and the speed-up; then
    the same two computations in this process with imports, numba and the routing memo warm (best of 1 after a
    warm-up), which is how the two paths scale with the number of points, pool start-up left out."""
    from sim.explore.runner import evaluate, evaluate_mrc
    from sim.explore.sweep import expand_grid, run_sweep

    points = expand_grid(Path(__file__).resolve().parents[2] / "scenarios" / f"{MRC_SCENARIO}.toml", list(grid))
    wall = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mrc in (True, False):
            start = time.perf_counter()
            run_sweep(points, Path(tmp) / f"mrc-{mrc}", executor="processes", workers=SWEEP_WORKERS, mrc=mrc)
            wall[mrc] = time.perf_counter() - start
    compute = {True: _best_seconds(lambda: evaluate_mrc(points), repeats=1),
               False: _best_seconds(lambda: [evaluate(p) for p in points], repeats=1)}
    where = f"{len(points)} cache sizes of {MRC_SCENARIO}"
    return [_row("sweep_mrc_cache_sizes", round(wall[True], 2), f"s wall, one-pass curve ({where}, "
                                                                 f"{SWEEP_WORKERS} worker processes)"),
            _row("sweep_per_point_cache_sizes", round(wall[False], 2), f"s wall, a replay per point ({where}, "
                                                                       f"{SWEEP_WORKERS} worker processes)"),
            _row("sweep_mrc_speedup", round(wall[False] / wall[True], 1), "x wall, per point / one-pass"),
            _row("sweep_mrc_compute_speedup", round(compute[False] / compute[True], 1),
                 f"x in one warm process ({compute[False]:.2f} s for a replay per point, {compute[True]:.2f} s "
                 f"one-pass; {where})")]


def run_bench(decode_tokens: int = 100_000, sweeps: bool = False, quick: bool = False,
              progress: Callable[[str, int, int], None] | None = None,
              scenarios: Sequence[Path] | None = None) -> list[dict]:
    """The benchmark's rows, group by group: the cache core and the seed scenarios (or the `scenarios` files
    given) always; the long prompts unless `quick` (a 256K-token Strata prompt and its routing take ~10 s, a
    million-token prompt per engine ~70 s); the 1,000-point sweep and the speed-up rows (minutes) only with
    `sweeps`. `progress(group, number, of)` is called before each group."""
    timed = _load_scenarios(seed_scenario_paths() if scenarios is None else scenarios)  # bad files fail first
    groups: list[tuple[str, Callable[[], list[dict]]]] = [
        ("cache core: trace, LRU replays, miss-ratio curves, libCacheSim", lambda: _core_rows(decode_tokens)),
        ("seed scenario runs" if scenarios is None else "scenario runs",
         lambda: _scenario_rows(timed, targets=scenarios is None))]
    if not quick:
        groups += [("long prompts", long_prompt_rows), ("1,000,000-token prompts (memory)", million_prompt_rows)]
    if sweeps:
        groups += [("1,000-point sweep and 1 -> 2 worker speed-up", sweep_rows),
                   ("one-pass miss-ratio-curve sweep", mrc_sweep_rows)]
    rows = []
    for number, (group, make) in enumerate(groups, 1):
        if progress is not None:
            progress(group, number, len(groups))
        rows += make()
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rows.append(_row("peak_rss", round(peak_mib, 1), "MiB"))
    return rows


def _core_rows(decode_tokens: int) -> list[dict]:
    rows = []
    generate_trace(MODEL, 8, 8, SEED)  # the kernel compiled (or loaded from numba's cache) and the preset calibrated
    start = time.process_time()  # CPU time: one request is one thread, and wall time moves with the machine's load
    trace = generate_trace(MODEL, PROMPT_TOKENS, decode_tokens, SEED)
    cpu_s = time.process_time() - start
    # the generator's speed target: a 100K-token trace of a 48-layer top-10 model within 20 s of one core
    rows.append(_row("trace_generate", round(cpu_s, 2), "CPU s", "< 20", cpu_s < 20))
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
    return rows
