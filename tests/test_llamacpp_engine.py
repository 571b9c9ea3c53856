"""llama.cpp's mechanisms against the machine, end to end: the bytes each phase moves come from the layout and the
run's own routing (computed here without the engine), and each knob moves its figure the way the code says
(../shared/reference/llamacpp-engine.md §3-§6)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest

from sim.engines.records import BY_ID
from sim.scenario import load_scenario
from sim.simulate import run_scenario
from sim.trace.format import MISSING

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "scenarios" / "llamacpp-qwen3.8-ncmoe.toml"


def _run(prompt: int, decode: int, hardware: str | None = None, page_cache: str = "warm", variant="mainline",
         **flags):
    data = tomllib.loads(SEED.read_text())
    data["engine"]["flags"] = {"ctx-size": 8192, "n-cpu-moe": 40, **flags}
    data["engine"]["variant"] = variant
    data["workload"] = {"page-cache": page_cache, "requests": [{"prompt_tokens": prompt, "decode_tokens": decode}]}
    if hardware:
        data["hardware"] = hardware
    return run_scenario(load_scenario(SEED, data))


def _expert_bytes(result) -> np.ndarray:
    return np.array([x.expert_bytes for x in result.scenario.layout.layers], np.int64)


def test_decode_reads_k_experts_per_cpu_layer_from_host_memory():
    """§4: B_tok = sum over CPU MoE layers of k x S_expert; blocks 0..39 are on the CPU (--n-cpu-moe 40)."""
    short, long = _run(1, 4), _run(1, 12)
    per_token = _expert_bytes(short)[:40].sum() * short.scenario.layout.top_k
    extra = long.summary["engine_state"]["cpu_expert_read_bytes"] - short.summary["engine_state"]["cpu_expert_read_bytes"]
    assert extra == 8 * per_token


def test_an_offloaded_ubatch_copies_the_union_of_the_experts_it_uses():
    """§5.2: per CPU layer, the distinct experts of the ubatch's rows, in runs of consecutive ids, each run not
    ending at the last expert padded by 512 bytes; two ubatches of 512 (a 1024-token prompt)."""
    result = _run(1024, 1)
    prompt = result.routing.requests[0].prompt
    layout = result.scenario.layout
    expected = 0
    for first in (0, 512):
        rows = prompt[first: first + 512]
        for layer in range(40):
            ids = rows[:, layer]
            used = np.zeros(layout.n_experts, bool)
            used[ids[ids != MISSING]] = True
            starts = np.flatnonzero(used & ~np.r_[False, used[:-1]])
            ends = np.flatnonzero(used & ~np.r_[used[1:], False])
            padded = int((ends != layout.n_experts - 1).sum())
            parts = 3  # gate, up (one fused tensor standing for both) and down all on the CPU
            expected += int(used.sum()) * _expert_bytes(result)[layer] + parts * padded * 512
            assert len(starts) == len(ends)
    assert result.summary["engine_state"]["h2d_expert_bytes"] == expected


def test_before_15346_every_expert_is_copied():
    result = _run(512, 1, variant="mainline-pre-15346")
    layout = result.scenario.layout
    assert result.summary["engine_state"]["h2d_expert_bytes"] == layout.n_experts * _expert_bytes(result)[:40].sum()


def test_a_ubatch_below_the_threshold_runs_on_the_cpu():
    below, at = _run(31, 1), _run(32, 1)
    assert below.summary["engine_state"]["h2d_expert_bytes"] == 0
    assert below.summary["engine_state"]["offloaded_layer_steps"] == 0
    assert at.summary["engine_state"]["offloaded_layer_steps"] == 40


def test_repacked_experts_run_a_large_ubatch_on_the_cpu():
    """-rtr: a ubatch far above ik's threshold copies nothing; each CPU layer's mul_mat_id reads its used experts once
    (the union from this run's own routing)."""
    result = _run(4096, 1, variant="ik", **{"run-time-repack": True})
    state = result.summary["engine_state"]
    assert state["h2d_expert_bytes"] == 0 and state["offloaded_layer_steps"] == 0
    prompt = result.routing.requests[0].prompt  # [tokens, layers, k]
    cpu_layers = list(enumerate(result.scenario.layout.layers))[8:]  # ik's --n-cpu-moe 40: the last 40 of 48
    expected = 0
    for first in range(0, 4096, 512):  # -ub 512 ubatches
        rows = prompt[first: first + 512]
        expected += sum(np.unique(rows[:, i][rows[:, i] != MISSING]).size * layer.expert_bytes
                        for i, layer in cpu_layers)
    decode = result.routing.requests[0].decode[0]
    expected += sum(np.unique(decode[i][decode[i] != MISSING]).size * layer.expert_bytes for i, layer in cpu_layers)
    assert state["cpu_expert_read_bytes"] == expected


def test_a_file_larger_than_ram_faults_from_the_drive():
    """§6: with the mapping, pages the page cache cannot hold are read from the SSD at every touch. 46.9 GiB of
    experts on the CPU with 31 GiB of RAM (rtx-4090-14900k-32gb) against 64 GiB (rtx-4090)."""
    small = _run(1, 16, hardware="rtx-4090-14900k-32gb", **{"n-cpu-moe": 48})
    large = _run(1, 16, **{"n-cpu-moe": 48})
    assert small.summary["engine_state"]["page_fault_read_bytes"] > 0
    assert large.summary["engine_state"]["page_fault_read_bytes"] == 0
    assert small.summary["decode_tok_s"] < large.summary["decode_tok_s"]
    ssd = {link["link"]: link for link in small.summary["links"]}["SSD"]
    assert ssd["bytes"] == small.summary["engine_state"]["page_fault_read_bytes"]


def test_a_cold_page_cache_reads_every_first_touch_from_the_drive():
    cold = _run(1, 1, page_cache="cold")
    first = _expert_bytes(cold)[:40].sum() * cold.scenario.layout.top_k  # the prompt token's k experts per layer
    assert cold.summary["engine_state"]["page_fault_read_bytes"] >= first


def test_pinned_experts_copy_faster_than_the_mapping():
    """§5.5: --load-mode none puts the CPU experts in pinned CUDA_Host memory, so op offload's copies run at the
    pinned rate instead of the driver's staged pageable one; decode (CPU reads) does not change."""
    mapped, pinned = _run(2048, 8), _run(2048, 8, **{"load-mode": "none"})
    assert pinned.summary["prefill_tok_s"] > mapped.summary["prefill_tok_s"]
    assert pinned.summary["ram_peak_mib"] > mapped.summary["ram_peak_mib"]
    assert pinned.summary["decode_tok_s"] == pytest.approx(mapped.summary["decode_tok_s"], rel=1e-9)


def test_fewer_cpu_layers_decode_faster():
    """§9: decode follows the bytes read on the CPU."""
    assert _run(1, 8, **{"n-cpu-moe": 36}).summary["decode_tok_s"] > _run(1, 8, **{"n-cpu-moe": 44}).summary["decode_tok_s"]


def test_a_larger_ubatch_reads_a_prompt_faster_while_copies_bound_it():
    """§5.3: per ubatch the used experts cross PCIe whatever the ubatch's size, so prefill grows with -ub."""
    assert _run(2048, 1, **{"ubatch-size": 1024}).summary["prefill_tok_s"] > \
        _run(2048, 1, **{"ubatch-size": 512}).summary["prefill_tok_s"]


def test_decode_reads_the_context_it_attends_to():
    """Each decode token reads the K/V of the positions its attention layers attend to: the same 16 tokens after a
    long prompt take longer than after a short one."""
    assert _run(4096, 16).summary["decode_tok_s"] < _run(256, 16).summary["decode_tok_s"]


def test_threads_beyond_the_physical_cores_add_nothing():
    """rtx-4090's assumed desktop has 8 physical cores: -t 16 runs them as -t 8 does, -t 4 on half of them."""
    eight, sixteen, four = (_run(1, 8, threads=t).summary["decode_tok_s"] for t in (8, 16, 4))
    assert sixteen == pytest.approx(eight, rel=1e-12) and four < eight


def _run_turns(turns: list[dict], **flags):
    data = tomllib.loads(SEED.read_text())
    data["engine"]["flags"] = {"ctx-size": 8192, "n-cpu-moe": 40, **flags}
    data["workload"] = {"requests": turns}
    return run_scenario(load_scenario(SEED, data))


def test_a_turn_that_continues_the_slot_computes_only_its_new_tokens():
    """llama-server keeps a slot's K/V: a second turn of the same conversation sends the 1,000 + 24 tokens before it
    again and 600 new ones; only the 600 are computed (the timings count what was computed, as llama.cpp reports
    it). A turn of another conversation starts afresh, and so does one after it."""
    first = {"prompt_tokens": 1000, "decode_tokens": 24, "conversation": "a"}
    same = _run_turns([first, {"prompt_tokens": 1624, "decode_tokens": 4, "conversation": "a"}])
    other = _run_turns([first, {"prompt_tokens": 1624, "decode_tokens": 4, "conversation": "b"}])
    assert same.timings["prompt_tokens"].tolist() == [1000, 600]
    assert other.timings["prompt_tokens"].tolist() == [1000, 1624]
    assert same.summary["engine_state"]["reused_prompt_tokens"] == 1024
    assert other.summary["engine_state"]["reused_prompt_tokens"] == 0
    # the 600 tokens run as two ubatches (512 + 88) starting at position 1,024
    steps = same.steps[(same.steps["request"] == 1) & (same.steps["phase"] == "prefill")]
    assert sorted(steps.groupby("step")["tokens"].first().tolist()) == [88, 512]


def test_a_whole_prompt_held_computes_its_last_token_again():
    """A turn whose prompt the slot already holds whole still computes one token (its logits)."""
    result = _run_turns([{"prompt_tokens": 700, "decode_tokens": 0, "conversation": "a"},
                         {"prompt_tokens": 700, "decode_tokens": 2, "conversation": "a"}])
    assert result.timings["prompt_tokens"].tolist() == [700, 1]


def test_a_prompt_at_depth_costs_more_than_the_same_prompt_at_the_start():
    """gpt-oss-20b all on the GPU (no copy whose size follows the routing): the same 512 new tokens after 6,144 held
    ones attend to more positions in its 12 full-attention layers than after 1, a slower ubatch. (The qwen3.8 packs'
    attention is a window whose prompt cost is not priced.)"""
    def turns(depth: int):
        data = tomllib.loads(SEED.read_text())
        data.update(model="gpt-oss-20b", trace={"generator": "gpt-oss-20b", "seed": 0})
        data["engine"]["flags"] = {"ctx-size": 8192}
        data["workload"] = {"requests": [
            {"prompt_tokens": depth, "decode_tokens": 0, "conversation": "a"},
            {"prompt_tokens": depth + 512, "decode_tokens": 1, "conversation": "a", "measured": True}]}
        return run_scenario(load_scenario(SEED, data)).summary["prefill_tok_s"]

    assert turns(6144) < 0.97 * turns(1)


def test_layers_left_on_the_cpu_read_their_weights_and_experts_every_token():
    """-ngl 40 on the 48 blocks: blocks 0-8 run whole on the CPU. Each decode token the CPU still reads k experts
    per CPU MoE layer (blocks 0-39, -ncmoe 40), and now also the 9 layers' other weights (the file's non-expert bytes
    less the output projection, 1/48 each)."""
    from sim.engines.llamacpp.weights import file_weights

    short, long = _run(1, 4, **{"n-gpu-layers": 40}), _run(1, 12, **{"n-gpu-layers": 40})
    per_token_experts = _expert_bytes(short)[:40].sum() * short.scenario.layout.top_k
    grew = {k: long.summary["engine_state"][k] - short.summary["engine_state"][k]
            for k in ("cpu_expert_read_bytes", "cpu_layer_weight_bytes")}
    weights = file_weights(short.scenario.layout, "t")
    assert grew["cpu_expert_read_bytes"] == 8 * per_token_experts
    assert grew["cpu_layer_weight_bytes"] == pytest.approx(8 * 9 * (weights.gpu_bytes - weights.output_bytes) / 48)


def test_fewer_gpu_layers_decode_slower_and_without_any_the_output_runs_on_the_cpu():
    rates = [_run(1, 8, **({} if n is None else {"n-gpu-layers": n})).summary["decode_tok_s"] for n in (None, 40, 24, 0)]
    assert rates == sorted(rates, reverse=True) and rates[0] > rates[-1] * 2
    none = _run(1, 8, **{"n-gpu-layers": 0}).summary["engine_state"]
    assert none["output_layer"] == "CPU" and none["cpu_blocks"] == 48


def test_cpu_layers_run_at_ggmls_measured_kernels_and_say_where_they_were_measured(tmp_path):
    """The CPU's matmuls run at ggml's kernels for the experts' types (IQ3_S-family and IQ4_NL slices here) on the
    profile's vector instructions, measured on another CPU: the run names those records. A profile that does not
    say its instructions runs at its own expert-kernel figure, told in a notice, and decodes at another rate."""
    measured = _run(1, 4)
    flagged = {note.split("(record ")[1].split(")")[0] for note in measured.summary["out_of_domain"]
               if "(record llamacpp-ggml-" in note}
    assert flagged == {"llamacpp-ggml-avx2-iq3_s", "llamacpp-ggml-avx2-iq4_xs"}
    text = (ROOT / "scenarios" / "hardware" / "rtx-4090.toml").read_text()
    lines = [line for line in text.splitlines() if not line.startswith("simd = ")]
    assert len(lines) == len(text.splitlines()) - 1
    profile = tmp_path / "rtx-4090-no-simd.toml"
    profile.write_text("\n".join(lines) + "\n")
    unsaid = _run(1, 4, hardware=str(profile))
    assert ("no measured ggml CPU kernels for host.simd (not set): the CPU expert matmul runs at the profile's "
            "host.expert_kernel_gbps per core") in unsaid.summary["notices"]
    assert unsaid.summary["decode_tok_s"] != measured.summary["decode_tok_s"]


def test_ik_llama_cpp_runs_its_own_measured_kernels_and_mainlines_where_it_has_none():
    """The ik variant's CPU layers run at ik_llama.cpp's kernels (records llamacpp-ik-*) where they were measured for
    the profile's instructions: the seed file's IQ3_XXS slices at ik's own IQ3_XXS kernel and IQ4_NL at ik's IQ4_XS
    family kernel on an AVX-512 host; IQ3_S, which ik's table lacks, at mainline's, told in a notice; an AVX2 host has
    no ik row at all (mainline's IQ3_S family kernel then takes IQ3_XXS too)."""
    def flagged(result):
        return {note.split("(record ")[1].split(")")[0] for note in result.summary["out_of_domain"]
                if "(record llamacpp-ik-" in note or "(record llamacpp-ggml-" in note}

    avx512 = _run(1, 4, hardware="rtx-pro-6000-maxq-9175f", variant="ik")
    assert flagged(avx512) == {"llamacpp-ik-avx512-iq3_xxs", "llamacpp-ggml-avx512-iq3_s", "llamacpp-ik-avx512-iq4_xs"}
    assert any("no measured ik_llama.cpp CPU kernel for IQ3_S on avx512" in n for n in avx512.summary["notices"])
    avx2 = _run(1, 4, variant="ik")
    assert flagged(avx2) == {"llamacpp-ggml-avx2-iq3_s", "llamacpp-ggml-avx2-iq4_xs"}


def test_decode_without_cuda_graphs_pays_each_nodes_launch():
    """graph.py: with GGML_CUDA_DISABLE_GRAPHS set (any value, common.cuh:1289) every decode graph node on the GPU
    costs the measured launch-bound time instead of the graphs' floor. Decode is serial (each CPU MoE layer drains
    the stream), so a token takes longer by exactly the GPU's nodes times the difference of the two records: 37 nodes
    in each of the 40 CPU MoE layers (their experts' 4 run on the CPU), 41 in every other layer, per the scheduler's
    dump."""
    data = tomllib.loads(SEED.read_text())
    data["engine"]["flags"] = {"ctx-size": 8192, "n-cpu-moe": 40}
    data["workload"] = {"requests": [{"prompt_tokens": 1, "decode_tokens": 4}]}
    graphs = run_scenario(load_scenario(SEED, data))
    data["engine"]["env"] = {"GGML_CUDA_DISABLE_GRAPHS": "0"}  # set at all: off, whatever its value
    launched = run_scenario(load_scenario(SEED, data))

    def per_token(result):
        t = result.timings.iloc[-1]
        return (t.end_s - t.prefill_end_s) / t.decode_tokens

    n_layers = graphs.scenario.layout.n_routed_layers
    nodes = 40 * 37 + (n_layers - 40) * 41
    delta_us = BY_ID["llamacpp-gpu-node-launch"].value - BY_ID["llamacpp-gpu-node-graphs"].value
    assert per_token(launched) - per_token(graphs) == pytest.approx(nodes * delta_us * 1e-6, rel=1e-9)
    assert any("llamacpp-gpu-node-launch" in note for note in launched.summary["out_of_domain"])


def test_a_host_with_its_own_kernel_rates_computes_its_cpu_experts_at_them(tmp_path):
    """host.ggml_kernel_gbps: with every family's rate of this host's own given, no kernel record is read, and a
    decode token's CPU expert matmuls take their bytes over the cores x that rate: halving the rate from 1 to 0.5
    GB/s a core adds the token's host-resident expert bytes / (8 cores x 1 GB/s) (rtx-4090.toml: 8 physical cores,
    62 GB/s of DRAM, which 8 GB/s of kernels never reach)."""
    base = (Path(__file__).resolve().parent.parent / "scenarios/hardware/rtx-4090.toml").read_text()

    def run_at(gbps):
        table = "\n".join(f'{t} = {{ value = {gbps}, unit = "GB/s", source = "[H] this host" }}'
                          for t in ("Q8_0", "Q5_0", "Q4_K", "Q6_K", "MXFP4", "IQ4_XS", "IQ3_S"))
        profile = tmp_path / f"own-{gbps}.toml"
        profile.write_text(base.replace("[pcie]", f"[host.ggml_kernel_gbps]\n{table}\n\n[pcie]", 1))
        return _run(1, 4, hardware=str(profile))

    fast, slow = run_at(1.0), run_at(0.5)
    assert not any("(record llamacpp-ggml" in note for note in fast.summary["out_of_domain"])
    from sim.engines import ENGINES

    assert not any(r.startswith("llamacpp-ggml") for r in ENGINES["llama.cpp"].records_read(fast.scenario))

    def per_token(result):
        t = result.timings.iloc[-1]
        return (t.end_s - t.prefill_end_s) / t.decode_tokens

    per_token_bytes = _expert_bytes(fast)[:40].sum() * fast.scenario.layout.top_k
    assert per_token(slow) - per_token(fast) == pytest.approx(per_token_bytes / 8e9, rel=1e-6)


@pytest.mark.parametrize("variant, flags", [("mainline", {}), ("ik", {}), ("mainline", {"n-gpu-layers": 30}),
                                            ("mainline", {"n-cpu-moe": 0})])
def test_records_read_are_the_records_a_run_reads(variant, flags):
    """records_read (what --uncertainty samples) names exactly the llama.cpp records a run of the box, away from every
    record's key, reports reading: the graph floor, the split where a layer's experts are on the CPU, the CPU
    kernels of the slices it computes (the seed's IQ3_XXS / IQ4_NL experts; -ngl's whole CPU layers)."""
    from sim.engines import ENGINES

    result = _run(1, 2, variant=variant, **flags)
    reported = {note.split("(record ")[1].split(")")[0] for note in result.summary["out_of_domain"]
                if "(record llamacpp-" in note}
    assert set(ENGINES["llama.cpp"].records_read(result.scenario)) == reported
