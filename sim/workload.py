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

A long generated prompt (its routing over PROMPT_FILE_BYTES) is written to a temporary file as it is generated, when
the engine reads its prompts a chunk at a time (Engine.reads_prompt_in_chunks): the request's `prompt` is then
FileRows (sim/trace/rowfile.py), read a chunk at a time, so a million-token prompt is not held in memory. The routing,
its sha256 and every result are the same either way (tests/test_engine_contract.py).

Memo: a sweep runs many points whose routing inputs are identical (only cache budgets, reserves, chunks...
differ), so `workload_routing` keeps the last few routings of this process in a small LRU dict keyed by
everything the routing depends on (`routing_key`). Its arrays are made read-only, so a caller cannot change
what later callers get (see `_freeze`).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.version import __version__
from sim.errors import InputError
from sim.trace.format import PHASE_DECODE, PHASE_PREFILL, Trace, TraceHeader, read_trace
from sim.trace.rowfile import FileRows


# A generated prompt's routing above this size goes to a temporary file (sim.trace.rowfile) when the engine reads its
# prompts a chunk at a time (Engine.reads_prompt_in_chunks): a million tokens of a 48-layer top-10 model are 916 MiB
PROMPT_FILE_BYTES = 256 << 20


@dataclass(frozen=True)
class RequestRouting:
    prompt: np.ndarray | FileRows  # uint16 [prompt_tokens, layers, k]; FileRows: kept in a file (PROMPT_FILE_BYTES)
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


def _phase_rows(trace: Trace, phase: int) -> np.ndarray:
    """The trace's rows of one phase: a view when they are one run of rows (a generated request: prompt, then
    decode), so that a long prompt's routing is not held twice while it is cut; a copy otherwise."""
    at = np.flatnonzero(trace.phase == phase)
    if len(at) and at[-1] - at[0] + 1 == len(at):
        return trace.experts[at[0]: at[-1] + 1]
    return trace.experts[at]


def runs_mtp(scenario) -> bool:
    """The scenario's engine runs MTP draft steps: --mtp is set (validated per variant by sim.scenario) and
    the model's file holds MTP layers."""
    return getattr(scenario.engine.flags, "mtp", None) is not None and scenario.layout.n_mtp_layers > 0


def mtp_seed(seed: int, request: int) -> int:
    """The seed of request `request`'s MTP stream: a hash of (seed, request), below 2**63; unrelated to the
    request streams' seeds (seed + index) but for a hash coincidence."""
    digest = hashlib.sha256(f"expertsim mtp stream {seed} {request}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


ROUTING_MEMO_SIZE = 4  # routings kept per process: a sweep varies one trace setting at a time, if any
_ROUTING_MEMO: OrderedDict[tuple, WorkloadRouting] = OrderedDict()
memo_stats = {"hits": 0, "misses": 0}


def routing_key(scenario, prompts_to_file: bool = False) -> tuple:
    """Everything `_build_routing` reads: the trace source (generator preset, or the trace file's resolved
    path with its size and modification time, so an edited file is read again), the seed, each request's
    prompt and decode sizes, the model layout (its name and routed / MTP layer counts), whether MTP runs,
    whether a long prompt may go to a file, and the package version (a newer generator may draw differently)."""
    trace = scenario.trace
    if trace.path is not None:
        path = Path(scenario.trace_path).resolve()
        try:
            stat = path.stat()
            source = ("file", str(path), stat.st_size, stat.st_mtime_ns)
        except OSError:  # missing: not memoised; read_trace reports it
            source = ("file", str(path), None, None)
    else:
        source = ("generator", trace.generator)
    sizes = tuple((r.prompt_tokens, r.decode_tokens) for r in scenario.workload.requests)
    layout = scenario.layout
    return (__version__, source, trace.seed, sizes, layout.name, layout.n_routed_layers, layout.n_mtp_layers,
            runs_mtp(scenario), prompts_to_file)


def _freeze(routing: WorkloadRouting) -> WorkloadRouting:
    """Mark every array read-only. Why the memo is safe: routing is a pure function of `routing_key` (seeded
    generator, or a file whose size and mtime are in the key); the dataclasses are frozen and their tuples
    immutable; the arrays are fresh copies (boolean-mask cuts, np.ascontiguousarray) or views owned by this routing
    alone, and read-only flags make any in-place write by an engine raise instead of leaking into the next
    point. Numpy views taken from them (slices, concatenations) are new arrays or read-only views. A generated
    request's prompt and decode rows are views of its own trace's array (`_phase_rows`), which nothing else
    holds."""
    for request in routing.requests:
        for array in (request.prompt, request.decode, request.mtp):
            if isinstance(array, np.ndarray):  # a prompt kept in a file (FileRows) is read into fresh arrays
                array.flags.writeable = False
    return routing


def clear_routing_memo() -> None:
    _ROUTING_MEMO.clear()
    memo_stats.update(hits=0, misses=0)


def workload_routing(scenario, memo: bool = True, prompts_to_file: bool = False) -> WorkloadRouting:
    """The scenario's routing; with `memo`, served from this process's memo when the inputs match (module
    docstring). The result is the same either way (tests/test_workload.py). `prompts_to_file`: the engine reads
    its prompts a chunk at a time (Engine.reads_prompt_in_chunks), so a long one may be kept in a file."""
    if not memo:
        return _freeze(_build_routing(scenario, prompts_to_file))
    key = routing_key(scenario, prompts_to_file)
    if key[1][0] == "file" and key[1][2] is None:
        return _freeze(_build_routing(scenario, prompts_to_file))
    hit = _ROUTING_MEMO.get(key)
    if hit is not None:
        _ROUTING_MEMO.move_to_end(key)
        memo_stats["hits"] += 1
        return hit
    memo_stats["misses"] += 1
    routing = _freeze(_build_routing(scenario, prompts_to_file))
    _ROUTING_MEMO[key] = routing
    while len(_ROUTING_MEMO) > ROUTING_MEMO_SIZE:
        _ROUTING_MEMO.popitem(last=False)
    return routing


def _build_routing(scenario, prompts_to_file: bool) -> WorkloadRouting:
    from sim.trace.generate import generate_prompt_to_file, generate_trace
    from sim.trace.generator_model import generator_shape

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
        stop = threading.Event()
        preset = scenario.trace.generator
        layers, _, top_k = generator_shape(preset)

        def one(job: tuple[int, bool]) -> Trace | tuple:
            i, draft = job
            request = requests[i]
            seed = mtp_seed(scenario.trace.seed, i) if draft else scenario.trace.seed + i
            if not draft and prompts_to_file and request.prompt_tokens * layers * top_k * 2 > PROMPT_FILE_BYTES:
                return generate_prompt_to_file(preset, request.prompt_tokens, max(request.decode_tokens, 1), seed,
                                               stop=stop)
            return generate_trace(preset, request.prompt_tokens, max(request.decode_tokens, 1), seed, stop=stop)

        jobs = [(i, False) for i in range(len(requests))] + ([(i, True) for i in range(len(requests))] if mtp else [])
        # the generator's kernel releases the GIL: requests are generated side by side, in a fixed order
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            try:
                traces = list(pool.map(one, jobs))
            except BaseException:  # a Ctrl-C, or a failed request: the others stop at their next block of rows,
                stop.set()         # not after their whole prompt (the pool's exit waits for them)
                raise
        n_mtp = scenario.layout.n_mtp_layers
        for i, (request, trace) in enumerate(zip(requests, traces)):
            draft = None
            if mtp:  # the MTP layers: the last routed layer(s) of the independent stream (module docstring)
                stream = traces[len(requests) + i]
                draft = stream.experts[stream.phase == PHASE_DECODE][: request.decode_tokens, n_routed - n_mtp:]
                draft = np.ascontiguousarray(draft)
                hashes.append(stream.sha256())
            if isinstance(trace, Trace):
                prompt, decode, digest = _phase_rows(trace, PHASE_PREFILL), _phase_rows(trace, PHASE_DECODE), \
                    trace.sha256()
            else:  # the prompt's rows in a file (generate_prompt_to_file)
                prompt, decode, digest = trace
            parts.append(RequestRouting(prompt, decode[: request.decode_tokens], draft))
            hashes.append(digest)
    return WorkloadRouting(tuple(parts), hashlib.sha256("".join(hashes).encode()).hexdigest())


def workload_trace(scenario, routing: WorkloadRouting | None = None) -> Trace:
    """The scenario's workload routing (given, or built) as one trace, as the replay engine and the bench's LRU peer
    replay it: per request its prompt rows, then its decode rows; the routed layers only."""
    routing = workload_routing(scenario) if routing is None else routing
    layout = scenario.layout
    routed = layout.n_routed_layers
    experts, request, position, phase = [], [], [], []
    for i, r in enumerate(routing.requests):
        rows = len(r.prompt) + len(r.decode)
        experts += [r.prompt[:, :routed], r.decode[:, :routed]]
        phase += [np.full(len(r.prompt), PHASE_PREFILL), np.full(len(r.decode), PHASE_DECODE)]
        request.append(np.full(rows, i))
        position.append(np.arange(rows))
    header = TraceHeader(layout.name, routed, layout.n_experts, layout.top_k, "scenario workload", routing.sha256)
    return Trace(header, np.concatenate(request), np.concatenate(position), np.concatenate(phase),
                 np.concatenate(experts))
