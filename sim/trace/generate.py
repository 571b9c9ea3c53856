"""Synthetic routing traces calibrated to measured MoE routing statistics (docs/trace-generator.md).

    generate_trace("qwen3-30b-a3b", prompt_tokens=512, decode_tokens=256, seed=1, requests=4) -> Trace

Not a plain Zipf draw. Per layer, each token picks its k distinct experts from a mixture of mechanisms
whose strengths come from public measurements (routing-traces.md):

  global popularity  p_l(e): per-layer stretched exponential over popularity ranks, fitted to real heat
                     (Qwen3, mbolt) or hotlists (DeepSeek V4, ds4), or set from published ranges; the
                     expert ids of each rank are a fixed per-model permutation (a model's hot experts are
                     the same in every trace, whatever the seed)
  working sets       each request (per layer) draws a score z ~ N(0, 1) per expert, shared in part by its
                     co-activation group; experts whose z beats a threshold (lower for popular experts)
                     form the request's working set and get weight w exp(sigma z); the others get none.
                     Scores drift at random segment boundaries. So a 512-token prompt touches far fewer
                     experts than independent draws from the global heat predict (§3.3). The set size
                     per layer is calibrated to the preset's prefill-union target; the base weights w are
                     corrected (Monte-Carlo over sets and contexts) so the long-run marginal stays p_l
  temporal reuse     each of the previous token's k experts is kept with probability rho_l (per phase),
                     calibrated so that measured adjacent-token reuse matches the per-layer target profile
  co-activation      with probability c a fresh pick is a group mate of an expert already picked
                     (groups: runs of similar popularity), giving within-layer pairs with lift >> 1
  cross-layer        a token's latent context (one of 4, drawn per token, shared by all layers) boosts a
                     context-specific subset of whole groups in every layer by kappa_l (rising with depth):
                     weak cross-layer mutual information (2-4 % of the entropy), adjacent-layer id
                     Jaccard ≈ shuffle
  hash layers        DeepSeek V4 blocks 0-2 route by token id: a fixed hash of a Zipf-distributed token id

The per-token loop is one numba kernel with its own splitmix64 generator, so a (preset, seed, sizes) triple
gives the same trace on every run. The calibration (working-set sizes, keep probabilities) depends only on
the preset; it is stored in generator_presets.json (traces/derive_generator_presets.py --calibrate-only
recomputes it) and recorded in header.generator["parameters"]["calibrated"]. A preset whose routing spec
has no stored calibration is calibrated at first use (seconds).
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from sim.errors import InputError
from sim.trace.format import PHASE_DECODE, PHASE_PREFILL, Trace, TraceHeader, routing_digest
from sim.trace.generator_model import _derived, _geometry, _model, model_of
from sim.trace.generator_spec import GENERATOR_PRESETS, with_statistics
from sim.trace.rowfile import FileRows, RowFile
from sim.units import GIB

SOURCE = "expertsim synthetic generator (sim/trace/generate.py)"
MAX_TRACE_BYTES = 4 << 30  # experts array of one generated trace
MAX_ROWS = 50_000_000

# --------------------------------------------------------------------------------------- entry


def _check_int(field: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InputError("generate_trace", field, value, "must be an integer")
    if value < minimum:
        raise InputError("generate_trace", field, value, f"must be >= {minimum}")
    return int(value)


def generator_preset_names() -> list[str]:
    return sorted(GENERATOR_PRESETS)


def generate_trace(preset: str, prompt_tokens: int, decode_tokens: int, seed: int, requests: int = 1,
                   statistics: dict | None = None, stop=None) -> Trace:
    """A synthetic trace of `requests` requests, each `prompt_tokens` prefill then `decode_tokens` decode
    rows, in execution order (request after request). Deterministic in (preset, statistics, sizes, seed).
    `statistics` (reuse_decode, reuse_prefill, entropy: generator_spec.with_statistics) replace the preset's
    defaults with measured ones; the model is calibrated to them at first use (seconds). `stop`, a
    threading.Event, ends a generation running in a worker thread once set (GenerationStopped)."""
    spec, model, sizes = _checked(preset, prompt_tokens, decode_tokens, seed, requests, statistics)
    return _generated(spec, model, preset, *sizes, statistics, stop)


def generate_prompt_to_file(preset: str, prompt_tokens: int, decode_tokens: int, seed: int,
                            stop=None) -> tuple[FileRows, np.ndarray, str]:
    """generate_trace's one request with its prompt rows written to a temporary file block by block, not held
    (sim.trace.rowfile): the prompt's rows (FileRows), the decode rows and the trace's sha256 (generate_trace's
    own: the same rows hashed in the same order)."""
    spec, model, (prompt, decode, seed, n_req) = _checked(preset, prompt_tokens, decode_tokens, seed, 1, None)
    header, request, position, phase = _layout(spec, model, preset, prompt, decode, seed, n_req)
    digest = routing_digest(header, request, position, phase)
    prompt_file = RowFile((header.n_layers, header.top_k))
    decode_rows = np.empty((decode, header.n_layers, header.top_k), np.uint16)
    for first, rows in model.blocks(seed, n_req, prompt, decode, stop):
        digest.update(rows)
        in_prompt = max(0, min(len(rows), prompt - first))
        prompt_file.append(rows[:in_prompt])
        decode_rows[first + in_prompt - prompt: first + len(rows) - prompt] = rows[in_prompt:]
    return prompt_file.rows(), decode_rows, digest.hexdigest()


def _checked(preset: str, prompt_tokens: int, decode_tokens: int, seed: int, requests: int,
             statistics: dict | None) -> tuple[dict, object, tuple[int, int, int, int]]:
    """The arguments checked: the routing spec, its model, and (prompt, decode, seed, requests)."""
    if not isinstance(preset, str) or preset not in GENERATOR_PRESETS:
        raise InputError("generate_trace", "preset", preset, f"unknown; valid: {', '.join(generator_preset_names())}")
    prompt = _check_int("prompt_tokens", prompt_tokens, 0)
    decode = _check_int("decode_tokens", decode_tokens, 0)
    n_req = _check_int("requests", requests, 1)
    seed = _check_int("seed", seed, 0)
    if seed >= 2**63:
        raise InputError("generate_trace", "seed", seed, "must be < 2**63")
    if prompt + decode == 0:
        raise InputError("generate_trace", "prompt_tokens + decode_tokens", 0, "a request needs at least one token")
    spec = GENERATOR_PRESETS[preset]
    if statistics:
        spec = with_statistics(spec, **statistics)
    model = model_of(spec) if statistics else _model(preset)
    return spec, model, (prompt, decode, seed, n_req)


def trace_of_spec(spec: dict, prompt_tokens: int, decode_tokens: int, seed: int, requests: int = 1) -> Trace:
    """A trace from any routing spec (a preset's with changed strengths, as traces/fit_generator_locality.py tries
    them): calibrated at first use, like a preset without a stored calibration."""
    return _generated(spec, model_of(spec), spec["model"], prompt_tokens, decode_tokens, seed, requests)


def _generated(spec: dict, model, preset: str, prompt: int, decode: int, seed: int, n_req: int,
               statistics: dict | None = None, stop=None) -> Trace:
    header, request, position, phase = _layout(spec, model, preset, prompt, decode, seed, n_req, statistics)
    return Trace(header, request, position, phase, model.run(seed, n_req, prompt, decode, stop))


def _layout(spec: dict, model, preset: str, prompt: int, decode: int, seed: int, n_req: int,
            statistics: dict | None = None) -> tuple[TraceHeader, np.ndarray, np.ndarray, np.ndarray]:
    """A generated trace's header and its row index columns (request, position, phase); its size checked."""
    geo = _geometry(spec["model"])
    rows = n_req * (prompt + decode)
    size = rows * geo.n_layers * geo.top_k * 2
    if rows > MAX_ROWS or size > MAX_TRACE_BYTES:
        raise InputError("generate_trace", "requests x (prompt_tokens + decode_tokens)", rows,
                         f"too large: {size / GIB:.1f} GiB of expert ids (limit {MAX_TRACE_BYTES >> 30} GiB, "
                         f"{MAX_ROWS} rows)")
    request = np.repeat(np.arange(n_req, dtype=np.int32), prompt + decode)
    position = np.tile(np.arange(prompt + decode, dtype=np.int32), n_req)
    phase = np.tile(np.r_[np.full(prompt, PHASE_PREFILL, np.uint8), np.full(decode, PHASE_DECODE, np.uint8)], n_req)
    params = {key: v for key, v in spec.items() if key != "targets"}
    params["calibrated"] = model.calibrated
    generator = dict(preset=preset, seed=seed, prompt_tokens=prompt, decode_tokens=decode, requests=n_req,
                     parameters=params)
    if statistics:
        generator["statistics"] = {k: v for k, v in statistics.items() if v is not None}
    digest = hashlib.sha256(json.dumps(generator, sort_keys=True).encode()).hexdigest()
    header = TraceHeader(model=spec["model"], n_layers=geo.n_layers, n_experts=geo.n_experts, top_k=geo.top_k,
                         source=SOURCE, source_sha256=digest, generator=generator)
    return header, request, position, phase


# A seed no workload draws from: workloads use (scenario seed + request index), so only a scenario seed
# within n_requests of 2**63 - 1 could meet it.
HOTLIST_PROFILE_SEED = 2**63 - 1


def hotlist_profile_tokens(preset: str) -> int | None:
    """Length of the profile run behind the ds4 hotlist this preset's popularity was derived from (299 tokens
    for Flash, generator_presets.json: profile_tokens); None when the preset was not derived from one.

    ds4 ships a popularity list made from one short profile run; its expert ids are the real model's, not
    this generator's. The same experiment on the preset (one prompt this long under HOTLIST_PROFILE_SEED,
    experts ranked by hits) stands in for it on the preset's ids (sim.engines.ds4.prefill.builtin_hotlist)."""
    if preset not in GENERATOR_PRESETS:
        raise InputError("hotlist_profile_tokens", "preset", preset,
                         f"unknown; valid: {', '.join(generator_preset_names())}")
    popularity = GENERATOR_PRESETS[preset].get("popularity", {})
    if popularity.get("kind") != "derived":
        return None
    derived = _derived()[popularity["key"]]
    if "hotlist" not in derived["source"]["path"]:
        return None
    return int(derived["profile_tokens"])

