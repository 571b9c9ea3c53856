"""The ds4 engine model against PR #504's measurements (seeds/ds4-504-per-size-class-expert-caches.txt).

Measured: before #504 ~0.9 tok/s and the cache never warms; after it ~25 tok/s sustained decode at 97 %
hit rate (RTX PRO 6000 96 GB, Flash q2-q4 GGUF from the page cache, budget 9472, reserve 12 GiB).
Targets: each tok/s within +-35 %, per-class/slab decode ratio >= 10, hit rate 0.90-0.99.
A target the model does not meet yet is an xfail(strict) test that states the simulated figure: it turns
into a failure the day the model meets it, so the bands and docs/validation.md get updated.
"""

import json
from pathlib import Path

import pandas as pd
import pytest

from sim.results import write_results
from sim.simulate import run_scenario
from sim.scenario import load_scenario
from sim.units import GIB

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
MEASURED_PER_CLASS_TOK_S = 25.0  # PR #504: "~25 t/s sustained decode"
MEASURED_SLAB_TOK_S = 0.9  # PR #504: "not finishing within 400s (~0.9 t/s)"
TOK_S_TOLERANCE = 0.35


@pytest.fixture(scope="module")
def per_class():
    return run_scenario(load_scenario(SCENARIOS / "ds4-504-per-class.toml"))


@pytest.fixture(scope="module")
def slab():
    return run_scenario(load_scenario(SCENARIOS / "ds4-504-slab.toml"))


def relative_error(simulated: float, measured: float) -> float:
    return (simulated - measured) / measured


def test_per_class_decode_tok_s_within_35_percent(per_class):
    error = relative_error(per_class.summary["decode_tok_s"], MEASURED_PER_CLASS_TOK_S)
    assert abs(error) <= TOK_S_TOLERANCE, f"simulated {per_class.summary['decode_tok_s']:.1f} tok/s, error {error:+.0%}"


def test_per_class_decode_hit_rate_in_band(per_class):
    assert 0.90 <= per_class.summary["decode_hit_rate"] <= 0.99  # measured 97 %


def test_slab_never_warms(slab):
    # "the cache never warms": every decode lookup misses, because every q2<->q4 transition releases it
    assert slab.summary["decode_hit_rate"] == 0.0
    # and the cap notice repeats at every transition (the "permanent cap-notice flood" of #503)
    assert len(slab.summary["engine_state"]["notices"]) >= slab.timings["decode_tokens"].sum()


@pytest.mark.xfail(strict=True, reason="simulated ~2.7 tok/s vs measured ~0.9 (+199 %): the model lacks the "
                   "cost that makes each slab rebuild take ~1 s; see docs/validation.md")
def test_slab_decode_tok_s_within_35_percent(slab):
    error = relative_error(slab.summary["decode_tok_s"], MEASURED_SLAB_TOK_S)
    assert abs(error) <= TOK_S_TOLERANCE, f"simulated {slab.summary['decode_tok_s']:.2f} tok/s, error {error:+.0%}"


@pytest.mark.xfail(strict=True, reason="simulated ratio ~7.2 (target >= 10) follows from the slab figure above")
def test_per_class_over_slab_decode_ratio_at_least_10(per_class, slab):
    assert per_class.summary["decode_tok_s"] / slab.summary["decode_tok_s"] >= 10


def test_q2_class_holds_every_q2_expert_and_q4_gets_the_leftover(per_class):
    caps = per_class.summary["engine_state"]["cache_slots_per_class"]
    assert caps[0] == 9472 == 37 * 256  # ds4-engine.md §1.12: the budget is exactly all q2 experts
    # §1.12 estimates ~285 q4 slots with a 3.375 GiB q4 prefill staging buffer, ~534 with decode-sized
    # staging; the simulated staging is the largest chunk union actually routed (below 256 experts)
    assert 285 <= caps[1] <= 534


def test_runs_are_deterministic(per_class):
    again = run_scenario(load_scenario(SCENARIOS / "ds4-504-per-class.toml"))
    assert again.summary == per_class.summary
    pd.testing.assert_frame_equal(again.steps, per_class.steps)


@pytest.mark.parametrize("name", ["ds4-504-per-class", "glm52-mtp-per-class"])
def test_a_tokens_lookups_in_one_call_change_nothing(name, monkeypatch):
    """Issue 33: a decode token's cache lookups in one kernel call (CudaDecode.lookups) give the run the same
    steps and summary as each step looking up for itself (its own prepare and lookup), MTP layers included."""
    from sim.engines.ds4.decode import CudaDecode

    scenario = load_scenario(SCENARIOS / f"{name}.toml")
    batched_tokens = []
    ahead = CudaDecode.lookups

    def counted(self, layers, experts):
        found = ahead(self, layers, experts)
        batched_tokens.append(found is not None)
        return found

    monkeypatch.setattr(CudaDecode, "lookups", counted)
    one_call = run_scenario(scenario)
    monkeypatch.setattr(CudaDecode, "lookups", lambda self, layers, experts: None)
    monkeypatch.setattr(CudaDecode, "prepared_lookups", lambda self, layers, experts: (None, None))
    per_step = run_scenario(scenario)
    assert sum(batched_tokens) > 0.9 * len(batched_tokens)  # the path under test ran
    pd.testing.assert_frame_equal(one_call.steps, per_step.steps)
    assert one_call.summary == per_step.summary


@pytest.mark.parametrize("name, variant, least_chained", [
    ("ds4-504-per-class", None, 5000), ("ds4-504-per-class", "pr605-cache", 5000),
    ("ds4-504-per-class", "pr1031", 5000), ("glm52-mtp-per-class", None, 20)])
@pytest.mark.parametrize("summary_only", [False, True])
def test_layers_done_as_chains_change_nothing(name, variant, least_chained, summary_only, monkeypatch):
    """Issue 33: decode layers whose experts all hit, done as chains of the machine's jobs (CudaDecode.chain,
    sim/machine/chains.py), give the same steps, copies, links and summary as each layer's jobs issued one at a
    time: D2D copies per expert (pr504), a gather kernel (pr605-cache), no hand-over (pr1031), MTP layers; a sweep
    point's run (summary only, the first job of each log) too."""
    from sim.engines.ds4 import decode
    from sim.engines.ds4.decode import CudaDecode
    from sim.schema import read_toml

    path = SCENARIOS / f"{name}.toml"
    data = read_toml(path, str(path))
    if variant:
        data["engine"]["variant"] = variant
    scenario = load_scenario(path, data)
    chained = []
    chain = CudaDecode.chain

    def counted(self, request, phase, step_no, layers, k):
        chained.append(len(layers))
        return chain(self, request, phase, step_no, layers, k)

    monkeypatch.setattr(CudaDecode, "chain", counted)
    monkeypatch.setattr(decode, "CHAIN_MIN_LAYERS", 1)  # every run of hits a chain, the shortest too
    monkeypatch.setattr(CudaDecode, "chain_tokens", False)  # (whole tokens as one call: the test below)
    with_chains = run_scenario(scenario, summary_only=summary_only)
    monkeypatch.setattr(CudaDecode, "chain_hits", False)
    one_at_a_time = run_scenario(scenario, summary_only=summary_only)
    assert sum(chained) >= least_chained  # the path under test ran
    _assert_same_results(with_chains, one_at_a_time)


def _assert_same_results(run, reference) -> None:
    """The same summary, steps, copies and links."""
    from sim.results import link_frame

    assert run.summary == reference.summary
    pd.testing.assert_frame_equal(run.steps, reference.steps)
    pd.testing.assert_frame_equal(run.copies, reference.copies)
    pd.testing.assert_frame_equal(link_frame(run.links), link_frame(reference.links))


@pytest.mark.parametrize("name, variant, env, least_steps", [
    ("ds4-504-per-class", None, {}, 10000), ("ds4-504-per-class", "pr605-cache", {}, 10000),
    ("ds4-504-per-class", "pr1031", {}, 10000),
    ("ds4-504-per-class", None, {"DS4_CUDA_KEEP_MODEL_PAGES": "1"}, 10000),  # page-cache hits: no drive read
    ("glm52-mtp-per-class", None, {"DS4_CUDA_NO_DIRECT_IO": "1"}, 100),  # (O_DIRECT takes the step path)
    ("ds4-504-slab", None, {}, 10000),  # the slab freed and reallocated twice a token, inside the call
    ("glm52-mtp-slab", None, {"DS4_CUDA_NO_DIRECT_IO": "1"}, 100)])
@pytest.mark.parametrize("summary_only", [False, True])
def test_tokens_done_in_one_call_change_nothing(name, variant, env, least_steps, summary_only, monkeypatch):
    """Issue 33: decode tokens done in one compiled call, misses included (sim/engines/ds4/decode_chain.py), give
    the same steps, copies, links and summary as each layer's jobs issued one at a time: the page cache's reads and
    drops, the drive's reads, the pread copies on host DRAM, the uploads and their DMA reservations, the hand-over
    (per-expert copies, a gather kernel, none), MTP layers, a pre-504 slab's frees and allocations at each change
    of size class (made ahead, their waits paid in the call); a sweep point's run too."""
    from sim.engines.ds4.decode import CudaDecode
    from sim.engines.ds4.decode_chain import TokenChain
    from sim.schema import read_toml

    path = SCENARIOS / f"{name}.toml"
    data = read_toml(path, str(path))
    if variant:
        data["engine"]["variant"] = variant
    data["engine"].setdefault("env", {}).update(env)
    scenario = load_scenario(path, data)
    chained = []
    run_steps = TokenChain.run_steps

    def counted(self, row, layers, *args):
        chained.append(len(layers))
        return run_steps(self, row, layers, *args)

    monkeypatch.setattr(TokenChain, "run_steps", counted)
    in_one_call = run_scenario(scenario, summary_only=summary_only)
    monkeypatch.setattr(CudaDecode, "chain_tokens", False)
    monkeypatch.setattr(CudaDecode, "chain_hits", False)
    one_at_a_time = run_scenario(scenario, summary_only=summary_only)
    assert sum(chained) >= least_steps  # the path under test ran
    _assert_same_results(in_one_call, one_at_a_time)


def test_results_are_written_with_provenance(per_class, tmp_path):
    files = write_results(per_class, tmp_path)
    summary = json.loads(Path(files["summary"]).read_text())
    for key in ("cache_slots", "cache_mib", "lent_slots", "prefill_buffer_mib", "file_blob_reads",
                "prefill_tok_s", "decode_tok_s", "decode_hit_rate", "ttft_s"):
        assert key in summary
    provenance = summary["provenance"]
    assert len(provenance["scenario_sha256"]) == 64 and len(provenance["trace_sha256"]) == 64
    assert provenance["expertsim"]
    steps = pd.read_parquet(files["steps"])
    copies = pd.read_parquet(files["copy_plan"])
    assert set(copies["kind"]) <= {"H2D", "D2D", "D2H"}
    # every decode hit is three D2D part copies in the plan
    decode_steps = steps.index[steps["phase"] == "decode"]
    d2d = copies[copies["step_id"].isin(decode_steps) & (copies["kind"] == "D2D")]["count"].sum()
    decode = steps.loc[decode_steps]
    assert d2d == 3 * (decode["hits"] + decode["inserts"] + decode["evictions"]).sum()


def test_belady_bound_is_above_the_simulated_decode_hit_rate(per_class, slab):
    s = per_class.summary
    assert s["decode_hit_rate"] <= s["belady_decode_hit_rate"] <= 1.0
    assert s["belady_gap"] == pytest.approx(s["belady_decode_hit_rate"] - s["decode_hit_rate"])
    assert slab.summary["belady_decode_hit_rate"] is None  # no fixed slot count to bound


def test_belady_bound_is_not_below_plain_min_over_the_whole_routing(per_class):
    # plain MIN maximises prompt + decode hits, so its decode hits can only be at or under the decode bound
    import numpy as np

    from sim.cache.replay import Geometry, replay
    from sim.trace.format import Trace, TraceHeader
    from sim.workload import workload_routing

    scenario = load_scenario(SCENARIOS / "ds4-504-per-class.toml")
    r = workload_routing(scenario).requests[per_class.summary["measured_request"]]
    rows = np.concatenate([r.prompt, r.decode])
    phase = np.r_[np.zeros(len(r.prompt)), np.ones(len(r.decode))].astype(np.uint8)
    trace = Trace(TraceHeader(scenario.layout.name, rows.shape[1], 256, 6, "test", ""), np.zeros(len(rows)),
                  np.arange(len(rows)), phase, rows)
    slots = np.array(per_class.summary["engine_state"]["cache_slots_per_class"])
    plain = replay(trace, Geometry.of(trace, scenario.layout), "opt", "class", slots)
    plain_decode = float(plain.per_phase().set_index("phase").loc["decode", "hit_rate"])
    assert plain_decode <= per_class.summary["belady_decode_hit_rate"] + 1e-12


def test_gpu_idle_time_is_what_compute_does_not_cover(per_class):
    compute = next(link for link in per_class.summary["links"] if link["link"] == "GPU compute stream")
    assert per_class.summary["gpu_idle_s"] == pytest.approx(per_class.summary["simulated_s"] - compute["busy_s"])


# ------------------------------------------------------------------------------ hotlist seeding and knobs


def variant_of(name: str, prompt: int = 1000, decode: int = 16, flags: dict | None = None, env: dict | None = None):
    """A scenario file's data with a shorter request and some knobs changed, loaded next to the file."""
    import tomllib

    path = SCENARIOS / name
    data = tomllib.loads(path.read_text())
    data["workload"]["requests"] = [{"prompt_tokens": prompt, "decode_tokens": decode, "measured": True}]
    data["engine"].setdefault("flags", {}).update(flags or {})
    data["engine"].setdefault("env", {}).update(env or {})
    return load_scenario(path, data)


@pytest.mark.xfail(strict=True, reason="the stand-in lists 6,049 pairs against 6,436 (-6.0 %): the generator's "
                   "locality, fitted to V4-Flash's verifier LRU curve, gives routed layers ~133 distinct experts in "
                   "299 tokens against the list's 142 (docs/trace-generator.md)")
def test_builtin_hotlist_stand_in_lists_as_many_pairs_as_ds4s_list():
    """ds4's built-in Flash list holds 6,436 (layer, expert) pairs, 251/252/254 on the hash layers and 103-183
    on the others; Pro's 6,884 (ds4-engine.md §2.5). The stand-in is the preset's own 299-token (Pro: its
    profile length) run ranked by hits; its size is a check of the generator, not of the list."""
    import numpy as np

    from sim.engines.ds4.prefill import builtin_hotlist

    flash = builtin_hotlist("deepseek-v4-flash-q2-q4")
    assert abs(len(flash) - 6436) / 6436 < 0.02
    per_layer = np.bincount(flash // 256, minlength=43)
    assert all(245 <= n <= 256 for n in per_layer[:3])
    assert 90 <= per_layer[3:].min() and per_layer[3:].max() <= 200
    assert abs(len(builtin_hotlist("deepseek-v4-pro")) - 6884) / 6884 < 0.02
    assert builtin_hotlist("glm-5.2") is None  # ds4 ships lists for DeepSeek V4 only


def test_per_class_seeding_adds_nothing_once_the_prompt_filled_the_q2_class(per_class):
    # §1.9: after #504 the first prefill allocates the full class cache; with a 5,000-token prompt the q2
    # class holds more than preload = min(9472, 4096) experts, so every IQ2 layer is skipped.
    seeding = per_class.summary["engine_state"]["hotlist_seeding"]
    assert seeding == {"passes": 1, "loaded": 0, "layers_skipped_full": 37}


def test_slab_seeds_4096_experts_that_the_first_decode_token_throws_away(slab):
    # before #504 the prefill left no cache, so the pass loads preload = 4096 experts into small caches;
    # the first decode token's full-size prepare() grows the slab, which flushes them (§1.4, §1.9)
    state = slab.summary["engine_state"]
    assert state["hotlist_seeding"]["loaded"] == 4096
    seeds = slab.steps[slab.steps["phase"] == "seed"]
    assert seeds["inserts"].sum() + seeds["evictions"].sum() == 4096
    assert slab.summary["decode_hit_rate"] == 0.0


def test_cold_start_skips_the_seeding_pass_and_its_time():
    seeded = run_scenario(variant_of("ds4-504-slab.toml"))
    cold = run_scenario(variant_of("ds4-504-slab.toml", flags={"ssd-streaming-cold": True}))
    assert (cold.steps["phase"] == "seed").sum() == 0
    seed_time = seeded.steps.loc[seeded.steps["phase"] == "seed", ["start_s", "end_s"]]
    spent = (seed_time["end_s"] - seed_time["start_s"]).sum()
    assert spent > 0
    # the seeded run also frees the last seed cache when decode grows the slab: cudaFree of the largest
    # layer's seed count x 6.75 MiB (q2 expert), at the profile's 30 us + 420 us/GiB (rtx-pro-6000-96gb.toml)
    seed_cache_gib = seeded.steps.loc[seeded.steps["phase"] == "seed", "lookups"].max() * 7_077_888 / GIB
    free_s = (30 + 420 * seed_cache_gib) * 1e-6
    assert seeded.summary["ttft_s"] - cold.summary["ttft_s"] == pytest.approx(spent + free_s, rel=1e-6)
    decode_s = [r.timings["end_s"].iloc[-1] - r.timings["prefill_end_s"].iloc[-1] for r in (seeded, cold)]
    assert decode_s[0] - decode_s[1] == pytest.approx(free_s, rel=1e-6)  # nothing of the seeds survives


def test_a_hotlist_file_seeds_its_own_entries(tmp_path):
    hotlist = tmp_path / "hot.csv"
    hotlist.write_text("rank,layer,expert\n0,0,7\n1,1,9\n2,40,3\n3,0,2\n")  # layer 40 is a q4 layer: skipped
    result = run_scenario(variant_of("ds4-504-slab.toml", env={"DS4_METAL_STREAMING_EXPERT_HOTLIST": str(hotlist)}))
    seeds = result.steps[result.steps["phase"] == "seed"]
    assert seeds["layer"].tolist() == [0, 1]
    # layer 0 sizes the seed cache at 2 slots; layer 1's seed (1 <= 2: no growth) evicts the LRU one
    assert seeds["inserts"].tolist() == [2, 0] and seeds["evictions"].tolist() == [0, 1]


@pytest.mark.parametrize("env", [{"DS4_METAL_DISABLE_STREAMING_DECODE_PREFILL": "1"},
                                 {"DS4_METAL_STREAMING_DECODE_PREFILL_MAX": "0"}])
def test_short_prompt_decode_path_can_be_switched_off(env):
    # a 10-token prompt runs token by token through the decode path (<= 18), or as one batch without it
    on = run_scenario(variant_of("ds4-504-per-class.toml", prompt=10, decode=2))
    off = run_scenario(variant_of("ds4-504-per-class.toml", prompt=10, decode=2, env=env))
    prefill_on, prefill_off = (r.steps[r.steps["phase"] == "prefill"] for r in (on, off))
    assert set(prefill_on["tokens"]) == {1} and len(prefill_on) == 10 * 43
    assert set(prefill_off["tokens"]) == {10} and len(prefill_off) == 43


def test_metal_prefill_chunk_applies_when_the_flag_is_absent():
    result = run_scenario(variant_of("ds4-504-per-class.toml", prompt=1000, env={"DS4_METAL_PREFILL_CHUNK": "300"}))
    prefill = result.steps[result.steps["phase"] == "prefill"]
    assert sorted(prefill.groupby("step")["tokens"].first().tolist()) == [100, 300, 300, 300]
    flagged = run_scenario(variant_of("ds4-504-per-class.toml", prompt=1000, flags={"prefill-chunk": 500},
                                      env={"DS4_METAL_PREFILL_CHUNK": "300"}))
    assert flagged.steps[flagged.steps["phase"] == "prefill"]["step"].nunique() == 2


@pytest.mark.parametrize("flags, env, key", [
    ({}, {"DS4_METAL_RESUME_PREFILL_MIN": "8"}, "engine.env.DS4_METAL_RESUME_PREFILL_MIN"),
    ({}, {"DS4_CUDA_DISABLE_STREAMING_PREFILL_BATCH_SELECTED_LOAD": "1"},
     "engine.env.DS4_CUDA_DISABLE_STREAMING_PREFILL_BATCH_SELECTED_LOAD"),
    ({}, {"DS4_METAL_PREFILL_CHUNK": "0"}, "engine.env.DS4_METAL_PREFILL_CHUNK"),
])
def test_knobs_the_model_does_not_simulate_are_refused_by_name(flags, env, key):
    from sim.errors import InputError

    with pytest.raises(InputError) as info:
        run_scenario(variant_of("ds4-504-per-class.toml", flags=flags, env=env))
    assert key in str(info.value) and "\n" not in str(info.value)


def test_copy_chunk_is_accepted_while_every_part_fits_one_chunk():
    # Flash parts are at most 4.5 MiB; the chunk is clamped to >= 16 MiB, so any setting copies a part in one go
    small = run_scenario(variant_of("ds4-504-per-class.toml", env={"DS4_CUDA_MODEL_COPY_CHUNK_MB": "1"}))
    plain = run_scenario(variant_of("ds4-504-per-class.toml"))
    assert small.summary["decode_tok_s"] == plain.summary["decode_tok_s"]


# ------------------------------------------------------------------------------ the later builds' budget


def later_build(variant: str, hardware: str, model: str, budget: str | None, ctx: int = 4096, decode: int = 4):
    data = {"hardware": hardware, "model": model,
            "engine": {"name": "ds4", "variant": variant,
                       "flags": {"ssd-streaming": True, "ctx": ctx} | ({"ssd-streaming-cache-experts": budget}
                                                                       if budget else {})},
            "trace": {"generator": model, "seed": 0},
            "workload": {"requests": [{"prompt_tokens": 300, "decode_tokens": decode, "measured": True}]}}
    return load_scenario(SCENARIOS / "ds4-504-per-class.toml", data)


def test_cuda_at_54b36ed_plans_a_cache_it_never_allocates():
    # #780's box: the planner prints 1,005 dynamic experts; the CUDA streaming cache of that build is a stub
    run = run_scenario(later_build("main-0728", "rtx-5070ti-laptop-12gb", "deepseek-v4-flash-q2", "12GB"))
    assert run.summary["planned_cache_slots"] == 1005
    assert run.summary["cache_slots"] == 0 and run.summary["decode_hit_rate"] == 0.0


def test_rocm_v41_cache_is_the_fitted_plan():
    # a stock Strix Halo (62 GiB working set): 89GB is capped to floor(7/8 x 62 - graph) = 52 GiB, then fitted to
    # 62 - 9.37 static - graph - 7.12 staging - 2 allowance
    run = run_scenario(later_build("main-v41", "strix-halo-128gb-stock", "deepseek-v4.1-flash-q2", "89GB",
                                   ctx=8192))
    graph = 1.72  # record ds4-v41-graph-8k, at this context
    fitted = int((62 - 9.37 - graph - 2) * GIB - 2 * 384 * 9_953_280) // 9_953_280
    assert run.summary["cache_slots"] == run.summary["planned_cache_slots"]
    assert abs(run.summary["cache_slots"] - fitted) <= 1
    assert any("capped to 52.00 GiB" in n for n in run.summary["notices"])


def test_weights_past_an_8gb_card_are_read_over_pcie_and_cost_decode_time():
    small = run_scenario(later_build("pr488", "rtx-4070-laptop-8gb-windows", "deepseek-v4-flash-q2", None))
    state = small.summary["engine_state"]
    assert small.summary["planned_cache_slots"] == 1  # #488: "keeping a one-expert cache"
    over = state["non_routed_over_pcie_gib"] * GIB
    placed = 8.20 * GIB - over
    assert over > 0 and placed % (1792 * 2**20) < 2**20  # the arena holds whole 1,792 MiB chunks
    assert small.summary["vram_peak_mib"] * 2**20 <= 7.99609375 * GIB  # nothing past the card


def test_the_planner_refuses_a_reserve_it_does_not_read():
    from sim.errors import InputError

    raw = {"hardware": "rtx-5070ti-laptop-12gb", "model": "deepseek-v4-flash-q2",
           "engine": {"name": "ds4", "variant": "main-0728", "flags": {"ssd-streaming": True},
                      "env": {"DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB": "4"}},
           "trace": {"generator": "deepseek-v4-flash-q2", "seed": 0},
           "workload": {"requests": [{"prompt_tokens": 300, "decode_tokens": 4, "measured": True}]}}
    with pytest.raises(InputError, match="not read by variant main-0728"):
        load_scenario(SCENARIOS / "ds4-504-per-class.toml", raw)


# ------------------------------------------------------------------------------ the Metal backend (@84cc882)

Q2_EXPERT_BYTES = 7_077_888  # IQ2_XXS gate + up (2 x 2,162,688 B) + Q2_K down (2,752,512 B): ds4-engine.md §2.2


def metal(budget: str = "8GB", prompt: int = 10, decode: int = 8, page_cache: str = "warm", variant="main-0814",
          hardware: str = "m5-pro-64gb", env: dict | None = None):
    data = {"hardware": hardware, "model": "deepseek-v4-flash-q2",
            "engine": {"name": "ds4", "variant": variant,
                       "flags": {"ssd-streaming": True, "ssd-streaming-cache-experts": budget}, "env": env or {}},
            "trace": {"generator": "deepseek-v4-flash-q2", "seed": 0},
            "workload": {"page-cache": page_cache,
                         "requests": [{"prompt_tokens": prompt, "decode_tokens": decode, "measured": True}]}}
    return run_scenario(load_scenario(SCENARIOS / "ds4-504-per-class.toml", data)).summary


def test_metal_cache_is_the_planned_budget_and_wires_its_slots_as_they_fill():
    # 8 GiB less two layers of 256 experts of prefill headroom, in 6.75 MiB experts: floor(4,966,055,936 /
    # 7,077,888) = 701. The slots are wired as misses fill them, so the process holds what it has cached: 701 x
    # 7,077,888 B = 4.96 GB once full, under the 5.1 GB max RSS #810 measured at 8 GB
    run = metal("8GB", decode=8)
    assert run["cache_slots"] == (8 * GIB - 2 * 256 * Q2_EXPERT_BYTES) // Q2_EXPERT_BYTES == 701
    held = run["engine_state"]["metal"]["cache_peak_gib"] * GIB
    assert held == 701 * Q2_EXPERT_BYTES and 4.9e9 < held <= 5.1e9
    assert run["engine_state"]["prefill_buffer_mib"] == 0  # a decode-path prompt allocates no prefill headroom


def test_metal_reads_the_non_routed_weights_from_the_mapped_file():
    # Nothing is copied: the weights are the file's pages. A cold page cache faults in, once, what a token reads
    # outside the routed experts: the 8.20 GiB of non-routed weights (#488) less the F16 token embedding, of which
    # a token reads one row (129,280 x 4,096 x 2 B)
    cold, warm = metal(page_cache="cold"), metal(page_cache="warm")
    want = 8.20 * GIB - 129_280 * 4096 * 2
    assert cold["engine_state"]["metal"]["weight_fault_gib"] * GIB == pytest.approx(want, rel=1e-6)
    assert warm["engine_state"]["metal"]["weight_fault_gib"] == 0
    assert cold["prefill_tok_s"] < warm["prefill_tok_s"]


def test_metal_warm_page_cache_is_the_previous_run_of_the_same_command():
    # with the whole file's share the page cache can hold (an 8 GB cache leaves it ~48 GiB), the previous run's
    # pages serve every miss of the next; a cold start reads them all from the drive
    warm, cold = metal("8GB", page_cache="warm"), metal("8GB", page_cache="cold")
    assert warm["engine_state"]["page_cache"]["read_misses"] == 0
    assert cold["engine_state"]["page_cache"]["read_hits"] < cold["engine_state"]["page_cache"]["read_misses"]


def metal_timeline(tokens: int = 3):
    """The links of a short 8 GB run on the M5 Pro: per token, the main thread's 43 graph encodes, the GPU's
    kernels, each with the layer it belongs to (the kernels run in the order encoded: a layer's attention, shared
    and routed experts, then the next layer's attention), and the load worker's round trips."""
    from sim.results import link_frame

    data = {"hardware": "m5-pro-64gb", "model": "deepseek-v4-flash-q2",
            "engine": {"name": "ds4", "variant": "main-0814",
                       "flags": {"ssd-streaming": True, "ssd-streaming-cache-experts": "8GB"}},
            "trace": {"generator": "deepseek-v4-flash-q2", "seed": 0},
            "workload": {"requests": [{"prompt_tokens": 1, "decode_tokens": tokens - 1, "measured": True}]}}
    run = run_scenario(load_scenario(SCENARIOS / "ds4-504-per-class.toml", data))
    links = link_frame(run.links).sort_values("start_s", kind="stable")
    encodes = links[links.kind == "graph encode"].reset_index(drop=True)
    gpu = links[links.link == "GPU compute stream"].copy()
    gpu["layer"] = (gpu.kind == "attention + router").cumsum() - 1  # 0 .. 43 x tokens - 1
    return run, encodes, gpu, links[links.kind == "selected-id round trip"]


def test_metal_routed_experts_wait_for_the_next_layers_commit():
    # ds4.c @b0309611 L23873-L23990: the main thread commits at a layer's router signal and after its shared
    # expert, and encodes the routed experts only after the join and the preads, so they go to the GPU in the
    # command buffer the next layer's router signal closes. The hash layers (0-2) commit nothing: their kernels
    # wait for layer 3's router
    _, encodes, gpu, _ = metal_timeline()
    assert len(encodes) == 3 * 43
    routed = gpu[gpu.kind.isin(["routed experts", "routed experts (misses)"])]
    for _, kernel in routed.iterrows():
        if (kernel.layer + 1) % 43:  # the last layer's go with the output head, at the token's end
            assert kernel.start_s >= encodes.end_s[kernel.layer + 1] - 1e-12
    for token in range(3):
        first = gpu[gpu.layer == 43 * token].start_s.min()
        assert first >= encodes.end_s[43 * token + 3] - 1e-12


def test_metal_pays_one_host_round_trip_per_router_readback():
    # layers 3-42 read their router's ids back through the shared event; the hash layers' ids are the token's,
    # looked up on the host (metal_graph_decode_set_hash_selected_override, ds4.c L23221): 40 round trips a token,
    # each record ds4-metal-round-trip-437's 259.5 us, the run told the figure was fitted on another box
    run, _, _, trips = metal_timeline()
    assert len(trips) == 3 * 40
    assert (trips.end_s - trips.start_s).to_numpy() == pytest.approx(259.5e-6)
    assert any("record ds4-metal-round-trip-437" in note and "fitted on m4-max-128gb" in note
               for note in run.summary["out_of_domain"])


@pytest.mark.parametrize("change, message", [
    ({"variant": "pr504"}, "modelled for variant main-0814 only"),
    ({"hardware": "dgx-spark-gb10"}, "modelled on its Metal backend only"),
    ({"env": {"DS4_CUDA_NO_DIRECT_IO": "1"}}, "read by ds4's CUDA backend only"),
    ({"prompt": 19}, "not modelled: ds4's Metal batch prefill"),  # q2 Flash: 18 tokens run the decode path
])
def test_metal_refuses_what_its_path_does_not_have(change, message):
    from sim.errors import InputError

    with pytest.raises(InputError, match=message):
        metal(**change)


def uncached_q4(variant: str, env: dict):
    """q4 Flash on the #503 box with no expert cache (every selected expert loaded per use), a short prompt
    (decode path) and two decode tokens."""
    data = {"hardware": "rtx-pro-6000-96gb", "model": "deepseek-v4-flash-q4",
            "engine": {"name": "ds4", "variant": variant, "flags": {"ssd-streaming": True},
                       "env": {"DS4_CUDA_STREAMING_EXPERT_CACHE_N": "0", **env}},
            "trace": {"generator": "deepseek-v4-flash-q4", "seed": 0},
            "workload": {"requests": [{"prompt_tokens": 8, "decode_tokens": 2, "measured": True}]}}
    return run_scenario(load_scenario(SCENARIOS / "ds4-504-per-class.toml", data))


def busy_by_kind(result, link_prefix: str):
    from sim.results import link_frame

    links = link_frame(result.links)
    links = links[links["link"].str.startswith(link_prefix)]
    return links.assign(seconds=links["end_s"] - links["start_s"]).groupby("kind")[["seconds", "bytes", "ops"]].sum()


def test_pr605_copies_misses_from_the_mapping_without_o_direct():
    """#605's fourth commit (5930a3f, 'default streamed expert uploads to plain copy without O_DIRECT'): with
    DS4_CUDA_NO_DIRECT_IO each of a miss's three parts is one cudaMemcpy from the mapped file, through the
    driver's pageable path: every loaded byte crosses at the profile's pageable rate (15 GB/s on this box) and
    none is pread into staging; the first commit alone preads every part."""
    env = {"DS4_CUDA_NO_DIRECT_IO": "1", "DS4_CUDA_KEEP_MODEL_PAGES": "1"}
    loaded_bytes = lambda run: int(run.steps["h2d_bytes"].sum())  # noqa: E731
    plain = uncached_q4("pr605", env)
    h2d, worker = busy_by_kind(plain, "H2D"), busy_by_kind(plain, "ds4 selected-load worker")
    assert h2d.loc["pageable H2D", "bytes"] == loaded_bytes(plain)
    assert h2d.loc["pageable H2D", "seconds"] == pytest.approx(loaded_bytes(plain) / 15e9)
    assert "pread copy" not in worker.index
    staged = busy_by_kind(uncached_q4("pr605-cache", env), "ds4 selected-load worker")
    assert staged.loc["pread copy", "bytes"] == loaded_bytes(plain)


def test_pr605_syncs_the_upload_stream_once_per_expert_with_o_direct():
    """#605's third commit (1c055bb, 'pipeline the streamed expert upload path'): a miss's gate, up and down
    are one group with a single stream sync (flush=0,0,1); before it every part was synced."""
    for variant, syncs_per_expert in (("pr605", 1), ("pr605-cache", 3)):
        run = uncached_q4(variant, {})
        worker = busy_by_kind(run, "ds4 selected-load worker")
        assert worker.loc["stream sync", "ops"] == syncs_per_expert * run.steps["file_blob_reads"].sum()


def test_a_capped_class_cache_says_which_size_class_it_is(per_class, slab):
    """Issue 34: the flagship run's notice "cache capped from 9472 to ... experts" did not say it was one size class
    only. The engine's own line is kept as ds4 prints it and the class follows it; the class is the one whose
    expert bytes are the line's MiB/expert (the model's layout, counted here)."""
    import re

    from sim.model.presets import get_preset
    from sim.units import MIB

    capped = [n for n in per_class.summary["notices"] if n.startswith("CUDA streaming expert cache capped from")]
    assert capped
    layer_bytes = get_preset("deepseek-v4-flash-q2-q4").expert_bytes_per_layer()[:43]
    for notice in capped:
        mib = float(re.search(r", ([\d.]+) MiB/expert\)", notice).group(1))
        layers = int(sum(abs(b / MIB - mib) < 0.005 for b in layer_bytes))
        assert re.search(rf"\) \[size class [12] of 2: {layers} of 43 layers; each class's cache is sized on its "
                         r"own\]$", notice), notice
    # one slab (before #504) has no classes, and a file of one quant one class: their lines are ds4's as printed
    assert all("size class" not in n for n in slab.summary["notices"])
    import tomllib

    data = tomllib.loads((SCENARIOS / "ds4-504-per-class.toml").read_text())
    data["model"] = data["trace"]["generator"] = "deepseek-v4-flash-q2"  # every routed layer q2: one class
    data["workload"]["requests"] = [{"prompt_tokens": 200, "decode_tokens": 2, "measured": True}]
    data["engine"]["flags"]["ssd-streaming-cache-experts"] = "11008"  # every expert: more than the card holds
    notices = run_scenario(load_scenario(SCENARIOS / "ds4-504-per-class.toml", data)).summary["notices"]
    assert any(n.startswith("CUDA streaming expert cache capped from 11008") for n in notices)
    assert all("size class" not in n for n in notices)


def test_a_trace_of_ones_own_asks_for_a_hotlist_by_name_and_says_how_to_make_one(tmp_path):
    """Issue 34: a ds4 scenario with the user's own trace failed naming "DS4_METAL_STREAMING_EXPERT_HOTLIST = None"
    on a CUDA box. The refusal says the variable is unset, why ds4 wants it, and both ways on; the list that
    `expertsim trace hotlist` writes from a profiling run then runs."""
    import subprocess
    import sys
    import tomllib

    from sim.errors import InputError
    from sim.trace.format import write_trace
    from sim.trace.generate import generate_trace

    write_trace(generate_trace("deepseek-v4-flash-q2-q4", 40, 8, seed=11), tmp_path / "mine.parquet")
    (tmp_path / "mine.toml").write_text((SCENARIOS / "ds4-504-per-class.toml").read_text())  # beside its trace
    data = tomllib.loads((SCENARIOS / "ds4-504-per-class.toml").read_text())
    data["trace"] = {"path": "mine.parquet"}
    data["workload"]["requests"] = [{"prompt_tokens": 40, "decode_tokens": 8, "measured": True}]
    with pytest.raises(InputError) as info:
        run_scenario(load_scenario(tmp_path / "mine.toml", data))
    message = str(info.value)
    assert "DS4_METAL_STREAMING_EXPERT_HOTLIST = (unset)" in message and "None" not in message
    assert "expertsim trace hotlist" in message and "ssd-streaming-cold = true" in message
    proc = subprocess.run([sys.executable, "-m", "sim", "trace", "hotlist", tmp_path / "mine.parquet", "-o",
                           tmp_path / "hot.csv"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    data["engine"]["env"]["DS4_METAL_STREAMING_EXPERT_HOTLIST"] = "hot.csv"
    assert run_scenario(load_scenario(tmp_path / "mine.toml", data)).summary["engine_state"]["hotlist_seeding"][
        "passes"] == 1


def test_a_gpu_too_small_is_refused_before_the_routing_is_built(monkeypatch):
    """Issue 34: a ds4 VRAM refusal came after 39.7 s of work (the routing of a long prompt generated first). The
    start-up refusal now comes before the routing is asked for."""
    import sim.simulate
    from sim.errors import InputError

    def no_routing(scenario):
        raise AssertionError("the routing was built before the refusal")

    monkeypatch.setattr(sim.simulate, "workload_routing", no_routing)
    scenario = variant_of("ds4-504-per-class.toml", env={"DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB": "4"})
    small = load_scenario(SCENARIOS / "ds4-504-per-class.toml",
                          {**scenario.model_dump(by_alias=True, exclude_none=True), "hardware": "rtx-3060-12gb"})
    with pytest.raises(InputError, match="before its expert cache; the GPU has 12.00 GiB"):  # the card's 12 GiB
        sim.simulate.run_scenario(small)


def test_a_run_past_the_cards_memory_is_refused_naming_the_knob_that_makes_room():
    """GLM-5.2 on a 16 GB card (glm52-mtp-slab.toml) with an 8 GiB cache and ds4's reserve at 0 GiB: its allocations
    reach 11 MiB past the 16,384 MiB card, where one would fail. Before, the run reported figures with a VRAM peak of
    16,395 MiB."""
    from sim.errors import InputError
    from sim.explore.sweep import parse_settings

    path = SCENARIOS / "glm52-mtp-slab.toml"
    reserve = "engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB"
    data, _ = parse_settings(path, ["engine.flags.ssd-streaming-cache-experts=8GB", f"{reserve}=0"])
    with pytest.raises(InputError) as refused:
        run_scenario(load_scenario(path, data))
    assert refused.value.field == "hardware"
    assert "of GPU memory at its peak, 11 MiB more than the 16,384 MiB this box has" in refused.value.why
    assert f"change {reserve}" in refused.value.why


@pytest.mark.parametrize("typed", ["0.5", "12GB", " 12"])
def test_a_reserve_ds4_cannot_parse_keeps_the_default_and_the_run_says_so(typed):
    """ds4 parses DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB as whole GiB; '0.5' fails to parse and the 16 GiB default
    stays (ds4-engine.md §1.3), silently in the engine. The run keeps that default too and names the value it
    dropped, where before nothing told the user the setting had changed nothing."""
    from sim.engines import ENGINES

    def plan(env):
        return ENGINES["ds4"].plan_memory(variant_of("ds4-504-per-class.toml", env=env))

    reserve = "DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB"
    typed_plan, parsed = plan({reserve: typed}), plan({reserve: "12"})  # the scenario's own 12 GiB (seed #504)
    assert typed_plan.reserve_bytes == 16 * 2**30 and parsed.reserve_bytes == 12 * 2**30  # the card's half is 48
    dropped = [n for n in typed_plan.notices if reserve in n]
    assert len(dropped) == 1 and repr(typed) in dropped[0] and "16 GiB default" in dropped[0]
    assert not [n for n in parsed.notices if reserve in n]
