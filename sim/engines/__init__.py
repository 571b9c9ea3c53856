"""The engines, each a package on the engine spec (sim/engines/base.py), registered here.

    ds4        sim/engines/ds4/       antirez/ds4 SSD streaming (CUDA/ROCm, Metal), PR #504 and its successors
    strata     sim/engines/strata/    Strata v0.1.35 .. 0.1.40, the live-memory builds, the #658 fork
    llama.cpp  sim/engines/llamacpp/  llama.cpp and ik_llama.cpp with experts in host RAM (--n-cpu-moe, op offload)
    replay     sim/engines/replay/    no engine: the routing through one `expertsim cache` cache, untimed

Adding an engine is its package and one line in ENGINES (docs/add-an-engine.md); tests/test_engine_contract.py
holds every registered engine to the spec. Registration checks it too: an engine that lacks a member fails here,
naming it, before anything runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Union

from pydantic import Field

from sim.engines.base import Engine, spec_problems
from sim.engines.ds4 import Ds4
from sim.engines.llamacpp import LlamaCpp
from sim.engines.replay import Replay
from sim.engines.strata import Strata


def register(*engines: Engine) -> dict[str, Engine]:
    """The engines by name, each checked against the spec (a TypeError naming what is missing)."""
    for engine in engines:
        problems = spec_problems(engine)
        if problems:
            raise TypeError(f"engine {type(engine).__name__} does not meet the spec: {'; '.join(problems)}")
    return {engine.name: engine for engine in engines}


ENGINES: Mapping[str, Engine] = register(Ds4(), Strata(), LlamaCpp(), Replay())


def names() -> tuple[str, ...]:
    return tuple(ENGINES)


def engine_of(scenario) -> Engine:
    """The engine a loaded scenario names."""
    return ENGINES[scenario.engine.name]


def settings_union():
    """The scenario's [engine] table: one of the engines' Settings, told apart by `name`."""
    return Annotated[Union[tuple(engine.Settings for engine in ENGINES.values())], Field(discriminator="name")]


def extra_metrics() -> tuple[str, ...]:
    """Every metric some engine's sweep rows carry beyond the run's headline, once each."""
    return tuple(dict.fromkeys(m for engine in ENGINES.values() for m in engine.extra_metrics))


__all__ = ["ENGINES", "Engine", "engine_of", "extra_metrics", "names", "register", "settings_union"]
