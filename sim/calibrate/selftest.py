"""The gather kernel's self-test: random hazard-free plans through the kernel and through per-descriptor copies,
on arenas of fresh random data with every destination poisoned; afterwards every word of both arenas is compared
with the plan done on host copies."""

from __future__ import annotations

import numpy as np

from sim.calibrate.backend import MEMORIES, PATHS, POISON, Backend, validate_descriptors


def reference_apply(arenas: dict, plan: list[tuple[str, np.ndarray]]) -> None:
    """The plan's copies done in order on host copies of the arenas (the expected result)."""
    for path, desc in plan:
        s_mem, d_mem = MEMORIES[path]
        for s, d, n in np.asarray(desc, np.int64).reshape(-1, 3):
            arenas[d_mem][d: d + n] = arenas[s_mem][s: s + n]


def random_plan(rng: np.random.Generator, dev_words: int, host_words: int, n_desc: int, max_words: int,
                paths=PATHS) -> list[tuple[str, np.ndarray]]:
    """A hazard-free step: descriptors of every path, lengths 1..max_words words (odd ones included),
    destinations pairwise disjoint and disjoint from every source, so any order of execution gives the
    same bytes. Each arena is cut into segments; half of them serve as sources, half as destinations."""
    pools = {}
    for name, total in (("dev", dev_words), ("host", host_words)):
        cuts = np.sort(rng.choice(np.arange(1, total), size=min(total - 1, 4 * n_desc), replace=False))
        bounds = np.concatenate([[0], cuts, [total]])
        segs = [(int(a), int(b - a)) for a, b in zip(bounds[:-1], bounds[1:])]
        order = rng.permutation(len(segs))
        half = len(segs) // 2
        pools[name] = {"src": [segs[i] for i in order[:half]], "dst": [segs[i] for i in order[half:]]}
    per_path: dict = {p: [] for p in paths}
    for k in range(n_desc):
        path = paths[k % len(paths)]
        s_mem, d_mem = MEMORIES[path]
        if not pools[d_mem]["dst"] or not pools[s_mem]["src"]:
            break
        d_off, d_len = pools[d_mem]["dst"].pop()
        s_off, s_len = pools[s_mem]["src"][int(rng.integers(len(pools[s_mem]["src"])))]
        room = min(d_len, s_len, max_words)
        n = int(rng.integers(1, room + 1))
        s_at = s_off + int(rng.integers(0, s_len - n + 1))
        d_at = d_off + int(rng.integers(0, d_len - n + 1))
        per_path[path].append((s_at, d_at, n))
    return [(p, np.array(v, np.int64).reshape(-1, 3)) for p, v in per_path.items() if v]


def self_test(backend: Backend, rng: np.random.Generator, steps: int = 4, n_desc: int = 24,
              max_words: int = 4096) -> dict:
    """Random plans through the gather kernel and through per-descriptor copies. Before each run the
    arenas get fresh random data and the destinations are poisoned; afterwards every word of both arenas
    is compared with the reference. Returns counts; raises AssertionError on the first difference."""
    checked = {"steps": 0, "descriptors": 0, "bytes_compared": 0, "ways": ["gather", "ce_sync", "ce_batch"]}
    for step in range(steps):
        plan = random_plan(rng, backend.dev_words, backend.host_words, n_desc, max_words)
        for path, desc in plan:
            s_mem, d_mem = MEMORIES[path]
            validate_descriptors("self-test", path, desc, backend.words(s_mem), backend.words(d_mem))
        for way in checked["ways"]:
            arenas = {name: rng.integers(0, 2**63, backend.words(name), dtype=np.uint64) for name in ("dev", "host")}
            for path, desc in plan:  # poison every destination, in the reference too
                d_mem = MEMORIES[path][1]
                for _, d, n in desc:
                    arenas[d_mem][d: d + n] = POISON
            for name, data in arenas.items():
                backend.write(name, 0, data)
            expected = {k: v.copy() for k, v in arenas.items()}
            reference_apply(expected, plan)
            if way == "gather":
                backend.run_gather(backend.gather_step(plan))
            else:
                ce = Backend.join_ce([backend.ce_step(p, d[:, 0], d[:, 1], d[:, 2]) for p, d in plan])
                backend.run_ce(ce, sync_each=(way == "ce_sync"))
            for name in ("dev", "host"):
                got = backend.read(name)
                if not np.array_equal(got, expected[name]):
                    wrong = np.flatnonzero(got != expected[name])
                    poisoned = int(np.count_nonzero(got[wrong] == POISON))
                    raise AssertionError(f"self-test step {step}, {way}: {len(wrong)} wrong words in the {name} "
                                         f"arena (first at word {int(wrong[0])}, {poisoned} still poisoned)")
                checked["bytes_compared"] += got.nbytes
        checked["steps"] += 1
        checked["descriptors"] += sum(len(d) for _, d in plan)
    return checked
