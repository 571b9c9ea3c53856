"""The engines: each one a set of pure rules (knobs, refusals, memory planning) and a SimPy process model.

    name    rules (no SimPy)          process (SimPy, on sim/machine)
    ds4     sim/engine/ds4_plan.py    sim/engine/ds4.py      antirez/ds4 CUDA streaming, PR #504 and successors
    strata  sim/engine/strata_plan.py sim/engine/strata.py   Strata v0.1.35 .. 0.1.40, the #658 fork

sim/engine/base.py states the interface run, sweep, plan and report use; `engines()` lists them. A cache-only
replay (`[engine] name = "replay"`) is no engine: sim/engine/cache_only.py.
"""

from __future__ import annotations

import importlib
from functools import lru_cache

_ENGINES = {"ds4": ("sim.engine.ds4_plan", "sim.engine.ds4", "Ds4"),
            "strata": ("sim.engine.strata_plan", "sim.engine.strata", "Strata")}


def names() -> tuple[str, ...]:
    return tuple(_ENGINES)


@lru_cache(maxsize=None)
def rules(name: str):
    """The engine's rules module: Settings (its [engine] table), validate, knobs, prune, DEFAULT_OBJECTIVE."""
    return importlib.import_module(_ENGINES[name][0])


def process_class(name: str):
    """The engine's process model class (sim/engine/base.py, EngineProcess)."""
    _, module, cls = _ENGINES[name]
    return getattr(importlib.import_module(module), cls)


def settings_models() -> tuple:
    return tuple(rules(name).Settings for name in _ENGINES)
