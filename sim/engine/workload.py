"""The routing each request of a scenario's workload sees: prompt rows and decode rows per request.

A generator preset makes one trace per request (seed + request index, so requests differ and runs repeat);
a trace file is cut by its request ids and must hold at least the tokens each request asks for.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from sim.errors import InputError
from sim.trace.format import PHASE_DECODE, PHASE_PREFILL, Trace, read_trace


@dataclass(frozen=True)
class RequestRouting:
    prompt: np.ndarray  # uint16 [prompt_tokens, layers, k]
    decode: np.ndarray  # uint16 [decode_tokens, layers, k]


@dataclass(frozen=True)
class WorkloadRouting:
    requests: tuple[RequestRouting, ...]
    sha256: str  # of the routing as simulated: provenance of the run


def _cut(trace: Trace, phase: int, request: int, n: int, where: str, what: str) -> np.ndarray:
    rows = trace.experts[(trace.request == request) & (trace.phase == phase)]
    if len(rows) < n:
        raise InputError(where, f"request {request} {what}", len(rows), f"the workload needs {n} tokens")
    return rows[:n]


def workload_routing(scenario) -> WorkloadRouting:
    from sim.trace.generate import generate_trace

    requests = scenario.workload.requests
    where = str(scenario.path or "scenario")
    parts, hashes = [], []
    if scenario.trace.path is not None:
        trace = read_trace(scenario.trace_path)
        ids = np.unique(trace.request)
        for i, request in enumerate(requests):
            rid = ids[i % len(ids)]
            parts.append(RequestRouting(_cut(trace, PHASE_PREFILL, rid, request.prompt_tokens, where, "prompt"),
                                        _cut(trace, PHASE_DECODE, rid, request.decode_tokens, where, "decode")))
        hashes.append(trace.sha256())
    else:
        def one(i: int) -> Trace:
            request = requests[i]
            return generate_trace(scenario.trace.generator, request.prompt_tokens, max(request.decode_tokens, 1),
                                  scenario.trace.seed + i)

        # the generator's kernel releases the GIL: requests are generated side by side, in a fixed order
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            traces = list(pool.map(one, range(len(requests))))
        for request, trace in zip(requests, traces):
            parts.append(RequestRouting(trace.experts[trace.phase == PHASE_PREFILL],
                                        trace.experts[trace.phase == PHASE_DECODE][: request.decode_tokens]))
            hashes.append(trace.sha256())
    return WorkloadRouting(tuple(parts), hashlib.sha256("".join(hashes).encode()).hexdigest())
