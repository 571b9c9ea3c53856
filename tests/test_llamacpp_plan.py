"""llama.cpp's rules as the code states them (../shared/reference/llamacpp-engine.md): where an expert tensor lands
(-ot, --cpu-moe, --n-cpu-moe per variant), when the GPU takes a prompt's expert matmuls (op offload), how the used
experts are copied, the memory plan and the refusals at load. Known answers, read off the cited code lines."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.engines.llamacpp.process import used_runs
from sim.engines.llamacpp.settings import VARIANTS, Flags, Knobs, cpu_placement
from sim.errors import InputError
from sim.model.presets import get_preset
from sim.scenario import load_scenario
from sim.trace.format import distinct_experts

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "scenarios" / "llamacpp-qwen3.8-ncmoe.toml"


def _scenario(**flags):
    data = tomllib.loads(SEED.read_text())
    data["engine"]["flags"] = {"ctx-size": 8192, **flags}
    variant = data["engine"]["flags"].pop("variant", None)
    if variant:
        data["engine"]["variant"] = variant
    env = data["engine"]["flags"].pop("env", None)
    if env:
        data["engine"]["env"] = env
    return load_scenario(SEED, data)


def _cpu_blocks(layout, variant: str, **flags) -> list[int]:
    on_cpu = cpu_placement("test", layout, Flags.model_validate(flags), VARIANTS[variant])
    return [layer.block for layer, cpu in zip(layout.layers, on_cpu.all(axis=1)) if cpu]


def test_n_cpu_moe_takes_the_first_blocks_in_mainline_and_the_last_layers_in_ik():
    layout = get_preset("qwen3.8-flash-next-iq3s")  # 48 MoE blocks, 0..47
    assert _cpu_blocks(layout, "mainline", **{"n-cpu-moe": 3}) == [0, 1, 2]  # common/common.h:1115-1117
    assert _cpu_blocks(layout, "ik", **{"n-cpu-moe": 3}) == [45, 46, 47]  # src/llama-load-tensors.cpp:270-285
    assert _cpu_blocks(layout, "mainline", **{"n-cpu-moe": 999}) == list(range(48))


def test_mainline_counts_dense_blocks_toward_n_cpu_moe():
    layout = get_preset("glm-5.2")  # blocks 0-2 dense: blk.0..4 covers two MoE blocks
    assert _cpu_blocks(layout, "mainline", **{"n-cpu-moe": 5}) == [3, 4]
    assert _cpu_blocks(layout, "ik", **{"n-cpu-moe": 2}) == [76, 77]  # the last MoE layers; blk.78 is the MTP layer
    assert _cpu_blocks(layout, "mainline", **{"n-cpu-moe": 999})[-2:] == [77, 78]  # blk.0..998: the MTP block's too


def test_a_user_override_wins_over_cpu_moe_and_matches_as_a_substring():
    layout = get_preset("qwen3.8-flash-next-iq3s")
    # -ot entries come before --cpu-moe's: blk.1.'s experts stay on the GPU, blk.10-19 do not match "blk\.1\."
    blocks = _cpu_blocks(layout, "mainline", **{"cpu-moe": True, "override-tensor": [r"blk\.1\.=CUDA0"]})
    assert 1 not in blocks and 10 in blocks and len(blocks) == 47
    # "exps=CPU" matches every expert tensor by substring (-ot exps=CPU)
    assert len(_cpu_blocks(layout, "mainline", **{"override-tensor": ["exps=CPU"]})) == 48


def test_an_override_can_put_one_part_on_the_cpu():
    layout = get_preset("qwen3-30b-a3b")  # separate gate, up, down tensors
    on_cpu = cpu_placement("test", layout, Flags.model_validate({"override-tensor": ["ffn_down_exps=CPU"]}),
                           VARIANTS["mainline"])
    assert on_cpu[:, 2].all() and not on_cpu[:, :2].any()


@pytest.mark.parametrize("entry,why", [("exps", "REGEX=BUFFER"), ("exps=GPU", "unknown buffer type"),
                                       ("(=CPU", "does not compile")])
def test_a_bad_override_is_refused_in_one_line(entry, why):
    with pytest.raises(InputError) as caught:
        cpu_placement("s.toml", get_preset("qwen3-30b-a3b"), Flags.model_validate({"override-tensor": [entry]}),
                      VARIANTS["mainline"])
    assert why in str(caught.value) and "override-tensor[0]" in str(caught.value)


def test_op_offload_switches_where_each_variant_says():
    mainline = Knobs.of(_scenario(**{"n-cpu-moe": 48}), "t")
    assert not mainline.offloads(31, 10, 512) and mainline.offloads(32, 10, 512)  # ggml-cuda.cu:5312-5331
    env = Knobs.of(_scenario(**{"n-cpu-moe": 48, "env": {"GGML_OP_OFFLOAD_MIN_BATCH": "64"}}), "t")
    assert not env.offloads(63, 10, 512) and env.offloads(64, 10, 512)
    ik = Knobs.of(_scenario(**{"n-cpu-moe": 48, "variant": "ik"}), "t")
    # ubatch x k >= 32 x E: 32 x 512 / 10 = 1638.4, so 1639 tokens (ggml-cuda.cu:5180-5210 in ik)
    assert not ik.offloads(1638, 10, 512) and ik.offloads(1639, 10, 512)
    off = Knobs.of(_scenario(**{"n-cpu-moe": 48, "no-op-offload": True}), "t")
    assert not off.offloads(4096, 10, 512)


def test_run_time_repacking_keeps_the_host_matmuls_on_the_cpu_and_turns_the_mapping_off():
    """ik's -rtr: the host tensors repacked for the CPU's kernels (no GPU kernel reads them, so no ubatch is offloaded),
    and mmap turned off (ik #147), even with pinning off; mainline has no such flag."""
    repacked = Knobs.of(_scenario(**{"n-cpu-moe": 48, "variant": "ik", "run-time-repack": True}), "t")
    assert repacked.offload_threshold(10, 512) is None and not repacked.offloads(65_536, 10, 512)
    unpinned = Knobs.of(_scenario(**{"n-cpu-moe": 48, "variant": "ik", "run-time-repack": True,
                                     "env": {"GGML_CUDA_NO_PINNED": "1"}}), "t")
    assert unpinned.host == "ram"  # without -rtr, GGML_CUDA_NO_PINNED keeps ik's mapping (§7)
    with pytest.raises(InputError) as caught:
        _scenario(**{"n-cpu-moe": 48, "run-time-repack": True})
    assert "engine.flags.run-time-repack" in str(caught.value) and "read only by ik" in str(caught.value)


def test_batches_are_clamped_as_the_context_does():
    knobs = Knobs.of(_scenario(**{"n-cpu-moe": 48, "ubatch-size": 4096, "batch-size": 1024}), "t")
    assert (knobs.batch, knobs.ubatch) == (1024, 1024)  # n_ubatch <= n_batch (src/llama-context.cpp:245-247)


def test_host_buffers_follow_load_mode_and_the_build():
    assert not Knobs.of(_scenario(**{"n-cpu-moe": 48}), "t").pinned  # the file mapping (§2.2)
    assert Knobs.of(_scenario(**{"n-cpu-moe": 48, "load-mode": "none"}), "t").pinned  # CUDA_Host
    assert Knobs.of(_scenario(**{"n-cpu-moe": 48, "variant": "ik"}), "t").pinned  # ik pins CPU overrides (§7)
    unpinned = _scenario(**{"n-cpu-moe": 48, "variant": "ik", "env": {"GGML_CUDA_NO_PINNED": "1"}})
    assert Knobs.of(unpinned, "t").host == "mapped"  # ik keeps the mapping when pinning is off
    plain = _scenario(**{"n-cpu-moe": 48, "load-mode": "none", "env": {"GGML_CUDA_NO_PINNED": "1"}})
    assert Knobs.of(plain, "t").host == "ram"  # no CUDA_Host buffer type: plain pageable RAM


def _runs_by_loop(ids: list[int], n_experts: int) -> tuple[int, int, int]:
    """The scheduler's copy plan written out plainly: walk the experts in order, open a run at each used expert
    after an unused one."""
    used = sorted(set(ids))
    runs = padded = 0
    for e in range(n_experts):
        if e in used and (e == 0 or e - 1 not in used):
            runs += 1
            end = e
            while end + 1 in used:
                end += 1
            padded += end != n_experts - 1
    return len(used), runs, padded


@given(st.lists(st.integers(0, 31), min_size=1, max_size=64))
def test_used_experts_are_copied_in_runs_of_consecutive_ids(ids):
    experts = distinct_experts(np.array(ids, np.uint16), 32)
    assert (len(experts), *used_runs(experts, 32)) == _runs_by_loop(ids, 32)


def test_used_runs_known_answer():
    # experts 0,1,2 | 5 | 30,31: three runs, the last one ends at the tensor's last expert and is not padded
    assert used_runs(distinct_experts(np.array([[2, 0], [1, 5], [31, 30]], np.uint16), 32), 32) == (3, 2)
    assert used_runs(np.array([], np.uint16), 32) == (0, 0)  # a ubatch whose rows all miss the layer


def test_a_placement_that_does_not_fit_the_card_is_pruned_and_refused_naming_the_knob():
    from sim.engines import engine_of
    from sim.simulate import run_scenario

    scenario = _scenario(**{"n-cpu-moe": 0, "fit": "off"})  # 46.9 GiB of experts on a 24 GB card, --fit off
    plan = engine_of(scenario).plan_memory(scenario)
    assert "out of memory" in plan.why_no_cache and plan.knob == "engine.flags.n-cpu-moe"
    with pytest.raises(InputError) as caught:
        run_scenario(scenario)
    assert "n-cpu-moe" in str(caught.value) and "out of memory" in str(caught.value)


def test_a_flag_of_the_other_build_is_refused():
    with pytest.raises(InputError) as caught:
        _scenario(**{"n-cpu-moe": 48, "no-ooae": True})
    assert "engine.flags.no-ooae" in str(caught.value) and "read only by ik" in str(caught.value)


def test_a_model_without_sourced_weights_is_refused():
    data = tomllib.loads(SEED.read_text())
    data["model"] = "qwen3-30b-a3b"
    data["model_class"] = "qwen3.8-flash-next"
    data["trace"] = {"generator": "qwen3-30b-a3b", "seed": 0}
    with pytest.raises(InputError) as caught:
        load_scenario(SEED, data)
    assert "non-expert weights are sourced" in str(caught.value)  # qwen3-30b-a3b: no file figure held


@given(st.integers(0, 70_000), st.integers(1, 4096), st.integers(1, 4096))
def test_attended_positions_match_a_plain_count(first, n, window):
    """Attention.positions in closed form against the sum it stands for: a query at position p attends to p + 1
    positions in a full layer and to at most `window` in a window layer."""
    from sim.engines.llamacpp.weights import Attention

    full = sum(p + 1 for p in range(first, first + n))
    capped = sum(min(p + 1, window) for p in range(first, first + n))
    assert Attention(1, 3, 2, window).positions(first, n) == pytest.approx(3 * full + 2 * capped, rel=1e-12)


def test_window_layers_cache_the_window_and_a_ubatch():
    from sim.engines.llamacpp.weights import Attention

    attention = Attention(2048, 18, 18, 128)  # gpt-oss-120b: 8 KV heads of 64 at F16, half the layers a 128 window
    assert attention.cache_bytes(32768, 512) == 2048 * (18 * 32768 + 18 * (128 + 512))
    assert attention.cache_bytes(100, 512) == 2048 * 36 * 100


def test_fit_keeps_the_last_layers_experts_on_the_cpu_until_the_rest_fits():
    """Mainline's --fit with no placement flags (common/fit.cpp, §2.3): the CPU-MoE layers at the end of the GPU's
    range, the fewest that leave its 1 GiB margin; a placement flag turns it off."""
    from sim.engines import engine_of
    from sim.engines.llamacpp.vram import FIT_MARGIN_BYTES

    def load(**flags):
        data = tomllib.loads(SEED.read_text())
        data["engine"]["flags"] = {"ctx-size": 8192, **flags}  # the seed's 4,096-token prompt
        data["workload"]["requests"] = [{"prompt_tokens": 1024, "decode_tokens": 64}]
        return load_scenario(SEED, data)

    fitted = load()
    on_cpu = Knobs.of(fitted, "t").on_cpu.all(axis=1)
    n = int(on_cpu.sum())
    assert 0 < n < 48 and on_cpu[48 - n:].all()  # the last n blocks
    assert engine_of(fitted).plan_memory(fitted).free_at_sizing_bytes >= FIT_MARGIN_BYTES
    # one layer fewer on the CPU, placed the same way by hand (-ot on the last n - 1 blocks), leaves less than it
    last = "|".join(str(b) for b in range(48 - (n - 1), 48))
    tighter = load(**{"override-tensor": [rf"blk\.({last})\.ffn_.*exps=CPU"]})
    assert Knobs.of(tighter, "t").on_cpu.all(axis=1).sum() == n - 1
    assert engine_of(tighter).plan_memory(tighter).free_at_sizing_bytes < FIT_MARGIN_BYTES
    # --n-cpu-moe turns fit off: the first blocks, as many as asked
    assert Knobs.of(load(**{"n-cpu-moe": 2}), "t").on_cpu.all(axis=1).nonzero()[0].tolist() == [0, 1]
    # --fit off with no placement: every expert on the GPU, which the 24 GB card cannot hold
    unfitted = load(fit="off")
    assert not Knobs.of(unfitted, "t").on_cpu.any()
    assert "out of memory" in engine_of(unfitted).plan_memory(unfitted).why_no_cache


def test_a_request_beyond_the_context_is_refused_as_llama_server_does():
    with pytest.raises(InputError) as caught:
        _scenario(**{"n-cpu-moe": 48, "ctx-size": 4096})  # the seed's 4,096-token prompt and 128 tokens
    assert "exceeds the available context size" in str(caught.value)


def test_n_gpu_layers_places_the_last_blocks_and_the_output_per_variant():
    """-ngl N on a 48-block model: mainline counts the output layer as slot 48, so the first GPU block is 49 - N and
    the output is on the GPU from N = 1 (src/llama-model.cpp, i_gpu_start = max(n_layer + 1 - N, 0)); ik_llama.cpp
    keeps the older rule, 48 - N, the output on the GPU only past every block (src/llama.cpp, llm_load_tensors)."""
    cases = {("mainline", 40): (9, True), ("mainline", 1): (48, True), ("mainline", 0): (48, False),
             ("mainline", 49): (0, True), ("ik", 40): (8, False), ("ik", 48): (0, False), ("ik", 49): (0, True)}
    for (variant, ngl), (first_gpu, output) in cases.items():
        knobs = Knobs.of(_scenario(**{"n-gpu-layers": ngl, "variant": variant}), "t")
        assert (knobs.cpu_blocks, knobs.output_on_gpu) == (first_gpu, output), (variant, ngl)
        assert knobs.whole_cpu.sum() == first_gpu and knobs.on_cpu[:first_gpu].all()  # their experts too


def test_n_gpu_layers_moves_weights_and_kv_from_vram_to_host_memory():
    """The 9 blocks -ngl 40 leaves on the CPU take 9/48 of the non-expert weights (the output projection stays on the
    GPU) and 9/48 of the K/V cache off the card, the plan's even split per layer [E]; the K/V lands in host RAM, the
    weights in the file mapping (page cache, no allocation). Their experts were on the CPU already (-ncmoe 48)."""
    from sim.engines.llamacpp.memory import plan_memory
    from sim.engines.llamacpp.weights import file_weights

    def plan(**flags):
        scenario = _scenario(**{"n-cpu-moe": 48, **flags})
        return scenario, plan_memory(scenario, Knobs.of(scenario, "t"), "t")

    scenario, every = plan()
    _, nine = plan(**{"n-gpu-layers": 40})
    weights = file_weights(scenario.layout, "t")
    cache = weights.attention.cache_bytes(8192, 512) + weights.state_bytes
    host = {a.name: a.bytes for a in nine.allocations if a.pool == "ram"}
    assert host == {"K/V cache of the CPU layers": int(cache * 9 / 48)}
    vram = lambda p: sum(a.bytes for a in p.allocations if a.pool == "vram")  # noqa: E731
    moved_weights = int((weights.gpu_bytes - weights.output_bytes) / 48 * 9)
    assert vram(every) - vram(nine) == moved_weights + int(cache * 9 / 48)
    assert "-ngl: blocks 0-8 run whole on the CPU, the output layer on the GPU" in nine.notices[-1]


@pytest.mark.parametrize("model, flags, knob, part", [
    (None, {"n-cpu-moe": 0, "fit": "off"}, "engine.flags.n-cpu-moe", "expert tensors on the GPU"),  # 46.9 GiB
    # every expert on the CPU; then a compute buffer of 65,536 positions' logits (151,936 x 4 B each), or the K/V of
    # ten million positions in each of Qwen3-30B-A3B's 48 full-attention layers (Qwen3.8's 12 keep a window)
    (None, {"cpu-moe": True, "ctx-size": 65_536, "batch-size": 65_536, "ubatch-size": 65_536},
     "engine.flags.ubatch-size", "compute buffer"),
    ("qwen3-30b-a3b-q4_k_m", {"cpu-moe": True, "ctx-size": 10_000_000}, "engine.flags.ctx-size", "K/V cache"),
])
def test_a_load_the_gpu_refuses_names_the_setting_that_shrinks_its_largest_part(model, flags, knob, part):
    """Before, every refusal named --n-cpu-moe (as 'n-cpu-moe = None' when it was not set), even when a context of
    ten million positions took the card."""
    from sim.simulate import run_scenario

    data = tomllib.loads(SEED.read_text())
    data["engine"]["flags"] = {"ctx-size": 8192, **flags}  # the seed's 4,096-token prompt
    if model:
        data["model"], data["trace"]["generator"] = model, model
    with pytest.raises(InputError) as caught:
        run_scenario(load_scenario(SEED, data))
    assert caught.value.field == knob and f"the largest part {part}" in caught.value.why
    assert caught.value.value == flags[knob.removeprefix("engine.flags.")]
