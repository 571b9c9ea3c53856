"""Derive the compact per-layer figures behind sim/trace/generator_presets.json from the real data.

    python traces/derive_generator_presets.py            # reads ../shared/data, writes the JSON
    python traces/derive_generator_presets.py --check    # recompute and compare with the stored JSON

Inputs (never committed; see ../shared/data/README.md for provenance and licenses):
  mbolt-coactivation/coactivation_qwen3-30b-a3b.json       doramirdor/mbolt @ e7e9dbf770b6b7171f47a42173dfcf01c083d819
  mbolt-coactivation/coactivation_qwen3-next-80b-a3b.json  (same), results/colibri-119/, MIT
  ds4-hotlist/deepseek-v4-flash.csv, deepseek-v4-pro.csv   antirez/ds4 @ 80ebbc396aee40eedc1d829222f3362d10fa4c6c,
                                                           ds4_streaming_hotlist.inc (as CSV), MIT

    python traces/derive_generator_presets.py --calibrate-only   # only redo the generator calibration

Output: only fitted parameters and summary statistics (per-layer numbers rounded to 3-4 digits), no heat
vectors, no pair lists, no rank lists; plus a "calibration" section (working-set sizes and keep
probabilities per preset, found by pilot runs of the generator; no data needed).

Method
------
Popularity family: a stretched exponential over popularity ranks, p(r) ∝ exp(-((r - 1) / r0)^beta),
r = 1..E, fitted per layer by grid search so that normalised entropy, top-k share, top-25 % share,
log(hottest ÷ uniform) and Gini match the layer's measured figures (it fits these five figures to within
~0.01 / 0.02 / 0.03 / 5 % / 0.02 on the Qwen3 heat; a Zipf-Mandelbrot law cannot match the top-k share and
the Gini together).

mbolt (Qwen3): heat[e] is the number of decode tokens that selected expert e; p = heat / sum(heat).

ds4 hotlist (DeepSeek V4): a list of (layer, expert) pairs sorted by profile hits, without the counts.
The pairs of one layer must carry the same total mass as those of any other layer (every token makes k
selections in every layer). We model the common value-of-rank curve v(g) = (g + g0)^-b of the global
rank g and fit (b, g0) so that the per-layer sums sum_{g in layer} v(g) are as equal as possible
(coefficient of variation over layers: 1.8 % Flash, 1.5 % Pro; fits b = 1.00, g0 = 51 and b = 0.90,
g0 = 46). A layer's distribution is then v(g) / sum over its listed pairs, zero for unlisted experts.
Check on Flash: its tail is in tie blocks ordered by (layer, expert), which gives the exact hit counts
1..26 of 86 % of the pairs; the three hash-routed layers sum to exactly 1,794 = 6 x 299 hits each, so
the Flash profile is one 299-token run. (A one-off fit of the same law to the counted tail plus the 40
per-layer totals, made while writing this script, gave b = 0.99, g0 = 47: the rank-only fit agrees.)
For Pro (ties broken by weight, no counts) the profile length is estimated from the hash layers'
distinct-expert counts: ~52 distinct tokens (a uniform hash), which real text holds in its first ~74 tokens
(the DeepSeek-V2-Lite prompts' distinct tokens, sim/trace/generator_deepseek_v2_lite.json).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
OUT = ROOT / "sim" / "trace" / "generator_presets.json"
V2_LITE = ROOT / "sim" / "trace" / "generator_deepseek_v2_lite.json"  # traces/derive_deepseek_v2_lite.py

MBOLT = {
    "qwen3-30b-a3b": "mbolt-coactivation/coactivation_qwen3-30b-a3b.json",
    "qwen3-next-80b-a3b": "mbolt-coactivation/coactivation_qwen3-next-80b-a3b.json",
}
MBOLT_SOURCE = dict(repository="doramirdor/mbolt", commit="e7e9dbf770b6b7171f47a42173dfcf01c083d819",
                    license="MIT")
HOTLIST = {
    "deepseek-v4-flash": ("ds4-hotlist/deepseek-v4-flash.csv", 43, 256, 6),
    "deepseek-v4-pro": ("ds4-hotlist/deepseek-v4-pro.csv", 61, 384, 6),
}
HOTLIST_SOURCE = dict(repository="antirez/ds4", commit="80ebbc396aee40eedc1d829222f3362d10fa4c6c",
                      path="ds4_streaming_hotlist.inc", license="MIT")
HASH_LAYERS = (0, 1, 2)  # DeepSeek V4 routes blocks 0-2 by token-id hash

BETAS = np.round(np.linspace(0.15, 2.5, 95), 4)
R0_FRACS = np.round(np.geomspace(0.002, 4.0, 130), 5)


# ------------------------------------------------------------------------------------------ figures


def popularity_figures(p: np.ndarray, k: int) -> np.ndarray:
    """[entropy_norm, top_k share, top-25 % share, hottest ÷ uniform, gini] of rows of p (sum 1)."""
    p = np.atleast_2d(np.asarray(p, float))
    e = p.shape[1]
    s = -np.sort(-p, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(s > 0, s * np.log(s), 0.0).sum(1) / math.log(e)
    asc = s[:, ::-1]
    gini = ((2 * np.arange(1, e + 1) - e - 1) * asc).sum(1) / e
    return np.stack([ent, s[:, :k].sum(1), s[:, : e // 4].sum(1), s[:, 0] * e, gini], axis=1)


def stretched_exp(e: int, beta: float, r0_frac: float) -> np.ndarray:
    r = np.arange(e, dtype=float)
    w = np.exp(-((r / (r0_frac * e)) ** beta))
    return w / w.sum()


def zipf_exponent(p: np.ndarray) -> float:
    """Slope of log p vs log rank over ranks <= E/2 (routing-traces.md §1 #2 convention)."""
    s = np.sort(p)[::-1][: len(p) // 2]
    s = s[s > 0]
    r = np.arange(1, s.size + 1)
    return float(-np.polyfit(np.log(r), np.log(s), 1)[0])


_GRID_CACHE: dict = {}


def _grid(e: int, k: int):
    if (e, k) not in _GRID_CACHE:
        params = [(b, f) for b in BETAS for f in R0_FRACS]
        dist = np.array([stretched_exp(e, b, f) for b, f in params])
        _GRID_CACHE[(e, k)] = (params, popularity_figures(dist, k))
    return _GRID_CACHE[(e, k)]


def fit_stretched_exp(p: np.ndarray, k: int) -> tuple[float, float, np.ndarray]:
    params, figs = _grid(len(p), k)
    t = popularity_figures(p, k)[0]
    err = (((figs[:, 0] - t[0]) / 0.01) ** 2 + ((figs[:, 1] - t[1]) / 0.02) ** 2
           + ((figs[:, 2] - t[2]) / 0.03) ** 2 + ((np.log(figs[:, 3]) - np.log(t[3])) / 0.1) ** 2
           + ((figs[:, 4] - t[4]) / 0.03) ** 2)
    i = int(np.argmin(err))
    return float(params[i][0]), float(params[i][1]), figs[i]


def independent_union(q: np.ndarray, chunk: int) -> np.ndarray:
    return (1.0 - (1.0 - np.clip(q, 0, 1)) ** chunk).sum(-1)


def spread(values) -> list[float]:
    v = np.asarray(values, float)
    return [round(float(v.min()), 4), round(float(np.median(v)), 4), round(float(v.max()), 4)]


def r(values, digits=4) -> list[float]:
    return [round(float(x), digits) for x in values]


def layer_block(dists: np.ndarray, k: int, fit_layers) -> dict:
    """Fitted parameters and measured figures of each layer's distribution (rows of dists)."""
    beta, r0, fitted = [], [], []
    for layer, p in enumerate(dists):
        if layer in fit_layers:
            b, f, fig = fit_stretched_exp(p, k)
        else:
            b, f, fig = math.nan, math.nan, np.full(5, math.nan)
        beta.append(b)
        r0.append(f)
        fitted.append(fig)
    figs = popularity_figures(dists, k)
    fitted = np.array(fitted)
    return dict(
        popularity=dict(family="stretched_exp", beta=[None if math.isnan(x) else x for x in beta],
                        r0_frac=[None if math.isnan(x) else x for x in r0]),
        measured=dict(entropy_norm=r(figs[:, 0]), top_k_share=r(figs[:, 1]), top_quarter_share=r(figs[:, 2]),
                      hottest_over_uniform=r(figs[:, 3], 3), gini=r(figs[:, 4]),
                      zipf_exponent=r([zipf_exponent(p) for p in dists], 3),
                      never_selected=[int((p == 0).sum()) for p in dists]),
        fit_error=dict(mean_abs=dict(zip(["entropy_norm", "top_k_share", "top_quarter_share",
                                          "hottest_over_uniform", "gini"],
                                         r(np.nanmean(np.abs(fitted - figs)[list(fit_layers)], axis=0))))),
    )


# ------------------------------------------------------------------------------------------ sources


def derive_mbolt(name: str, rel: str) -> dict:
    path = DATA / rel
    doc = json.loads(path.read_text())
    k = int(doc["k"])
    n_tokens = int(doc["n_decode_tokens"])
    heat = np.array([layer["heat"] for layer in doc["layers"]], float)
    dists = heat / heat.sum(1, keepdims=True)
    out = dict(source=dict(MBOLT_SOURCE, path="results/colibri-119/" + Path(rel).name, stored_as=rel,
                           what=f"per-layer decode heat over {n_tokens} tokens, within-layer pairs"),
               n_layers=int(doc["n_layers"]), n_experts=int(doc["n_expert_per_layer"]), top_k=k,
               tokens=n_tokens)
    out.update(layer_block(dists, k, range(len(dists))))
    q = heat / n_tokens
    out["independent_union"] = {str(b): spread(independent_union(q, b)) for b in (32, 128, 512, 1300)}
    kept, med, p99, cofire = [], [], [], []
    for layer in doc["layers"]:
        pairs = np.array(layer["pairs"], float).reshape(-1, 4)
        kept.append(len(pairs))
        med.append(np.median(pairs[:, 3]) if len(pairs) else math.nan)
        p99.append(np.percentile(pairs[:, 3], 99) if len(pairs) else math.nan)
        cofire.append(pairs[:, 2].max() / n_tokens if len(pairs) else math.nan)
    e = out["n_experts"]
    out["coactivation"] = dict(
        note="pairs kept by mbolt: count >= 5 and lift >= 1.5, top 2000 per layer by count",
        kept_pairs=spread(kept), kept_share_of_all_pairs=spread(np.array(kept) / (e * (e - 1) / 2)),
        kept_lift_median=spread(med), kept_lift_p99=spread(p99), top_pair_cofire_share=spread(cofire))
    return out


def hotlist_rows(path: Path):
    with path.open() as fh:
        rows = [(int(x["rank"]), int(x["layer"]), int(x["expert"])) for x in csv.DictReader(fh)]
    rows.sort()
    ranks = np.array([x[0] for x in rows], float)
    layers = np.array([x[1] for x in rows], np.int64)
    experts = np.array([x[2] for x in rows], np.int64)
    return ranks, layers, experts


def fit_value_curve(ranks, layers, n_layers) -> tuple[float, float, float]:
    best = None
    for b in np.linspace(0.3, 2.0, 69):
        for g0 in np.geomspace(1, 5000, 81):
            v = (ranks + g0) ** -b
            sums = np.bincount(layers, weights=v, minlength=n_layers)
            cv = sums.std() / sums.mean()
            if best is None or cv < best[0]:
                best = (cv, float(b), float(g0))
    return best[1], best[2], best[0]


def tie_block_counts(layers, experts) -> np.ndarray:
    """Hit counts implied by tie blocks: a new block starts where (layer, expert) stops increasing; the
    last block holds count 1, the one before it 2, ... Exact where blocks are long (the tail)."""
    key = layers * 100_000 + experts
    block = np.r_[0, np.cumsum(np.diff(key) < 0)]
    return (block.max() - block + 1).astype(float)


def derive_hotlist(name: str, rel: str, n_layers: int, e: int, k: int) -> dict:
    ranks, layers, experts = hotlist_rows(DATA / rel)
    b, g0, cv = fit_value_curve(ranks, layers, n_layers)
    v = (ranks + g0) ** -b
    dists = np.zeros((n_layers, e))
    dists[layers, experts] = v
    dists /= dists.sum(1, keepdims=True)
    listed = np.bincount(layers, minlength=n_layers)
    out = dict(source=dict(HOTLIST_SOURCE, stored_as=rel,
                           what=f"{len(ranks)} (layer, expert) pairs in profile-popularity order, no counts"),
               n_layers=n_layers, n_experts=e, top_k=k, hash_layers=list(HASH_LAYERS),
               value_curve=dict(law="v(g) = (g + g0)^-b over global rank g", b=round(b, 4), g0=round(g0, 3),
                                per_layer_sum_cv=round(cv, 4)),
               listed_per_layer=listed.tolist())
    counts = tie_block_counts(layers, experts)
    hash_sums = [float(counts[layers == h].sum()) for h in HASH_LAYERS]
    if len(set(hash_sums)) == 1 and hash_sums[0] % k == 0 and counts[layers == HASH_LAYERS[0]].max() < 64:
        tokens = int(hash_sums[0] // k)
        out["profile_tokens"] = tokens
        out["profile_tokens_how"] = (f"tie blocks give exact counts in the tail; each hash layer sums to "
                                     f"{int(hash_sums[0])} = {k} x {tokens} hits")
    else:
        # a hash layer's experts depend on the distinct tokens only: D = ln(1 - n/E) / ln(1 - k/E) distinct
        # tokens; real text repeats tokens, so the run is longer than D: the length at which the DeepSeek-V2-Lite
        # trace's prompts hold D distinct tokens (traces/derive_deepseek_v2_lite.py, distinct_in_first)
        hash_n = listed[list(HASH_LAYERS)]
        distinct = float((np.log(1 - hash_n / e) / np.log(1 - k / e)).mean())
        text = json.loads(V2_LITE.read_text())["text_tokens"]["distinct_in_first"]
        tokens = float(np.interp(distinct, text["distinct"], text["tokens"]))
        out["profile_tokens"] = int(round(tokens))
        out["profile_tokens_how"] = ("no tie blocks (sorted by weight); the hash layers' "
                                     f"{hash_n.tolist()} distinct experts of {e} come from {distinct:.1f} distinct "
                                     "tokens (uniform hash: n = E (1 - (1 - k/E)^D)), which real text (the "
                                     "DeepSeek-V2-Lite prompts) holds in its first "
                                     f"{tokens:.0f} tokens")
    routed = [layer for layer in range(n_layers) if layer not in HASH_LAYERS]
    out.update(layer_block(dists, k, routed))
    out["distinct_in_profile"] = dict(routed_layers=spread(listed[routed]), hash_layers=listed[list(HASH_LAYERS)].tolist(),
                                      per_layer=listed.tolist())
    return out


def derive() -> dict:
    if not DATA.is_dir():
        sys.exit(f"no data folder at {DATA}")
    out = {"_about": ("Figures derived by traces/derive_generator_presets.py from ../shared/data (see that "
                      "script for sources and method). Regenerate, never hand-edit.")}
    for name, rel in MBOLT.items():
        out[name] = derive_mbolt(name, rel)
    for name, (rel, n_layers, e, k) in HOTLIST.items():
        out[name] = derive_hotlist(name, rel, n_layers, e, k)
    return out


def calibrate(stored: dict) -> dict:
    """Per distinct routing spec: the calibrated working-set shifts and keep probabilities (slow: pilots)."""
    sys.path.insert(0, str(ROOT))
    import sim.trace.generator_model as gen
    from sim.trace.generator_spec import GENERATOR_PRESETS

    gen._derived.cache_clear()
    out: dict = {}
    for name in sorted(GENERATOR_PRESETS):
        key = gen.routing_key_hash(name)
        if key in out:
            out[key]["presets"].append(name)
            continue
        print(f"calibrating {name} ...", flush=True)
        out[key] = dict(presets=[name], **gen.calibrate_preset(name))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare the data-derived part with the stored JSON")
    ap.add_argument("--calibrate", action="store_true",
                    help="also recompute the generator calibration section (needs no data; minutes)")
    ap.add_argument("--calibrate-only", action="store_true", help="recompute only the calibration section")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    if args.calibrate_only:
        doc = {key: v for key, v in old.items() if key != "calibration"}
    else:
        doc = derive()
    if args.check:
        same = {key: v for key, v in old.items() if key != "calibration"} == json.loads(json.dumps(doc))
        print("up to date" if same else f"{args.out} differs from a fresh derivation")
        return 0 if same else 1
    doc["calibration"] = old.get("calibration", {})
    args.out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    if args.calibrate or args.calibrate_only:
        doc["calibration"] = calibrate(doc)
        doc["calibration"]["_about"] = ("generator calibration (sim/trace/generate.py calibrate_preset) per routing "
                                        "spec hash; a preset whose hash is absent calibrates at run time")
        args.out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
