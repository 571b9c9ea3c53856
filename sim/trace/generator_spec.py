"""The generator presets' routing specs: every strength of the generator's mechanisms, with the published
figure it comes from (docs/trace-generator.md has the table; routing-traces.md the sources).

A spec is data: popularity, temporal reuse, working sets (locality), co-activation, cross-layer contexts,
segments and the targets the calibration meets. `GENERATOR_PRESETS` maps a preset name to its spec;
`with_statistics` gives a spec with a user's measured statistics in place of the preset's defaults.
"""

from __future__ import annotations

import copy

from sim.errors import InputError

# ------------------------------------------------------------------------------- published figures

# Qwen3-30B-A3B decode reuse by layer, gajsanders/moe-trace docs/findings/006 (25 prompts, 3,225 decode
# tokens): L0 7.9 %, L6 56.2, L7 59.7, L18 55.6, L31 57.7, L47 20.6 %. As (relative depth, reuse) knots.
# Linear interpolation of these knots averages 0.474 over 48 layers, above the measured layer mean 0.427,
# so presets use the *shape* and rescale it to their own mean.
REUSE_SHAPE_QWEN3 = ((0.0, 0.079), (6 / 47, 0.562), (7 / 47, 0.597), (18 / 47, 0.556), (31 / 47, 0.577),
                     (1.0, 0.206))
REUSE_SHAPE_FLAT = ((0.0, 1.0), (1.0, 1.0))

# Prefill reuse relative to decode: Qwen3-30B-A3B 36.5 vs 41.5 % (gajsanders 005).
PREFILL_OVER_DECODE = 36.5 / 41.5
# How far back a recalled token lies: P(j) ~ j^-exponent for j = 2 .. LAG_MAX_TOKENS. Beyond 256 tokens a
# request's working set, not its recency, decides what recurs (the within-d curves of §6 flatten by d = 64).
LAG_MAX_TOKENS = 256

# Qwen3-30B-A3B's long-range reuse, fitted (traces/fit_generator_locality.py) to kekzl/imp PR #1359's 80 % of
# selections recurring within 8 tokens (3 prompts x 512 decode tokens), the lag law's exponent borrowed from
# the Qwen3.8-Flash-Next fit (a sibling model, decode rows; PR #1359 alone cannot tell the law's shape)
QWEN3_30B_RECALL = dict(prob=0.84, lag=dict(exponent=1.2, max_tokens=LAG_MAX_TOKENS),
                        source="fitted to kekzl/imp PR #1359 (80 % within 8 tokens); exponent from the "
                               "Qwen3.8-Flash-Next fit (QWEN38_REUSE: the same family, decode)")
_FINE_REUSE = dict(decode=0.427, prefill=0.376, shape="qwen3", recall=QWEN3_30B_RECALL,
                   source="Qwen3-30B-A3B: decode mean 42.7 % (gajsanders 006, 25 prompts); prefill/decode "
                          "36.5/41.5 % (gajsanders 005) -> prefill 0.427 x 36.5/41.5 = 0.376; layer shape "
                          "from the 006 per-layer values; recall: QWEN3_30B_RECALL")
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
    "reuse_within_8_decode": dict(
        kind="reuse_within", fit=True, tolerance=0.05,
        run=dict(requests=3, prompt_tokens=0, decode_tokens=512, seeds=2),
        protocol=dict(rows="decode"), distances=[8], measured=[0.80],
        source="kekzl/imp PR #1359: three prompts x 512 decode tokens, 80 % of selections recur within eight tokens "
               "(median reuse distance 2 tokens)"),
    "reuse_next_token_decode": dict(
        kind="reuse_within", tolerance=0.05, run=dict(requests=3, prompt_tokens=0, decode_tokens=512, seeds=2),
        protocol=dict(rows="decode"), distances=[1], measured=[0.45],
        source="kekzl/imp PR #1359: 45 % of selections repeat at the very next token (the preset's adjacent reuse is "
               "gajsanders' 42.7 %, so this is a check)"),
    "lru_shared_pool_256_cold": dict(
        kind="lru", tolerance=0.05, run=dict(requests=1, prompt_tokens=8, decode_tokens=256, seeds=8),
        protocol=dict(rows="all", cold="trace", keys_per_expert=3, pool="shared"),
        capacities=[24 * 48, 73 * 48, 146 * 48, 244 * 48], measured=[0.366, 0.741, 0.894, 0.962],
        source="kekzl/imp PR #1374: Qwen3-30B-A3B, 256 cold decode tokens after an 8-token prompt (--bench-pp 8 "
               "--bench-reps 1), 24 / 73 / 146 / 244 slots per layer of one VRAM-sized pool (routing-traces.md §6), "
               "3 cache keys per expert (73 slots 'is ~3 tokens' of top-8; kekzl/imp expert_cache_sim.py)"),
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


# ------------------------------------------------------------------------------- measured locality (§6)
# A measured curve and how it was measured; sim/trace/generator_targets.py re-measures it on generated traces.
# run: the generated requests that stand for the study's runs (seeds: independent replicates, averaged);
# protocol: its LRU (sim.trace.locality.LruProtocol); fit: the preset's reuse strengths were fitted to it
# (traces/fit_generator_locality.py), otherwise it is a held-out check; tolerance: the allowed |error|.

_DS4_ITER9 = ("lobanov/ds4 @ d978d982 issue468/artifacts/lead08_reassessment/17_iter9_profiler_correction.{md,csv}, "
              "three_family_192 (16_iter8_actual_expert_lru.csv holds the same curve with its 1-256 slot rows)")
_V4_VERIFIER_RUN = dict(requests=3, prompt_tokens=0, decode_tokens=95, seeds=16)

def _fitted_reuse(decode: float, recall_prob: float, lag_exponent: float, recall_fitted_to: str,
                  decode_fitted_to: str) -> dict:
    """Reuse strengths fitted by traces/fit_generator_locality.py: the adjacent reuse of decode (prefill scaled by
    PREFILL_OVER_DECODE, gajsanders 005), the long-range recall and its lag law; Qwen3-30B's layer shape."""
    return dict(decode=decode, prefill=round(decode * PREFILL_OVER_DECODE, 4), shape="qwen3",
                recall=dict(prob=recall_prob, lag=dict(exponent=lag_exponent, max_tokens=LAG_MAX_TOKENS),
                            source=f"fitted to {recall_fitted_to}"),
                source=f"decode fitted to {decode_fitted_to}; prefill = decode x 36.5/41.5 (gajsanders 005); layer shape "
                       "from Qwen3-30B (gajsanders 006)")

V4_FLASH_LOCALITY = {
    "lru_verifier_rows": dict(
        kind="lru", fit=True, tolerance=0.05, run=_V4_VERIFIER_RUN,
        protocol=dict(rows="decode", cold="trace", keys_per_expert=1, pool="layer"),
        capacities=[8, 16, 32, 64, 128], measured=[0.386, 0.573, 0.723, 0.815, 0.879],
        source=_DS4_ITER9 + ": per-layer LRU over the batched verifier's 12,212 layer records = 284 rows x 43 "
               "layers (hash layers included) of 3 prompts x 64 emitted tokens, cold once, the prompts one after "
               "another, prompt rows not recorded; a generated request stands for one prompt's ~95 verifier rows "
               "(draft rows are routed like tokens)"),
    "lru_verifier_rows_all_experts": dict(
        kind="lru", tolerance=0.03, run=_V4_VERIFIER_RUN,
        protocol=dict(rows="decode", cold="trace", keys_per_expert=1, pool="layer"),
        capacities=[256], measured=[0.897],
        source=_DS4_ITER9 + ": the 256-slot row (every expert fits): 1 - 7,555 first uses / 73,272 selections"),
    "adjacent_verifier_rows": dict(
        kind="adjacent", fit=True, tolerance=0.03, run=_V4_VERIFIER_RUN, protocol=dict(rows="decode"),
        measured=0.373, source=_DS4_ITER9 + ": mean adjacent top-6 overlap of the same rows, all 43 layers"),
    "hash_layers_on_real_text": dict(
        kind="reuse_within", fit=True, tolerance=0.03, layers=[0, 1, 2],
        run=dict(prompt_lengths="deepseek-v2-lite", seeds=4), protocol=dict(rows="all"),
        distances=[1, 2, 4, 8, 16, 32, 64], measured=[0.0364, 0.071, 0.1351, 0.2512, 0.413, 0.573, 0.6903],
        source="what a token-id-hashed layer (6 of 256 experts fixed per token) shows on the DeepSeek-V2-Lite "
               "trace's prompt text (traces/derive_deepseek_v2_lite.py: hash_layer_reuse; ngavhane/moe-beyond @ "
               "4dca2eac)"),
}
# DeepSeek V4's reuse strengths, fitted (traces/fit_generator_locality.py) to V4_FLASH_LOCALITY; V4-Pro and
# V4.1-Flash have no measurement of their own and borrow them.
V4_FLASH_REUSE = _fitted_reuse(0.39, 0.8475, 1.3, "V4_FLASH_LOCALITY (lru_verifier_rows, adjacent_verifier_rows)",
                               "V4_FLASH_LOCALITY (adjacent reuse in long requests)")
# The token stream of the hash-routed blocks: a token repeats one of the request's earlier tokens (lag law as
# above, j >= 1), fitted to hash_layers_on_real_text (the exponent at the search's floor: a text repeats its
# earlier tokens almost regardless of how far back); otherwise a fresh draw from the text's rank-frequency law
V4_TOKEN_REPEAT = dict(prob=0.7275, lag=dict(exponent=0.3, max_tokens=LAG_MAX_TOKENS))


def _deepseek(model: str, key: str, hottest_median_v3: float = 6.0) -> dict:
    targets = {
        "hottest_over_uniform": dict(median=6.0, range=(3.2, 13.3),
                                     source="DeepSeek-V3 GPQA, 178 requests (§3.2)"),
        "profile_union": dict(source=f"{key} hotlist: listed experts per layer (derived JSON)"),
        "hash_layers": dict(value="near-uniform; 251-254 of 256 experts in the Flash hotlist",
                            source="ds4 hotlist"),
    }
    if key == "deepseek-v4-flash":
        targets.update(copy.deepcopy(V4_FLASH_LOCALITY))
    return _fine(
        model,
        popularity=dict(kind="derived", key=key, temper_hottest_median=hottest_median_v3,
                        source=f"ds4 hotlist ranks ({key}), per-layer stretched-exponential fit "
                               "(traces/derive_generator_presets.py); the hotlist is one short profile run, so "
                               "its skew is tempered (p^tau, one tau per model) to the long-run DeepSeek-V3 "
                               "median hottest ÷ uniform of 6.0 (max per-layer frequency 1.25-5.19 %, median "
                               "2.36 % of 256, johanna-rock/moe-balance GPQA, §3.2)"),
        reuse=V4_FLASH_REUSE,
        union=dict(chunk="profile_tokens", derived=key,
                   source=f"distinct experts per layer in the {key} hotlist profile run (one request): "
                          "the per-layer listed counts at the run's length"),
        targets=targets,
        hash_layers=[0, 1, 2],
        hash_routing=dict(vocab=129_280, tokens="deepseek-v2-lite", repeat=V4_TOKEN_REPEAT,
                          source="DeepSeek V4 routes blocks 0-2 by token id (tid2eid, a fixed table: here a hash); "
                                 "token ids follow the rank-frequency law of real text under a DeepSeek tokenizer "
                                 "(the DeepSeek-V2-Lite trace's prompts: f(r) ~ r^-0.958, derived JSON) over the "
                                 "129,280-token vocabulary; repeats: V4_TOKEN_REPEAT"),
    )


for _name in ("deepseek-v4-flash-q2", "deepseek-v4-flash-q2-q4", "deepseek-v4-flash-q4"):
    GENERATOR_PRESETS[_name] = _deepseek(_name, "deepseek-v4-flash")
GENERATOR_PRESETS["deepseek-v4-pro"] = _deepseek("deepseek-v4-pro", "deepseek-v4-pro")


def _deepseek_generic(model: str, version: str, n_experts: int) -> dict:
    """A DeepSeek router with no hotlist or heat of its own stored: a generic popularity whose hottest expert is the
    DeepSeek-V3 long-run median's ~6x uniform, and V4-Flash's reuse."""
    return _fine(
        model,
        popularity=dict(kind="generic", beta=0.8, entropy_first=0.89, entropy_mid=0.89, entropy_spread=0.02,
                        source=f"no {version} heat stored: a stretched exponential whose hottest of {n_experts} "
                               "experts is ~6x uniform (entropy 0.89), the DeepSeek-V3 GPQA median (§3.2)"),
        reuse=V4_FLASH_REUSE,
        targets={
            "hottest_over_uniform": dict(median=6.0, range=(3.2, 13.3),
                                         source="DeepSeek-V3 GPQA, 178 requests (§3.2)"),
            "reuse": dict(value="V4_FLASH_REUSE", source="borrowed from DeepSeek-V4-Flash (same router family)"),
        })


# DeepSeek-V4.1-Flash: no hotlist or heat of it is published. Its router is DeepSeek's (sigmoid, top-6, no hash
# layers).
GENERATOR_PRESETS["deepseek-v4.1-flash-q2"] = _deepseek_generic("deepseek-v4.1-flash-q2", "V4.1", 384)
# DeepSeek-V3.2 (its Q8_0 file, validation case L19): the long-run DeepSeek-V3 heat of §3.2 is a measurement of this
# router family (V3.2 keeps V3's router and adds DSA to attention); no V3.2 hotlist or per-layer heat is stored.
GENERATOR_PRESETS["deepseek-v3.2-q8_0"] = _deepseek_generic("deepseek-v3.2-q8_0", "V3.2", 256)
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
# Qwen3.8-Flash-Next: routed mass held by the top-N (layer, expert) pairs of the engine's own expert profile
# (spideytznn/Strata generate.cpp @ 01dee942, quoted in reference/validation-cases.md): 5,805 pairs -> 69.2 %
# (a four-GPU rig, 14.9 M decode lookups); two profiles of ~14.5k pairs -> 89.8 % (14,384) and 92.2 % (14,541);
# 20,000 -> 99.4 %. The two middle profiles are merged into their mean (14,462 -> 91.0 %): as two points 157
# pairs apart they would put a spike of 15x the uniform density in the middle of the ranking.
QWEN38_PROFILE_COVERAGE = ((5805, 0.692), (14384, 0.898), (14541, 0.922), (20000, 0.994))
QWEN38_COVERAGE_POINTS = ((5805, 0.692), (14462, 0.910), (20000, 0.994))
_IMP_2061 = ("kekzl/imp PR #2061 (a 300-token real-text generation of Qwen3.8-Flash-Next-NVFP4, decode-only "
             "diagnostics.moe_expert_trace, replayed by tools/analysis/expert_cache_sim.py @ 6e67989: one LRU per "
             "layer, cold, whose keys are (projection, expert), 3 per selected expert, in one slot budget; the "
             "engine's own counter agrees, 62.7 vs 62.0 %)")
QWEN38_LOCALITY = {
    "lru_300_tokens": dict(
        kind="lru", fit=True, tolerance=0.05, run=dict(requests=1, prompt_tokens=0, decode_tokens=300, seeds=16),
        protocol=dict(rows="decode", cold="trace", keys_per_expert=3, pool="layer"),
        capacities=[93, 186, 279, 372, 512], measured=[0.435, 0.620, 0.720, 0.789, 0.850], source=_IMP_2061),
    "hot_pairs_long_run": dict(
        kind="hot_pairs", tolerance=0.01, run=dict(requests=1, prompt_tokens=0, decode_tokens=20000, seeds=1),
        fractions=[5805 / 24576], measured=[0.692],
        source="the engine's profile (spideytznn generate.cpp @ 01dee942, 14.9 M decode lookups): the hottest 5,805 "
               "of 24,576 pairs (23.6 %) hold 69.2 %; Qwen3-Next-80B-A3B's mbolt heat gives 56.7 % (§6), a lower "
               "bound for the check"),
}
# Qwen3.8-Flash-Next's reuse strengths, fitted (traces/fit_generator_locality.py) to QWEN38_LOCALITY's LRU curve;
# no working sets: the curve is met without them
QWEN38_REUSE = _fitted_reuse(0.2125, 0.7163, 1.2, "QWEN38_LOCALITY (lru_300_tokens)",
                             "QWEN38_LOCALITY (lru_300_tokens)")
GENERATOR_PRESETS["qwen3.8-flash-next-iq3s"] = _fine(
    "qwen3.8-flash-next-iq3s",
    popularity=dict(kind="coverage", points=[list(p) for p in QWEN38_COVERAGE_POINTS],
                    source="the engine's profile coverage (spideytznn generate.cpp @ 01dee942): every layer "
                           "follows the measured curve of routed mass against the number of hottest pairs, "
                           "linear between the points (the pairs of a stretch equally hot); llama.cpp PR #28544 "
                           "saw a flatter 1.3k-token window (98.6 % of slots active, hottest ~2.5x uniform) and "
                           "is kept as a documented disagreement (docs/trace-generator.md)"),
    reuse=QWEN38_REUSE,
    union=False,
    targets={
        "profile_coverage": dict(points=[list(p) for p in QWEN38_PROFILE_COVERAGE],
                                 source="spideytznn generate.cpp @ 01dee942 (validation-cases.md)"),
        "slots_active_1300": dict(value=0.986, source="PR #28544: 98.6 % of 24,576 slots within ~1.3k tokens "
                                                      "(disagrees with the profile's tail: not met)"),
        **copy.deepcopy(QWEN38_LOCALITY),
    })
# Strata's other packs of the same model route the same way (a pack changes the bytes, not the router): they
# share the IQ3_S preset's spec, so its stored calibration and its traces.
for _name in ("qwen3.8-flash-next-q2_0", "qwen3.8-flash-next-iq3xxs", "qwen3.8-flash-next-huihui-iq3s",
              "qwen3.8-flash-next-iq2xs"):
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
        "lru_humaneval_decode": dict(
            kind="lru", tolerance=0.05, run=dict(requests=2, prompt_tokens=0, decode_tokens=169, seeds=8),
            protocol=dict(rows="decode", cold="trace", keys_per_expert=1, pool="layer"),
            capacities=[2, 3, 4, 5, 6], measured=[0.34, 0.48, 0.60, 0.70, 0.80],
            source="routing-traces.md §1 #1 (computed by the project; tests/test_trace_locality.py re-measures the "
                   "stored file): Mario928 humaneval_2_routing.jsonl, decode only, 83 + 255 tokens, one cache per "
                   "layer, cold once; a held-out check (no reuse strength of Mixtral is fitted to it)"),
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
# gpt-oss-20b: nothing of its routing is stored; the same stand-ins as gpt-oss-120b's, with the default working sets
# (_FINE_UNION: fitted on #15346's 512-token ubatch log of gpt-oss-120b).
GENERATOR_PRESETS["gpt-oss-20b"] = _fine(
    "gpt-oss-20b",
    popularity=dict(kind="generic", beta=0.8, entropy_first=0.947, entropy_mid=0.89, entropy_spread=0.02,
                    source="no gpt-oss heat stored: Qwen3-30B-A3B-like (§1 #2 medians, layer 0 flattest)"),
    targets={"reuse_decode_mean": dict(value=0.427, source="borrowed from Qwen3-30B-A3B")})
# Qwen3.6-35B-A3B and GLM-4.7-Flash: nothing of their routing is stored. Stand-ins: Qwen3-30B-A3B's medians for the
# Qwen (a 256-expert sibling), OLMoE's measured popularity and reuse for GLM-4.7-Flash (the other 64-expert model).
GENERATOR_PRESETS["qwen3.6-35b-a3b"] = _fine(
    "qwen3.6-35b-a3b",
    popularity=dict(kind="generic", beta=0.8, entropy_first=0.947, entropy_mid=0.89, entropy_spread=0.02,
                    source="no Qwen3.6 heat stored: Qwen3-30B-A3B-like (§1 #2 medians, layer 0 flattest)"),
    targets={"reuse_decode_mean": dict(value=0.427, source="borrowed from Qwen3-30B-A3B")})
GENERATOR_PRESETS["glm-4.7-flash"] = _fine(
    "glm-4.7-flash",
    popularity=dict(GENERATOR_PRESETS["olmoe-1b-7b"]["popularity"],
                    source="no GLM-4.7-Flash heat stored: OLMoE-1B-7B's (64 experts too), see its preset"),
    reuse=dict(GENERATOR_PRESETS["olmoe-1b-7b"]["reuse"], source="borrowed from OLMoE-1B-7B (colibri route200)"),
    targets={"reuse_decode_mean": dict(value=0.422, source="borrowed from OLMoE-1B-7B")})
# A file's quantisation changes the bytes, not the router: these share their model's spec (its stored calibration and
# its traces), as Strata's packs share the IQ3_S preset's.
for _name, _of in (("qwen3.6-35b-a3b-q8_0", "qwen3.6-35b-a3b"), ("qwen3-30b-a3b-q4_k_m", "qwen3-30b-a3b"),
                   ("qwen3.5-35b-a3b", "qwen3.6-35b-a3b"), ("mixtral-8x7b-q4_k_m", "mixtral-8x7b")):
    GENERATOR_PRESETS[_name] = {**copy.deepcopy(GENERATOR_PRESETS[_of]), "model": _name}
GENERATOR_PRESETS["glm-5.2"]["coactivation"]["partner_prob"] = 0.15
# GLM-5.1's router is GLM-5.2's (one architecture, hardware-and-gguf.md §4): its file routes with GLM-5.2's spec
GENERATOR_PRESETS["glm-5.1-iq3_ks"] = {**copy.deepcopy(GENERATOR_PRESETS["glm-5.2"]), "model": "glm-5.1-iq3_ks"}
_V2_LITE = ("the DeepSeek-V2-Lite-Chat trace of ngavhane/moe-beyond @ 4dca2eac (1,999 teacher-forced prompts, "
            "192,023 tokens; traces/derive_deepseek_v2_lite.py)")
_V2_LITE_RUN = dict(prompt_lengths="deepseek-v2-lite", seeds=8)
V2_LITE_LOCALITY = {
    "reuse_within_prompts": dict(
        kind="reuse_within", fit=True, tolerance=0.05, run=_V2_LITE_RUN, protocol=dict(rows="all"),
        distances=[1, 2, 4, 8, 16, 32, 64], measured=[0.262, 0.365, 0.495, 0.647, 0.787, 0.873, 0.907],
        source="routing-traces.md §6 (re-derived by traces/derive_deepseek_v2_lite.py: the same figures) from "
               + _V2_LITE + "; a generated replicate is one prompt at each of the 32 length quantiles"),
    "adjacent_prompts": dict(
        kind="adjacent", fit=True, tolerance=0.03, run=_V2_LITE_RUN, protocol=dict(rows="all"), measured=0.265,
        source="routing-traces.md §6: adjacent reuse 0.265 (random 0.094), " + _V2_LITE),
    "lru_shared_pool": dict(
        kind="lru", tolerance=0.05, run=dict(_V2_LITE_RUN, joined=True),
        protocol=dict(rows="all", cold="trace", keys_per_expert=1, pool="shared"),
        capacities=[166, 310, 416, 832], measured=[0.263, 0.370, 0.445, 0.704],
        source="routing-traces.md §6: one LRU over all 1,664 (layer, expert) pairs, the prompts one after another, at "
               "10 / 18.6 / 25 / 50 % of the pairs; " + _V2_LITE + "; the generated replicates joined into one run"),
}
# DeepSeek-V2-Lite's reuse strengths, fitted (traces/fit_generator_locality.py) to V2_LITE_LOCALITY
V2_LITE_REUSE = dict(prefill=0.2675, decode=round(0.2675 / PREFILL_OVER_DECODE, 4), shape="derived",
                     shape_key="deepseek-v2-lite",
                     recall=dict(prob=0.4988, lag=dict(exponent=0.925, max_tokens=LAG_MAX_TOKENS),
                                 source="fitted to V2_LITE_LOCALITY (reuse_within_prompts)"),
                     source="prefill fitted to V2_LITE_LOCALITY (adjacent_prompts: the trace is prompt text); "
                            "decode = prefill x 41.5/36.5 (gajsanders 005); layer shape: the trace's per-layer "
                            "adjacent reuse (derived JSON)")
GENERATOR_PRESETS["deepseek-v2-lite"] = _fine(
    "deepseek-v2-lite",
    popularity=dict(kind="derived", key="deepseek-v2-lite",
                    source="per-layer stretched-exponential fit of " + _V2_LITE + " (normalised entropy 0.99)"),
    reuse=V2_LITE_REUSE,
    union=dict(chunk=32, derived="deepseek-v2-lite",
               source="distinct experts per layer in full 32-token chunks of the prompts (46.6-56.9 of 64), "
                      + _V2_LITE),
    targets={"entropy_norm": dict(range=(0.990, 0.998), source=_V2_LITE),
             "coactivation": dict(value="derived JSON: coactivation", source=_V2_LITE),
             **copy.deepcopy(V2_LITE_LOCALITY)})
# its trace's pairs: 14 % of pairs at lift >= 1.5, p99 of those 6.2, largest 10.2 (derived JSON, coactivation); a
# partner probability of 0.25 gives the p99 (0.15 the share, 0.3 the largest: pairs here are groups of two)
GENERATOR_PRESETS["deepseek-v2-lite"]["coactivation"].update(
    partner_prob=0.25, source="fitted by hand to the kept-pair p99 lift of " + _V2_LITE)
# its Q4_K_M file (validation case L06) routes as the model does: the same spec, calibration and derived figures
GENERATOR_PRESETS["deepseek-v2-lite-q4_k_m"] = {**copy.deepcopy(GENERATOR_PRESETS["deepseek-v2-lite"]),
                                               "model": "deepseek-v2-lite-q4_k_m"}



def with_statistics(spec: dict, reuse_decode: float | None = None, reuse_prefill: float | None = None,
                    entropy: float | None = None, where: str = "trace gen") -> dict:
    """A copy of a preset's spec with measured statistics in place of its defaults: the mean adjacent-token
    reuse (the share of a token's experts the previous token also picked, over routed layers) in decode and
    in prefill, and the normalized entropy of the middle layers' popularity (1 = uniform; presets whose
    popularity is fitted to measured heat keep it). The calibration then meets the new targets."""
    out = copy.deepcopy(spec)
    for name, value in (("reuse-decode", reuse_decode), ("reuse-prefill", reuse_prefill)):
        if value is None:
            continue
        if not 0.0 <= value < 0.95:
            raise InputError(where, f"--{name}", value, "a share of the k experts: 0 <= reuse < 0.95")
        out["reuse"][name.split("-")[1]] = float(value)
        out["reuse"]["source"] = f"set by the user (--{name})"
    if entropy is not None:
        popularity = out["popularity"]
        if popularity.get("kind") != "generic":
            fitted = {"derived": "measured heat", "coverage": "the engine's measured profile coverage"}
            raise InputError(where, "--entropy", entropy, f"{spec['model']}'s popularity is fitted to "
                                                          f"{fitted.get(popularity.get('kind'), 'measurements')}; "
                                                          "only presets with a generic popularity take an entropy")
        if not 0.5 <= entropy <= 1.0:
            raise InputError(where, "--entropy", entropy, "a normalized entropy: 0.5 <= entropy <= 1")
        popularity["entropy_mid"] = float(entropy)
        popularity["entropy_first"] = max(float(entropy), popularity["entropy_first"])
        popularity["source"] = "set by the user (--entropy)"
    return out
