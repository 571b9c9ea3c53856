"""Derive DeepSeek-V2-Lite routing figures from a real per-token trace, for the generator's preset and its checks.

    python traces/derive_deepseek_v2_lite.py --git DIR           # writes sim/trace/generator_deepseek_v2_lite.json
    python traces/derive_deepseek_v2_lite.py --git DIR --check   # recompute and compare with the stored JSON

DIR is a git directory holding ngavhane/moe-beyond (the `fetch` tool's mirror, for instance); the script reads
the pinned commit's files with `git cat-file`, never a work tree. The repository has no license: its CSV files
are never copied here, only the compact figures below (at most a few dozen numbers per list).

Input: `training_data_eamc/prompt_*_data.csv` (prompts 1-1000) and
`expert_activation_scripts/training_data_eamc/prompt_*_data.csv` (1001-2000), written by
`expert_activation_scripts/generate_deepseek_logs_eamc.py`: DeepSeek-V2-Lite-Chat in 8-bit, one teacher-forced
forward pass over each prompt's text (prefill only, no generation), a hook on every MoE gate. One row per
(layer 1..26, token): layer, batch, token string, the 6 routed expert ids. 1,999 prompts, 192,023 tokens
(prompt 317's blob is absent from the stored snapshot); these counts match routing-traces.md §6.

Figures (all pooled over prompts unless per layer):
  reuse_within     share of all selections whose expert the layer used in one of the previous d tokens of the
                   prompt (d = 1 .. 64); the §6 figures 26.2 / 36.5 / 49.5 / 64.7 / 78.7 / 87.3 / 90.7 %
  adjacent_reuse   the same for d = 1 counted over token pairs (0.265), and per layer
  popularity       per-layer stretched-exponential fit of the selection shares (traces/derive_generator_presets.py)
  coactivation     within-layer pair lift as trace_stats measures it (share of pairs with lift >= 1.5, p99 of
                   those pairs' lift, the largest lift)
  union            mean distinct experts per layer in full chunks of 32 and 64 tokens of a prompt
  prompt_tokens    prompt lengths at the 32 quantiles (i + 0.5) / 32 of the 1,999 prompts
  lru              per-layer LRU (cold once, prompts one after another) and one shared LRU over all 1,664
                   (layer, expert) pairs (§6: 26.3 / 37.0 / 44.5 / 70.4 % at 10 / 18.6 / 25 / 50 % of the pairs)
  hash_layer_reuse what a token-id-hashed layer (DeepSeek V4 blocks 0-2: 6 of 256 experts fixed per token id)
                   would show on this text: each distinct token string gets 6 experts from a fixed seeded draw,
                   then reuse within d is measured as above. It is the target of the generator's token stream.
  text_tokens      the text's own token repetition within d, its distinct tokens in the first n tokens of a
                   prompt, and its rank-frequency law, fitted as
                   f(r) ~ (r + offset)^-exponent over ranks 1..2000 (least squares on log frequency)
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "traces"))

from derive_generator_presets import layer_block  # noqa: E402 - the same fit as the other presets

from sim.trace.format import PHASE_PREFILL, Trace, TraceHeader  # noqa: E402
from sim.trace.locality import LruProtocol, lru_hit_rates, reuse_within  # noqa: E402
from sim.trace.stats import _heat_kernel, coactivation_stats, prefill_union_by_layer, reuse_by_layer  # noqa: E402

OUT = ROOT / "sim" / "trace" / "generator_deepseek_v2_lite.json"
SOURCE = dict(repository="ngavhane/moe-beyond", commit="4dca2eacb7bc0a3086770a4de7a57cc0b81479bd",
              paths=["training_data_eamc/prompt_*_data.csv",
                     "expert_activation_scripts/training_data_eamc/prompt_*_data.csv"],
              producer="expert_activation_scripts/generate_deepseek_logs_eamc.py", license="none (figures only)",
              model="deepseek-ai/DeepSeek-V2-Lite-Chat, load_in_8bit, teacher-forced prompt text (prefill only)")
N_LAYERS, N_EXPERTS, TOP_K = 26, 64, 6
DISTANCES = (1, 2, 4, 8, 16, 32, 64)
SHARED_FRACTIONS = (0.10, 0.186, 0.25, 0.50)
LAYER_CAPACITIES = (6, 12, 24, 32, 48)
HASH_EXPERTS = 256  # DeepSeek V4's hash-routed blocks pick 6 of 256


def read_prompts(git_dir: str) -> tuple[list[np.ndarray], list[list[str]], list[int]]:
    """(experts [tokens, 26, 6] per prompt, token strings per prompt, prompt numbers whose blob is absent)."""
    listing = subprocess.run(["git", "-C", git_dir, "ls-tree", "-r", SOURCE["commit"]], capture_output=True,
                             text=True, check=True).stdout.splitlines()
    files = []
    for line in listing:
        meta, path = line.split("\t")
        if re.search(r"(^|/)training_data_eamc/prompt_\d+_data\.csv$", path):
            files.append((int(re.search(r"prompt_(\d+)_", path).group(1)), meta.split()[2]))
    files.sort()
    cat = subprocess.Popen(["git", "-C", git_dir, "cat-file", "--batch"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE)
    experts, tokens, absent = [], [], []
    for number, blob in files:
        cat.stdin.write((blob + "\n").encode())
        cat.stdin.flush()
        header = cat.stdout.readline().split()
        if len(header) < 3 or header[1] != b"blob":
            absent.append(number)
            continue
        data = cat.stdout.read(int(header[2]))
        cat.stdout.read(1)
        rows = list(csv.reader(io.StringIO(data.decode("utf-8"))))[1:]
        by_layer: dict[int, list] = {}
        for row in rows:
            by_layer.setdefault(int(row[0]), []).append([int(x) for x in row[3].strip("[]").split(",")])
        layers = sorted(by_layer)
        assert len(layers) == N_LAYERS and len({len(v) for v in by_layer.values()}) == 1, number
        experts.append(np.array([by_layer[x] for x in layers], np.uint16).transpose(1, 0, 2))
        tokens.append([row[2] for row in rows if int(row[0]) == layers[0]])
    cat.stdin.close()
    cat.wait()
    return experts, tokens, absent


def as_trace(experts: list[np.ndarray], n_experts: int) -> Trace:
    lengths = [x.shape[0] for x in experts]
    request = np.repeat(np.arange(len(experts), dtype=np.int32), lengths)
    position = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
    ex = np.concatenate(experts)
    header = TraceHeader(model="deepseek-v2-lite", n_layers=ex.shape[1], n_experts=n_experts, top_k=ex.shape[2],
                         source=f"{SOURCE['repository']} @ {SOURCE['commit']}", source_sha256="-")
    return Trace(header, request, position, np.full(ex.shape[0], PHASE_PREFILL, np.uint8), ex)


def r(values, digits=4) -> list[float]:
    return [round(float(x), digits) for x in values]


def _heat(trace: Trace):
    return _heat_kernel(trace.experts, trace.header.n_experts)


def hashed_layer(tokens: list[list[str]]) -> list[np.ndarray]:
    """A token-id-hashed layer on this text: 6 distinct experts of 256 per distinct token string (seeded)."""
    table: dict[str, np.ndarray] = {}
    out = []
    for prompt in tokens:
        rows = []
        for tok in prompt:
            if tok not in table:
                seed = int.from_bytes(hashlib.sha256(tok.encode()).digest()[:8], "little")
                table[tok] = np.random.default_rng(seed).choice(HASH_EXPERTS, TOP_K, replace=False)
            rows.append(table[tok])
        out.append(np.array(rows, np.uint16)[:, None, :])
    return out


def token_figures(tokens: list[list[str]]) -> dict:
    gaps = []
    for prompt in tokens:
        last: dict[str, int] = {}
        for t, tok in enumerate(prompt):
            gaps.append(t - last[tok] if tok in last else 1 << 30)
            last[tok] = t
    gaps = np.array(gaps)
    freq = np.array(sorted(Counter(t for p in tokens for t in p).values(), reverse=True), float)
    ranks = np.arange(1, min(2000, freq.size) + 1, dtype=float)
    logf = np.log(freq[: ranks.size] / freq.sum())
    best = None
    for offset in np.linspace(0.0, 20.0, 201):
        a = np.polyfit(np.log(ranks + offset), logf, 1)
        err = float(((np.polyval(a, np.log(ranks + offset)) - logf) ** 2).mean())
        if best is None or err < best[0]:
            best = (err, -float(a[0]), float(offset))
    spans = (8, 16, 32, 64, 128, 256, 512)
    distinct_first = [float(np.mean([len(set(p[:n])) for p in tokens if len(p) >= n])) for n in spans]
    return dict(repeat_within=dict(distances=list(DISTANCES), share=r([(gaps <= d).mean() for d in DISTANCES])),
                distinct_in_first=dict(tokens=list(spans), distinct=r(distinct_first, 2),
                                       how="mean distinct token strings in the first n tokens of prompts >= n long"),
                distinct=int(freq.size), top_share=r(freq[:5] / freq.sum()),
                rank_frequency=dict(law="f(r) ~ (r + offset)^-exponent, ranks 1..2000", exponent=round(best[1], 3),
                                    offset=round(best[2], 2), rms_log_error=round(best[0] ** 0.5, 3)))


def derive(git_dir: str) -> dict:
    experts, tokens, absent = read_prompts(git_dir)
    trace = as_trace(experts, N_EXPERTS)
    lengths = np.array([x.shape[0] for x in experts])
    out = dict(_about="Figures derived by traces/derive_deepseek_v2_lite.py (see it for method); regenerate, "
                      "never hand-edit. The source has no license: no routing or token data is stored here.",
               source=SOURCE, n_layers=N_LAYERS, n_experts=N_EXPERTS, top_k=TOP_K,
               prompts=len(experts), tokens=int(lengths.sum()), absent_prompts=absent)
    out["prompt_tokens"] = dict(quantiles=[int(round(q)) for q in np.quantile(lengths, (np.arange(32) + 0.5) / 32)],
                                mean=round(float(lengths.mean()), 2), max=int(lengths.max()))
    within = reuse_within(trace, DISTANCES)
    hits, pairs = reuse_by_layer(trace.experts, trace.request, trace.phase)
    out["reuse_within"] = dict(distances=list(DISTANCES), share=r(within["share"]),
                               per_layer_8=r([row[DISTANCES.index(8)] for row in within["per_layer"]]))
    out["adjacent_reuse"] = dict(mean=round(float(hits.sum() / (TOP_K * pairs.sum())), 4),
                                 per_layer=r(hits.sum(0) / (TOP_K * pairs.sum(0))))
    counts = np.zeros((N_LAYERS, N_EXPERTS))
    for layer in range(N_LAYERS):
        counts[layer] = np.bincount(trace.experts[:, layer].ravel().astype(np.int64), minlength=N_EXPERTS)
    out.update(layer_block(counts / counts.sum(1, keepdims=True), TOP_K, range(N_LAYERS)))
    out["union"] = {}
    for chunk in (32, 64):
        mean, n = prefill_union_by_layer(trace.experts, trace.request, trace.phase, chunk, N_EXPERTS)
        out["union"][str(chunk)] = dict(chunks=n, per_layer=r(mean, 2))
    shared = [int(round(f * N_LAYERS * N_EXPERTS)) for f in SHARED_FRACTIONS]
    out["lru"] = dict(
        per_layer=dict(protocol="cold once, prompts one after another, every token", capacities=list(LAYER_CAPACITIES),
                       hit=r(lru_hit_rates(trace, LAYER_CAPACITIES)["hit_rate"])),
        shared=dict(protocol="one pool over all (layer, expert) pairs, cold once, prompts one after another",
                    fractions=list(SHARED_FRACTIONS), capacities=shared,
                    hit=r(lru_hit_rates(trace, shared, LruProtocol(pool="shared"))["hit_rate"])))
    within = coactivation_stats(trace.experts, *_heat(trace), N_EXPERTS, TOP_K)["within_layer"]
    out["coactivation"] = {key: round(float(within[key]), 4) for key in
                           ("share_lift_ge_1_5", "kept_pairs_p99_median", "lift_max", "layer_share_lift_ge_1_5_median")}
    hashed = as_trace(hashed_layer(tokens), HASH_EXPERTS)
    out["hash_layer_reuse"] = dict(distances=list(DISTANCES), share=r(reuse_within(hashed, DISTANCES)["share"]),
                                   how="6 of 256 experts per distinct token string (seeded draw), reuse within d")
    out["text_tokens"] = token_figures(tokens)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--git", required=True, help="git directory holding ngavhane/moe-beyond")
    ap.add_argument("--check", action="store_true", help="compare with the stored JSON, write nothing")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    doc = json.loads(json.dumps(derive(args.git)))
    if args.check:
        same = args.out.exists() and json.loads(args.out.read_text()) == doc
        print("up to date" if same else f"{args.out} differs from a fresh derivation")
        return 0 if same else 1
    args.out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
