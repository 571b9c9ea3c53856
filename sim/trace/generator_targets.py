"""The generator against the published locality figures: each preset's measured curves (its spec's `targets`
entries that have a `kind`) are re-measured on traces generated the way the study ran its model.

    generated_figures(preset, name)  -> the generated values of one target, in the order of its `measured`
    locality_report(preset)          -> one row per figure: measured, generated, error, tolerance, within

A target is data (generator_spec.py): kind ('lru', 'reuse_within', 'adjacent', 'hot_pairs'), `run` (the
requests that stand for the study's runs: requests x (prompt_tokens + decode_tokens), or one request per prompt
length of a derived length list; `seeds` independent replicates), the LRU `protocol` (sim.trace.locality.LruProtocol
fields), the sizes (capacities, distances or fractions), optionally the `layers` measured, `measured` and
`source`; `run["joined"]`: the replicates are measured as one run. `fit` marks the figures the
preset's strengths were fitted to (traces/fit_generator_locality.py); the others are held-out checks.
"""

from __future__ import annotations

import numpy as np

from sim.errors import InputError
from sim.trace.format import Trace, TraceHeader
from sim.trace.generate import generate_trace
from sim.trace.generator_model import _derived
from sim.trace.generator_spec import GENERATOR_PRESETS
from sim.trace.locality import LruProtocol, hot_pair_coverage, lru_hit_rates, reuse_within
from sim.trace.stats import reuse_by_layer

KINDS = ("lru", "reuse_within", "adjacent", "hot_pairs")


def locality_targets(preset: str) -> dict[str, dict]:
    """The preset's measured locality figures (targets with a kind), by name."""
    if preset not in GENERATOR_PRESETS:
        raise InputError("locality_targets", "preset", preset,
                         f"unknown; valid: {', '.join(sorted(GENERATOR_PRESETS))}")
    return {name: t for name, t in GENERATOR_PRESETS[preset]["targets"].items() if t.get("kind") in KINDS}


def _lengths(run: dict) -> list[tuple[int, int, int]]:
    """(requests, prompt_tokens, decode_tokens) of each generate call of one replicate."""
    if "prompt_lengths" in run:
        lengths = _derived()[run["prompt_lengths"]]["prompt_tokens"]["quantiles"]
        return [(1, int(n), 0) for n in lengths]
    return [(int(run.get("requests", 1)), int(run.get("prompt_tokens", 0)), int(run.get("decode_tokens", 0)))]


def _joined(traces: list[Trace]) -> Trace:
    """The traces as one, their requests one after another (request ids renumbered)."""
    if len(traces) == 1:
        return traces[0]
    offset, request = 0, []
    for t in traces:
        request.append(t.request + offset)
        offset += int(t.request.max()) + 1
    first = traces[0]
    return Trace(first.header, np.concatenate(request), np.concatenate([t.position for t in traces]),
                 np.concatenate([t.phase for t in traces]), np.concatenate([t.experts for t in traces]))


def replicate(generate, run: dict, seed: int) -> Trace:
    """One replicate of a study's run: generate(requests, prompt, decode, seed) per call, joined."""
    calls = _lengths(run)
    return _joined([generate(n, p, d, seed * len(calls) + i) for i, (n, p, d) in enumerate(calls)])


def measure(trace: Trace, target: dict) -> list[float]:
    """The target's figures measured on one trace (real or generated), on the target's `layers` if it names some."""
    kind = target["kind"]
    if "layers" in target:
        h = trace.header
        layers = list(target["layers"])
        trace = Trace(TraceHeader(model=h.model, n_layers=len(layers), n_experts=h.n_experts, top_k=h.top_k,
                                  source=h.source, source_sha256=h.source_sha256),
                      trace.request, trace.position, trace.phase, np.ascontiguousarray(trace.experts[:, layers]))
    rows = target.get("protocol", {}).get("rows", "all")
    if kind == "lru":
        return lru_hit_rates(trace, target["capacities"], LruProtocol(**target["protocol"]))["hit_rate"]
    if kind == "reuse_within":
        return reuse_within(trace, target["distances"], rows)["share"]
    if kind == "hot_pairs":
        return hot_pair_coverage(trace, target["fractions"])["share"]
    if kind == "adjacent":  # mean over all layers of the share of a token's experts its predecessor also used
        keep = trace.rows(np.ones(trace.n_rows, bool) if rows == "all" else
                          trace.phase == {"decode": 1, "prefill": 0}[rows])
        hits, pairs = reuse_by_layer(keep.experts, keep.request, keep.phase)
        return [float(hits.sum() / (trace.header.top_k * pairs.sum()))]
    raise InputError("locality target", "kind", kind, f"one of {', '.join(KINDS)}")


def generated_figures(preset: str, name: str, generate=None) -> list[float]:
    """A target's figures on the preset's generated traces: the mean over the run's seeds (each seed an
    independent replicate of the study). `generate(requests, prompt, decode, seed)` defaults to the preset's."""
    target = locality_targets(preset)[name]
    if generate is None:
        def generate(n, p, d, seed):
            return generate_trace(preset, p, d, seed, requests=n)
    run = target["run"]
    traces = [replicate(generate, run, seed) for seed in range(int(run["seeds"]))]
    if run.get("joined"):  # the study measured one long run: the replicates one after another
        traces = [_joined(traces)]
    values = [measure(t, target) for t in traces]
    return [float(x) for x in np.mean(np.array(values, float), axis=0)]


def _sizes(target: dict) -> list:
    for key in ("capacities", "distances", "fractions"):
        if key in target:
            return list(target[key])
    return [None]


def locality_report(preset: str, generate=None) -> list[dict]:
    """Generated vs measured, one row per figure of every locality target of the preset."""
    rows = []
    for name, target in locality_targets(preset).items():
        got = generated_figures(preset, name, generate)
        measured = target["measured"] if isinstance(target["measured"], list) else [target["measured"]]
        for size, real, gen in zip(_sizes(target), measured, got):
            tol = float(target["tolerance"])
            rows.append(dict(preset=preset, target=name, kind=target["kind"], size=size, measured=float(real),
                             generated=gen, error=gen - float(real), tolerance=tol,
                             within=abs(gen - float(real)) <= tol + 1e-12, fit=bool(target.get("fit")),
                             source=target["source"]))
    return rows
