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

import copy
import functools
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numba as nb
import numpy as np

from sim.errors import InputError
from sim.trace.format import PHASE_DECODE, PHASE_PREFILL, Trace, TraceHeader
from sim.trace.stats import prefill_union_by_layer, reuse_by_layer
from sim.units import GIB

DERIVED_PATH = Path(__file__).with_name("generator_presets.json")
SOURCE = "expertsim synthetic generator (sim/trace/generate.py)"
MAX_TRACE_BYTES = 4 << 30  # experts array of one generated trace
MAX_ROWS = 50_000_000

# ------------------------------------------------------------------------------- published figures

# Qwen3-30B-A3B decode reuse by layer, gajsanders/moe-trace docs/findings/006 (25 prompts, 3,225 decode
# tokens): L0 7.9 %, L6 56.2, L7 59.7, L18 55.6, L31 57.7, L47 20.6 %. As (relative depth, reuse) knots.
# Linear interpolation of these knots averages 0.474 over 48 layers, above the measured layer mean 0.427,
# so presets use the *shape* and rescale it to their own mean.
REUSE_SHAPE_QWEN3 = ((0.0, 0.079), (6 / 47, 0.562), (7 / 47, 0.597), (18 / 47, 0.556), (31 / 47, 0.577),
                     (1.0, 0.206))
REUSE_SHAPE_FLAT = ((0.0, 1.0), (1.0, 1.0))

_FINE_REUSE = dict(decode=0.427, prefill=0.376, shape="qwen3",
                   source="Qwen3-30B-A3B: decode mean 42.7 % (gajsanders 006, 25 prompts); prefill/decode "
                          "36.5/41.5 % (gajsanders 005) -> prefill 0.427 x 36.5/41.5 = 0.376; layer shape "
                          "from the 006 per-layer values")
_FINE_UNION = dict(chunk=512, ratio=0.69, ratio_first=0.78,
                   source="a 512-token ubatch touched 72-95 (median ~84) of 128 experts per layer (llama.cpp "
                          "PR #15346, slaren; blk 0: 95) where independent draws from Qwen3-30B-A3B heat "
                          "predict 111-126 (median 122): ratio 84/122 = 0.69, first layer 95/122 = 0.78")
_COACT = dict(group_size_frac=1 / 32, partner_prob=0.3,
              source="mbolt within-layer pairs: lift up to ~35-800, kept pairs (lift >= 1.5) 17-25 % of all "
                     "pairs on Qwen3-30B-A3B; GLM-5.2 top pair co-fires on 7.5 % of tokens at lift 5.1, "
                     "p99 lift ~15 (colibri #119)")
_CROSS = dict(contexts=4, stick=0.0, boost_first=6.0, boost_last=50.0,
              source="OLMoE rank-aligned MI 3 % (layers 0->7) to 6-8 % (7->15) of the entropy (allenai/OLMoE "
                     "counts, routing-traces.md §1 #3); adjacent-layer Jaccard 0.017 vs 0.016 shuffle (mbolt). "
                     "Boosts chosen by hand: they give 2-4 % all-pairs MI without moving reuse or skew")
_SEGMENT = dict(mean_tokens=256, drift=0.05,
                source="no measurement: a request's working set drifts slowly (5 % of the tilt variance "
                       "replaced every ~256 tokens) so that very long requests do not freeze one hot set")


# How a request's working set is drawn (see the module docstring); the set size is calibrated per layer.
_WORKING_SET = dict(tilt_sigma=0.5, popularity_preference=0.5, own_share=0.5, leak=0.0)


def _fine(model: str, popularity: dict, targets: dict, reuse=None, union=None, **extra) -> dict:
    locality = copy.deepcopy(_FINE_UNION) if union is None else (copy.deepcopy(union) or None)
    if locality:
        locality = {**_WORKING_SET, **locality}
    spec = dict(model=model, popularity=popularity, reuse=copy.deepcopy(reuse or _FINE_REUSE),
                locality=locality,
                coactivation=copy.deepcopy(_COACT), cross_layer=copy.deepcopy(_CROSS),
                segments=copy.deepcopy(_SEGMENT), targets=targets)
    spec.update(extra)
    return spec


_QWEN3_30B_TARGETS = {
    "entropy_norm": dict(min=0.868, median=0.888, max=0.947, source="mbolt heat, routing-traces.md §1 #2"),
    "top_k_share": dict(min=0.16, median=0.25, max=0.31, source="§1 #2"),
    "hottest_over_uniform": dict(min=3.1, median=5.7, max=7.7, source="§1 #2"),
    "gini": dict(min=0.39, median=0.56, max=0.61, source="§1 #2"),
    "reuse_decode_mean": dict(value=0.427, band=(0.36, 0.43), source="gajsanders 006 / 005"),
    "reuse_prefill_mean": dict(value=0.376, source="gajsanders 005 (36.5 vs 41.5 %)"),
    "reuse_layers": dict(first=0.079, middle=(0.55, 0.60), last=0.206, source="gajsanders 006"),
    "union_512": dict(min=72, max=95, independent=(111, 126), source="PR #15346; §3.3 (computed)"),
    "coactivation": dict(kept_pairs_share=(0.17, 0.25), top_lift="~35 (layer 0)", source="mbolt pairs"),
}
_QWEN3_NEXT_TARGETS = {
    "entropy_norm": dict(min=0.908, median=0.929, max=0.971, source="mbolt heat, routing-traces.md §1 #2"),
    "top_k_share": dict(min=0.06, median=0.09, max=0.14, source="§1 #2"),
    "hottest_over_uniform": dict(min=4.0, median=6.5, max=12.8, source="§1 #2"),
    "gini": dict(min=0.32, median=0.51, max=0.57, source="§1 #2"),
    "reuse_decode_mean": dict(value=0.427, source="borrowed from Qwen3-30B-A3B (no Next measurement)"),
    "union_512": dict(ratio_to_independent=0.69, source="borrowed from Qwen3-30B-A3B (PR #15346)"),
}

GENERATOR_PRESETS: dict[str, dict] = {}


def _deepseek(model: str, key: str, hottest_median_v3: float = 6.0) -> dict:
    return _fine(
        model,
        popularity=dict(kind="derived", key=key, temper_hottest_median=hottest_median_v3,
                        source=f"ds4 hotlist ranks ({key}), per-layer stretched-exponential fit "
                               "(traces/derive_generator_presets.py); the hotlist is one short profile run, so "
                               "its skew is tempered (p^tau, one tau per model) to the long-run DeepSeek-V3 "
                               "median hottest ÷ uniform of 6.0 (max per-layer frequency 1.25-5.19 %, median "
                               "2.36 % of 256, johanna-rock/moe-balance GPQA, §3.2)"),
        union=dict(chunk="profile_tokens", derived=key,
                   source=f"distinct experts per layer in the {key} hotlist profile run (one request): "
                          "the per-layer listed counts at the run's length"),
        targets={
            "hottest_over_uniform": dict(median=6.0, range=(3.2, 13.3),
                                         source="DeepSeek-V3 GPQA, 178 requests (§3.2)"),
            "reuse_decode_mean": dict(value=0.427, source="borrowed from Qwen3-30B-A3B; hash layers excluded"),
            "profile_union": dict(source=f"{key} hotlist: listed experts per layer (derived JSON)"),
            "hash_layers": dict(value="near-uniform; 251-254 of 256 experts in the Flash hotlist",
                                source="ds4 hotlist"),
        },
        hash_layers=[0, 1, 2],
        hash_routing=dict(vocab=129_280, zipf_exponent=1.0, zipf_offset=2.7,
                          source="DeepSeek V4 routes blocks 0-2 by token id (tid2eid); token ids Zipf(1.0) "
                                 "over the 129,280-token vocabulary, our choice"),
    )


for _name in ("deepseek-v4-flash-q2", "deepseek-v4-flash-q2-q4", "deepseek-v4-flash-q4"):
    GENERATOR_PRESETS[_name] = _deepseek(_name, "deepseek-v4-flash")
GENERATOR_PRESETS["deepseek-v4-pro"] = _deepseek("deepseek-v4-pro", "deepseek-v4-pro")
GENERATOR_PRESETS["qwen3-30b-a3b"] = _fine(
    "qwen3-30b-a3b",
    popularity=dict(kind="derived", key="qwen3-30b-a3b",
                    source="mbolt heat (75,773 decode tokens), per-layer stretched-exponential fit"),
    targets=_QWEN3_30B_TARGETS)
GENERATOR_PRESETS["qwen3-next-80b-a3b"] = _fine(
    "qwen3-next-80b-a3b",
    popularity=dict(kind="derived", key="qwen3-next-80b-a3b",
                    source="mbolt heat (24,963 decode tokens), per-layer stretched-exponential fit"),
    targets=_QWEN3_NEXT_TARGETS)
GENERATOR_PRESETS["qwen3.8-flash-next-iq3s"] = _fine(
    "qwen3.8-flash-next-iq3s",
    popularity=dict(kind="generic", beta=0.8, entropy_first=0.997, entropy_mid=0.992, entropy_spread=0.002,
                    source="llama.cpp PR #28544: hottest slot only ~2.5x uniform within ~1.3k tokens, 'no "
                           "exploitable hot set'; reuse bursts alone lift a 1.3k-token window's hottest slot "
                           "to ~3x, so the long-run skew is set low (hottest ~2x uniform)"),
    union=False,
    targets={
        "slots_active_1300": dict(value=0.986, band=(0.95, 1.0), source="PR #28544: 98.6 % of 24,576 slots "
                                                                       "within ~1.3k tokens"),
        "hottest_over_uniform": dict(value=2.5, source="PR #28544 (hottest slot over all slots)"),
        "reuse_decode_mean": dict(value=0.427, source="borrowed from Qwen3-30B-A3B"),
    })
# Strata's other packs of the same model route the same way (a pack changes the bytes, not the router): they
# share the IQ3_S preset's spec, so its stored calibration and its traces.
for _name in ("qwen3.8-flash-next-q2_0", "qwen3.8-flash-next-iq3xxs", "qwen3.8-flash-next-huihui-iq3s"):
    GENERATOR_PRESETS[_name] = {**copy.deepcopy(GENERATOR_PRESETS["qwen3.8-flash-next-iq3s"]), "model": _name}
GENERATOR_PRESETS["mixtral-8x7b"] = _fine(
    "mixtral-8x7b",
    popularity=dict(kind="generic", beta=1.0, entropy_first=0.995, entropy_mid=0.985, entropy_spread=0.01,
                    source="Mario928 Mixtral files: per-layer normalised entropy 0.92-1.00 (mean 0.98), top "
                           "share 0.14-0.24; allenai/OLMoE Mixtral counts 0.98-1.00 (§1 #1, #3)"),
    reuse=dict(decode=0.372, prefill=0.39, shape="flat",
               source="Mario928 files (computed): decode 0.399 HumanEval / 0.344 GSM8K (mean 0.372); "
                      "HumanEval/0 raw prefill 0.390"),
    union=False,
    targets={
        "reuse_decode_mean": dict(value=0.372, band=(0.34, 0.40), source="Mario928 files (§1 #1)"),
        "entropy_norm": dict(min=0.92, mean=0.98, max=1.0, source="Mario928 files (§1 #1)"),
        "top_k_share": dict(min=0.27, max=0.31, source="OLMoE repo Mixtral counts, top-2 (§1 #3)"),
    })
GENERATOR_PRESETS["mixtral-8x7b"]["coactivation"]["partner_prob"] = 0.0
GENERATOR_PRESETS["olmoe-1b-7b"] = _fine(
    "olmoe-1b-7b",
    popularity=dict(kind="generic", beta=0.9, entropy_first=0.97, entropy_mid=0.93, entropy_spread=0.03,
                    source="allenai/OLMoE counts, layers 0/7/15: normalised entropy 0.83-0.99 by domain "
                           "(c4 0.99/0.98/0.97 ... wikipedia 0.94/0.91/0.83), hottest 2.5-7.8x (§1 #3); the "
                           "middle of that range, which also gives the 8-token window coverage below"),
    reuse=dict(decode=0.422, prefill=0.361, shape="qwen3",
               source="colibri route200 replay: 40.3 % all rows, 42.2 % decode (91 prompt + 198 decode rows -> "
                      "prefill 0.361); Tejas3023 teacher-forced WikiText 35.8 %"),
    union=False,
    targets={
        "window8_coverage": dict(value=0.755, source="Tejas3023 Day_5_to_10_Progress.md: the previous 8 tokens "
                                                     "cover 75.5 % (6.04 of 8) of a token's experts; met "
                                                     "without request working sets, so none are used"),
        "reuse_all_rows": dict(value=0.403, source="colibri policy_replay_route200.json"),
        "reuse_decode_mean": dict(value=0.422, source="colibri"),
        "entropy_norm": dict(range=(0.83, 0.99), source="allenai/OLMoE counts (§1 #3)"),
        "hottest_over_uniform": dict(range=(2.5, 7.8), source="§1 #3"),
    })
GENERATOR_PRESETS["glm-5.2"] = _fine(
    "glm-5.2",
    popularity=dict(kind="generic", beta=0.8, entropy_first=0.947, entropy_mid=0.89, entropy_spread=0.02,
                    source="no GLM-5.2 heat stored: Qwen3-30B-A3B-like (§1 #2 medians, layer 0 flattest)"),
    targets={
        "coactivation": dict(top_pair_cofire=0.075, top_pair_lift=5.1, p99_lift=15,
                             source="mbolt GLM-5.2 overlay via colibri #119 (§1 #2)"),
        "reuse_decode_mean": dict(value=0.427, source="borrowed from Qwen3-30B-A3B"),
    })
GENERATOR_PRESETS["gpt-oss-120b"] = _fine(
    "gpt-oss-120b",
    popularity=dict(kind="generic", beta=0.8, entropy_first=0.947, entropy_mid=0.89, entropy_spread=0.02,
                    source="no gpt-oss heat stored: Qwen3-30B-A3B-like (§1 #2 medians, layer 0 flattest)"),
    union=dict(chunk=512, absolute_first=[95, 91, 72, 74, 73, 78, 87, 95], absolute_rest=83,
               source="llama.cpp PR #15346 (slaren): one 512-token ubatch of code, blk 0-7 touched "
                      "95/91/72/74/73/78/87/95 of 128 (thread about gpt-oss-120b); later layers: their mean 83"),
    targets={
        "union_512": dict(min=72, max=95, source="PR #15346"),
        "reuse_decode_mean": dict(value=0.427, source="borrowed from Qwen3-30B-A3B"),
    })
GENERATOR_PRESETS["glm-5.2"]["coactivation"]["partner_prob"] = 0.15


# --------------------------------------------------------------------------------------- geometry


@dataclass(frozen=True)
class _Geometry:
    n_layers: int
    n_experts: int
    top_k: int


_FALLBACK_GEOMETRY = {  # routed layers (no MTP) x experts, top-k; used only without sim.model.presets
    "deepseek-v4-flash-q2": (43, 256, 6), "deepseek-v4-flash-q2-q4": (43, 256, 6),
    "deepseek-v4-flash-q4": (43, 256, 6), "deepseek-v4-pro": (61, 384, 6),
    "qwen3.8-flash-next-iq3s": (48, 512, 10), "qwen3-30b-a3b": (48, 128, 8), "qwen3-next-80b-a3b": (48, 512, 10),
    "mixtral-8x7b": (32, 8, 2), "olmoe-1b-7b": (16, 64, 8), "glm-5.2": (75, 256, 8), "gpt-oss-120b": (36, 128, 4),
}


def _geometry(model: str) -> _Geometry:
    try:
        from sim.model.presets import get_preset
    except ImportError:  # pragma: no cover - presets ship with the package
        return _Geometry(*_FALLBACK_GEOMETRY[model])
    layout = get_preset(model)
    return _Geometry(layout.n_routed_layers, layout.n_experts, layout.top_k)


@functools.lru_cache(maxsize=1)
def _derived() -> dict:
    return json.loads(DERIVED_PATH.read_text())


def _model_seed(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


# --------------------------------------------------------------------------------------- popularity


def _stretched_exp(e: int, beta: float, r0_frac: float) -> np.ndarray:
    r = np.arange(e, dtype=float)
    w = np.exp(-((r / (r0_frac * e)) ** beta))
    return w / w.sum()


def _r0_for_entropy(e: int, beta: float, target: float) -> float:
    lo, hi = math.log(1e-4), math.log(1e3)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        p = _stretched_exp(e, beta, math.exp(mid))
        ent = float(-(p * np.log(p)).sum() / math.log(e))
        lo, hi = (mid, hi) if ent < target else (lo, mid)
    return math.exp(0.5 * (lo + hi))


def _rank_popularity(spec: dict, geo: _Geometry, hash_layers: set[int], seed: int) -> tuple[np.ndarray, dict]:
    """[layers, n_experts] popularity by rank (descending), plus the per-layer parameters used."""
    pop = spec["popularity"]
    n, e = geo.n_layers, geo.n_experts
    beta = np.full(n, np.nan)
    r0 = np.full(n, np.nan)
    if pop["kind"] == "derived":
        d = _derived()[pop["key"]]
        if d["n_layers"] != n or d["n_experts"] != e:
            raise InputError("generator preset", "popularity.key", pop["key"],
                             f"derived figures are for {d['n_layers']}x{d['n_experts']}, model is {n}x{e}")
        for layer in range(n):
            if layer in hash_layers:
                continue
            beta[layer] = d["popularity"]["beta"][layer]
            r0[layer] = d["popularity"]["r0_frac"][layer]
        tau = 1.0
        if "temper_hottest_median" in pop:
            routed = [x for x in range(n) if x not in hash_layers]
            target = pop["temper_hottest_median"]

            def hottest_median(t):
                return float(np.median([_stretched_exp(e, beta[x], r0[x] * t ** (-1 / beta[x]))[0] * e
                                        for x in routed]))
            lo, hi = 0.01, 1.0
            for _ in range(50):
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if hottest_median(mid) < target else (lo, mid)
            tau = 0.5 * (lo + hi)
            for x in routed:  # p^tau of a stretched exponential is one with r0 * tau^(-1/beta)
                r0[x] = r0[x] * tau ** (-1 / beta[x])
        used = dict(tau=round(tau, 4))
    elif pop["kind"] == "generic":
        rng = np.random.default_rng(seed ^ 0x5EED)
        targets = np.full(n, pop["entropy_mid"]) + rng.uniform(-1, 1, n) * pop["entropy_spread"]
        targets[0] = pop["entropy_first"]
        if n > 2:
            targets[1] = 0.5 * (pop["entropy_first"] + targets[1])
        targets = np.minimum(targets, 0.9995)
        beta[:] = pop["beta"]
        for layer in range(n):
            r0[layer] = _r0_for_entropy(e, pop["beta"], float(targets[layer]))
        used = dict(entropy_targets=[round(float(x), 4) for x in targets])
    else:
        raise InputError("generator preset", "popularity.kind", pop["kind"], "must be 'derived' or 'generic'")
    p = np.full((n, e), 1.0 / e)
    for layer in range(n):
        if not math.isnan(beta[layer]):
            p[layer] = _stretched_exp(e, float(beta[layer]), float(r0[layer]))
    used.update(beta=[None if math.isnan(x) else round(float(x), 4) for x in beta],
                r0_frac=[None if math.isnan(x) else round(float(x), 5) for x in r0])
    return p, used


def _inclusion(u: np.ndarray, k: int, lam: np.ndarray | None = None, steps: int = 40):
    """Inclusion probabilities of k picks without replacement with weights u (last axis), by the
    exponential-clock approximation pi_e = 1 - exp(-lam u_e) with sum pi = k. Returns (pi, lam)."""
    u = u / u.sum(axis=-1, keepdims=True)
    if lam is None:
        lam = np.full(u.shape[:-1] + (1,), float(k))
    for _ in range(steps):
        ex = np.exp(-lam * u)
        f = (1 - ex).sum(-1, keepdims=True) - k
        df = (u * ex).sum(-1, keepdims=True)
        lam = np.maximum(lam - f / np.maximum(df, 1e-300), 1e-9)
    return 1 - np.exp(-lam * u), lam


# --------------------------------------------------------------------------------------- kernel


@nb.njit(inline="always")
def _next(st):
    st[0] += np.uint64(0x9E3779B97F4A7C15)
    z = st[0]
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@nb.njit(inline="always")
def _rand(st):
    return (_next(st) >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@nb.njit(inline="always")
def _normal(st):
    u1 = _rand(st)
    while u1 <= 1e-300:
        u1 = _rand(st)
    u2 = _rand(st)
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


@nb.njit(inline="always")
def _mix(x):
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@nb.njit(inline="always")
def _search(cum, x):
    lo = 0
    hi = cum.shape[0] - 1
    while lo < hi:
        mid = (lo + hi) >> 1
        if cum[mid] > x:
            hi = mid
        else:
            lo = mid + 1
    return lo


@nb.njit(inline="always")
def _pick(x, n, sel, srt, stamp, mark):
    """Append expert x to the n picks: sel in pick order, srt kept ascending, x stamped; returns n + 1."""
    sel[n] = x
    stamp[x] = mark
    i = n - 1
    while i >= 0 and srt[i] > x:
        srt[i + 1] = srt[i]
        i -= 1
    srt[i + 1] = x
    return n + 1


@nb.njit(cache=True)
def _build_cum(cum, w, sigma, thr, leak, local, eta, zg, zi, group_of, ctx_of, kappa, n_ctx, layer):
    e_n = w.shape[1]
    a = math.sqrt(1.0 - eta * eta)
    for c in range(n_ctx):
        acc = 0.0
        for e in range(e_n):
            u = w[layer, e]
            inside = True
            if local[layer]:
                z = a * zg[layer, group_of[layer, e]] + eta * zi[layer, e]
                if z <= thr[layer, e]:
                    u *= leak  # outside the request's working set: a small, untilted weight
                    inside = False
                else:
                    u *= math.exp(sigma[layer] * z)
            if inside and n_ctx > 1 and ctx_of[layer, e] == c:
                u *= kappa[layer]
            acc += u
            cum[layer, c, e] = acc


@nb.njit(cache=True, nogil=True)  # nogil: independent requests can be generated on several cores
def _kernel(seed, n_req, prompt, decode, k, w, sigma, thr, leak, local, eta, group_of, members, gstart, n_groups,
            ctx_of, n_ctx, kappa, stick, rho, partner, seg_p, drift, is_hash, vocab_cum, hash_seed):
    n_layers, e_n = w.shape
    steps = prompt + decode
    rows = n_req * steps
    out = np.empty((rows, n_layers, k), np.uint16)
    st = np.empty(1, np.uint64)
    st[0] = np.uint64(seed) * np.uint64(0xD1B54A32D192ED03) + np.uint64(0x2545F4914F6CDD1D)
    max_g = 1
    for layer in range(n_layers):
        if n_groups[layer] > max_g:
            max_g = n_groups[layer]
    zg = np.zeros((n_layers, max_g))
    zi = np.zeros((n_layers, e_n))
    cum = np.zeros((n_layers, n_ctx, e_n))
    prev = np.zeros((n_layers, k), np.int64)
    sel = np.zeros(k, np.int64)
    srt = np.zeros(k, np.int64)  # the picks of the current (token, layer) in ascending id order
    # stamp[e] == mark: e is already picked for the current (token, layer); one O(1) test instead of a scan
    stamp = np.zeros(e_n, np.int64)
    mark = 0
    mate_weight = np.zeros(members.shape[1])  # group mates' current weights, 0 once picked
    any_hash = False
    for layer in range(n_layers):
        if is_hash[layer]:
            any_hash = True
    keep_d = math.sqrt(1.0 - drift)
    add_d = math.sqrt(drift)
    row = 0
    for r in range(n_req):
        for layer in range(n_layers):
            if is_hash[layer]:
                continue
            for g in range(n_groups[layer]):
                zg[layer, g] = _normal(st)
            for e in range(e_n):
                zi[layer, e] = _normal(st)
            _build_cum(cum, w, sigma, thr, leak, local, eta, zg, zi, group_of, ctx_of, kappa, n_ctx, layer)
        ctx = 0
        for t in range(steps):
            ph = 0 if t < prompt else 1
            if t > 0 and seg_p > 0.0 and _rand(st) < seg_p:
                for layer in range(n_layers):
                    if is_hash[layer] or not local[layer]:
                        continue
                    for g in range(n_groups[layer]):
                        zg[layer, g] = keep_d * zg[layer, g] + add_d * _normal(st)
                    for e in range(e_n):
                        zi[layer, e] = keep_d * zi[layer, e] + add_d * _normal(st)
                    _build_cum(cum, w, sigma, thr, leak, local, eta, zg, zi, group_of, ctx_of, kappa, n_ctx, layer)
            if n_ctx > 1 and (t == 0 or _rand(st) >= stick):
                ctx = int(_rand(st) * n_ctx)
            tid = 0
            if any_hash:
                tid = _search(vocab_cum, _rand(st) * vocab_cum[vocab_cum.shape[0] - 1])
            for layer in range(n_layers):
                n = 0
                mark += 1
                removed = 0.0  # the summed weights of the picks so far, in pick order
                if is_hash[layer]:
                    attempt = 0
                    while n < k:
                        h = _mix(hash_seed ^ (np.uint64(layer) << np.uint64(40)) ^ (np.uint64(tid) << np.uint64(8))
                                 ^ np.uint64(attempt))
                        attempt += 1
                        x = int(h % np.uint64(e_n))
                        dup = False
                        for j in range(n):
                            if sel[j] == x:
                                dup = True
                                break
                        if not dup:
                            sel[n] = x
                            n += 1
                else:
                    c = cum[layer, ctx]
                    total = c[e_n - 1]
                    if t > 0:
                        p_keep = rho[ph, layer]
                        for j in range(k):
                            if _rand(st) < p_keep:
                                n = _pick(prev[layer, j], n, sel, srt, stamp, mark)
                                removed += c[sel[n - 1]] - (c[sel[n - 1] - 1] if sel[n - 1] > 0 else 0.0)
                    while n < k:
                        x = -1
                        if n > 0 and partner[layer] > 0.0 and _rand(st) < partner[layer]:
                            a = sel[int(_rand(st) * n)]
                            g = group_of[layer, a]
                            s0 = gstart[layer, g]
                            size = gstart[layer, g + 1] - s0
                            if size > 1:
                                # a group mate not yet picked, by its current weight (so the working
                                # set and the token's context still apply)
                                tot = 0.0
                                for i in range(size):
                                    y = members[layer, s0 + i]
                                    mate_weight[i] = c[y] - (c[y - 1] if y > 0 else 0.0)
                                    if stamp[y] == mark:
                                        mate_weight[i] = -1.0  # already picked
                                    if mate_weight[i] >= 0.0:
                                        tot += mate_weight[i]
                                if tot > 0.0:
                                    pick = _rand(st) * tot
                                    for i in range(size):
                                        if mate_weight[i] < 0.0:
                                            continue
                                        x = members[layer, s0 + i]
                                        pick -= mate_weight[i]
                                        if pick <= 0.0:
                                            break
                        if x < 0:
                            # an exact draw without replacement: a point of the range with the picked
                            # experts cut out, mapped back onto cum by adding the widths of the cut
                            # intervals below it (picked ids visited in ascending order)
                            left = total - removed
                            if left > total * 1e-9:
                                xx = _rand(st) * left
                                for j in range(n):
                                    y = srt[j]
                                    if (c[y - 1] if y > 0 else 0.0) <= xx:
                                        xx += c[y] - (c[y - 1] if y > 0 else 0.0)
                                    else:
                                        break
                                y = _search(c, xx)
                                if c[y] - (c[y - 1] if y > 0 else 0.0) > 0.0 and stamp[y] != mark:
                                    x = y
                        if x < 0:  # fewer than k experts with weight: take a free id from a random start
                            y = int(_rand(st) * e_n)
                            while stamp[y] == mark:
                                y = (y + 1) % e_n
                            x = y
                        n = _pick(x, n, sel, srt, stamp, mark)
                        removed += c[x] - (c[x - 1] if x > 0 else 0.0)
                for j in range(k):
                    prev[layer, j] = sel[j]
                    out[row, layer, j] = sel[j]
            row += 1
    return out


# --------------------------------------------------------------------------------------- model setup


@dataclass
class _Model:
    name: str
    geo: _Geometry
    w: np.ndarray            # [L, E] base weights (corrected so the long-run marginal is q_target / k)
    q_target: np.ndarray     # [L, E] target marginal inclusion per token
    sigma: np.ndarray        # [L] log-normal spread of the request tilt inside the working set
    shift: np.ndarray        # [L] working-set size knob c_l (calibrated): larger = larger set
    pop_pref: float          # lambda: how much more likely popular experts are in a request's set
    leak: float              # weight factor of experts outside the working set
    local: np.ndarray        # [L] bool: layer has request working sets
    eta: float
    group_of: np.ndarray
    members: np.ndarray
    gstart: np.ndarray
    n_groups: np.ndarray
    ctx_of: np.ndarray
    n_ctx: int
    kappa: np.ndarray
    stick: float
    rho: np.ndarray          # [2, L]
    partner: np.ndarray
    seg_p: float
    drift: float
    is_hash: np.ndarray
    vocab_cum: np.ndarray
    hash_seed: int
    calibrated: dict

    @property
    def thr(self) -> np.ndarray:
        """[L, E] threshold: expert e is in a request's working set when its score z exceeds thr."""
        return -_norm_ppf(_membership(self, self.shift))

    def run(self, seed: int, n_req: int, prompt: int, decode: int) -> np.ndarray:
        return _kernel(np.uint64(seed), n_req, prompt, decode, self.geo.top_k, self.w, self.sigma, self.thr,
                       self.leak, self.local, self.eta, self.group_of, self.members, self.gstart, self.n_groups,
                       self.ctx_of, self.n_ctx, self.kappa, self.stick, self.rho, self.partner, self.seg_p,
                       self.drift, self.is_hash, self.vocab_cum, np.uint64(self.hash_seed))


def _interp_shape(knots, n: int) -> np.ndarray:
    xs = np.array([x for x, _ in knots])
    ys = np.array([y for _, y in knots])
    pos = np.linspace(0, 1, n) if n > 1 else np.zeros(1)
    return np.interp(pos, xs, ys)


def _reuse_targets(spec: dict, n: int, hash_layers: set[int]) -> np.ndarray:
    """[2, L] target reuse (prefill, decode); NaN for hash layers."""
    reuse = spec["reuse"]
    shape = _interp_shape(REUSE_SHAPE_QWEN3 if reuse["shape"] == "qwen3" else REUSE_SHAPE_FLAT, n)
    routed = np.array([x not in hash_layers for x in range(n)])
    shape = shape / shape[routed].mean()
    out = np.vstack([shape * reuse["prefill"], shape * reuse["decode"]])
    out[:, ~routed] = np.nan
    return np.clip(out, 0.0, 0.95)


def _union_targets(spec: dict, geo: _Geometry, q_target: np.ndarray, hash_layers: set[int]):
    """(chunk tokens, [L] target distinct experts per layer, NaN = no locality) or None."""
    loc = spec.get("locality")
    if not loc:
        return None
    n = geo.n_layers
    if "derived" in loc:
        d = _derived()[loc["derived"]]
        chunk = int(d["profile_tokens"])
        target = np.array(d["listed_per_layer"], float)
    elif "absolute_first" in loc:
        chunk = int(loc["chunk"])
        target = np.full(n, float(loc["absolute_rest"]))
        first = np.array(loc["absolute_first"], float)[:n]
        target[: first.size] = first
        target *= geo.n_experts / 128.0
    else:
        chunk = int(loc["chunk"])
        pred = (1 - (1 - np.clip(q_target, 0, 1)) ** chunk).sum(1)
        target = pred * loc["ratio"]
        target[0] = pred[0] * loc["ratio_first"]
    for h in hash_layers:
        target[h] = np.nan
    return chunk, target


def _groups(rank_to_expert: np.ndarray, size: int, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Groups of `size` experts of similar popularity: consecutive ranks, lightly shuffled."""
    e = rank_to_expert.size
    order = rank_to_expert.copy()
    if size > 1:
        # swap a few neighbours so groups are not exact rank runs
        jitter = np.argsort(np.arange(e) + rng.uniform(0, size * 1.5, e))
        order = order[jitter]
    n_groups = -(-e // size)
    group_of = np.empty(e, np.int32)
    for g in range(n_groups):
        group_of[order[g * size:(g + 1) * size]] = g
    members = np.argsort(group_of, kind="stable").astype(np.int32)
    gstart = np.searchsorted(group_of[members], np.arange(n_groups + 1)).astype(np.int32)
    return group_of, members, gstart, n_groups


# Bump when the kernel or the calibration changes meaning: stored calibrations then no longer match.
CALIBRATION_VERSION = 1


@functools.lru_cache(maxsize=None)
def _routing_key(name: str) -> str:
    """Everything the generated routing depends on (not the preset's name or its documentation)."""
    spec = GENERATOR_PRESETS[name]

    def strip(x):  # documentation strings do not change the routing
        if isinstance(x, dict):
            return {key: strip(v) for key, v in x.items() if key != "source"}
        return x
    body = strip({key: v for key, v in spec.items() if key not in ("model", "targets")})
    geo = _geometry(spec["model"])
    return json.dumps([CALIBRATION_VERSION, body, geo.n_layers, geo.n_experts, geo.top_k], sort_keys=True)


def routing_key_hash(name: str) -> str:
    return hashlib.sha256(_routing_key(name).encode()).hexdigest()[:16]


def _stored_calibration(key: str) -> dict | None:
    entry = _derived().get("calibration", {}).get(hashlib.sha256(key.encode()).hexdigest()[:16])
    return entry


@functools.lru_cache(maxsize=None)
def _build_cached(key: str, calibrate: bool = False) -> _Model:
    _, body, n_layers, n_experts, top_k = json.loads(key)
    stored = None if calibrate else _stored_calibration(key)
    return _build(body, _Geometry(n_layers, n_experts, top_k), _model_seed(key), stored)


def _model(name: str, calibrate: bool = False) -> _Model:
    """The routing model of a preset: stored calibration when it matches, else calibrated now (seconds)."""
    return _build_cached(_routing_key(name), calibrate)


def calibrate_preset(name: str) -> dict:
    """Run the calibration of a preset from scratch; returns what generator_presets.json stores for it."""
    model = _model(name, calibrate=True)
    c = model.calibrated
    return dict(working_set_shift=c["working_set_shift"], rho_prefill=c["rho_prefill"], rho_decode=c["rho_decode"])


def _build(spec: dict, geo: _Geometry, seed: int, stored: dict | None = None) -> _Model:
    rng = np.random.default_rng(seed)
    n, e, k = geo.n_layers, geo.n_experts, geo.top_k
    hash_layers = set(spec.get("hash_layers", ()))
    is_hash = np.array([x in hash_layers for x in range(n)])
    p_rank, pop_used = _rank_popularity(spec, geo, hash_layers, seed)
    rank_to_expert = np.array([rng.permutation(e) for _ in range(n)])
    p = np.empty((n, e))
    for layer in range(n):
        p[layer, rank_to_expert[layer]] = p_rank[layer]
    q_target = np.minimum(k * p, 0.98)

    co = spec["coactivation"]
    size = max(2, int(round(e * co["group_size_frac"]))) if e >= 16 else 1
    group_of = np.zeros((n, e), np.int32)
    members = np.zeros((n, e), np.int32)
    n_groups = np.zeros(n, np.int64)
    max_g = -(-e // size)
    gstart = np.zeros((n, max_g + 1), np.int32)
    for layer in range(n):
        g_of, mem, gs, ng = _groups(rank_to_expert[layer], size, rng)
        group_of[layer], members[layer], n_groups[layer] = g_of, mem, ng
        gstart[layer, : ng + 1] = gs
    partner = np.where(is_hash, 0.0, co["partner_prob"] if size > 1 else 0.0)

    cross = spec["cross_layer"]
    n_ctx = max(1, min(int(cross["contexts"]), e // 2))
    # Contexts hold whole co-activation groups (so a partner pick stays in the token's context) and have
    # about equal popularity mass: groups are runs of similar rank, dealt out to the contexts in blocks.
    ctx_of = np.zeros((n, e), np.int32)
    for layer in range(n):
        ng = int(n_groups[layer])
        deal = np.concatenate([rng.permutation(n_ctx) for _ in range(-(-ng // n_ctx))])[:ng]
        ctx_of[layer] = deal[group_of[layer]]
    kappa = np.linspace(cross["boost_first"], cross["boost_last"], n)

    seg = spec["segments"]
    hr = spec.get("hash_routing")
    if hr:
        v = np.arange(hr["vocab"], dtype=float)
        vocab_cum = np.cumsum((v + hr["zipf_offset"]) ** -hr["zipf_exponent"])
    else:
        vocab_cum = np.ones(1)

    loc = spec.get("locality") or {}
    reuse_t = _reuse_targets(spec, n, hash_layers)
    union_t = _union_targets(spec, geo, q_target, hash_layers)
    local = np.zeros(n, bool) if union_t is None else ~np.isnan(union_t[1])
    w = -np.log1p(-q_target)  # exponential-clock weights that give inclusion q_target without a tilt
    w /= w.sum(1, keepdims=True)
    model = _Model(spec.get("model", ""), geo, w, q_target,
                   sigma=np.where(local, float(loc.get("tilt_sigma", 0.5)), 0.0), shift=np.zeros(n),
                   pop_pref=float(loc.get("popularity_preference", 0.5)), leak=float(loc.get("leak", 0.0)),
                   local=local, eta=float(loc.get("own_share", 0.5)), group_of=group_of, members=members,
                   gstart=gstart, n_groups=n_groups, ctx_of=ctx_of, n_ctx=n_ctx, kappa=kappa,
                   stick=float(cross["stick"]), rho=np.where(np.isnan(reuse_t), 0.0, reuse_t * 0.8),
                   partner=partner, seg_p=1.0 / seg["mean_tokens"], drift=float(seg["drift"]), is_hash=is_hash,
                   vocab_cum=vocab_cum, hash_seed=seed & 0x7FFF_FFFF_FFFF_FFFF, calibrated={})
    w0 = model.w.copy()
    if stored is None:
        _calibrate(model, reuse_t, union_t)
        origin = "calibrated at run time (no stored calibration matches this preset)"
    else:
        model.shift = np.array(stored["working_set_shift"], float)
        model.rho = np.array([stored["rho_prefill"], stored["rho_decode"]], float)
        origin = "generator_presets.json"
    model.calibrated = dict(
        origin=origin,
        popularity=pop_used,
        working_set_shift=[round(float(x), 4) for x in model.shift],
        rho_prefill=[round(float(x), 4) for x in model.rho[0]],
        rho_decode=[round(float(x), 4) for x in model.rho[1]],
        reuse_target_prefill=[None if math.isnan(x) else round(float(x), 4) for x in reuse_t[0]],
        reuse_target_decode=[None if math.isnan(x) else round(float(x), 4) for x in reuse_t[1]],
        union_target=None if union_t is None else dict(
            chunk_tokens=union_t[0], distinct=[None if math.isnan(x) else round(float(x), 2) for x in union_t[1]]),
        group_size=size, contexts=n_ctx, model_seed=seed)
    # the kernel runs on exactly the recorded (rounded) values; the base weights are then corrected for
    # them with a fixed random stream, the same whether the calibration was stored or just computed
    model.shift = np.array(model.calibrated["working_set_shift"])
    model.rho = np.array([model.calibrated["rho_prefill"], model.calibrated["rho_decode"]])
    model.w = w0
    _correct_marginal(model, _correction_rng(model))
    return model


def _correction_rng(model: _Model):
    return np.random.default_rng([model.hash_seed, 0xC0FFEE])


def _tilt_samples(model: _Model, rng, n_mc: int) -> np.ndarray:
    """[n_mc * contexts, L, E] weight factors of random request working sets times each context's boost."""
    n, e = model.w.shape
    a = math.sqrt(1 - model.eta ** 2)
    zg = rng.standard_normal((n_mc, n, e))
    zi = rng.standard_normal((n_mc, n, e))
    z = a * np.take_along_axis(zg, np.broadcast_to(model.group_of[None].astype(np.int64), zg.shape), 2) \
        + model.eta * zi
    inside = (z > model.thr[None]) | ~model.local[None, :, None]
    tilt = np.where(model.local[None, :, None], np.exp(model.sigma[None, :, None] * z), 1.0)
    if model.n_ctx > 1:
        boost = np.where(model.ctx_of[None] == np.arange(model.n_ctx)[:, None, None], model.kappa[None, :, None], 1.0)
        tilt = tilt[:, None] * boost[None]
        inside = inside[:, None]
    tilt = np.where(inside, tilt, model.leak)
    return tilt.reshape(-1, n, e)


def _correct_marginal(model: _Model, rng, n_mc: int = 16, iters: int = 8) -> None:
    """Adjust base weights so that the mean per-token inclusion over request working sets and token
    contexts equals q_target (routed layers)."""
    fix = ~model.is_hash
    if not fix.any():
        return
    k = model.geo.top_k
    tilt = _tilt_samples(model, rng, n_mc if model.local.any() else 1)
    w = model.w.copy()
    target = np.maximum(model.q_target, 1e-7)
    lam = None
    start = w / w.sum(1, keepdims=True)
    for i in range(iters):
        incl, lam = _inclusion(w[None] * tilt, k, lam, 40 if i == 0 else 8)
        w = np.where(fix[:, None], w * (target / np.maximum(incl.mean(0), 1e-12)) ** 0.9, w)
        w /= w.sum(1, keepdims=True)
        w = np.clip(w, start / 30, start * 30)  # a guard: no expert's weight runs away
    model.w = w


def _pilot_union(model: _Model, chunk: int, n_req: int, seed: int) -> np.ndarray:
    ex = model.run(seed, n_req, chunk, 0)
    req = np.repeat(np.arange(n_req, dtype=np.int32), chunk)
    phase = np.zeros(ex.shape[0], np.uint8)
    mean, _ = prefill_union_by_layer(ex, req, phase, chunk, model.geo.n_experts)
    return mean


def _pilot_reuse(model: _Model, n_req: int, steps: int, seed: int) -> np.ndarray:
    half = steps // 2
    ex = model.run(seed, n_req, half, steps - half)
    req = np.repeat(np.arange(n_req, dtype=np.int32), steps)
    phase = np.tile(np.r_[np.zeros(half, np.uint8), np.ones(steps - half, np.uint8)], n_req)
    hits, pairs = reuse_by_layer(ex, req, phase)
    with np.errstate(invalid="ignore", divide="ignore"):
        return hits / (model.geo.top_k * pairs)


def _calibrate_rho(model: _Model, reuse_t: np.ndarray, rounds: int, seed: int) -> None:
    ok = ~np.isnan(reuse_t)
    for i in range(rounds):
        meas = _pilot_reuse(model, 8, 384, seed + i)
        rho = model.rho
        # measured m = rho + (1 - rho)^2 b: estimate b, then solve for the rho that gives the target
        with np.errstate(invalid="ignore", divide="ignore"):
            b = np.clip((meas - rho) / np.maximum((1 - rho) ** 2, 1e-6), 0.0, 0.95)
            disc = np.maximum(1 - 4 * b * (1 - reuse_t), 0.0)
            y = np.where(b > 1e-6, (1 - np.sqrt(disc)) / (2 * np.maximum(b, 1e-6)), 1 - reuse_t)
            # the baseline overlap alone already exceeds the target: keep nothing on purpose
            y = np.where(b >= reuse_t, 1.0, y)
        new = np.clip(1 - y, 0.0, 0.95)
        model.rho = np.where(ok, new, 0.0)


def _norm_cdf(x: np.ndarray) -> np.ndarray:
    """Standard normal CDF (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7)."""
    z = np.abs(x) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * z)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = 1.0 - poly * np.exp(-z * z)
    return 0.5 * (1.0 + np.sign(x) * erf)


def _norm_ppf(p: np.ndarray) -> np.ndarray:
    """Inverse standard normal CDF (Acklam's rational approximation, relative error < 1.2e-9)."""
    a = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02, 1.383577518672690e+02,
         -3.066479806614716e+01, 2.506628277459239e+00)
    b = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02, 6.680131188771972e+01,
         -1.328068155288572e+01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00, -2.549671010115154e+00,
         4.374664141464968e+00, 2.938163982698783e+00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00, 3.754408661907416e+00)
    p = np.clip(np.asarray(p, float), 1e-12, 1 - 1e-12)

    def tail(q):
        num = ((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]
        return num / ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
    q = p - 0.5
    r = q * q
    mid = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q / (
        ((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)
    low = tail(np.sqrt(-2 * np.log(np.minimum(p, 0.5))))
    high = -tail(np.sqrt(-2 * np.log(np.minimum(1 - p, 0.5))))
    return np.where(p < 0.02425, low, np.where(p > 1 - 0.02425, high, mid))


# An expert's chance to be in a request's working set is at least its long-run inclusion per token over
# this: a set member cannot be picked by more than every token, so a lower chance would force the weight
# correction to make rare members huge.
MAX_INCLUSION_IN_SET = 0.8


def _membership(model: _Model, shift: np.ndarray) -> np.ndarray:
    """[L, E] chance that expert e is in a request's working set: Phi(lambda log(p_e E) + c_l), popular
    experts more often, floored so that the set can carry the expert's long-run inclusion."""
    e = model.geo.n_experts
    pref = model.pop_pref * np.log(np.maximum(model.q_target / model.geo.top_k * e, 1e-12))
    floor = np.minimum(model.q_target / MAX_INCLUSION_IN_SET, 0.999)
    return np.maximum(_norm_cdf(pref + np.asarray(shift, float)[:, None]), floor)


def _shift_for_size(model: _Model, size: np.ndarray) -> np.ndarray:
    """Per-layer shift c_l such that the expected working-set size sum_e membership = size."""
    lo = np.full(model.geo.n_layers, -12.0)
    hi = np.full(model.geo.n_layers, 12.0)
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        small = _membership(model, mid).sum(1) < size
        lo = np.where(small, mid, lo)
        hi = np.where(small, hi, mid)
    return 0.5 * (lo + hi)


def _set_size(model: _Model, size) -> None:
    model.shift = np.where(model.local, _shift_for_size(model, np.broadcast_to(size, model.shift.shape)), 0.0)


def _calibrate(model: _Model, reuse_t: np.ndarray, union_t) -> None:
    """Find each layer's working-set size (from the prefill-union target) and keep probabilities (from the
    reuse target) by pilot runs; the base weights get the marginal correction for the sizes found."""
    seed = 7_777
    w0 = model.w.copy()

    def correct():  # the same random stream as the final correction in _build
        model.w = w0.copy()
        _correct_marginal(model, _correction_rng(model))

    if union_t is None or not model.local.any():
        correct()
        _calibrate_rho(model, reuse_t, 3, seed)
        return
    chunk, target = union_t
    n_req = max(4, min(16, 4096 // chunk))
    e, k = model.geo.n_experts, model.geo.top_k
    n_layers = model.geo.n_layers
    # 1. With uncorrected weights: the union grows with the set size, except for tiny sets, where the k
    #    picks exhaust the set. Scan sizes from the full set down, take the first bracket where the union
    #    falls to the target (or the narrowest point if none does) and refine it by bisection.
    sizes = np.linspace(float(e), min(3.0 * k, float(e)), 12)
    unions = np.empty((sizes.size, n_layers))
    for i, size in enumerate(sizes):
        _set_size(model, size)
        unions[i] = _pilot_union(model, chunk, n_req, seed + i)
    below = unions <= target[None, :]
    first = np.where(below.any(0), below.argmax(0), np.argmin(unions, 0))
    hi = sizes[np.maximum(first - 1, 0)]
    lo = sizes[first]

    def bisect(lo, hi, steps, seed0, corrected):
        for step in range(steps):
            mid = 0.5 * (lo + hi)
            _set_size(model, mid)
            if corrected:
                correct()
            too_wide = _pilot_union(model, chunk, n_req, seed0 + step) > target
            hi = np.where(too_wide, mid, hi)
            lo = np.where(too_wide, lo, mid)
        return 0.5 * (lo + hi)

    size = bisect(lo, hi, 4, seed + 50, corrected=False)
    # 2. Calibrate reuse at that size, then refine the size with the marginal correction redone at every
    #    step (the correction moves the union), and recalibrate reuse for the final size.
    _set_size(model, size)
    correct()
    _calibrate_rho(model, reuse_t, 2, seed + 1000)
    size = bisect(np.maximum(0.6 * size, min(2.0 * k, e)), np.minimum(1.6 * size, e), 6, seed + 2000,
                  corrected=True)
    _set_size(model, size)
    correct()
    _calibrate_rho(model, reuse_t, 2, seed + 3000)


# --------------------------------------------------------------------------------------- entry


def _check_int(field: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InputError("generate_trace", field, value, "must be an integer")
    if value < minimum:
        raise InputError("generate_trace", field, value, f"must be >= {minimum}")
    return int(value)


def generator_preset_names() -> list[str]:
    return sorted(GENERATOR_PRESETS)


def generate_trace(preset: str, prompt_tokens: int, decode_tokens: int, seed: int, requests: int = 1) -> Trace:
    """A synthetic trace of `requests` requests, each `prompt_tokens` prefill then `decode_tokens` decode
    rows, in execution order (request after request). Deterministic in (preset, sizes, seed)."""
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
    geo = _geometry(spec["model"])
    rows = n_req * (prompt + decode)
    size = rows * geo.n_layers * geo.top_k * 2
    if rows > MAX_ROWS or size > MAX_TRACE_BYTES:
        raise InputError("generate_trace", "requests x (prompt_tokens + decode_tokens)", rows,
                         f"too large: {size / GIB:.1f} GiB of expert ids (limit {MAX_TRACE_BYTES >> 30} GiB, "
                         f"{MAX_ROWS} rows)")
    model = _model(preset)
    experts = model.run(seed, n_req, prompt, decode)
    request = np.repeat(np.arange(n_req, dtype=np.int32), prompt + decode)
    position = np.tile(np.arange(prompt + decode, dtype=np.int32), n_req)
    phase = np.tile(np.r_[np.full(prompt, PHASE_PREFILL, np.uint8), np.full(decode, PHASE_DECODE, np.uint8)], n_req)
    params = {key: v for key, v in spec.items() if key != "targets"}
    params["calibrated"] = model.calibrated
    generator = dict(preset=preset, seed=seed, prompt_tokens=prompt, decode_tokens=decode, requests=n_req,
                     parameters=params)
    digest = hashlib.sha256(json.dumps(generator, sort_keys=True).encode()).hexdigest()
    header = TraceHeader(model=spec["model"], n_layers=geo.n_layers, n_experts=geo.n_experts, top_k=geo.top_k,
                         source=SOURCE, source_sha256=digest, generator=generator)
    return Trace(header, request, position, phase, experts)



# A seed no workload draws from: workloads use (scenario seed + request index), so only a scenario seed
# within n_requests of 2**63 - 1 could meet it.
HOTLIST_PROFILE_SEED = 2**63 - 1


def hotlist_profile_tokens(preset: str) -> int | None:
    """Length of the profile run behind the ds4 hotlist this preset's popularity was derived from (299 tokens
    for Flash, generator_presets.json: profile_tokens); None when the preset was not derived from one.

    ds4 ships a popularity list made from one short profile run; its expert ids are the real model's, not
    this generator's. The same experiment on the preset (one prompt this long under HOTLIST_PROFILE_SEED,
    experts ranked by hits) stands in for it on the preset's ids (sim.engine.ds4.builtin_hotlist)."""
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
