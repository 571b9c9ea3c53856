"""The engines' knobs and the machine's overlap, checked as mechanisms rather than as figures.

A knob test runs one scenario twice (or more) changing one setting, and checks that the result moves in the
direction the engine's own documentation states for it. An overlap test runs one scenario on a machine whose
resources are made (nearly) free: a difference that vanishes there came from waiting on those resources,
not from a term the engine model adds.
"""

from __future__ import annotations

import collections
import tomllib
from pathlib import Path

import pytest

from sim.simulate import run_scenario
from sim.hardware import load_hardware
from sim.scenario import load_scenario
from tests.conftest import profile_with
from tests.test_strata_engine import run_file, scenario_file
from sim.units import GIB, MIB

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
GiB = GIB


def thousandfold(value: float) -> float:
    return value * 1000


# I/O made 1000x faster and its fixed costs zero; compute stays as it is
FREE_SSD = {"ssd.read_gbps_by_queue_depth": thousandfold, "ssd.request_latency_us": 0}
FREE_H2D = {"pcie.h2d_pinned_gbps": thousandfold, "pcie.h2d_pageable_gbps": thousandfold,
            "pcie.copy_fixed_latency_us": 0}
FREE_HOST = {"host.memcpy_gbps": thousandfold, "host.dram_bandwidth_gbps": thousandfold,
             "latency.memcpy_call_us": 0, "latency.device_sync_us": 0}


def ds4_run(*, prompt: int = 1000, decode: int = 16, variant: str | None = None, hardware: str | Path | None = None,
            model: str | None = None, flags: dict | None = None, env: dict | None = None):
    """ds4-504-per-class.toml with a shorter request and some settings changed; env=None keeps the seed's."""
    data = tomllib.loads((SCENARIOS / "ds4-504-per-class.toml").read_text())
    data["workload"]["requests"] = [{"prompt_tokens": prompt, "decode_tokens": decode, "measured": True}]
    data["engine"]["flags"].update(flags or {})
    if env is not None:
        data["engine"]["env"] = env
    if variant:
        data["engine"]["variant"] = variant
    if hardware:
        data["hardware"] = str(hardware)
    if model:
        data["model"] = data["trace"]["generator"] = model
    return run_scenario(load_scenario(SCENARIOS / "ds4-504-per-class.toml", data)).summary


# ------------------------------------------------------------------------------------------ ds4 knobs


def test_ds4_ctx_grows_the_kv_cache_and_leaves_less_room_for_experts():
    # ds4 sizes its KV cache and the prefill's context buffers from --ctx (ds4.c
    # metal_graph_context_bytes_for_kv_policy); the expert cache gets what VRAM is left
    runs = [ds4_run(decode=4, flags={"ctx": ctx, "ssd-streaming-cache-experts": "11008"})
            for ctx in (32768, 262144, 1048576)]
    kv = [r["engine_state"]["vram_before_cache"]["kv_gib"] for r in runs]
    slots = [r["cache_slots"] for r in runs]
    assert kv[0] < kv[1] < kv[2] and slots[0] > slots[1] > slots[2]
    # every byte more of KV and context buffers is a byte less of expert cache, to within one q4 slot
    before_mib = [r["engine_state"]["vram_before_cache_gib"] * 1024 for r in runs]
    cache_mib = [r["cache_mib"] for r in runs]
    q4_slot_mib = runs[0]["engine_state"]["class_expert_bytes"][1] / MIB
    assert cache_mib[0] - cache_mib[2] == pytest.approx(before_mib[2] - before_mib[0], abs=q4_slot_mib)


def test_ds4_on_unified_memory_a_bigger_cache_can_be_slower():
    # On unified memory the expert cache, the page cache and the process share one pool (validation-cases.md
    # notes): a bigger cache leaves fewer model pages cached, so more misses go to the SSD. ds4-engine.md §5
    # (question 3): "#1031's slot sweep and #810/#780 show smaller caches winning when memory headroom is
    # the binding constraint". A discrete card with ample RAM gains from every GB.
    def run(hardware, cache, **settings):
        # 96 tokens: long enough for the 32 GB cache's wired slots (filled as they miss) to squeeze the page
        # cache below the run's pages; in a shorter run the slots are still filling
        return ds4_run(decode=96, hardware=hardware, model="deepseek-v4-flash-q2",
                       flags={"ssd-streaming-cache-experts": cache}, **settings)

    # the Mac runs ds4's Metal backend (buffered preads, the pages kept): the 32 GB cache's wired slots leave
    # the page cache less than the run reads, so a repeat run finds fewer of its pages cached
    unified = [run("m5-pro-64gb", cache, prompt=10, variant="main-0814", env={}) for cache in ("8GB", "32GB")]
    pages = [u["engine_state"]["page_cache"] for u in unified]
    assert pages[1]["capacity_gib"] < pages[0]["capacity_gib"] and pages[1]["read_misses"] > pages[0]["read_misses"]
    assert unified[1]["decode_hit_rate"] > unified[0]["decode_hit_rate"]  # more hits, and yet slower
    assert unified[1]["decode_tok_s"] < unified[0]["decode_tok_s"]
    page_cache_env = {"DS4_CUDA_NO_DIRECT_IO": "1", "DS4_CUDA_KEEP_MODEL_PAGES": "1"}
    discrete = [run("rtx-pro-6000-96gb", cache, env=page_cache_env)["decode_tok_s"] for cache in ("8GB", "32GB")]
    assert discrete[1] > discrete[0]


def test_ds4_partial_page_cache_makes_misses_slower_as_ram_shrinks(tmp_path):
    # DS4_CUDA_NO_DIRECT_IO=1: misses are buffered preads; what the page cache holds of the 80.8 GB q2 file is
    # read from RAM, the rest from the SSD (ds4-engine.md §1.8). Less RAM, fewer cached pages, slower misses.
    env = {"DS4_CUDA_NO_DIRECT_IO": "1", "DS4_CUDA_KEEP_MODEL_PAGES": "1"}
    runs = {}
    for ram in (180, 64, 32):
        box = profile_with(tmp_path, "rtx-pro-6000-96gb", f"ram-{ram}", {"host.ram_gib": ram})
        runs[ram] = ds4_run(decode=32, hardware=box, model="deepseek-v4-flash-q2", env=env,
                            flags={"ssd-streaming-cache-experts": "8GB"})
    pages = {ram: r["engine_state"]["page_cache"] for ram, r in runs.items()}
    assert pages[180]["read_misses"] == 0  # the whole file fits
    assert 0 < pages[64]["read_misses"] < pages[32]["read_misses"]
    assert runs[180]["decode_tok_s"] > runs[64]["decode_tok_s"] > runs[32]["decode_tok_s"]


# ------------------------------------------------------------------------------------------ Strata knobs


def test_strata_auto_n_takes_bigger_chunks_lends_more_and_rereads_from_the_file(tmp_path):
    # upstream #669: --prefill auto:32768 extends the auto chunk list to 32768 tokens. On a prompt much longer
    # than 8192 a bigger chunk lends more of the cache's tail, and lent experts without a RAM copy are read
    # from the files (validation-cases.md S10: auto:32768 lent ~6,000 slots, re-read 2,292-3,974 from a SATA
    # SSD, and ran slower than auto): the S10 box, RAM, drive and pack
    runs = {}
    for prefill in ("auto", "auto:32768"):
        runs[prefill] = run_file(scenario_file(tmp_path, prefill.replace(":", "-"), variant="v0.1.39",
                                               flags={"prefill": prefill, "expert-cache": "auto", "kv": "q4_0"},
                                               hardware="rtx-4090-14900k-32gb", model="qwen3.8-flash-next-iq2xs",
                                               requests=((40000, 4),)))
    (auto, auto_st), (wide, wide_st) = runs["auto"], runs["auto:32768"]
    assert wide_st["plan_lend"]["chunk"] > auto_st["plan_lend"]["chunk"]
    assert wide_st["plan_lend"]["lent_slots"] > auto_st["plan_lend"]["lent_slots"]
    assert auto.summary["file_blob_reads"] == 0 < wide.summary["file_blob_reads"]
    assert wide.summary["prefill_tok_s"] < auto.summary["prefill_tok_s"]


def test_strata_kv_resident_frees_vram_for_experts_and_streams_the_rest(tmp_path):
    # docs/FLAGS.md: --kv-resident N keeps N cells of each QSA layer in VRAM and the rest in host RAM: the
    # freed VRAM goes to the expert cache, and the hits it buys outweigh the K/V blocks a decode window streams
    # from RAM ("Q2_0 at 262K: 50.9 -> 62.6 tokens/s (1,589 -> 3,872 experts in VRAM)", Strata docs/DETAILS.md)
    runs = {}
    for kv in (None, 20480):
        runs[kv] = run_file(scenario_file(tmp_path, f"kv-{kv}", variant="v0.1.39b",
                                          flags={"kv-resident": kv, "expert-cache": "auto"},
                                          requests=((60000, 8),)))
    (full, _), (resident, _) = runs[None], runs[20480]
    assert resident.summary["cache_slots"] > full.summary["cache_slots"]
    assert resident.summary["ram_peak_mib"] > full.summary["ram_peak_mib"]
    assert resident.summary["decode_tok_s"] > full.summary["decode_tok_s"]


# ------------------------------------------------------------------------------------------ overlap


def test_ds4_pread_pool_changes_time_only_through_resource_waits(tmp_path, monkeypatch):
    # PR #1082: hits first and an 8-worker pread pool, so miss reads overlap each other and the hit compute.
    # O_DIRECT misses (the seed's page-cache env dropped) read the SSD. On free I/O and free host work (the main
    # thread's graph encode too) the two must agree: only the GPU's own work is left.
    import dataclasses

    from sim.engines import records

    def decode_tok_s(box, pool):
        return ds4_run(decode=24, variant="pr1082", hardware=box, env={"DS4_CUDA_HITS_FIRST": pool,
                                                                        "DS4_CUDA_STREAMING_EXPERT_PREAD_POOL": pool},
                       flags={"ssd-streaming-cache-experts": "2048"})["decode_tok_s"]

    real = {pool: decode_tok_s("rtx-pro-6000-96gb", pool) for pool in ("1", "0")}
    free_io = profile_with(tmp_path, "rtx-pro-6000-96gb", "free-io", {**FREE_SSD, **FREE_H2D, **FREE_HOST,
                                                                      "latency.kernel_launch_us": 0})
    encode = records.BY_ID["ds4-graph-encode-773"]
    monkeypatch.setitem(records.BY_ID, encode.id, dataclasses.replace(encode, value=0.0))
    free = {pool: decode_tok_s(free_io, pool) for pool in ("1", "0")}
    assert real["1"] > 1.2 * real["0"]
    assert free["1"] == pytest.approx(free["0"], rel=1e-9)


def test_strata_ssd_reads_and_the_h2d_stream_overlap(tmp_path):
    # The mmap fallback with a cold page cache: every lent expert of a chunk is faulted in from the SSD by
    # the stager and then DMA'd to the GPU. Each resource's own cost (the time it adds over a machine where
    # both are free) is measured alone; together they cost more than the larger one (they contend) and less
    # than the sum (they overlap): neither would hold if the engine added the two terms or took their max.
    env = {"STRATA_PREFILL_OWN_AUTO": "0", "STRATA_RESIDENT_HEADROOM_GIB": "20"}

    def ttft(tag, changes):
        box = profile_with(tmp_path, "rtx-5090-48gb-windows", f"box-{tag}", changes)
        path = scenario_file(tmp_path, f"cold-{tag}", env=env, hardware=str(box), requests=((8192, 2),))
        path.write_text(path.read_text().replace("[[workload.requests]]",
                                                 '[workload]\npage-cache = "cold"\n\n[[workload.requests]]', 1))
        result, state = run_file(path)
        assert state["ram_plan"]["outcome"] == "mmap-fallback" and result.summary["file_blob_reads"] > 0
        return result.summary["ttft_s"]

    base = ttft("free", {**FREE_SSD, **FREE_H2D})
    ssd_cost = ttft("ssd-only", FREE_H2D) - base
    h2d_cost = ttft("h2d-only", FREE_SSD) - base
    both = ttft("real", {}) - base
    assert ssd_cost > 0 and h2d_cost > 0
    assert max(ssd_cost, h2d_cost) < both < ssd_cost + h2d_cost


def test_strata_small_chunks_pay_the_expert_weight_read_over_fewer_tokens(tmp_path, monkeypatch):
    # A chunk's layer reads each routed expert's weights once whatever its token count: on a machine whose
    # I/O is free the prompt is compute only, and shorter chunks are slower, by at most a whole layer's expert
    # bytes read once more per chunk (IQ3_S blobs at 80 % of the 5090's 1,792 GB/s, ggml-org/llama.cpp#28196).
    # The box's WDDM stalls per stream event, also paid per chunk, are taken out (tests/test_strata_stream_events.py)
    import sim.machine
    from sim.model import get_preset

    monkeypatch.setattr(sim.machine, "WDDM_STREAM_EVENT_S", 0.0)
    box = profile_with(tmp_path, "rtx-5090-48gb-windows", "free-io", {**FREE_SSD, **FREE_H2D, **FREE_HOST})
    tok_s = {}
    for chunk in (512, 2048, 8192):
        result, _ = run_file(scenario_file(tmp_path, f"chunk-{chunk}", flags={"prefill": chunk},
                                           env={"STRATA_PREFILL_OWN_AUTO": "0"}, hardware=str(box),
                                           requests=((16384, 2),)))
        tok_s[chunk] = result.summary["prefill_tok_s"]
    assert tok_s[512] < tok_s[2048] < tok_s[8192]
    layout = get_preset("qwen3.8-flash-next-iq3s")
    layer_read_s = sum(layer.expert_bytes for layer in layout.layers) * 512 / 48 / (1792e9 * 0.80)
    per_token_s = 48 * load_hardware(box).compute["qwen3.8-flash-next"].prefill_us_per_token_layer.value * 1e-6
    most = (per_token_s + 48 * layer_read_s / 512) / (per_token_s + 48 * layer_read_s / 8192)
    assert 1 < tok_s[8192] / tok_s[512] <= most * 1.01


def test_strata_adaptive_swaps_hold_the_link_the_decode_pcie_share_reads_over(tmp_path):
    # Strata's decode reads a share of its pinned misses over PCIe while the adaptive tier copies hot experts in on
    # a side stream (strata-engine.md §3.1): both cross the one link, so a window's PCIe reads can wait behind a
    # swap. The GPU is held from the read's issue to its end; the link carries it for its own time only.
    def waits(adapt_every: int) -> tuple[float, float]:
        path = scenario_file(tmp_path, f"swaps-{adapt_every}", variant="v0.1.35", requests=((200, 64),),
                             flags={"resident-experts": None, "adapt-every": adapt_every})  # arena: all pinned
        r, st = run_file(path)
        busy = collections.Counter()
        for server in r.links:
            for start, end, _, _, kind in server.intervals():
                busy[server.name.split(" ")[0], kind] += end - start
        gpu, link = busy["GPU", "decode experts (PCIe share)"], busy["H2D", "decode experts (PCIe share)"]
        swaps = busy["H2D", "adaptive swap"]
        assert link > 0 and (st["adaptive_swaps"] > 0) == (adapt_every > 0)
        return gpu - link, swaps

    waited, swaps = waits(4)
    assert 0 < waited <= swaps  # the reads waited, for no longer than the swaps held the link
    assert waits(0) == (pytest.approx(0.0, abs=1e-12), 0.0)  # no swaps: each read has the link to itself
