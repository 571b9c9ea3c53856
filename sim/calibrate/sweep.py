"""`expertsim calibrate`: measure every copy path on the current GPU, fit the cost model, check the speed rows.

One run, in this order:
1. the kernel self-test (random plans, poisoned outputs, every byte compared) for every way of launching
   it (raw cuLaunchKernel, numba's compiled-kernel launch, numba's dispatcher; descriptors in device or
   mapped memory); the way with the lowest host time for a small step (18 x 2 MiB) is kept;
2. launch-shape tuning of the gather kernel per path (threads x unroll x blocks per multiprocessor), on
   1 GiB gathers, best median kept;
3. references with CUDA events: one large device copy, one large pinned H2D and D2H copy, and the gather
   kernel on the same byte counts (the speed rows);
4. the sweep: expert sizes x experts per step x path (d2d, h2d, d2h) x way (ce_sync: one cudaMemcpyAsync
   and a stream sync per expert, as ds4 does; ce_batch: the same calls, one sync; gather: one kernel launch,
   or three for the same descriptors). Each configuration is repeated with fresh random slots (so sources
   are not L2-resident), all repeats shuffled; the first repeat of each is checked byte for byte at its
   first and last copy. Each sample is timed right after Backend.settle() (the host as an engine issues a
   step: just after a GPU call and its sync). Host time per step is what the simulator models (its engines
   are serial chains);
5. the fit (sim.calibrate.fit) and the speed rows.
The host probe (Backend.host_probe) is timed before the sweep and after each quarter of it: the file records
how the host's state moved while the grid was measured, and a replay compares it with its own.

Memory: a device arena (slab of random slots + compact staging) and a mapped pinned host arena, sized from
the grid (512 experts x 16 MiB: 10 GiB slab, 8 GiB staging, 8.5 GiB pinned host memory).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from sim.calibrate import cudaenv, fit
from sim.calibrate.backend import PATHS, POISON, WORD, Backend
from sim.calibrate.kernel import Variant
from sim.calibrate.selftest import self_test
from sim.errors import InputError
from sim.units import GIB, MIB

# fmt: off
DEFAULT_SIZES_MIB = (1, 2, 3, 4, 6, 8, 12, 16)     # expert (part) sizes: ds4 parts are 2.06-4.5 MiB
DEFAULT_EXPERTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DEFAULT_REPEATS = 5
SLOT_ALIGN_WORDS = 32                              # slots start on 256-byte boundaries
SLAB_FACTOR = 1.25                                 # random source slots: the slab is this much larger
REFERENCE_BYTES = GIB                              # one large copy, and gathers of the same total
EVENT_REPS = 10
GATHER_SPLIT = 3                                   # the second launch count of gather samples
SMALL_STEP_BYTES = 64 * MIB                        # steps up to this size get SMALL_STEP_REPEATS x the repeats
SMALL_STEP_REPEATS = 3
TARGET_GATHER_VS_COPY = 0.85                       # issue #4 speed rows
TARGET_MAPPED_VS_PINNED = 0.90
TUNING = (Variant(256, 4, 8), Variant(256, 8, 8), Variant(512, 4, 4), Variant(512, 8, 4),
          Variant(1024, 8, 2), Variant(256, 8, 32), Variant(128, 8, 16), Variant(512, 8, 16))
# fmt: on


@dataclass
class Grid:
    sizes_bytes: tuple = tuple(s * MIB for s in DEFAULT_SIZES_MIB)
    experts: tuple = DEFAULT_EXPERTS
    repeats: int = DEFAULT_REPEATS
    paths: tuple = PATHS
    ways: tuple = fit.WAYS
    seed: int = 0
    tune: bool = True
    reference_bytes: int = REFERENCE_BYTES
    event_reps: int = EVENT_REPS
    self_test_words: int = 1 << 22
    self_test_max_words: int = 1 << 19

    def __post_init__(self):
        if not self.sizes_bytes or min(self.sizes_bytes) < WORD:
            raise InputError("calibrate", "--sizes", list(self.sizes_bytes), "need sizes of at least 8 bytes")
        if not self.experts or min(self.experts) < 1:
            raise InputError("calibrate", "--experts", list(self.experts), "need counts of at least 1")
        if self.repeats < 1:
            raise InputError("calibrate", "--repeats", self.repeats, "must be >= 1")
        self.sizes_bytes = tuple(sorted({_round_words(s) * WORD for s in self.sizes_bytes}))
        self.experts = tuple(sorted(set(int(n) for n in self.experts)))
        self.reference_bytes = int(min(self.reference_bytes, self.max_total_bytes))

    @property
    def max_total_bytes(self) -> int:
        return max(self.experts) * _slot_words(max(self.sizes_bytes)) * WORD

    def as_dict(self) -> dict:
        return {"sizes_bytes": list(self.sizes_bytes), "experts": list(self.experts), "repeats": self.repeats,
                "paths": list(self.paths), "ways": list(self.ways), "seed": self.seed}


def _round_words(nbytes: int) -> int:
    return -(-int(nbytes) // WORD)


def _slot_words(nbytes: int) -> int:
    w = _round_words(nbytes)
    return -(-w // SLOT_ALIGN_WORDS) * SLOT_ALIGN_WORDS


@dataclass
class Layout:
    """Word offsets of the regions: device = slab | staging, host = one region of random slots."""

    slab_words: int
    staging_words: int
    host_words: int

    @classmethod
    def for_grid(cls, grid: Grid) -> "Layout":
        total = max(grid.max_total_bytes, grid.reference_bytes) // WORD
        slab = int(total * SLAB_FACTOR) + SLOT_ALIGN_WORDS
        host = int(total * 1.0625) + SLOT_ALIGN_WORDS
        return cls(slab, total, host)

    @property
    def dev_words(self) -> int:
        return self.slab_words + self.staging_words

    @property
    def staging_at(self) -> int:
        return self.slab_words

    def need_bytes(self) -> int:
        return self.dev_words * WORD + 64 * MIB


def check_memory(layout: Layout, what: str = "the sweep", hint: str = "pass fewer --experts or smaller --sizes"):
    free = cudaenv.free_memory_bytes()
    need = layout.need_bytes()
    if need > 0.92 * free:
        raise InputError("calibrate", "GPU memory", f"{free / GIB:.1f} GiB free",
                         f"{what} needs {need / GIB:.1f} GiB of device memory: {hint}")


def random_slots(rng: np.random.Generator, region_words: int, slot_words: int, n: int, base: int = 0) -> np.ndarray:
    """n distinct random slot starts (word offsets) in a region."""
    slots = region_words // slot_words
    if slots < n:
        raise InputError("calibrate", "slots", f"{n} x {slot_words * WORD} bytes",
                         f"the region holds only {slots} such slots")
    return base + rng.choice(slots, size=n, replace=False).astype(np.int64) * slot_words


def sample_descriptors(rng, layout: Layout, path: str, size_bytes: int, n: int) -> np.ndarray:
    """(n, 3) word descriptors: d2d slab -> compact staging, h2d host -> slab, d2h slab -> host."""
    w = _round_words(size_bytes)
    sw = _slot_words(size_bytes)
    if path == "d2d":
        src = random_slots(rng, layout.slab_words, sw, n)
        if n * sw > layout.staging_words:
            raise InputError("calibrate", "staging", f"{n} x {sw * WORD} bytes",
                             f"the staging region holds only {layout.staging_words // sw} such slots")
        dst = layout.staging_at + np.arange(n, dtype=np.int64) * sw
    elif path == "h2d":
        src = random_slots(rng, layout.host_words, sw, n)
        dst = random_slots(rng, layout.slab_words, sw, n)
    else:
        src = random_slots(rng, layout.slab_words, sw, n)
        dst = random_slots(rng, layout.host_words, sw, n)
    return np.column_stack([src, dst, np.full(n, w, np.int64)])


def _split(desc: np.ndarray, launches: int) -> list[np.ndarray]:
    return [part for part in np.array_split(desc, launches) if len(part)]


def prepare(backend: Backend, path: str, way: str, desc: np.ndarray, launches: int = 1):
    if way == "gather":
        return backend.gather_step([(path, part) for part in _split(desc, launches)])
    return backend.ce_step(path, desc[:, 0], desc[:, 1], desc[:, 2])


def execute(backend: Backend, way: str, step):
    if way == "gather":
        return backend.run_gather(step)
    return backend.run_ce(step, sync_each=(way == "ce_sync"))


def spot_check(backend: Backend, path: str, desc: np.ndarray, run) -> None:
    """Poison the first and last destination, run, compare both with their sources word for word."""
    src_mem, dst_mem = {"d2d": ("dev", "dev"), "h2d": ("host", "dev"), "d2h": ("dev", "host")}[path]
    rows = [desc[0], desc[-1]] if len(desc) > 1 else [desc[0]]
    for s, d, n in rows:
        backend.poison(dst_mem, int(d), int(n))
    run()
    for s, d, n in rows:
        got = backend.read(dst_mem, int(d), int(n))
        want = backend.read(src_mem, int(s), int(n))
        if not np.array_equal(got, want):
            bad = np.flatnonzero(got != want)
            raise AssertionError(f"{path}: copy of {int(n) * WORD} bytes wrong at {len(bad)} words "
                                 f"({int(np.count_nonzero(got[bad] == POISON))} still poisoned)")


# ----------------------------------------------------------------------------------------------- steps


LAUNCHES = (("raw", "device"), ("raw", "mapped"), ("pointer", "device"), ("dispatch", "device"))


def run_self_test(backend: Backend, seed: int, words: int, max_words: int) -> dict:
    """The self-test on a small scratch backend of `words` device words, for every way of launching the
    gather kernel (on a GPU) and both ways of copying per descriptor. Returns per launch way its counts or
    its error; `backend` is left on the first way that passed."""
    rng = np.random.default_rng(seed)
    small = Backend(dev_words=words, host_words=words // 2, variants=dict(backend.variants), launch_mode="dispatch")
    if small.sim:
        return {"dispatch/device": self_test(small, rng, steps=2, n_desc=24, max_words=max_words)}
    results, working = {}, []
    for mode, desc_in in LAUNCHES:
        key = f"{mode}/{desc_in}"
        try:
            small.set_launch(mode, desc_in)
            results[key] = self_test(small, rng, steps=2, n_desc=48, max_words=max_words)
            working.append((mode, desc_in))
        except Exception as exc:  # a launch way this driver or numba-cuda does not take: note it, go on
            results[key] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    if not working:
        raise AssertionError(f"the gather kernel failed its self-test every way: {results}")
    backend.set_launch(*working[0], why="first that passed the self-test")
    results["working"] = [f"{m}/{d}" for m, d in working]
    return results


def choose_launch(backend: Backend, layout: Layout, rng, ways: list, reps: int = 200) -> list[dict]:
    """Host time of a small step (18 x 2 MiB D2D copies, a ds4 decode layer) per working launch way; the
    backend keeps the fastest."""
    desc = sample_descriptors(rng, layout, "d2d", 2 * MIB, 18)
    rows = []
    for key in ways:
        mode, desc_in = key.split("/")
        backend.set_launch(mode, desc_in)
        step = backend.gather_step([("d2d", desc)])
        for _ in range(10):
            backend.run_gather(step)
        walls = [backend.run_gather(step) for _ in range(reps)]
        rows.append({"launch": key, "wall_us": float(np.median([w.wall_us for w in walls])),
                     "enqueue_us": float(np.median([w.enqueue_us for w in walls]))})
    best = min(rows, key=lambda r: r["wall_us"])
    backend.set_launch(*best["launch"].split("/"), why=f"fastest small step, {best['wall_us']:.1f} us")
    return rows


def reference_descriptors(path: str, total_bytes: int) -> tuple[int, int]:
    """(size, count) of the expert-sized descriptors a reference gather uses: 4 MiB for d2d, 16 MiB for the
    host paths (smaller when the total is small), as many as fit into total_bytes."""
    size = min(4 * MIB if path == "d2d" else 16 * MIB, max(WORD, total_bytes // 4 // WORD * WORD))
    return size, max(1, total_bytes // (_slot_words(size) * WORD))


def tune(backend: Backend, layout: Layout, rng, grid: Grid, log) -> list[dict]:
    """Median GPU time of 1 GiB gathers (4 MiB descriptors for d2d, 16 MiB for the host paths) per launch
    shape; each path keeps its fastest."""
    rows = []
    for path in grid.paths:
        size, n = reference_descriptors(path, min(grid.reference_bytes, layout.staging_words * WORD))
        best = None
        for variant in TUNING if grid.tune else (backend.variants[path],):
            backend.set_variant(path, variant)
            step = backend.gather_step([(path, sample_descriptors(rng, layout, path, size, n))])
            backend.enqueue_gather(step)  # warm-up (and first-launch module load)
            ms = float(np.median(backend.gpu_ms(lambda: backend.enqueue_gather(step), max(3, grid.event_reps // 2))))
            gbps = step.nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("nan")
            rows.append({"path": path, **variant.as_dict(), "bytes": step.nbytes, "ms": ms, "gbps": gbps})
            if best is None or ms < best[0]:
                best = (ms, variant)
        backend.set_variant(path, best[1])
        log(f"tune {path}: {best[1].as_dict()} {rows[-1]['bytes'] / (best[0] * 1e6):.1f} GB/s")
    return rows


def references(backend: Backend, layout: Layout, rng, grid: Grid) -> dict:
    """Event-timed medians: one large copy per path with the copy engine, and the gather kernel over the
    same number of bytes in expert-sized descriptors (4 MiB for d2d, 16 MiB for the host paths)."""
    total_w = min(grid.reference_bytes, layout.staging_words * WORD) // WORD
    big = {"d2d": (0, layout.staging_at), "h2d": (0, 0), "d2h": (0, 0)}
    out = {}
    for path in grid.paths:
        s, d = big[path]
        ce = backend.ce_step(path, [s], [d], [total_w])
        backend.enqueue_ce(ce)
        ce_ms = float(np.median(backend.gpu_ms(lambda: backend.enqueue_ce(ce), grid.event_reps)))
        size, n = reference_descriptors(path, total_w * WORD)
        steps = [backend.gather_step([(path, sample_descriptors(rng, layout, path, size, n))]) for _ in range(4)]
        backend.enqueue_gather(steps[0])
        turn = [0]

        def rotating():  # four slot sets in turn, so no source stays in L2 between repeats
            turn[0] += 1
            backend.enqueue_gather(steps[turn[0] % 4])

        g_ms = float(np.median(backend.gpu_ms(rotating, grid.event_reps)))
        out[path] = {"copy_bytes": total_w * WORD, "copy_ms": ce_ms, "copy_gbps": total_w * WORD / (ce_ms * 1e6),
                     "gather_bytes": steps[0].nbytes, "gather_descriptors": n, "gather_ms": g_ms,
                     "gather_gbps": steps[0].nbytes / (g_ms * 1e6)}
    return out


def idle_sync_us(backend: Backend, reps: int = 2000) -> float:
    backend.sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        backend.sync()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return float(np.median(times))


PROBE_POINTS = 4  # host probes during the sweep, after each quarter of its samples (and one before)


def sweep(backend: Backend, layout: Layout, rng, grid: Grid, log) -> tuple[pd.DataFrame, list[float]]:
    """The grid's samples, and the host probe before the first of them and after each PROBE_POINTS-th."""
    configs = []
    for path in grid.paths:
        for way in grid.ways:
            for size in grid.sizes_bytes:
                for n in grid.experts:
                    for launches in ((1, GATHER_SPLIT) if way == "gather" and n >= GATHER_SPLIT else (1,)):
                        configs.append((path, way, size, n, launches))
    # small steps are the noisy ones (a few microseconds of host jitter is a large fraction): repeat more
    order = [(c, r) for c in configs
             for r in range(grid.repeats * (SMALL_STEP_REPEATS if c[2] * c[3] <= SMALL_STEP_BYTES else 1))]
    rng.shuffle(order)
    # warm-up: every (path, way) once, so first-call costs stay out of the samples
    for path in grid.paths:
        for way in grid.ways:
            step = prepare(backend, path, way, sample_descriptors(rng, layout, path, grid.sizes_bytes[0], 4))
            execute(backend, way, step)
    rows = []
    t_start = time.perf_counter()
    checkpoints = {len(order) * i // PROBE_POINTS for i in range(1, PROBE_POINTS + 1)}
    probes = [backend.host_probe()]
    for k, ((path, way, size, n, launches), rep) in enumerate(order):
        desc = sample_descriptors(rng, layout, path, size, n)
        step = prepare(backend, path, way, desc, launches)
        if rep == 0:
            spot_check(backend, path, desc, lambda: execute(backend, way, step))
        backend.settle()
        timing = execute(backend, way, step)
        rows.append((path, way, int(size), int(n), int(launches), int(rep), timing.wall_us, timing.enqueue_us))
        if k and k % 500 == 0:
            log(f"sweep {k}/{len(order)} samples, {time.perf_counter() - t_start:.0f} s")
        if k + 1 in checkpoints:
            probes.append(backend.host_probe())
    return pd.DataFrame.from_records(rows, columns=list(fit.SAMPLE_COLUMNS)), probes


def speed_rows(refs: dict) -> list[dict]:
    def describe(r: dict) -> str:
        return f"{r['gather_descriptors']} x {r['gather_bytes'] // r['gather_descriptors'] // MIB} MiB"

    checks = (  # path, what is compared, target ratio (None: reported only), GB/s decimals
        ("d2d", lambda r: f"gather kernel D2D ({describe(r)}) vs one {r['copy_bytes'] // MIB} MiB device copy",
         TARGET_GATHER_VS_COPY, 0),
        ("h2d", lambda r: f"H2D from mapped pinned memory (gather kernel, {describe(r)}) vs one pinned "
                          f"{r['copy_bytes'] // MIB} MiB cudaMemcpy", TARGET_MAPPED_VS_PINNED, 1),
        ("d2h", lambda r: "D2H to mapped pinned memory (gather kernel) vs one pinned cudaMemcpy", None, 1),
    )
    rows = []
    for path, name, target, decimals in checks:
        if path not in refs:
            continue
        r = refs[path]
        ratio = r["gather_gbps"] / r["copy_gbps"]
        rows.append({"name": name(r), "value": ratio, "unit": "ratio",
                     "target": "" if target is None else f">= {target}",
                     "met": None if target is None else bool(ratio >= target),
                     "detail": f"{r['gather_gbps']:.{decimals}f} vs {r['copy_gbps']:.{decimals}f} GB/s"
                               + (" (bytes copied)" if path == "d2d" else "")})
    return rows


def comparison(med: pd.DataFrame, size_bytes: int) -> list[dict]:
    """The engines' way against the gather kernel, per path and experts per step, at one expert size."""
    sizes = np.array(sorted(med["size_bytes"].unique()))
    size = int(sizes[np.argmin(np.abs(sizes - size_bytes))])
    part = med[(med["size_bytes"] == size) & (med["launches"] == 1)]
    rows = []
    for (path, n), g in part.groupby(["path", "n"]):
        by_way = dict(zip(g["way"], g["wall_us"]))
        row = {"path": path, "experts": int(n), "size_bytes": size}
        row.update({f"{w}_us": by_way.get(w) for w in fit.WAYS})
        if by_way.get("ce_sync") and by_way.get("gather"):
            row["speedup"] = by_way["ce_sync"] / by_way["gather"]
        rows.append(row)
    return rows


@dataclass
class SweepResult:
    device: dict
    grid: Grid
    samples: pd.DataFrame
    params: dict
    tuning: list = field(default_factory=list)
    references: dict = field(default_factory=dict)
    speed: list = field(default_factory=list)
    comparison: list = field(default_factory=list)
    self_test: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    seconds: float = 0.0


def calibrate(grid: Grid, log=lambda msg: None) -> SweepResult:
    """The whole measurement on the current GPU (or the simulator, where the numbers mean nothing)."""
    t0 = time.perf_counter()
    device = cudaenv.device_info()
    layout = Layout.for_grid(grid)
    if not device["simulator"]:
        check_memory(layout)
    elif (layout.dev_words + layout.host_words) * WORD > GIB:
        raise InputError("calibrate", "simulator", f"{(layout.dev_words + layout.host_words) * WORD / GIB:.1f} GiB",
                         "Numba's simulator runs tiny grids only: pass --sizes of a few KiB (e.g. 0.004) and "
                         "few --experts")
    log(f"{device['name']} (cc {device['compute_capability']}): arenas {layout.dev_words * WORD / GIB:.2f} GiB "
        f"device, {layout.host_words * WORD / GIB:.2f} GiB pinned host")
    backend = Backend(dev_words=layout.dev_words, host_words=layout.host_words)
    rng = np.random.default_rng(grid.seed)
    st = run_self_test(backend, grid.seed + 1, min(grid.self_test_words, layout.dev_words),
                       grid.self_test_max_words)
    log(f"self-test passed: {st}")
    # arena contents: random words with a period that is no multiple of any slot, so slots differ
    pattern = rng.integers(1, 2**63, size=(1 << 22) + 1, dtype=np.uint64)
    backend.fill("dev", pattern)
    backend.fill("host", pattern[::-1].copy())
    launches = []
    if not device["simulator"]:
        launches = choose_launch(backend, layout, rng, st["working"])
        log(f"launch ways: {launches}")
    tuning = tune(backend, layout, rng, grid, log) if not device["simulator"] else []
    refs = references(backend, layout, rng, grid)
    sync_idle = idle_sync_us(backend, 200 if device["simulator"] else 2000)
    samples, probes = sweep(backend, layout, rng, grid, log)
    log(f"host probe through the sweep: {', '.join(f'{p:.1f}' for p in probes)} us")
    params = fit.fit(samples)
    med = fit.medians(samples)
    result = SweepResult(device=device, grid=grid, samples=samples, params=params, tuning=tuning,
                         references=refs, speed=speed_rows(refs), comparison=comparison(med, 4 * MIB),
                         self_test=st, extra={"sync_idle_us": sync_idle, "launch_mode": backend.launch_mode,
                                              "desc_in": backend.desc_in, "launch_ways": launches,
                                              "host_probe_us": probes,
                                              "variants": {p: v.as_dict() for p, v in backend.variants.items()}},
                         notes=list(backend.notes))
    result.seconds = time.perf_counter() - t0
    return result
