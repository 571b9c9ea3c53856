"""The docs' exhibits: every figure and every number the pages quote, computed from the project's own
scenarios and library calls. One function per exhibit; each returns the data it plots, the numbers the
text quotes (already formatted as the text shows them) and its SVG figures.

Files (docs/figures/): NAME.json holds {"made_by", "data", "numbers"}; STEM.svg each figure. Pages quote a
number as `30.6<!--=NAME.key-->`; docs/tools/make_docs.py writes everything, `--check` compares.

Data are rounded to 5 significant digits before they are stored, so that a last-bit difference of a
floating-point sum on another machine does not count as a stale figure while any real change does.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from docgen import svg

ROOT = Path(__file__).resolve().parents[3]
SCENARIOS = ROOT / "scenarios"
MIB = 1 << 20
GIB = 1 << 30


@dataclass
class Exhibit:
    made_by: dict
    data: dict
    numbers: dict[str, str]
    figures: dict[str, str] = field(default_factory=dict)

    def record(self) -> dict:
        return {"made_by": self.made_by, "data": rounded(self.data), "numbers": self.numbers}


EXHIBITS: dict[str, Callable[[], Exhibit]] = {}


def exhibit(name: str):
    def register(fn: Callable[[], Exhibit]) -> Callable[[], Exhibit]:
        EXHIBITS[name] = fn
        return fn

    return register


# ------------------------------------------------------------------------------------------ helpers


def rounded(value, sig: int = 5):
    if isinstance(value, dict):
        return {k: rounded(v, sig) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, sig) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if value != value:  # NaN
            return None
        return float(f"{value:.{sig}g}")
    return value


def f0(x: float) -> str:
    return f"{x:,.0f}"


def f1(x: float) -> str:
    return f"{x:,.1f}"


def f2(x: float) -> str:
    return f"{x:,.2f}"


def pct(x: float, digits: int = 1) -> str:
    """A share as percent (the page writes the % sign after the marker)."""
    return f"{100 * x:.{digits}f}"


def signed_pct(x: float) -> str:
    return f"{100 * x:+.1f}"


def _set(data: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    if value is None:
        node.pop(parts[-1], None)
    else:
        node[parts[-1]] = value


def scenario_data(name: str, overrides: tuple = ()) -> dict:
    """A seed scenario's TOML data with dotted overrides applied (a value of None removes the key)."""
    from sim.schema import read_toml

    path = SCENARIOS / f"{name}.toml"
    data = copy.deepcopy(read_toml(path, str(path)))
    for key, value in overrides:
        _set(data, key, value)
    return data


@functools.lru_cache(maxsize=64)
def run(name: str, overrides: tuple = ()):
    """Simulate a seed scenario (with overrides) once per process; returns sim.results.RunResult."""
    from sim.simulate import run_scenario
    from sim.scenario import load_scenario

    path = SCENARIOS / f"{name}.toml"
    return run_scenario(load_scenario(path, scenario_data(name, overrides)))


# ------------------------------------------------------------------------------------------ routing


@exhibit("routing")
def routing() -> Exhibit:
    """How many distinct experts a prefill chunk touches, against the chunk length."""
    from sim.model.presets import get_preset
    from sim.trace.generate import generate_trace
    from sim.trace.stats import prefill_union_by_layer, trace_stats

    model, prompt, decode, requests, seed = "deepseek-v4-flash-q2-q4", 4096, 256, 2, 0
    chunks = (1, 4, 16, 64, 256, 1024, 4096)
    trace = generate_trace(model, prompt, decode, seed, requests)
    stats = trace_stats(trace, chunk_lengths=chunks)
    union = {u["chunk_tokens"]: u for u in stats["prefill_union"]}
    layout = get_preset(model)
    per_layer, _ = prefill_union_by_layer(trace.experts, trace.request, trace.phase, 4096, layout.n_experts)
    layer_bytes = layout.expert_bytes_per_layer()[: layout.n_routed_layers]
    staging = per_layer * layer_bytes / GIB  # ds4's per-layer staging for one 4096-token chunk
    s = stats["summary"]
    data = {"chunks": list(chunks),
            "measured": [union[c]["mean_distinct_per_layer"] for c in chunks],
            "min_layer": [union[c]["min"] for c in chunks],
            "max_layer": [union[c]["max"] for c in chunks],
            "independent": [union[c]["independent_draw_prediction"] for c in chunks],
            "union_4096_per_layer": per_layer.tolist(), "staging_gib_per_layer": staging.tolist()}
    q4 = [i for i, b in enumerate(layer_bytes) if b == layer_bytes.max()]
    numbers = {
        "reuse_decode": pct(s["reuse_decode_mean"]), "reuse_prefill": pct(s["reuse_prefill_mean"]),
        "reuse_random": pct(s["reuse_random"]),
        "union_16": f1(union[16]["mean_distinct_per_layer"]), "indep_16": f1(union[16]["independent_draw_prediction"]),
        "union_4096": f1(union[4096]["mean_distinct_per_layer"]),
        "indep_4096": f1(union[4096]["independent_draw_prediction"]),
        "union_4096_min": f1(union[4096]["min"]), "union_4096_max": f1(union[4096]["max"]),
        "hash_union_4096": f1(per_layer[:3].mean()),
        "staging_q2_gib": f2(staging[: q4[0]].max()), "staging_q4_gib": f2(staging[q4].max()),
    }
    fig = svg.line_chart(
        "Distinct experts per layer in a prefill chunk (DeepSeek-V4-Flash, 256 experts, top-6)",
        "chunk length (tokens)", "distinct experts per layer",
        [{"name": "generated trace, mean over layers", "x": chunks, "y": data["measured"]},
         {"name": "independent draws, same popularity", "x": chunks, "y": data["independent"], "dashed": True},
         {"name": "least-spread layer", "x": chunks, "y": data["min_layer"]},
         {"name": "most-spread layer", "x": chunks, "y": data["max_layer"]}],
        log_x=True, x_ticks=list(chunks), y_min=0, y_max=256,
        note=f"expertsim trace gen --preset {model} --prompt-tokens {prompt} --decode-tokens {decode} "
             f"--requests {requests} --seed {seed}; trace_stats")
    layers = svg.bar_chart(
        "ds4 prefill staging per layer for one 4096-token chunk (GiB = distinct experts x expert bytes)",
        [str(i) for i in range(len(staging))],
        [{"name": "q2 layers (6.75 MiB experts)", "values": [v if i not in q4 else None for i, v in enumerate(staging)]},
         {"name": "q4 layers (13.5 MiB experts)", "values": [v if i in q4 else None for i, v in enumerate(staging)]}],
        "GiB", stacked=True, labels=False, category_label="layer (0-2 are hash-routed)",
        note="generate_trace: 2 requests of 4,096 prompt tokens; sim.trace.stats.prefill_union_by_layer")
    return Exhibit({"trace": f"generate_trace({model!r}, {prompt}, {decode}, seed={seed}, requests={requests})",
                    "functions": ["sim.trace.stats.trace_stats", "sim.trace.stats.prefill_union_by_layer"]},
                   data, numbers, {"routing-unions": fig, "routing-staging": layers})


# ------------------------------------------------------------------------------------------ demo


@exhibit("demo")
def demo() -> Exhibit:
    """`expertsim demo`: the slab against per-class caches, and append-only prefill at a tight budget."""
    from sim.explore.demo import run_demo

    result = run_demo()
    rows = result["rows"]
    names = [f"{r['cache']}, {r['budget']:,}, {r['prefill']}" for r in rows]
    by = {(r["cache"], r["budget"], r["prefill"]): r for r in rows}
    slab = by[("one slab (pre-#504)", 9472, "evict")]
    per_class = by[("per class (#504)", 9472, "append")]
    tight_evict = by[("per class", 2048, "evict")]
    tight_append = by[("per class", 2048, "append")]
    bound = by[("OPT bound", 2048, "evict")]
    numbers = {
        "slab_decode_hit": pct(slab["decode_hit"]), "per_class_decode_hit": pct(per_class["decode_hit"]),
        "slab_mib_per_token": f0(slab["MiB_per_token"]), "per_class_mib_per_token": f1(per_class["MiB_per_token"]),
        "tight_evict_decode_hit": pct(tight_evict["decode_hit"]),
        "tight_append_decode_hit": pct(tight_append["decode_hit"]),
        "tight_evict_prefill_hit": pct(tight_evict["prefill_hit"]),
        "tight_append_prefill_hit": pct(tight_append["prefill_hit"]),
        "opt_decode_hit": pct(bound["decode_hit"]),
    }
    fig = svg.bar_chart("expertsim demo: decode and prefill hit rates (DeepSeek-V4-Flash q2-q4)",
                        [f"{r['cache'].split(' (')[0]} {r['budget']:,} {r['prefill']}" for r in rows],
                        [{"name": "decode hit rate", "values": [r["decode_hit"] for r in rows]},
                         {"name": "prefill hit rate", "values": [r["prefill_hit"] for r in rows]}],
                        "hit rate", note="expertsim demo: 2,048-token prompt, 256 decoded tokens, seed 0")
    return Exhibit({"command": "expertsim demo", "function": "sim.explore.demo.run_demo"},
                   {"cases": names, "rows": rows}, numbers, {"demo": fig})


# ------------------------------------------------------------------------------------------ size classes


@exhibit("size-classes")
def size_classes() -> Exhibit:
    """Bytes per expert in each layer of the mixed q2/q4 file, and the size classes they form."""
    from sim.model.presets import get_preset

    layout = get_preset("deepseek-v4-flash-q2-q4")
    layer_bytes = layout.expert_bytes_per_layer()[: layout.n_routed_layers]
    classes = layout.size_classes()
    mib = (layer_bytes / MIB).tolist()
    q2_bytes, q4_bytes = (int(b) for b in classes.expert_bytes)
    q2 = [b == q2_bytes for b in layer_bytes]
    numbers = {"q2_mib": f2(q2_bytes / MIB), "q4_mib": f2(q4_bytes / MIB),
               "q2_layers": f0(sum(q2)), "q4_layers": f0(len(q2) - sum(q2)),
               "q2_keys": f0(sum(q2) * layout.n_experts), "q4_keys": f0((len(q2) - sum(q2)) * layout.n_experts),
               "all_gib": f2(layout.total_expert_bytes / GIB)}
    fig = svg.bar_chart("Bytes of one expert (gate + up + down) per layer: deepseek-v4-flash-q2-q4",
                        [str(i) for i in range(len(mib))],
                        [{"name": f"class 0 ({q2_bytes / MIB:.2f} MiB)",
                          "values": [m if q else None for m, q in zip(mib, q2)]},
                         {"name": f"class 1 ({q4_bytes / MIB:.2f} MiB)",
                          "values": [None if q else m for m, q in zip(mib, q2)]}],
                        "MiB per expert", stacked=True, labels=False, category_label="layer",
                        note="sim.model.presets.get_preset('deepseek-v4-flash-q2-q4')")
    return Exhibit({"function": "sim.model.presets.get_preset('deepseek-v4-flash-q2-q4')"},
                   {"mib_per_layer": mib}, numbers, {"size-classes": fig})


# ------------------------------------------------------------------------------------------ policies

POLICY_FRACTIONS = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4)


def _policy_curves(model: str) -> dict:
    from sim.cache.replay import Geometry, lru_mrc, replay, trace_profile
    from sim.model.presets import get_preset
    from sim.trace.generate import generate_trace

    trace = generate_trace(model, 512, 2048, 0)
    other = generate_trace(model, 512, 2048, 1, requests=4)  # other traffic: the profile of another day
    geometry = Geometry.of(trace, get_preset(model))
    curve = lru_mrc(trace, geometry, "layer")
    decode_lookups = curve.hist[:, 1].sum() + curve.cold[:, 1].sum()
    profile = trace_profile(other)
    slots = [max(1, int(round(f * geometry.n_experts))) for f in POLICY_FRACTIONS]
    out = {"slots": slots, "lru": [], "opt": [], "static_oracle": [], "static_other": []}

    def decode_hit(policy, capacity, ranking=None):
        r = replay(trace, geometry, policy, "layer", capacity, "evict", ranking)
        return float(r.per_phase().set_index("phase").loc["decode", "hit_rate"])

    for c in slots:
        capacity = np.full(geometry.n_layers, c)
        out["lru"].append(float(curve.hist[:, 1, 1: c + 1].sum() / decode_lookups))  # exact, from the one pass
        out["opt"].append(decode_hit("opt", capacity))
        out["static_oracle"].append(decode_hit("static", capacity))
        out["static_other"].append(decode_hit("static", capacity, profile))
    out["n_experts"] = geometry.n_experts
    return out


@exhibit("policies")
def policies() -> Exhibit:
    """LRU (exact miss-ratio curve), OPT and a static profile-filled cache, one pool per layer."""
    models = {"deepseek": "deepseek-v4-flash-q2", "qwen38": "qwen3.8-flash-next-iq3s"}
    data = {key: _policy_curves(model) for key, model in models.items()}
    numbers = {}
    figures = {}
    for key, model in models.items():
        d = data[key]
        i = POLICY_FRACTIONS.index(1 / 4)
        numbers.update({f"{key}_slots": f0(d["slots"][i]), f"{key}_lru": pct(d["lru"][i]),
                        f"{key}_opt": pct(d["opt"][i]), f"{key}_static_oracle": pct(d["static_oracle"][i]),
                        f"{key}_static_other": pct(d["static_other"][i])})
        figures[f"policies-{key}"] = svg.line_chart(
            f"Decode hit rate against slots per layer: {model} ({d['n_experts']} experts per layer)",
            "slots per layer", "decode hit rate",
            [{"name": "OPT (Belady MIN with bypass)", "x": d["slots"], "y": d["opt"], "dashed": True},
             {"name": "LRU (exact curve)", "x": d["slots"], "y": d["lru"]},
             {"name": "static, profiled on this trace", "x": d["slots"], "y": d["static_oracle"]},
             {"name": "static, profiled on other requests", "x": d["slots"], "y": d["static_other"]}],
            y_min=0, y_max=1,
            note=f"generate_trace({model!r}, 512, 2048, seed 0); profile: seed 1, 4 requests; scope layer")
    i = POLICY_FRACTIONS.index(1 / 2)
    numbers["deepseek_half_lru"] = pct(data["deepseek"]["lru"][i])
    numbers["deepseek_half_static_other"] = pct(data["deepseek"]["static_other"][i])
    return Exhibit({"traces": {k: f"generate_trace({m!r}, 512, 2048, 0); profile seed 1, 4 requests"
                               for k, m in models.items()},
                    "functions": ["sim.cache.replay.lru_mrc", "sim.cache.replay.replay"]}, data, numbers, figures)


# ------------------------------------------------------------------------------------------ prefill eviction

EVICTION_BUDGETS = (512, 1024, 2048, 3072, 4096, 6144, 8192, 9472)
EVICTION_TURN_TOKENS = 16


@exhibit("prefill-eviction")
def prefill_eviction() -> Exhibit:
    """A conversation's next reply after someone else's long prompt: evicting vs append-only prefill."""
    from sim.cache.replay import Geometry, replay
    from sim.model.presets import get_preset
    from sim.trace.format import PHASE_DECODE, PHASE_PREFILL, Trace

    from sim.trace.generate import generate_trace

    model = "deepseek-v4-flash-q2-q4"
    trace = generate_trace(model, 4096, 512, 0, 2)
    req, phase = trace.request, trace.phase
    a_prompt = np.flatnonzero((req == 0) & (phase == PHASE_PREFILL))
    a_decode = np.flatnonzero((req == 0) & (phase == PHASE_DECODE))
    b_prompt = np.flatnonzero((req == 1) & (phase == PHASE_PREFILL))
    # A's prompt and first reply, B's long prompt, then A's next reply (same request: same working set)
    order = np.r_[a_prompt, a_decode[:256], b_prompt, a_decode[256: 256 + EVICTION_TURN_TOKENS]]

    def rows(idx):
        return Trace(trace.header, trace.request[idx], trace.position[idx], trace.phase[idx], trace.experts[idx])

    full, before = rows(order), rows(order[: len(order) - EVICTION_TURN_TOKENS])
    geometry = Geometry.of(full, get_preset(model))
    data = {"budgets": list(EVICTION_BUDGETS), "evict": [], "append": []}
    for budget in EVICTION_BUDGETS:
        capacity = np.full(geometry.n_classes, budget)
        for mode in ("evict", "append"):
            # the reply's own counts: the whole sequence minus the sequence before it (replays are deterministic)
            counts = (replay(full, geometry, "lru", "class", capacity, mode).counts
                      - replay(before, geometry, "lru", "class", capacity, mode).counts)[:, PHASE_DECODE]
            data[mode].append(float(counts[:, 0].sum() / counts.sum()))
    keys_b = len(np.unique((np.arange(geometry.n_layers)[None, :, None] * geometry.n_experts
                            + trace.experts[b_prompt].astype(np.int64)).ravel()))
    i, j = EVICTION_BUDGETS.index(2048), EVICTION_BUDGETS.index(4096)
    numbers = {"evict_2048": pct(data["evict"][i]), "append_2048": pct(data["append"][i]),
               "evict_4096": pct(data["evict"][j]), "append_4096": pct(data["append"][j]),
               "b_prompt_keys": f0(keys_b)}
    fig = svg.line_chart(
        f"Hit rate of A's next {EVICTION_TURN_TOKENS}-token reply after B's 4,096-token prompt (per-class LRU)",
        "slots per size class (the --ssd-streaming-cache-experts budget)", "decode hit rate",
        [{"name": "prefill evicts (plain LRU, before #504)", "x": EVICTION_BUDGETS, "y": data["evict"]},
         {"name": "prefill appends, never evicts (#504)", "x": EVICTION_BUDGETS, "y": data["append"]}],
        y_min=0, y_max=1, note=f"generate_trace({model!r}, 4096, 512, seed 0, requests 2), rows reordered A, A, B, A")
    return Exhibit({"trace": f"generate_trace({model!r}, 4096, 512, 0, 2), rows reordered",
                    "function": "sim.cache.replay.replay (scope class, prefill evict vs append)"},
                   data, numbers, {"prefill-eviction": fig})


# ------------------------------------------------------------------------------------------ lending

LENDING_BUDGETS = (3000, 4000, 5400, 6500, 7500, 8500)


@exhibit("lending")
def lending() -> Exhibit:
    """Strata #658: borrowed vs owned prompt buffers over the --expert-cache budget."""
    data = {"budgets": list(LENDING_BUDGETS)}
    for arm, own in (("borrow", "0"), ("own", "1")):
        rows = []
        for budget in LENDING_BUDGETS:
            r = run("strata-658-borrow", (("engine.env.STRATA_PREFILL_OWN_AUTO", own),
                                          ("engine.flags.expert-cache", budget)))
            s, st = r.summary, r.summary["engine_state"]
            req = st["requests"][s["measured_request"]]
            rows.append({"prefill_tok_s": s["prefill_tok_s"], "lent_slots": s["lent_slots"],
                         "file_blob_reads": s["file_blob_reads"], "cache_slots": s["cache_slots"],
                         "owned": st["owned"], "chunk": st["chunk"], "buffer_mib": s["prefill_buffer_mib"],
                         "pp_ms": req["pp_ms"], "refill_ms": req["refill_ms"], "prefill_ms": req["prefill_ms"],
                         "decode_hit_rate": s["decode_hit_rate"]})
        data[arm] = rows
    i = LENDING_BUDGETS.index(5400)
    b, o = data["borrow"][i], data["own"][i]
    owned_budgets = [bu for bu, row in zip(LENDING_BUDGETS, data["own"]) if row["owned"]]
    numbers = {"borrow_tok_s": f0(b["prefill_tok_s"]), "own_tok_s": f0(o["prefill_tok_s"]),
               "lent": f0(b["lent_slots"]), "reads": f0(b["file_blob_reads"]), "slots": f0(b["cache_slots"]),
               "refill_ms": f0(b["refill_ms"]), "borrow_pp_ms": f0(b["pp_ms"]), "own_pp_ms": f0(o["pp_ms"]),
               "buffer_mib": f0(o["buffer_mib"]), "chunk": f0(o["chunk"]),
               "last_owned_budget": f0(max(owned_budgets)),
               "small_own_chunk": f0(data["own"][0]["chunk"]), "small_own_buffer_mib": f0(data["own"][0]["buffer_mib"]),
               "small_borrow_tok_s": f0(data["borrow"][0]["prefill_tok_s"]),
               "small_own_tok_s": f0(data["own"][0]["prefill_tok_s"]),
               "top_tok_s": f0(data["borrow"][-1]["prefill_tok_s"])}
    fig = svg.line_chart(
        "Strata fork-658: prompt tok/s of a 17,944-token prompt against the expert-cache budget",
        "--expert-cache N (a byte budget of N x the largest blob)", "prompt tok/s",
        [{"name": "borrowed buffers (STRATA_PREFILL_OWN_AUTO=0)", "x": LENDING_BUDGETS,
          "y": [r["prefill_tok_s"] for r in data["borrow"]]},
         {"name": "owned when spare VRAM allows (=1)", "x": LENDING_BUDGETS,
          "y": [r["prefill_tok_s"] for r in data["own"]]}],
        y_min=0, note="scenarios/strata-658-borrow.toml with engine.flags.expert-cache and STRATA_PREFILL_OWN_AUTO set")
    reads = svg.line_chart(
        "Borrowing arm: slots lent to the prompt path and the lent experts read from the model files",
        "--expert-cache N", "experts",
        [{"name": "lent slots", "x": LENDING_BUDGETS, "y": [r["lent_slots"] for r in data["borrow"]]},
         {"name": "file-blob reads during the prompt", "x": LENDING_BUDGETS,
          "y": [r["file_blob_reads"] for r in data["borrow"]]}],
        y_min=0, note="scenarios/strata-658-borrow.toml (measured request: the second 17,944-token prompt)")
    return Exhibit({"scenario": "scenarios/strata-658-borrow.toml",
                    "grid": {"engine.env.STRATA_PREFILL_OWN_AUTO": ["0", "1"],
                             "engine.flags.expert-cache": list(LENDING_BUDGETS)}},
                   data, numbers, {"lending-tok-s": fig, "lending-reads": reads})


# ------------------------------------------------------------------------------------------ memory budgets

RESERVES_GIB = (4, 6, 8, 10, 12, 14, 16)
HEADROOMS_GIB = ("4", "4.5", "5", "5.5", "6", "7")


@exhibit("memory")
def memory() -> Exhibit:
    """ds4's VRAM reserve, Strata's RAM headroom and Strata's conversation cache."""
    reserve_rows = []
    for gib in RESERVES_GIB:
        s = run("ds4-504-per-class", (("engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB", str(gib)),)).summary
        per_class = s["engine_state"]["cache_slots_per_class"]
        reserve_rows.append({"reserve_gib": gib, "q2_slots": per_class[0], "q4_slots": per_class[1],
                             "decode_hit_rate": s["decode_hit_rate"], "decode_tok_s": s["decode_tok_s"]})
    headroom_rows = []
    for gib in HEADROOMS_GIB:
        # upstream v0.1.35 takes the headroom as given; the fork raises it to cover the conversation budget
        s = run("strata-658-borrow", (("engine.variant", "v0.1.35"), ("engine.env.STRATA_PREFILL_OWN_AUTO", None),
                                      ("engine.env.STRATA_RESIDENT_HEADROOM_GIB", gib))).summary
        ram = s["engine_state"]["ram_plan"]
        headroom_rows.append({"headroom_gib": float(gib), "covered_lent_slots": ram["covered_lent_slots"],
                              "lent_slots": s["lent_slots"], "file_blob_reads": s["file_blob_reads"],
                              "prefill_tok_s": s["prefill_tok_s"]})
    conversation = {}
    for label, mib in (("on", 2048), ("off", 0)):
        s = run("conversation-aba", (("engine.flags.conversation-cache-mib", mib),)).summary
        st = s["engine_state"]
        req = st["requests"][s["measured_request"]]
        cc = st["conversation_cache"]
        conversation[label] = {"ttft_s": s["ttft_s"], "resumed_tokens": req["resumed_tokens"],
                               "prefill_ms": req["prefill_ms"], "parks": cc["parks"],
                               "restore_ms": cc["restores"][0]["ms"] if cc["restores"] else None,
                               "parked_mib": sum(p["mib"] for p in cc["parked"])}
    fork = run("strata-658-borrow").summary["engine_state"]["ram_plan"]
    by_reserve = {r["reserve_gib"]: r for r in reserve_rows}
    by_headroom = {r["headroom_gib"]: r for r in headroom_rows}
    numbers = {
        "q4_slots_12": f0(by_reserve[12]["q4_slots"]), "q4_slots_16": f0(by_reserve[16]["q4_slots"]),
        "q4_slots_4": f0(by_reserve[4]["q4_slots"]),
        "tok_s_4": f1(by_reserve[4]["decode_tok_s"]), "tok_s_12": f1(by_reserve[12]["decode_tok_s"]),
        "tok_s_16": f1(by_reserve[16]["decode_tok_s"]),
        "hit_12": pct(by_reserve[12]["decode_hit_rate"]), "hit_16": pct(by_reserve[16]["decode_hit_rate"]),
        "covered_4": f0(by_headroom[4.0]["covered_lent_slots"]), "reads_4": f0(by_headroom[4.0]["file_blob_reads"]),
        "covered_5": f0(by_headroom[5.0]["covered_lent_slots"]), "reads_5": f0(by_headroom[5.0]["file_blob_reads"]),
        "reads_7": f0(by_headroom[7.0]["file_blob_reads"]), "lent": f0(by_headroom[4.0]["lent_slots"]),
        "tok_s_headroom_4": f0(by_headroom[4.0]["prefill_tok_s"]),
        "tok_s_headroom_7": f0(by_headroom[7.0]["prefill_tok_s"]),
        "fork_headroom_gib": f2(fork["headroom_gib"]), "fork_covered": f0(fork["covered_lent_slots"]),
        "conv_on_ttft": f2(conversation["on"]["ttft_s"]), "conv_off_ttft": f2(conversation["off"]["ttft_s"]),
        "conv_resumed": f0(conversation["on"]["resumed_tokens"]),
        "conv_restore_ms": f1(conversation["on"]["restore_ms"]),
        "conv_parked_mib": f0(conversation["on"]["parked_mib"]),
    }
    reserve_fig = svg.line_chart(
        "ds4 #504 per-class caches on the 96 GB card: decode tok/s against the VRAM reserve",
        "DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB", "decode tok/s",
        [{"name": "decode tok/s", "x": RESERVES_GIB, "y": [r["decode_tok_s"] for r in reserve_rows]}],
        y_min=0, x_ticks=list(RESERVES_GIB),
        note="scenarios/ds4-504-per-class.toml with the reserve set; budget 9472 (every q2 expert)")
    headroom_fig = svg.line_chart(
        "Strata v0.1.35, --expert-cache 5400: lent slots kept in RAM against the resident headroom",
        "STRATA_RESIDENT_HEADROOM_GIB", "experts",
        [{"name": "lent slots with a RAM copy", "x": [r["headroom_gib"] for r in headroom_rows],
          "y": [r["covered_lent_slots"] for r in headroom_rows]},
         {"name": "file-blob reads during the prompt", "x": [r["headroom_gib"] for r in headroom_rows],
          "y": [r["file_blob_reads"] for r in headroom_rows]}],
        y_min=0, note="scenarios/strata-658-borrow.toml as variant v0.1.35 with the headroom set")
    return Exhibit({"scenarios": ["scenarios/ds4-504-per-class.toml", "scenarios/strata-658-borrow.toml",
                                  "scenarios/conversation-aba.toml"]},
                   {"reserve": reserve_rows, "headroom": headroom_rows, "conversation": conversation},
                   numbers, {"memory-reserve": reserve_fig, "memory-headroom": headroom_fig})


# ------------------------------------------------------------------------------------------ I/O paths


@exhibit("io-paths")
def io_paths() -> Exhibit:
    """Time to bring one expert to the GPU on each path, on an idle machine: the machine's own figures for the
    copies the ds4 model makes (sim/machine; each expert is 3 parts)."""
    import simpy

    from sim.engines.ds4.geometry import expert_bytes
    from sim.engines.ds4.loads import PARTS_PER_EXPERT
    from sim.simulate import extent_bytes
    from sim.machine import Machine
    from sim.scenario import load_scenario

    path = SCENARIOS / "ds4-504-per-class.toml"
    scenario = load_scenario(path)
    machine = Machine(simpy.Environment(), scenario.hardware_profile, extent_bytes(scenario.layout))
    parts = PARTS_PER_EXPERT
    classes = {}
    for x in scenario.layout.layers:
        classes.setdefault((x.gate_bytes, x.down_bytes), expert_bytes(x.gate_bytes, x.down_bytes))
    sizes = dict(zip(("q2", "q4"), classes.values()))
    ssd = machine.ssd
    sync_s = machine.sync_s

    def ssd_qd1_s(n_bytes: int) -> float:  # one reader: parts one after another at queue depth 1
        return parts * (ssd.latency_s + n_bytes / parts / ssd.rate_at(1))

    def ms(seconds: float) -> float:
        return 1e3 * seconds

    paths = {
        "hit: D2D copy slab -> staging": lambda b: ms(parts * machine.memcpy_call_s + b / machine.d2d.bytes_per_s),
        "miss from pinned RAM (H2D only)": lambda b: ms(machine.h2d.cost_s(b, parts) + parts * sync_s),
        "miss from the page cache": lambda b: ms(b / machine.memcpy_bytes_per_s + machine.h2d.cost_s(b, parts)
                                                 + parts * sync_s),
        "miss from the SSD, O_DIRECT QD1": lambda b: ms(ssd_qd1_s(b) + machine.h2d.cost_s(b, parts) + parts * sync_s),
    }
    data = {"paths": list(paths), **{k: [fn(b) for fn in paths.values()] for k, b in sizes.items()}}
    runs = {}
    for label, value in (("page_cache", "1"), ("o_direct", "0")):
        s = run("ds4-504-per-class", (("engine.env.DS4_CUDA_NO_DIRECT_IO", value),)).summary
        runs[label] = {"decode_tok_s": s["decode_tok_s"], "prefill_tok_s": s["prefill_tok_s"],
                       "miss_source": s["engine_state"]["miss_source"]}
    data["runs"] = runs
    hw = scenario.hardware_profile
    numbers = {
        "d2d_q4": f2(data["q4"][0]), "pinned_q4": f2(data["q4"][1]), "page_q4": f2(data["q4"][2]),
        "ssd_q4": f2(data["q4"][3]), "page_q2": f2(data["q2"][2]), "ssd_q2": f2(data["q2"][3]),
        "memcpy_gbps": f1(hw.host.memcpy_gbps.value), "ssd_qd1_gbps": f1(hw.ssd_read_gbps(1)),
        "h2d_gbps": f1(hw.pcie.h2d_pinned_gbps.value), "d2d_gbps": f0(hw.d2d.copy_gbps.value),
        "ssd_qd8_gbps": f1(hw.ssd_read_gbps(8)),
        "page_decode": f1(runs["page_cache"]["decode_tok_s"]), "direct_decode": f1(runs["o_direct"]["decode_tok_s"]),
        "page_prefill": f0(runs["page_cache"]["prefill_tok_s"]), "direct_prefill": f0(runs["o_direct"]["prefill_tok_s"]),
    }
    strata = run("strata-658-own").summary["engine_state"]
    box = load_scenario(SCENARIOS / "strata-658-own.toml").hardware_profile
    numbers.update({"strata_stager_gbps": f1(strata["stager_threads"] * box.host.memcpy_gbps.value),
                    "strata_pinned_gbps": f1(box.pcie.h2d_pinned_gbps.value)})
    fig = svg.bar_chart("ms to bring one expert (3 parts) to the compute buffer, RTX PRO 6000 profile",
                        ["D2D hit", "pinned RAM", "page cache", "SSD O_DIRECT"],
                        [{"name": f"q2 expert ({sizes['q2'] / MIB:.2f} MiB)", "values": data["q2"]},
                         {"name": f"q4 expert ({sizes['q4'] / MIB:.2f} MiB)", "values": data["q4"]}],
                        "ms per expert", horizontal=True,
                        note="the machine's figures on an idle machine (sim/machine), rtx-pro-6000-96gb.toml")
    return Exhibit({"scenario": "scenarios/ds4-504-per-class.toml",
                    "hardware": "scenarios/hardware/rtx-pro-6000-96gb.toml",
                    "function": "sim.machine.Machine: Server.cost_s, Ssd.rate_at"},
                   data, numbers, {"io-paths": fig})


# ------------------------------------------------------------------------------------------ links

LINK_NAMES = {"H2D copy engine (PCIe)": "PCIe H2D", "GPU compute stream": "GPU compute", "host DRAM": "host memcpy"}


@exhibit("links")
def links() -> Exhibit:
    """Busy time of every link against the simulated time: a serial chain vs a copy stream beside compute."""
    runs = {"ds4 #504 per class": "ds4-504-per-class", "Strata #658 own": "strata-658-own"}
    data = {}
    for label, name in runs.items():
        s = run(name).summary
        data[label] = {"simulated_s": s["simulated_s"], "gpu_idle_s": s["gpu_idle_s"],
                       "links": {LINK_NAMES.get(l["link"], l["link"]): l["busy_s"] for l in s["links"]},
                       "host_threads": [LINK_NAMES.get(l["link"], l["link"]) for l in s["links"] if l["host_thread"]]}
    names = []
    for d in data.values():
        names += [n for n, busy in d["links"].items() if busy > 0 and n not in names]
    categories = []
    series = {n: [] for n in names + ["simulated time"]}
    for label, d in data.items():
        categories += [f"{label}: links busy", f"{label}: simulated"]
        for n in names:
            series[n] += [d["links"].get(n) or None, None]
        series["simulated time"] += [None, d["simulated_s"]]
    ds4, strata = data["ds4 #504 per class"], data["Strata #658 own"]
    numbers = {
        "ds4_device_sum": f2(sum(v for n, v in ds4["links"].items() if n not in ds4["host_threads"])),
        "ds4_simulated": f2(ds4["simulated_s"]),
        "ds4_idle_share": pct(ds4["gpu_idle_s"] / ds4["simulated_s"], 0),
        "ds4_memcpy_s": f2(ds4["links"]["host memcpy"]), "ds4_compute_s": f2(ds4["links"]["GPU compute"]),
        "strata_device_sum": f2(sum(v for n, v in strata["links"].items() if n not in strata["host_threads"])),
        "strata_simulated": f2(strata["simulated_s"]),
        "strata_h2d_s": f2(strata["links"]["PCIe H2D"]), "strata_compute_s": f2(strata["links"]["GPU compute"]),
        "strata_h2d_util": pct(strata["links"]["PCIe H2D"] / strata["simulated_s"], 0),
    }
    fig = svg.bar_chart("Seconds each link is busy, stacked, against the simulated time of the run",
                        categories, [{"name": n, "values": v} for n, v in series.items()], "seconds",
                        horizontal=True, stacked=True,
                        note="summary['links'] of scenarios/ds4-504-per-class.toml and strata-658-own.toml")
    return Exhibit({"scenarios": ["scenarios/ds4-504-per-class.toml", "scenarios/strata-658-own.toml"]},
                   data, numbers, {"links": fig})


# ------------------------------------------------------------------------------------------ ds4 #504


@exhibit("ds4-504")
def ds4_504() -> Exhibit:
    """The two seed scenarios of ds4 #503/#504, side by side."""
    data, numbers = {}, {}
    for arm in ("slab", "per-class"):
        r = run(f"ds4-504-{arm}")
        s, st = r.summary, r.summary["engine_state"]
        steps = r.steps[(r.steps["request"] == s["measured_request"]) & (r.steps["phase"] == "decode")]
        per_layer = steps.groupby("layer")[["hits", "lookups"]].sum()
        data[arm] = {"decode_hit_by_layer": (per_layer["hits"] / per_layer["lookups"]).tolist(),
                     "decode_tok_s": s["decode_tok_s"], "prefill_tok_s": s["prefill_tok_s"],
                     "decode_hit_rate": s["decode_hit_rate"], "cache_slots_per_class": st["cache_slots_per_class"],
                     "size_changes": st["slab_size_changes"], "flushes": st["flushes_per_pool"],
                     "notices": len(st["notices"]), "belady": s["belady_decode_hit_rate"],
                     "host_calls_s": sum(l["busy_s"] for l in s["links"] if l["link"].startswith("ds4 ")),
                     "simulated_s": s["simulated_s"]}
        key = arm.replace("-", "_")
        numbers.update({f"{key}_decode_tok_s": f1(s["decode_tok_s"]), f"{key}_prefill_tok_s": f0(s["prefill_tok_s"]),
                        f"{key}_decode_hit": pct(s["decode_hit_rate"]), f"{key}_notices": f0(len(st["notices"]))})
    slab, per_class = data["slab"], data["per-class"]
    numbers.update({
        "ratio": f1(per_class["decode_tok_s"] / slab["decode_tok_s"]),
        "slab_decode_size_changes": f0(slab["size_changes"]["decode"]),
        "slab_flushes": f0(sum(slab["flushes"])), "slab_host_calls_s": f1(slab["host_calls_s"]),
        "q2_slots": f0(per_class["cache_slots_per_class"][0]), "q4_slots": f0(per_class["cache_slots_per_class"][1]),
        "belady": pct(per_class["belady"]),
        "q4_layer_hit": pct(float(np.mean(per_class["decode_hit_by_layer"][37:]))),
        "q2_layer_hit": pct(float(np.mean(per_class["decode_hit_by_layer"][:37]))),
    })
    layers = list(range(len(per_class["decode_hit_by_layer"])))
    fig = svg.line_chart("Decode hit rate per layer, measured request (DeepSeek-V4-Flash q2-q4, 96 GB card)",
                         "layer", "decode hit rate",
                         [{"name": "per-class caches (pr504)", "x": layers, "y": per_class["decode_hit_by_layer"]},
                          {"name": "one slab (pre-504)", "x": layers, "y": slab["decode_hit_by_layer"]}],
                         y_min=0, y_max=1, x_ticks=layers[::6],
                         note="steps.parquet of scenarios/ds4-504-per-class.toml and ds4-504-slab.toml")
    return Exhibit({"scenarios": ["scenarios/ds4-504-slab.toml", "scenarios/ds4-504-per-class.toml"]},
                   data, numbers, {"ds4-504-layers": fig})


# ------------------------------------------------------------------------------------------ Strata #658

STRATA_SEEDS = ("strata-658-borrow", "strata-658-own", "strata-658-auto-borrow", "strata-658-auto-own")


@exhibit("strata-658")
def strata_658() -> Exhibit:
    """The four #658 seed scenarios: where the prompt time goes with borrowed and owned buffers."""
    data = {}
    for name in STRATA_SEEDS:
        s = run(name).summary
        st = s["engine_state"]
        req = st["requests"][s["measured_request"]]
        data[name] = {"cache_slots": s["cache_slots"], "cache_mib": s["cache_mib"], "lent_slots": s["lent_slots"],
                      "file_blob_reads": s["file_blob_reads"], "buffer_mib": s["prefill_buffer_mib"],
                      "owned": st["owned"], "chunk": st["chunk"], "prefill_tok_s": s["prefill_tok_s"],
                      "pp_ms": req["pp_ms"], "refill_ms": req["refill_ms"], "prefill_ms": req["prefill_ms"],
                      "notices": st["notices"]}
    b, o = data["strata-658-borrow"], data["strata-658-own"]
    numbers = {"own_over_borrow": f2(o["prefill_tok_s"] / b["prefill_tok_s"]),
               "borrow_refill_ms": f0(b["refill_ms"]), "borrow_pp_ms": f0(b["pp_ms"]), "own_pp_ms": f0(o["pp_ms"]),
               "borrow_prefill_ms": f0(b["prefill_ms"]), "own_prefill_ms": f0(o["prefill_ms"]),
               "auto_slots": f0(data["strata-658-auto-own"]["cache_slots"]),
               "auto_tok_s": f0(data["strata-658-auto-own"]["prefill_tok_s"])}
    labels = {"strata-658-borrow": "5400, borrow", "strata-658-own": "5400, own",
              "strata-658-auto-borrow": "auto, borrow", "strata-658-auto-own": "auto, own allowed"}
    fig = svg.bar_chart("Where the measured 17,944-token prompt's time goes (ms)", list(labels.values()),
                        [{"name": "batched chunks", "values": [data[n]["pp_ms"] for n in labels]},
                         {"name": "refill of the lent slots", "values": [data[n]["refill_ms"] for n in labels]},
                         {"name": "short parts (last token)",
                          "values": [data[n]["prefill_ms"] - data[n]["pp_ms"] - data[n]["refill_ms"] for n in labels]}],
                        "ms", stacked=True, note="engine_state['requests'] of the four strata-658-*.toml scenarios")
    return Exhibit({"scenarios": [f"scenarios/{n}.toml" for n in STRATA_SEEDS]}, data, numbers, {"strata-658": fig})


# ------------------------------------------------------------------------------------------ Strata reserve

STRATA_RESERVES_MIB = (700, 1536, 3072, 6144)


@exhibit("strata-reserve")
def strata_reserve() -> Exhibit:
    """Strata's --vram-reserve-mib with the auto cache: what each MiB kept free costs in slots."""
    rows = []
    for mib in STRATA_RESERVES_MIB:
        s = run("strata-658-auto-own", (("engine.flags.vram-reserve-mib", mib),)).summary
        st = s["engine_state"]
        rows.append({"reserve_mib": mib, "cache_slots": s["cache_slots"], "cache_mib": s["cache_mib"],
                     "owned": st["owned"], "lent_slots": s["lent_slots"], "prefill_tok_s": s["prefill_tok_s"],
                     "decode_hit_rate": s["decode_hit_rate"]})
    by = {r["reserve_mib"]: r for r in rows}
    numbers = {"slots_700": f0(by[700]["cache_slots"]), "slots_1536": f0(by[1536]["cache_slots"]),
               "slots_6144": f0(by[6144]["cache_slots"]), "tok_s_700": f0(by[700]["prefill_tok_s"]),
               "tok_s_1536": f0(by[1536]["prefill_tok_s"]), "tok_s_6144": f0(by[6144]["prefill_tok_s"])}
    return Exhibit({"scenario": "scenarios/strata-658-auto-own.toml",
                    "grid": {"engine.flags.vram-reserve-mib": list(STRATA_RESERVES_MIB)}}, {"rows": rows}, numbers)


# ------------------------------------------------------------------------------------------ calibration


@exhibit("calibration")
def calibration() -> Exhibit:
    """The committed H200 calibration, refitted from its raw samples, and the engines' way vs the gather."""
    from sim.calibrate import api

    path = SCENARIOS / "hardware" / "calibration" / "h200.json"
    record = api.refit(path, None)["record"]
    params = {(r["path"], r["way"]): r for r in api.report_rows(record)["parameters"]}
    rows = record["references"]["engine_vs_gather"]
    data = {"engine_vs_gather": rows, "parameters": [params[k] for k in sorted(params)]}
    fit_all = record["fit_error"]["all"]
    h2d, d2d = params[("h2d", "ce_sync")], params[("d2d", "ce_sync")]
    published = {n: json.loads((SCENARIOS / "hardware" / "calibration" / f"{n}.json").read_text())["status"]
                 for n in ("rtx-5090", "rtx-pro-6000")}
    numbers = {"h2d_gbps": f1(h2d["gbps"]), "h2d_per_copy_us": f1(h2d["per_copy_us"]),
               "d2d_per_copy_us": f1(d2d["per_copy_us"]), "d2d_gbps": f0(d2d["gbps"]),
               "fit_median": pct(fit_all["median"]), "fit_p95": pct(fit_all["p95"]),
               "samples": f0(len(record["samples"]["rows"])), "status_5090": published["rtx-5090"],
               "status_pro": published["rtx-pro-6000"]}
    by = {(r["path"], r["experts"]): r for r in rows if r["size_bytes"] == 4 * MIB}
    counts = sorted({n for _, n in by})
    for n in (1, 512):
        numbers[f"d2d_speedup_{n}"] = f1(by[("d2d", n)]["speedup"])
    fig = svg.line_chart("H200, 4 MiB experts: host time per step, the engines' way vs one gather launch",
                         "experts per step", "microseconds per step",
                         [{"name": "D2D, one cudaMemcpyAsync + sync per copy", "x": counts,
                           "y": [by[("d2d", n)]["ce_sync_us"] for n in counts]},
                          {"name": "D2D, gather kernel", "x": counts, "y": [by[("d2d", n)]["gather_us"] for n in counts]},
                          {"name": "H2D, one copy + sync per copy", "x": counts,
                           "y": [by[("h2d", n)]["ce_sync_us"] for n in counts], "dashed": True},
                          {"name": "H2D, gather from mapped memory", "x": counts,
                           "y": [by[("h2d", n)]["gather_us"] for n in counts], "dashed": True}],
                         log_x=True, log_y=True, x_ticks=counts,
                         note="references.engine_vs_gather of scenarios/hardware/calibration/h200.json")
    return Exhibit({"file": "scenarios/hardware/calibration/h200.json",
                    "function": "sim.calibrate.api.refit (expertsim calibrate --from-samples)"},
                   data, numbers, {"calibration": fig})


# ------------------------------------------------------------------------------------------ validation

# Seed measurements: (scenario, summary path, measured value, what it is, where it is stated).
MEASURED = (
    ("ds4-504-per-class", "decode_tok_s", 25.0, "decode tok/s, per-class caches", "ds4 PR #504: \"~25 t/s sustained decode\""),
    ("ds4-504-per-class", "decode_hit_rate", 0.97, "decode hit rate, per-class caches", "ds4 PR #504: \"97% cache hit rate\""),
    ("ds4-504-slab", "decode_tok_s", 0.9, "decode tok/s, one slab", "ds4 PR #504: \"~0.9 t/s\" (a run that did not finish)"),
    ("strata-658-borrow", "cache_slots", 7056, "--expert-cache 5400: slots", "#658: \"7056 slots / 13709 MiB\""),
    ("strata-658-borrow", "cache_mib", 13709, "--expert-cache 5400: MiB", "#658: \"7056 slots / 13709 MiB\""),
    ("strata-658-borrow", "lent_slots", 1972, "borrowing: lent slots", "#658: \"lent 1972 slots\""),
    ("strata-658-borrow", "file_blob_reads", 1799, "borrowing: file-blob reads", "#658: \"1799 additional file-blob reads\""),
    ("strata-658-borrow", "prefill_tok_s", 2311.6, "borrowing: prompt tok/s", "#658: 2311.6 tok/s"),
    ("strata-658-own", "prefill_buffer_mib", 3805, "own buffers: MiB", "#658: \"independent buffers were 3805 MiB\""),
    ("strata-658-own", "file_blob_reads", 0, "own buffers: file-blob reads", "#658: \"zero file-blob reads\""),
    ("strata-658-own", "prefill_tok_s", 2901.7, "own buffers: prompt tok/s", "#658: 2901.7 tok/s"),
    ("strata-658-auto-borrow", "cache_slots", 10222, "auto cache: slots", "#658: \"equal 10222 expert slots\""),
    ("strata-658-auto-borrow", "prefill_tok_s", 2924.7, "auto cache, upstream: prompt tok/s", "#658: 2924.7 tok/s"),
    ("strata-658-auto-own", "prefill_tok_s", 2919.0, "auto cache, fork: prompt tok/s", "#658: 2919.0 tok/s"),
    ("conversation-aba", "engine_state.conversation_cache.restore_ms_984_tokens", 26.0,
     "984-token checkpoint restore, ms", "#658: \"about 26 ms\""),
)


@exhibit("validation")
def validation() -> Exhibit:
    """Every seed measurement against the seed scenario that reproduces its setup, with the error."""
    rows = []
    for name, key, measured, what, source in MEASURED:
        value = run(name).summary
        for part in key.split("."):
            value = value[part]
        error = None if measured == 0 else (value - measured) / measured
        rows.append({"scenario": name, "metric": key.rsplit(".", 1)[-1], "what": what, "measured": measured,
                     "simulated": value, "error": error, "source": source})
    by = {(r["scenario"], r["metric"]): r for r in rows}
    numbers = {"restore_984_ms": f1(by[("conversation-aba", "restore_ms_984_tokens")]["simulated"]),
               "borrow_error": signed_pct(by[("strata-658-borrow", "prefill_tok_s")]["error"]),
               "auto_error": signed_pct(by[("strata-658-auto-borrow", "prefill_tok_s")]["error"])}
    return Exhibit({"scenarios": sorted({f"scenarios/{n}.toml" for n, *_ in MEASURED}),
                    "measured": "../shared/seeds/ (ds4 PR #504, Strata #658)"}, {"rows": rows}, numbers)


# ------------------------------------------------------------------------------------------ design


@exhibit("design")
def design() -> Exhibit:
    """What coarse events cost, and overlap emerging: SimPy events against layer steps and expert lookups of
    one run; ds4 #1082's pread pool on and off (O_DIRECT misses, a 2,048-expert budget)."""
    r = run("ds4-504-per-class")
    steps = r.steps
    requests = r.timings
    decode_tokens = int(requests["decode_tokens"].sum())
    prefill = steps[steps["phase"] == "prefill"]
    chunks = int(prefill.groupby(["request", "step"]).ngroups)
    events = int(r.summary["simulated_events"])
    pool = {}
    for on in ("1", "0"):
        s = run("ds4-504-per-class", (("engine.variant", "pr1082"),
                                      ("engine.flags.ssd-streaming-cache-experts", "2048"),
                                      ("engine.env.DS4_CUDA_NO_DIRECT_IO", None),
                                      ("engine.env.DS4_CUDA_KEEP_MODEL_PAGES", None),
                                      ("engine.env.DS4_CUDA_HITS_FIRST", on),
                                      ("engine.env.DS4_CUDA_STREAMING_EXPERT_PREAD_POOL", on))).summary
        pool[on] = {"decode_tok_s": s["decode_tok_s"], "gpu_idle_s": s["gpu_idle_s"], "simulated_s": s["simulated_s"]}
    numbers = {"lookups": f0(steps["lookups"].sum()), "layer_steps": f0(len(steps)), "events": f0(events),
               "events_per_step": f1(events / len(steps)), "decode_tokens": f0(decode_tokens), "chunks": f0(chunks),
               "pool_on_tok_s": f1(pool["1"]["decode_tok_s"]), "pool_off_tok_s": f1(pool["0"]["decode_tok_s"]),
               "pool_on_idle": pct(pool["1"]["gpu_idle_s"] / pool["1"]["simulated_s"], 0),
               "pool_off_idle": pct(pool["0"]["gpu_idle_s"] / pool["0"]["simulated_s"], 0)}
    return Exhibit({"scenario": "scenarios/ds4-504-per-class.toml"},
                   {"lookups": int(steps["lookups"].sum()), "layer_steps": len(steps), "events": events,
                    "pread_pool": pool}, numbers)

# ------------------------------------------------------------------------------------------ validation cases


@exhibit("validation-cases")
def validation_cases() -> Exhibit:
    """Every validation case (scenarios/validation/) through `expertsim validate`: predicted vs measured."""
    from sim.explore.validate import validate_all

    record = validate_all(workers=2)
    rows = [{k: r[k] for k in ("case", "title", "role", "metric", "kind", "arms", "predicted", "measured_low",
                               "measured_high", "predicted_effect", "measured_effect_low", "measured_effect_high",
                               "sign_agrees", "error", "tolerance", "within", "failed", "source", "note")}
            | {"out_of_domain": len(r["out_of_domain"])} for r in record["rows"]]
    t = record["totals"]
    judged = t["prediction_rows_judged"]
    numbers = {"cases": f0(t["cases"]), "expressible": f0(t["expressible"]),
               "calibration_cases": f0(t["calibration_cases"]),
               "within": f0(t["prediction_rows_within"]), "judged": f0(judged),
               "ratio_rows": f0(t["ratio_rows"]), "ratio_within": f0(t["ratio_rows_within"]),
               "ratio_wrong_sign": f0(t["ratio_rows_wrong_sign"]),
               "within_share": pct(t["prediction_rows_within"] / judged, 0) if judged else "-"}
    return Exhibit({"cases": "scenarios/validation/*.toml", "command": "expertsim validate"},
                   {"rows": rows, "totals": t}, numbers)


# ------------------------------------------------------------------------------------------ generator honesty

HONESTY_STATS = (("reuse_prefill_mean", "adjacent-token reuse, prefill"), ("reuse_decode_mean",
                 "adjacent-token reuse, decode"), ("entropy_norm_median", "popularity entropy (median layer)"),
                 ("entropy_norm_min", "popularity entropy (lowest layer)"),
                 ("hottest_over_uniform_max", "hottest expert / uniform (max over layers)"))


# Exhibits drawn from real data outside the repository (../shared/data, beside the checkout in CI): the file each reads
MIXTRAL_ROUTING = ROOT.parent / "shared" / "data" / "mixtral-routing" / "routing_raw.jsonl"
SHARED_DATA = {"generator-honesty": MIXTRAL_ROUTING}


@exhibit("generator-honesty")
def generator_honesty() -> Exhibit:
    """The generator against real routing: the Mixtral per-token trace of ../shared/data (the same prompt and
    decode lengths, 8 generated requests), and Qwen3.8-Flash-Next's measured profile coverage."""
    from sim.trace.generate import generate_trace
    from sim.trace.importers import import_trace
    from sim.trace.stats import trace_stats

    real = trace_stats(import_trace(MIXTRAL_ROUTING, n_experts=8))["summary"]
    ours = trace_stats(generate_trace("mixtral-8x7b", 135, 83, 0, requests=8))["summary"]
    rows = []
    for key, what in HONESTY_STATS:
        r, o = real.get(key), ours.get(key)
        rows.append({"model": "mixtral-8x7b", "statistic": what, "real": r, "generated": o,
                     "error": None if r in (None, 0) or o is None else (o - r) / r})
    trace = generate_trace("qwen3.8-flash-next-iq3s", 0, 20000, 0)
    counts = np.bincount((trace.experts.astype(np.int64) + (np.arange(48) * 512)[None, :, None]).ravel(),
                         minlength=48 * 512)
    share = np.cumsum(np.sort(counts)[::-1]) / counts.sum()
    from sim.trace.generator_spec import QWEN38_PROFILE_COVERAGE

    for n, measured in QWEN38_PROFILE_COVERAGE:
        rows.append({"model": "qwen3.8-flash-next-iq3s", "statistic": f"routed mass of the top {n:,} pairs",
                     "real": measured, "generated": float(share[n - 1]),
                     "error": (float(share[n - 1]) - measured) / measured})
    numbers = {"mixtral_reuse_error": signed_pct(rows[1]["error"]),
               "qwen_top5805_generated": pct(rows[len(HONESTY_STATS)]["generated"], 0)}
    return Exhibit({"real": ["../shared/data/mixtral-routing/routing_raw.jsonl (Mario928/speculative-moe)",
                             "reference/validation-cases.md: Qwen3.8 profile coverage"],
                    "generated": "generate_trace(mixtral-8x7b, 135, 83, seed 0, 8 requests); "
                                 "generate_trace(qwen3.8-flash-next-iq3s, 0, 20000, seed 0)"}, {"rows": rows}, numbers)


# ------------------------------------------------------------------------------------------ generator locality

LOCALITY_PRESETS = ("deepseek-v4-flash-q2", "qwen3.8-flash-next-iq3s", "deepseek-v2-lite", "qwen3-30b-a3b",
                    "mixtral-8x7b")


@exhibit("generator-locality")
def generator_locality() -> Exhibit:
    """The generator against the published locality curves (routing-traces.md §6): every locality target of the
    presets that have one, re-measured on traces generated the way each study ran (sim.trace.generator_targets)."""
    from sim.trace.generator_targets import locality_report

    rows = [{k: r[k] for k in ("preset", "target", "kind", "size", "measured", "generated", "error", "tolerance",
                               "within", "fit")}
            for preset in LOCALITY_PRESETS for r in locality_report(preset)]
    checks = [r for r in rows if not r["fit"]]
    worst = max(abs(r["error"]) for r in rows)
    numbers = {"figures": f0(len(rows)), "within": f0(sum(r["within"] for r in rows)),
               "checks": f0(len(checks)), "worst_points": f1(100 * worst)}
    return Exhibit({"generated": "sim.trace.generator_targets.locality_report(preset) for " + ", ".join(LOCALITY_PRESETS),
                    "measured": "each target's source in sim/trace/generator_spec.py"}, {"rows": rows}, numbers)
