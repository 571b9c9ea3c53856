"""`expertsim calibrate --replay RESULTS`: a simulated run's copy plan, replayed on the GPU, step by step.

The plan (copy_plan.parquet, written by `expertsim run -o RESULTS`) says per engine step which copies the
engine makes: kind (H2D, D2D, D2H), count, bytes each, source and destination labels ("slab:gate",
"staging:down", "file", ...). It has no addresses, so the replay gives each (memory, label) its own arena of
fixed-size slots and places the copies the way the engines do:

- a label that is ever a copy source is a cache: its copies read or fill random slots (so sources are not
  L2-resident), and a source that was filled earlier in the same step is read from that slot (ds4: a miss is
  loaded into a slab slot, then copied slab -> staging like a hit);
- a label that is only ever a destination is a staging buffer: its copies are laid out compactly from the
  start, as the engines' compact buffers are.

Host labels (H2D sources, D2H destinations) live in pinned, mapped host memory: the replay measures the
GPU side of a copy, not the page-cache read or memcpy that feeds the pinned buffer (the simulator books
those on other links).

Each step runs two ways: the engines' way (one cudaMemcpyAsync and one stream sync per copy, in plan order)
and the gather kernel (launches grouped by path and by dependency level, one sync at the end). Host time
per step, timed right after Backend.settle() as the grid's samples are, is compared with the calibration's
prediction for that step. The calibration predicts the median of a configuration's repeats, so a step is run
`repeats` times, each on fresh random slots as the grid's repeats are, and the median of its times is what is
compared; the report's `noise_floor` is how far one run of a step lies from that median (the median over all
runs), the error a model of the median cannot go below when each step is timed once. The host probe
(Backend.host_probe) is timed before each way and after each quarter of its steps: `host_drift` is how much
slower (+) or faster (-) the host's part of a copy was than while the calibration's grid was measured, the part
of a replay's error that is the machine's state and not the model's; where the calibration recorded its probe,
`host_adjusted_median_error` compares the engines' way with its prediction moved to the replay's host state
(host_adjusted). At the same points the engines' way times its anchors (choose_anchors: some of the calibration
grid's own configurations near the plan's copy sizes) and compares them with the calibration's samples of them:
`anchor_adjusted_median_error` is the engines' way against its prediction moved by how far they moved
(anchor_adjusted). Some steps (the first two, then every `verify_every`-th) are
verified: destinations poisoned, every byte compared with a host-side reference.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from sim.calibrate import cudaenv, fit, sweep
from sim.calibrate.backend import POISON, PROBE_COPIES, WORD, Backend
from sim.calibrate.fileformat import plain_parameters, probe_us, samples_frame
from sim.calibrate.kernel import SIM_VARIANT, Variant
from sim.errors import InputError
from sim.units import GIB, MIB

KIND_PATH = {"H2D": "h2d", "D2D": "d2d", "D2H": "d2h"}
PATH_MEMORIES = {"d2d": ("dev", "dev"), "h2d": ("host", "dev"), "d2h": ("dev", "host")}
PLAN_COLUMNS = ("step_id", "kind", "count", "bytes_each", "src", "dst")
SLOT_ALIGN_WORDS = 32
MIN_CACHE_BYTES = {"dev": 256 * MIB, "host": 64 * MIB}  # random-slot arenas at least this large (L2 is 60 MB)
WARMUP_STEPS = 3
# Runs of each step whose median is compared (--repeats): three keep a replay of 3,000 steps to minutes on an H200
# and bring the median of a step's runs near the median the calibration's 5-15 repeats per configuration fit.
REPLAY_REPEATS = 3
SIM_MAX_BYTES = 1 << 30  # Numba's simulator keeps the arenas in host memory and copies at Python speed
SIM_MIN_CACHE_BYTES = {"dev": 1 << 20, "host": 1 << 20}  # the simulator has no L2 for sources to stay out of

# Host-state anchors: the probe's 4 KiB copies moved less than the grid's MiB copies did on a host loaded by other
# processes (H200 Q, 8 memory-copy processes through its calibration: probe +0.9 us a copy, the ce_sync grid's
# per-copy cost +1.7-1.9 us and h2d 55 -> 43 GB/s; docs/calibration.md), so the engines' way also times some of
# the grid's own configurations near the plan's copy sizes, as the grid timed them, and compares them with the
# calibration's samples of the same configurations.
ANCHOR_COPIES = (8, 16, 32)  # copies per anchor step: grid points of sweep.DEFAULT_EXPERTS
ANCHOR_RUNS = sweep.SMALL_STEP_REPEATS * sweep.DEFAULT_REPEATS  # the most runs the grid gave a configuration


def read_plan(results: str | Path) -> tuple[pd.DataFrame, dict, pd.DataFrame | None]:
    """copy_plan.parquet (checked), summary.json and steps.parquet (when present) of a results folder."""
    folder = Path(results)
    where = str(folder)
    if not folder.is_dir():
        raise InputError(where, "--replay", where, "no such results folder (expertsim run SCENARIO -o FOLDER)")
    plan_path = folder / "copy_plan.parquet"
    if not plan_path.is_file():
        raise InputError(where, "copy_plan.parquet", "(missing)", "not a results folder of expertsim run -o")
    try:
        plan = pd.read_parquet(plan_path)
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise InputError(str(plan_path), "parquet", type(exc).__name__, "unreadable copy plan") from None
    check_plan(plan, str(plan_path))
    summary = {}
    if (folder / "summary.json").is_file():
        try:
            summary = json.loads((folder / "summary.json").read_text())
        except (OSError, json.JSONDecodeError):
            raise InputError(str(folder / "summary.json"), "json", "summary.json", "not valid JSON") from None
    steps = pd.read_parquet(folder / "steps.parquet") if (folder / "steps.parquet").is_file() else None
    return plan, summary, steps


def check_plan(plan: pd.DataFrame, where: str) -> None:
    missing = [c for c in PLAN_COLUMNS if c not in plan.columns]
    if missing:
        raise InputError(where, "columns", missing, f"a copy plan has columns {', '.join(PLAN_COLUMNS)}")
    if not len(plan):
        raise InputError(where, "rows", 0, "the copy plan is empty: nothing to replay")
    kinds = set(plan["kind"].unique())
    if not kinds <= set(KIND_PATH):
        raise InputError(where, "kind", sorted(kinds - set(KIND_PATH))[0], "must be H2D, D2D or D2H")
    for col, low in (("step_id", 0), ("count", 0), ("bytes_each", 1)):
        if not pd.api.types.is_integer_dtype(plan[col]):
            raise InputError(where, col, str(plan[col].dtype), "must be integers")
        bad = plan.index[plan[col] < low]
        if len(bad):
            raise InputError(where, f"{col}[row {int(bad[0])}]", int(plan.loc[bad[0], col]), f"must be >= {low}")
    for col in ("src", "dst"):
        if plan[col].isna().any() or (plan[col].astype(str) == "").any():
            row = int(plan.index[plan[col].isna() | (plan[col].astype(str) == "")][0])
            raise InputError(where, f"{col}[row {row}]", "", "every copy needs a source and destination label")


@dataclass
class Arena:
    mem: str
    label: str
    slot_words: int
    slots: int
    cache: bool  # random slots (a cache) or compact (a staging buffer)
    base: int = 0  # word offset in its memory

    @property
    def words(self) -> int:
        return self.slot_words * self.slots


class Placement:
    """Arenas per (memory, label) for a plan, and the descriptors of each step."""

    def __init__(self, plan: pd.DataFrame, max_bytes: dict | None = None, min_cache_bytes: dict | None = None):
        min_cache_bytes = min_cache_bytes or MIN_CACHE_BYTES
        plan = plan[plan["count"] > 0]
        paths = plan["kind"].map(KIND_PATH)
        rows = pd.DataFrame({"step_id": plan["step_id"].to_numpy(), "count": plan["count"].to_numpy(),
                             "words": -(-plan["bytes_each"].to_numpy() // WORD),
                             "src_mem": [PATH_MEMORIES[p][0] for p in paths],
                             "dst_mem": [PATH_MEMORIES[p][1] for p in paths],
                             "src": plan["src"].astype(str).to_numpy(), "dst": plan["dst"].astype(str).to_numpy()})
        sources = set(zip(rows["src_mem"], rows["src"]))
        use = pd.concat([rows[["step_id", "count", "words"]].assign(mem=rows["src_mem"], label=rows["src"]),
                         rows[["step_id", "count", "words"]].assign(mem=rows["dst_mem"], label=rows["dst"])])
        per_step = use.groupby(["mem", "label", "step_id"])["count"].sum().groupby(["mem", "label"]).max()
        widest = use.groupby(["mem", "label"])["words"].max()
        self.arenas: dict[tuple, Arena] = {}
        cursor = {"dev": 0, "host": 0}
        for (mem, label), peak in per_step.items():
            slot = int(-(-int(widest[(mem, label)]) // SLOT_ALIGN_WORDS) * SLOT_ALIGN_WORDS)
            cache = (mem, label) in sources
            slots = int(peak)
            if cache:
                slots = max(2 * int(peak), -(-int(min_cache_bytes[mem]) // (slot * WORD)))
            arena = Arena(mem, label, slot, slots, cache, cursor[mem])
            cursor[mem] += arena.words
            self.arenas[(mem, label)] = arena
        self.words = cursor
        if max_bytes:
            for mem, limit in max_bytes.items():
                if self.words[mem] * WORD > limit:
                    raise InputError("replay", f"{mem} memory", f"{self.words[mem] * WORD / GIB:.2f} GiB",
                                     f"the plan's arenas need more than the {limit / GIB:.1f} GiB available "
                                     "(in Numba's simulator: replay small plans only)")
        self.rows = rows

    def step_descriptors(self, step_rows: pd.DataFrame, rng: np.random.Generator) -> list[tuple]:
        """Per plan row in order: (path, desc (n, 3) words, src arena key, dst arena key)."""
        written: dict = {}  # arena key -> slots filled in this step, not yet read back
        used: dict = {}  # arena key -> slots touched in this step
        compact: dict = {}
        out = []
        for r in step_rows.itertuples(index=False):
            skey, dkey = (r.src_mem, r.src), (r.dst_mem, r.dst)
            sa, da = self.arenas[skey], self.arenas[dkey]
            n = int(r.count)
            fresh = written.get(skey, [])
            take = fresh[:n]
            written[skey] = fresh[n:]
            src_slots = list(take) + self._random(sa, n - len(take), used, rng)
            if da.cache:
                dst_slots = self._random(da, n, used, rng)
                written.setdefault(dkey, []).extend(dst_slots)
            else:
                first = compact.get(dkey, 0)
                if first + n > da.slots:
                    raise InputError("replay", f"step {int(r.step_id)} {r.dst}", first + n,
                                     f"more copies than the {da.slots} slots sized for it")
                dst_slots = list(range(first, first + n))
                compact[dkey] = first + n
            src = sa.base + np.asarray(src_slots, np.int64) * sa.slot_words
            dst = da.base + np.asarray(dst_slots, np.int64) * da.slot_words
            path = {("dev", "dev"): "d2d", ("host", "dev"): "h2d", ("dev", "host"): "d2h"}[(r.src_mem, r.dst_mem)]
            out.append((path, np.column_stack([src, dst, np.full(n, int(r.words), np.int64)]), skey, dkey))
        return out

    @staticmethod
    def _random(arena: Arena, n: int, used: dict, rng) -> list:
        if n <= 0:
            return []
        taken = used.setdefault((arena.mem, arena.label), set())
        free = arena.slots - len(taken)
        if free < n:
            raise InputError("replay", f"{arena.mem}:{arena.label}", n, f"only {free} free slots in this step")
        if len(taken) < arena.slots // 4:  # rejection sampling is cheap while few slots are taken
            picks: list = []
            while len(picks) < n:
                for s in rng.integers(0, arena.slots, size=2 * (n - len(picks)) + 4).tolist():
                    if s not in taken:
                        taken.add(s)
                        picks.append(s)
                        if len(picks) == n:
                            break
            return picks
        pool = np.setdiff1d(np.arange(arena.slots), np.fromiter(taken, np.int64, len(taken)))
        picks = rng.choice(pool, size=n, replace=False).tolist()
        taken.update(picks)
        return picks


def gather_launches(descs: list[tuple]) -> list[tuple[str, np.ndarray]]:
    """Group a step's copies into kernel launches, one per (dependency level, path), with few launches.
    Dependencies at slot granularity: read after write, write after read, write after write. Each copy may
    sit at any level between its earliest (after everything it depends on) and its latest (before
    everything that depends on it); taken in plan order, it joins an existing launch of its path in that
    window if there is one, else the latest level (so cache hits join the copies of freshly loaded experts)."""
    items = []  # (path, src key, dst key, row)
    for path, desc, skey, dkey in descs:
        for row in desc:
            items.append((path, (skey, int(row[0])), (dkey, int(row[1])), row))
    n = len(items)
    succ: list[list[int]] = [[] for _ in range(n)]
    pred: list[list[int]] = [[] for _ in range(n)]
    last_write: dict = {}
    reads_since: dict = {}
    for j, (_, src, dst, _) in enumerate(items):
        deps = set(reads_since.get(dst, ()))
        if src in last_write:
            deps.add(last_write[src])
        if dst in last_write:
            deps.add(last_write[dst])
        deps.discard(j)
        for i in deps:
            succ[i].append(j)
            pred[j].append(i)
        reads_since.setdefault(src, []).append(j)
        last_write[dst] = j
        reads_since[dst] = []
    height = [0] * n
    for i in range(n - 1, -1, -1):
        height[i] = 1 + max((height[j] for j in succ[i]), default=0)
    depth = max(height, default=0)
    level = [0] * n
    groups: dict = {}
    for i, (path, _, _, row) in enumerate(items):
        low = max((level[p] + 1 for p in pred[i]), default=0)
        high = depth - height[i]
        chosen = next((lv for lv in range(low, high + 1) if (lv, path) in groups), high)
        level[i] = chosen
        groups.setdefault((chosen, path), []).append(row)
    return [(path, np.array(rows, np.int64)) for (lv, path), rows in sorted(groups.items())]


def verify(backend: Backend, descs: list[tuple], run) -> int:
    """Poison the step's destinations, run it, compare them with the host-side reference. Returns bytes."""
    regions: dict = {}
    for path, desc, _, _ in descs:
        s_mem, d_mem = PATH_MEMORIES[path]
        for s, d, n in desc:
            for key in ((s_mem, int(s)), (d_mem, int(d))):
                regions[key] = max(regions.get(key, 0), int(n))
    snap = {key: backend.read(key[0], key[1], n) for key, n in regions.items()}
    dsts = {(PATH_MEMORIES[p][1], int(d)): int(n) for p, desc, _, _ in descs for _, d, n in desc}
    for (mem, off), n in dsts.items():
        backend.poison(mem, off, n)
        snap[(mem, off)][:n] = POISON
    for path, desc, _, _ in descs:
        s_mem, d_mem = PATH_MEMORIES[path]
        for s, d, n in desc:
            snap[(d_mem, int(d))][:n] = snap[(s_mem, int(s))][:n]
    run()
    checked = 0
    for (mem, off), n in dsts.items():
        got = backend.read(mem, off, n)
        if not np.array_equal(got, snap[(mem, off)][:n]):
            raise AssertionError(f"replay: {mem} word {off}: {int(np.count_nonzero(got != snap[(mem, off)][:n]))} "
                                 "wrong words after the step")
        checked += n * WORD
    return checked


def replay(results: str | Path, calibration: dict, *, max_steps: int | None = None, seed: int = 0,
           repeats: int = REPLAY_REPEATS, verify_every: int = 1000, ways=("ce_sync", "gather"),
           min_cache_bytes: dict | None = None, log=lambda msg: None) -> dict:
    """Replay a results folder's copy plan; returns the report (per step and summary statistics)."""
    if repeats < 1:
        raise InputError("replay", "--repeats", repeats, "runs of each step: at least 1")
    plan, summary, steps_frame = read_plan(results)
    params = plain_parameters(calibration)
    cudaenv.require_gpu()
    cuda_sim = cudaenv.simulating()
    free = None if cuda_sim else cudaenv.free_memory_bytes()
    limit = {"dev": SIM_MAX_BYTES, "host": SIM_MAX_BYTES} if cuda_sim else {"dev": 0.9 * free - 256 * MIB}
    placement = Placement(plan, limit, min_cache_bytes or (SIM_MIN_CACHE_BYTES if cuda_sim else None))
    step_ids = np.unique(placement.rows["step_id"].to_numpy())
    if max_steps is not None and len(step_ids) > max_steps:
        step_ids = step_ids[np.unique(np.linspace(0, len(step_ids) - 1, max_steps).round().astype(int))]
    kernel = calibration.get("kernel") or {}
    variants = {p: Variant(**v) for p, v in (kernel.get("variants") or {}).items()}
    if cuda_sim:  # the simulator runs each CUDA thread as a Python thread and times nothing: the calibration's
        # kernels (its unroll) on the simulator's small blocks copy the same bytes, minutes sooner
        variants = {p: replace(v, threads=SIM_VARIANT.threads, blocks_per_sm=SIM_VARIANT.blocks_per_sm)
                    for p, v in variants.items()}
    dev_words, host_words = max(placement.words["dev"], 1024), max(placement.words["host"], 1024)
    backend = Backend(dev_words=dev_words, host_words=host_words,
                      variants=variants, launch_mode=kernel.get("launch_mode") or "raw",
                      desc_in=kernel.get("desc_in") or "device")
    rng = np.random.default_rng(seed)
    pattern = rng.integers(1, 2**63, size=(1 << 20) + 3, dtype=np.uint64)
    backend.fill("dev", pattern)
    backend.fill("host", pattern[::-1].copy())
    log(f"replay: {len(step_ids)} steps, arenas {placement.words['dev'] * WORD / GIB:.2f} GiB device, "
        f"{placement.words['host'] * WORD / GIB:.2f} GiB pinned host")
    grouped = {sid: g for sid, g in placement.rows.groupby("step_id", sort=True)}
    records = []
    verified = 0
    t_start = time.perf_counter()
    probes = []
    anchors = choose_anchors(plan, calibration) if "ce_sync" in ways else []
    half = dev_words // 2 // SLOT_ALIGN_WORDS * SLOT_ALIGN_WORDS  # the grid's layout: a slab, then staging
    anchor_layout = sweep.Layout(half, dev_words - half, host_words)
    anchor_rng = np.random.default_rng([seed, 1])  # its own stream: the steps get the slots they got without anchors
    anchor_readings: list[tuple[int, list[float]]] = []
    checkpoints = {len(step_ids) * i // sweep.PROBE_POINTS for i in range(1, sweep.PROBE_POINTS + 1)}
    for way in ways:
        for sid in step_ids[:WARMUP_STEPS]:  # untimed: the first steps of a way load its code paths
            _prepare(backend, params, way, placement.step_descriptors(grouped[sid], rng))[0]()
        way_probes = [(0, backend.host_probe())]
        timing_anchors = False
        if way == "ce_sync" and anchors:
            first = time_anchors(backend, anchors, anchor_layout, anchor_rng)
            timing_anchors = first is not None
            anchor_readings = [(0, first)] if timing_anchors else []
        first_record = len(records)
        for idx, sid in enumerate(step_ids):
            times = []
            for r in range(repeats):
                descs = placement.step_descriptors(grouped[sid], rng)  # fresh random slots for every run
                run, predicted, n_calls = _prepare(backend, params, way, descs)
                if r == 0 and (idx < 2 or (verify_every and idx % verify_every == 0)):
                    verified += verify(backend, descs, run)
                backend.settle()
                times.append(run().wall_us)
            by_path: dict[str, tuple[int, int]] = {}  # path -> (copies, bytes)
            for path, d, _, _ in descs:
                copies, total = by_path.get(path, (0, 0))
                by_path[path] = (copies + len(d), total + int(d[:, 2].sum()) * WORD)
            records.append({"way": way, "step_id": int(sid), "copies": sum(c for c, _ in by_path.values()),
                            "calls": int(n_calls), "bytes": sum(b for _, b in by_path.values()),
                            "predicted_us": float(predicted),
                            "measured_us": float(np.median(times)), "runs_us": [float(t) for t in times],
                            "by_path": by_path})
            if idx + 1 in checkpoints:
                way_probes.append((idx + 1, backend.host_probe()))
                if timing_anchors:
                    anchor_readings.append((idx + 1, time_anchors(backend, anchors, anchor_layout, anchor_rng)))
        at, readings = zip(*way_probes)
        # a step's host state: the probe interpolated between the readings before and after its part of the way
        for idx, record in enumerate(records[first_record:]):
            record["host_probe_us"] = float(np.interp(idx + 0.5, at, readings))
        probes.extend(readings)
        log(f"replay {way}: {len(step_ids)} steps x {repeats} runs, {time.perf_counter() - t_start:.0f} s")
    frame = pd.DataFrame.from_records(records)
    frame["rel_error"] = fit.relative_errors(frame["predicted_us"], frame["measured_us"])
    calibration_probe = probe_us(calibration)
    if calibration_probe is not None:
        frame["host_adjusted_us"] = host_adjusted(frame, calibration_probe)
        frame["host_adjusted_error"] = fit.relative_errors(frame["host_adjusted_us"], frame["measured_us"])
    shift_readings = [(at, anchor_shifts(anchors, medians)) for at, medians in anchor_readings]
    frame["anchor_adjusted_us"] = anchor_adjusted(frame, shift_readings)
    frame["anchor_adjusted_error"] = fit.relative_errors(frame["anchor_adjusted_us"], frame["measured_us"])
    if steps_frame is not None and len(steps_frame) > int(frame["step_id"].max()):
        frame["phase"] = steps_frame["phase"].to_numpy()[frame["step_id"].to_numpy()]
    else:
        frame["phase"] = "all"
    host_anchors = None if not anchor_readings else {
        "configurations": [vars(a) for a in anchors],
        "replay_us": [[round(m, 3) for m in medians] for _, medians in anchor_readings],
        "shifts": [{path: {"us_a_copy": round(c, 4), "us_a_mib": round(b * MIB, 4)} for path, (c, b) in shift.items()}
                   for _, shift in shift_readings]}
    return _report(frame, summary, calibration, results, verified, len(step_ids), repeats, probes, host_anchors,
                   cuda_sim, cudaenv.device_info()["name"])


def host_adjusted(frame: pd.DataFrame, calibration_probe_us: float) -> pd.Series:
    """The engines' way's prediction at the host state of the replay: the probe is PROBE_COPIES calls of the same
    kind (a cudaMemcpyAsync and a sync each, a few KiB whose copy is all host and driver time), so a step of
    `calls` such calls gains calls x (probe now - probe then) / PROBE_COPIES; measured on H200 I, whose probe rose
    2.4 us a copy within its grid while the grid's ce_sync samples rose 1.9 us a copy (docs/calibration.md).
    The gather way (one sync per step) is not adjusted: the probe does not time a kernel launch. NaN there."""
    shift_us = frame["calls"] * (frame["host_probe_us"] - calibration_probe_us) / PROBE_COPIES
    return (frame["predicted_us"] + shift_us).where(frame["way"] == "ce_sync")


@dataclass(frozen=True)
class Anchor:
    """A configuration of the calibration's grid that the replay times again: `copies` copies of `size_bytes` on
    `path`, the engines' way (a sync after each)."""

    path: str
    size_bytes: int
    copies: int
    calibration_us: float  # the median of the calibration's samples of it


def choose_anchors(plan: pd.DataFrame, calibration: dict) -> list[Anchor]:
    """Per path of the plan, the grid's two sizes around the plan's mean copy size on that path (weighted by copies)
    x ANCHOR_COPIES, each with the median of the calibration's samples; [] where the calibration has no samples of
    one of them (a published file, a narrower grid)."""
    if "samples" not in calibration:
        return []
    samples = samples_frame(calibration)
    engines_way = samples[samples["way"] == "ce_sync"]
    plan = plan[plan["count"] > 0]
    anchors = []
    for path, rows in plan.groupby(plan["kind"].map(KIND_PATH), sort=True):
        mean_bytes = float(np.average(rows["bytes_each"], weights=rows["count"]))
        on_path = engines_way[engines_way["path"] == path]
        sizes = np.sort(on_path["size_bytes"].unique())
        if not len(sizes):
            return []
        low = int(np.clip(np.searchsorted(sizes, mean_bytes) - 1, 0, max(len(sizes) - 2, 0)))
        for size in sizes[low:low + 2]:
            for copies in ANCHOR_COPIES:
                times = on_path.loc[(on_path["size_bytes"] == size) & (on_path["n"] == copies), "wall_us"]
                if times.empty:
                    return []
                anchors.append(Anchor(path, int(size), copies, float(times.median())))
    return anchors


def time_anchors(backend: Backend, anchors: list[Anchor], layout: sweep.Layout, rng) -> list[float] | None:
    """Each anchor's median host time over ANCHOR_RUNS runs, each on fresh random slots and timed right after a
    settle, as the grid timed its samples; None where the arenas cannot hold one (Numba's simulator)."""
    medians = []
    for anchor in anchors:
        times = []
        for _ in range(ANCHOR_RUNS):
            try:
                desc = sweep.sample_descriptors(rng, layout, anchor.path, anchor.size_bytes, anchor.copies)
            except InputError:
                return None
            step = backend.ce_step(anchor.path, desc[:, 0], desc[:, 1], desc[:, 2])
            backend.settle()
            times.append(backend.run_ce(step, sync_each=True).wall_us)
        medians.append(float(np.median(times)))
    return medians


def anchor_shifts(anchors: list[Anchor], medians: list[float]) -> dict[str, tuple[float, float]]:
    """Per path, how much a copy's host time moved since the calibration: (us a copy, us a byte), the line through
    the anchors' moves per copy against their copy size (the grid's two terms that a host state moves: the call,
    and the DMA rate out of or into host memory). One size: the mean move a copy, nothing a byte."""
    out = {}
    for path in sorted({a.path for a in anchors}):
        pairs = [(a.size_bytes, (m - a.calibration_us) / a.copies) for a, m in zip(anchors, medians) if a.path == path]
        sizes, moves = (np.array(v, float) for v in zip(*pairs))
        if len(np.unique(sizes)) < 2:
            out[path] = (float(moves.mean()), 0.0)
        else:
            per_byte, per_copy = np.polyfit(sizes, moves, 1)
            out[path] = (float(per_copy), float(per_byte))
    return out


def anchor_adjusted(frame: pd.DataFrame, shift_readings: list[tuple[int, dict]]) -> pd.Series:
    """The engines' way's prediction moved by the anchors' shifts (anchor_shifts, read before the way and at its
    checkpoints) at each step's place in the way, interpolated between the readings around it as the probe is:
    copies x (us a copy) + bytes x (us a byte) per path. NaN for the gather way, and where no anchor was timed."""
    engines = frame["way"] == "ce_sync"
    out = pd.Series(np.nan, index=frame.index)
    if not shift_readings or not engines.any():
        return out
    at = [k for k, _ in shift_readings]
    position = np.arange(int(engines.sum())) + 0.5
    moved = frame.loc[engines, "predicted_us"].to_numpy(float).copy()
    by_path = frame.loc[engines, "by_path"].tolist()
    for path in shift_readings[0][1]:
        per_copy = np.interp(position, at, [shift[path][0] for _, shift in shift_readings])
        per_byte = np.interp(position, at, [shift[path][1] for _, shift in shift_readings])
        copies = np.array([b.get(path, (0, 0))[0] for b in by_path], float)
        n_bytes = np.array([b.get(path, (0, 0))[1] for b in by_path], float)
        moved += copies * per_copy + n_bytes * per_byte
    out[engines] = moved
    return out


def _prepare(backend: Backend, params: dict, way: str, descs: list[tuple]):
    """A step's copies issued one way: (run, the calibration's prediction in us, GPU calls)."""
    if way == "gather":
        launches = gather_launches(descs)
        step = backend.gather_step(launches)
        predicted = fit.predict_gather_step(params, [(p, len(d), int(d[:, 2].sum()) * WORD) for p, d in launches])
        return (lambda: backend.run_gather(step)), predicted, len(step.launches)
    step = Backend.join_ce([backend.ce_step(p, d[:, 0], d[:, 1], d[:, 2]) for p, d, _, _ in descs])
    predicted = fit.predict_ce_step(params, [(p, len(d), int(d[:, 2].sum()) * WORD) for p, d, _, _ in descs],
                                    sync_each=(way == "ce_sync"))
    return (lambda: backend.run_ce(step, sync_each=(way == "ce_sync"))), predicted, step.n


def noise_floor(runs: pd.Series) -> float | None:
    """How far one run of a step lies from the median of its runs: the median over every run of
    |run / median - 1| (None with one run per step). A model that predicted each step's median exactly would
    show this median error against steps timed once."""
    deviations = []
    for times in runs:
        middle = float(np.median(times))
        if len(times) > 1 and middle > 0:
            deviations.extend(abs(t / middle - 1) for t in times)
    return float(np.median(deviations)) if deviations else None


def _report(frame: pd.DataFrame, summary: dict, calibration: dict, results, verified: int, n_steps: int,
            repeats: int, probes: list[float], host_anchors: dict | None, simulated: bool, device_name: str) -> dict:
    calibration_probe = probe_us(calibration)
    rows = []
    for way, part in frame.groupby("way", sort=False):
        parts = [("all", part)]
        if part["phase"].nunique() > 1:
            parts += list(part.groupby("phase"))
        for phase, sub in parts:
            stats = fit.error_stats(sub["rel_error"])
            adjusted = sub["host_adjusted_error"].dropna() if "host_adjusted_error" in sub else ()
            anchored = sub["anchor_adjusted_error"].dropna()
            rows.append({"way": way, "phase": phase, "steps": int(len(sub)), "median_error": stats["median"],
                         "p95_error": stats["p95"], "max_error": stats["max"],
                         "host_adjusted_median_error": fit.error_stats(adjusted)["median"],
                         "anchor_adjusted_median_error": fit.error_stats(anchored)["median"],
                         "noise_floor": noise_floor(sub["runs_us"]),
                         "measured_s": float(sub["measured_us"].sum() / 1e6),
                         "predicted_s": float(sub["predicted_us"].sum() / 1e6)})
    return {
        "results": str(results),
        "run": {k: summary.get(k) for k in ("engine", "variant", "hardware", "model", "scenario")},
        "calibration": {"gpu": calibration["gpu"]["name"], "status": calibration["status"],
                        "date": calibration.get("date")},
        "gpu": device_name,
        "simulator": simulated,
        "steps": n_steps,
        "repeats": repeats,
        "host_probe": {"calibration_us": calibration_probe, "replay_us": [round(p, 3) for p in probes]},
        "host_drift": None if calibration_probe is None else float(np.median(probes)) / calibration_probe - 1,
        "host_anchors": host_anchors,
        "verified_bytes": verified,
        "goal": f"median relative error <= {fit.REPLAY_GOAL_MEDIAN_ERROR:.2f}",
        "summary": rows,
        "per_step": {c: frame[c].astype(object).where(frame[c].notna(), None).tolist()  # JSON has no NaN
                     for c in ("way", "step_id", "phase", "copies", "calls", "bytes", "predicted_us", "measured_us",
                               "runs_us", "rel_error", "host_probe_us", "host_adjusted_us", "anchor_adjusted_us")
                     if c in frame},
    }
