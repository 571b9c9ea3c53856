"""The engine interface: what run, sweep, plan and report may ask of an engine, and nothing else.

An engine is two modules (sim/engine/__init__.py lists them):

rules (`<name>_plan.py`, pure: no SimPy, no numba kernels)
    Settings                 the pydantic table of its [engine] section: name, variant, flags, env
    validate(scenario, where)  its refusals, one InputError each (what the engine refuses, what the model
                             does not simulate), run when the scenario loads
    plan_memory(scenario)    the memory plan before anything runs: VRAM before the cache, the cache it
                             would size, what does not fit (a dict; `fits` False with a reason)
    knobs(data)              the plan's search space: (primary, secondary) lists of (grid key, candidates)
    records_read(scenario)   the calibration records (sim/engine/records.py) a run of the scenario reads
    DEFAULT_OBJECTIVE        the summary metric explore.plan maximises by default

process (`<name>.py`, a class built per run)
    __init__(scenario, routing, recorder, machine, domain)
    serve(env, timings)      the SimPy process: serves the scenario's requests on the machine
    state()                  the engine state a summary reports (cache slots, loans, notices, memory, ...)
    bounds(request)          bounds of the measured request, e.g. {"belady_decode_hit_rate": ...}

`domain` (sim/engine/records.py) collects the calibration records the engine uses outside their key.
"""

from __future__ import annotations

from typing import Protocol

import simpy


class EngineProcess(Protocol):
    name: str

    def serve(self, env: simpy.Environment, timings: list): ...

    def state(self) -> dict: ...

    def bounds(self, request: int) -> dict: ...
