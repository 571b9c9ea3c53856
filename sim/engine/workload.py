"""The routing each request of a scenario's workload sees: prompt rows and decode rows per request.

A generator preset makes one trace per request (seed + request index, so requests differ and runs repeat);
a trace file is cut by its request ids and must hold at least the tokens each request asks for.

MTP draft routing (a ds4 scenario with --mtp, on a model whose file holds MTP layers): each decode token
also routes the MTP layers. A trace file must carry their columns (layout.layers order: routed, then MTP).
A generator preset has no MTP layer (it generates the routed layers only) and no public routing
statistics of an MTP layer are stored, so the MTP layer is derived as one more layer: the generator's
LAST routed layer (its popularity, reuse and working-set calibration, the deepest layer's) drawn from an
independent stream, a second trace of the same preset and sizes under a seed derived from (seed, request)
(`mtp_seed`). Its decode rows are the MTP rows; its own prompt rows only warm its working-set state. So
the MTP layer's statistics are borrowed from the last routed layer, and its choices are independent of the
token's choices in the routed layers: an assumption, not a measurement.
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
    mtp: np.ndarray | None = None  # uint16 [decode_tokens, mtp layers, k]: the draft step of each decode token


@dataclass(frozen=True)
class WorkloadRouting:
    requests: tuple[RequestRouting, ...]
    sha256: str  # of the routing as simulated: provenance of the run


def _cut(trace: Trace, phase: int, request: int, n: int, where: str, what: str) -> np.ndarray:
    rows = trace.experts[(trace.request == request) & (trace.phase == phase)]
    if len(rows) < n:
        raise InputError(where, f"request {request} {what}", len(rows), f"the workload needs {n} tokens")
    return rows[:n]


def runs_mtp(scenario) -> bool:
    """The scenario's engine runs MTP draft steps: --mtp is set (validated per variant by sim.scenario) and
    the model's file holds MTP layers."""
    return getattr(scenario.engine.flags, "mtp", None) is not None and scenario.layout.n_mtp_layers > 0


def mtp_seed(seed: int, request: int) -> int:
    """The seed of request `request`'s MTP stream: a hash of (seed, request), below 2**63; unrelated to the
    request streams' seeds (seed + index) but for a hash coincidence."""
    digest = hashlib.sha256(f"expertsim mtp stream {seed} {request}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def workload_routing(scenario) -> WorkloadRouting:
    from sim.trace.generate import generate_trace

    requests = scenario.workload.requests
    where = str(scenario.path or "scenario")
    parts, hashes = [], []
    mtp = runs_mtp(scenario)
    n_routed = scenario.layout.n_routed_layers
    if scenario.trace.path is not None:
        trace = read_trace(scenario.trace_path)
        if mtp and trace.header.n_layers == n_routed:
            raise InputError(where, "trace.path", scenario.trace.path,
                             f"--mtp needs the MTP layers' routing: the trace has the {n_routed} routed layers only")
        ids = np.unique(trace.request)
        for i, request in enumerate(requests):
            rid = ids[i % len(ids)]
            decode = _cut(trace, PHASE_DECODE, rid, request.decode_tokens, where, "decode")
            parts.append(RequestRouting(_cut(trace, PHASE_PREFILL, rid, request.prompt_tokens, where, "prompt"),
                                        decode, decode[:, n_routed:] if mtp else None))
        hashes.append(trace.sha256())
    else:
        def one(job: tuple[int, bool]) -> Trace:
            i, draft = job
            request = requests[i]
            seed = mtp_seed(scenario.trace.seed, i) if draft else scenario.trace.seed + i
            return generate_trace(scenario.trace.generator, request.prompt_tokens, max(request.decode_tokens, 1), seed)

        jobs = [(i, False) for i in range(len(requests))] + ([(i, True) for i in range(len(requests))] if mtp else [])
        # the generator's kernel releases the GIL: requests are generated side by side, in a fixed order
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            traces = list(pool.map(one, jobs))
        n_mtp = scenario.layout.n_mtp_layers
        for i, (request, trace) in enumerate(zip(requests, traces)):
            draft = None
            if mtp:  # the MTP layers: the last routed layer(s) of the independent stream (module docstring)
                stream = traces[len(requests) + i]
                draft = stream.experts[stream.phase == PHASE_DECODE][: request.decode_tokens, n_routed - n_mtp:]
                draft = np.ascontiguousarray(draft)
                hashes.append(stream.sha256())
            parts.append(RequestRouting(trace.experts[trace.phase == PHASE_PREFILL],
                                        trace.experts[trace.phase == PHASE_DECODE][: request.decode_tokens], draft))
            hashes.append(trace.sha256())
    return WorkloadRouting(tuple(parts), hashlib.sha256("".join(hashes).encode()).hexdigest())
