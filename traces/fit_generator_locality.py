"""Fit the generator's reuse strengths to the measured locality curves (routing-traces.md §6), one preset at a time.

    python traces/fit_generator_locality.py                      # every fit below; prints the fitted values
    python traces/fit_generator_locality.py deepseek-v2-lite     # one fit

Each fit varies a few strengths of one preset's routing spec (generator_spec.py) and minimises the summed squared
error, in tolerances, of the spec's targets marked `fit` (re-measured by sim/trace/generator_targets.py on traces
generated the way the study ran: same seeds every time, so the objective is deterministic). Every trial spec is
calibrated like a new preset (working-set sizes, keep probabilities), which takes seconds; a fit takes minutes.
The values found are typed into generator_spec.py beside their sources: this script prints them, it never edits.

Search: a compass search over the box of each fit's ranges, scaled to [0, 1], from the start given: try a step
up and down along each strength, move to the best, halve the step when none helps (hand-written: scipy is not one
of the project's dependencies, and one to three strengths need no more).
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim.trace.generate import trace_of_spec  # noqa: E402
from sim.trace.generator_spec import GENERATOR_PRESETS, PREFILL_OVER_DECODE  # noqa: E402
from sim.trace.generator_targets import generated_figures, locality_targets  # noqa: E402

# preset -> (strengths: dotted spec path -> (low, high, start), the spec paths set from them, the targets fitted)
FITS = {
    "deepseek-v2-lite": (
        {"reuse.prefill": (0.05, 0.5, 0.2675), "reuse.recall.prob": (0.0, 0.95, 0.5),
         "reuse.recall.lag.exponent": (0.5, 3.0, 0.925)},
        {"reuse.decode": lambda v: v["reuse.prefill"] / PREFILL_OVER_DECODE},
        ("reuse_within_prompts", "adjacent_prompts")),
    "deepseek-v4-flash-q2": (
        {"reuse.decode": (0.2, 0.6, 0.39), "reuse.recall.prob": (0.0, 0.95, 0.85),
         "reuse.recall.lag.exponent": (0.5, 3.0, 1.3)},
        {"reuse.prefill": lambda v: v["reuse.decode"] * PREFILL_OVER_DECODE},
        ("lru_verifier_rows", "adjacent_verifier_rows")),
    "deepseek-v4-flash-q2:tokens": (
        {"hash_routing.repeat.prob": (0.0, 0.9, 0.3), "hash_routing.repeat.lag.exponent": (0.3, 3.0, 1.0)},
        {}, ("hash_layers_on_real_text",)),
    "qwen3.8-flash-next-iq3s": (
        {"reuse.decode": (0.1, 0.6, 0.2125), "reuse.recall.prob": (0.0, 0.95, 0.72),
         "reuse.recall.lag.exponent": (0.5, 3.0, 1.2)},
        {"reuse.prefill": lambda v: v["reuse.decode"] * PREFILL_OVER_DECODE},
        ("lru_300_tokens",)),
    "qwen3-30b-a3b": (
        {"reuse.recall.prob": (0.0, 0.95, 0.84)}, {}, ("reuse_within_8_decode",)),
}


def _set(spec: dict, dotted: str, value: float) -> None:
    node = spec
    *parents, last = dotted.split(".")
    for key in parents:
        node = node[key]
    node[last] = round(float(value), 4)


def trial_spec(preset: str, values: dict, tied: dict) -> dict:
    spec = copy.deepcopy(GENERATOR_PRESETS[preset])
    for path, value in values.items():
        _set(spec, path, value)
    for path, rule in tied.items():
        _set(spec, path, rule(values))
    return spec


def objective(preset: str, values: dict, tied: dict, names) -> tuple[float, dict]:
    spec = trial_spec(preset, values, tied)

    def generate(n, p, d, seed):
        return trace_of_spec(spec, p, d, seed, requests=n)
    err, got = 0.0, {}
    targets = locality_targets(preset)
    for name in names:
        target = targets[name]
        measured = np.atleast_1d(np.array(target["measured"], float))
        figures = np.array(generated_figures(preset, name, generate))
        got[name] = figures.round(3).tolist()
        err += float((((figures - measured) / target["tolerance"]) ** 2).sum())
    return err, got


def fit(name: str) -> dict:
    preset = name.split(":")[0]
    ranges, tied, names = FITS[name]
    paths = list(ranges)
    low = np.array([ranges[p][0] for p in paths])
    span = np.array([ranges[p][1] - ranges[p][0] for p in paths])
    start = (np.array([ranges[p][2] for p in paths]) - low) / span
    seen: dict = {}

    def f(x):
        x = np.clip(x, 0.0, 1.0)
        values = dict(zip(paths, np.round(low + x * span, 4)))
        key = tuple(values.values())
        if key not in seen:
            t = time.perf_counter()
            seen[key] = objective(preset, values, tied, names)
            print(f"  {values} -> {seen[key][0]:.2f} {seen[key][1]} ({time.perf_counter() - t:.0f} s)", flush=True)
        return seen[key][0]
    x, step = start.copy(), 0.05
    while step >= 0.02 and len(seen) < 40:
        best_x, best_f = x, f(x)
        for i in range(len(paths)):
            for sign in (1, -1):
                y = x.copy()
                y[i] = np.clip(y[i] + sign * step, 0.0, 1.0)
                if f(y) < best_f:
                    best_x, best_f = y, f(y)
        if best_x is x:
            step /= 2
        x = best_x
    best = min(seen.items(), key=lambda kv: kv[1][0])
    values = dict(zip(paths, best[0]))
    values.update({p: round(rule(values), 4) for p, rule in tied.items()})
    print(f"{name}: {values}  error {best[1][0]:.2f}  {best[1][1]}  ({len(seen)} trials)", flush=True)
    return values


def main(argv=None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(FITS)
    for name in names:
        fit(name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
