"""ds4 CUDA streaming cache sizing (sim/engines/ds4: settings, sizing, planner, memory) against ds4-engine.md §1.3, §1.4, §1.12, §1.13."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.engines.ds4.geometry import expert_bytes
from sim.engines.ds4.memory import flash_context_buffer_bytes, flash_kv_bytes, flash_raw_rows
from sim.engines.ds4.planner import budget_plan, graph_pressure_cap_bytes
from sim.engines.ds4.settings import (
    cache_budget_bytes,
    parse_cache_experts_arg,
    requested_budget_experts,
    vram_reserve_bytes,
)
from sim.engines.ds4.sizing import (
    CacheState,
    LiveBudget,
    NoticeDedup,
    allocate_class_caches,
    live_budget,
    oom_shrink,
    prefill_staging_bytes,
    prepare_class_cache,
    replay_cache_sizing,
    shrunken_cap,
)
from sim.errors import InputError
from sim.model import get_preset
from sim.units import GIB, MIB

MiB, GiB = MIB, GIB
Q2_EXPERT_BYTES = 7_077_888  # 6.75 MiB: IQ2_XXS gate/up + Q2_K down (ds4-engine.md §2.3)
Q4_EXPERT_BYTES = 14_155_776  # 13.5 MiB: Q4_K gate/up/down
AVAILABLE_503_BYTES = round(81.57 * GiB)  # "available 81.57 GiB" in the #503 log
RTX_PRO_6000_VRAM_BYTES = 96 * GiB  # the clamp at VRAM / 2 does not bind here
TOP_K = 6


def mixed_visits(tokens: int) -> list[tuple[int, int]]:
    """Layer visits of `tokens` decode tokens through the q2-q4 Flash file, forward order."""
    layout = get_preset("deepseek-v4-flash-q2-q4")
    return [(layer.gate_bytes, layer.down_bytes) for layer in layout.layers] * tokens


# ------------------------------------------------------------------------------------------ parsing


def test_byte_budget_converts_with_the_first_routed_layer():
    # 10619 = floor(70 GiB / 6.75 MiB): the #503 run's budget (§1.12)
    assert parse_cache_experts_arg("70GB", Q2_EXPERT_BYTES) == 10619
    assert 70 * GiB // Q2_EXPERT_BYTES == 10619
    first = get_preset("deepseek-v4-flash-q2-q4").layers[0]
    assert expert_bytes(first.gate_bytes, first.down_bytes) == Q2_EXPERT_BYTES


def test_plain_count_and_clamp_and_default():
    assert parse_cache_experts_arg("9472", Q2_EXPERT_BYTES) == 9472
    assert requested_budget_experts() == 512
    assert requested_budget_experts(9472) == 9472
    big = parse_cache_experts_arg("200GB", Q2_EXPERT_BYTES)
    assert big == 30340 and requested_budget_experts(big) == 23424 == 61 * 384
    assert requested_budget_experts(4500, env_cache_experts="777") == 777  # the variable wins
    assert requested_budget_experts(4500, env_cache_experts="99999") == 23424
    assert requested_budget_experts(4500, env_cache_experts="lots") == 4500


@pytest.mark.parametrize("text", ["", "70 GB", "70gb", "1.5GB", "-3", "GB", "0", "0GB", "1GB1"])
def test_cache_experts_arg_rejects(text):
    with pytest.raises(InputError, match="--ssd-streaming-cache-experts"):
        parse_cache_experts_arg(text, 10 * GiB)  # 1GB of 10 GiB experts is 0 experts


@pytest.mark.parametrize("value, reserve_gib", [
    (None, 16), ("12", 12), ("0", 0), ("0.5", 16), ("12GB", 16), ("-1", 16), (" 12", 16), ("", 16), ("64", 48),
])
def test_reserve_env_is_integer_gib_clamped_to_half_vram(value, reserve_gib):
    assert vram_reserve_bytes(value, RTX_PRO_6000_VRAM_BYTES) == reserve_gib * GiB


def test_default_reserve_clamped_on_a_small_card():
    assert vram_reserve_bytes(None, 24 * GiB) == 12 * GiB


# ------------------------------------------------------------------------------------------ live budget


def test_503_notices_come_out_exactly():
    q4 = live_budget(10619, Q4_EXPERT_BYTES, AVAILABLE_503_BYTES, 16 * GiB)
    q2 = live_budget(10619, Q2_EXPERT_BYTES, AVAILABLE_503_BYTES, 16 * GiB)
    assert (q4.capacity_experts, q2.capacity_experts) == (4973, 9947)
    assert q4.notice == ("CUDA streaming expert cache capped from 10619 to 4973 experts "
                         "(available 81.57 GiB, reserve 16.00 GiB, 13.50 MiB/expert)")
    assert q2.notice == ("CUDA streaming expert cache capped from 10619 to 9947 experts "
                         "(available 81.57 GiB, reserve 16.00 GiB, 6.75 MiB/expert)")
    assert not q4.disabled and not q2.disabled


def test_reclaim_counts_as_available_and_no_notice_at_the_request():
    fit = live_budget(100, Q2_EXPERT_BYTES, 16 * GiB, 16 * GiB, reclaim_bytes=100 * Q2_EXPERT_BYTES)
    assert fit == LiveBudget(100, None, False)


def test_disabled_when_available_not_above_reserve():
    off = live_budget(512, Q2_EXPERT_BYTES, 12 * GiB, 16 * GiB, reclaim_bytes=4 * GiB)
    assert off.disabled and off.capacity_experts == 0
    assert off.notice == "CUDA streaming expert cache disabled: available 16.00 GiB <= reserve 16.00 GiB"


@given(st.integers(0, 30000), st.integers(1, 64 * MiB), st.integers(0, 200 * GiB), st.integers(0, 48 * GiB))
def test_live_cap_never_exceeds_request_nor_free_memory(requested, size, free, reserve):
    decision = live_budget(requested, size, free, reserve)
    assert 0 <= decision.capacity_experts <= requested
    assert decision.capacity_experts * size <= max(0, free - reserve)
    assert (decision.notice is None) == (decision.capacity_experts == requested and not decision.disabled)


def test_notice_dedup_prints_a_value_once_until_it_changes_or_resets():
    dedup = NoticeDedup()
    assert dedup.emit("a") == "a" and dedup.emit("a") is None and dedup.emit(None) is None
    assert dedup.emit("b") == "b" and dedup.emit("a") == "a"
    dedup.reset()
    assert dedup.emit("a") == "a"


# ------------------------------------------------------------------------------------------ #504 classes

# The #504 configuration (§1.12): RTX PRO 6000 96 GB, 81.57 GiB available as in #503, budget 9472, reserve
# 12. Staging held when each class allocates: decode-first, 6 experts of that layer's size; prefill-first,
# a whole layer's union (256 experts: 1.6875 GiB at layer 0, 3.375 GiB at layer 37; grow-only).
DECODE_STAGING = [TOP_K * Q2_EXPERT_BYTES, TOP_K * Q4_EXPERT_BYTES]
PREFILL_STAGING = [256 * Q2_EXPERT_BYTES, 256 * Q4_EXPERT_BYTES]


@pytest.mark.parametrize("reserve_gib, staging, q4_slots, note", [
    (12, DECODE_STAGING, 535, "§1.12 estimates ~534"),
    (12, PREFILL_STAGING, 285, "§1.12 estimates ~285"),
    (16, DECODE_STAGING, 231, "§1.12 estimates ~231"),
    (16, PREFILL_STAGING, 0, "§1.12: disabled"),
])
def test_504_q2_class_takes_all_q2_experts_and_q4_gets_the_leftover(reserve_gib, staging, q4_slots, note):
    q2, q4 = allocate_class_caches([Q2_EXPERT_BYTES, Q4_EXPERT_BYTES], 9472, RTX_PRO_6000_VRAM_BYTES,
                                      AVAILABLE_503_BYTES, reserve_gib * GiB, staging)
    assert q2.capacity_experts == 9472 == 37 * 256 and q2.notice is None
    assert q4.capacity_experts == q4_slots, note
    if q4_slots == 0:
        assert q4.disabled and q4.notice.startswith("CUDA streaming expert cache disabled: available 15.76 GiB")


def test_504_without_staging_and_notice_text():
    q2, q4 = allocate_class_caches([Q2_EXPERT_BYTES, Q4_EXPERT_BYTES], 9472, RTX_PRO_6000_VRAM_BYTES,
                                      AVAILABLE_503_BYTES, 12 * GiB, DECODE_STAGING)
    assert q4.notice == ("CUDA streaming expert cache capped from 9472 to 535 experts "
                         "(available 19.05 GiB, reserve 12.00 GiB, 13.50 MiB/expert)")
    bare = allocate_class_caches([Q2_EXPERT_BYTES, Q4_EXPERT_BYTES], 9472, RTX_PRO_6000_VRAM_BYTES,
                                    AVAILABLE_503_BYTES, 12 * GiB)
    assert [c.capacity_experts for c in bare] == [9472, 541]


def test_class_reserve_is_clamped_and_class_count_checked():
    (only,) = allocate_class_caches([Q2_EXPERT_BYTES], 512, 8 * GiB, 6 * GiB, 16 * GiB)
    assert only.capacity_experts == 2 * GiB // Q2_EXPERT_BYTES  # reserve clamped to 4 GiB
    with pytest.raises(InputError, match="size classes"):
        allocate_class_caches([Q2_EXPERT_BYTES] * 5, 512, 96 * GiB, 90 * GiB, 16 * GiB)
    with pytest.raises(InputError, match="one value per class"):
        allocate_class_caches([Q2_EXPERT_BYTES] * 2, 512, 96 * GiB, 90 * GiB, 16 * GiB, [0])


# ------------------------------------------------------------------------------------------ slab replay


def test_pre_504_slab_repeats_the_notice_at_every_size_transition():
    replay = replay_cache_sizing(mixed_visits(2), 10619, AVAILABLE_503_BYTES, 16 * GiB, per_class=False)
    assert [visit for visit, _ in replay.notices] == [0, 37, 43, 80]  # layer 0, 37, next token's 0, 37
    assert [text.split(" to ")[1].split()[0] for _, text in replay.notices] == ["9947", "4973", "9947", "4973"]
    assert replay.flushes == 3 and replay.allocations == 4  # every transition throws the slab away
    assert replay.capacities[:37] == (9947,) * 37 and replay.capacities[37:43] == (4973,) * 6


def test_post_504_classes_notice_once_and_never_flush():
    replay = replay_cache_sizing(mixed_visits(10), 10619, AVAILABLE_503_BYTES, 16 * GiB, per_class=True)
    assert [visit for visit, _ in replay.notices] == [0, 37]
    assert replay.flushes == 0 and replay.allocations == 1
    # q2 takes 9947 x 6.75 MiB, which leaves 1.4 MiB above the 16 GiB reserve: the q4 class gets 0 slots
    assert set(replay.capacities[37:43]) == {0} and "to 0 experts" in replay.notices[1][1]
    tuned = replay_cache_sizing(mixed_visits(3), 9472, AVAILABLE_503_BYTES, 12 * GiB, per_class=True,
                                   other_allocation_bytes=TOP_K * Q4_EXPERT_BYTES)
    assert set(tuned.capacities) == {9472, 535} and len(tuned.notices) == 1


def test_fifth_size_class_recycles_class_zero():
    keys = [(1000, 1000), (2000, 1000), (3000, 1000), (4000, 1000), (5000, 1000), (1000, 1000)]
    replay = replay_cache_sizing(keys, 10, 10**9, 0, per_class=True)
    assert replay.capacities == (10,) * 6
    assert replay.flushes == 2  # the 5th size takes class 0; the 1st size, back again, takes it back
    assert replay.allocations == 6


# ------------------------------------------------------------------------------------------ prepare / growth


def test_growth_flushes_and_reallocates_empty():
    key = (2_162_688, 2_752_512)
    small = CacheState(key, 100)
    grown = prepare_class_cache(small, key, 500, free_vram_bytes=20 * GiB, reserve_bytes=16 * GiB)
    assert grown.state == CacheState(key, 500) and grown.flushed and grown.allocated and grown.notice is None
    kept = prepare_class_cache(small, key, 100, 0, 16 * GiB)
    assert kept.state is small and not kept.flushed and not kept.allocated
    no_room = prepare_class_cache(small, key, 500, free_vram_bytes=16 * GiB, reserve_bytes=16 * GiB)
    assert no_room.state is small and not no_room.flushed  # live cap with reclaim = 100, no growth


def test_size_change_releases_and_sizes_with_the_freed_bytes():
    q2, q4 = (2_162_688, 2_752_512), (4_718_592, 4_718_592)
    out = prepare_class_cache(CacheState(q2, 9947), q4, 10619, AVAILABLE_503_BYTES - 9947 * Q2_EXPERT_BYTES,
                                 16 * GiB)
    assert out.flushed and out.state == CacheState(q4, 4973) and "4973" in out.notice


# ------------------------------------------------------------------------------------------ OOM


@pytest.mark.parametrize("cap, shrunk", [(0, 0), (1, 0), (9, 8), (10, 9), (11, 9), (100, 90), (9472, 8524)])
def test_shrunken_cap_removes_ceil_tenth(cap, shrunk):
    assert shrunken_cap(cap) == shrunk


def test_oom_shrinks_until_it_fits_with_messages():
    out = oom_shrink(100, Q2_EXPERT_BYTES, 60 * Q2_EXPERT_BYTES)
    assert out.attempts == (100, 90, 81, 72, 64, 57) and out.capacity_experts == 57
    assert out.messages[0] == "allocation failed at 100 experts / 0.66 GiB"
    assert out.messages[1] == "shrinking resident cache margin by 10 experts; runtime cache cap now 90"


def test_oom_reaching_zero_disables_the_cache():
    out = oom_shrink(3, Q2_EXPERT_BYTES, 0)
    assert out.capacity_experts == 0 and out.attempts == (3, 2, 1)
    assert out.messages[-1] == "disabling resident expert cache after OOM; using direct selected loads"
    assert oom_shrink(100, Q2_EXPERT_BYTES, 0, live_cap_experts=5).attempts == (100, 5, 4, 3, 2, 1)


@given(st.integers(0, 30000), st.integers(0, 30000))
def test_oom_terminates_with_the_first_cap_that_fits(cap, fits):
    out = oom_shrink(cap, 1, fits)
    assert out.capacity_experts <= min(cap, fits)
    assert all(a > b for a, b in zip(out.attempts, out.attempts[1:]))
    assert out.capacity_experts == 0 or out.capacity_experts == out.attempts[-1]


# ------------------------------------------------------------------------------------------ staging


def test_prefill_staging_is_the_union_high_water_mark():
    layout = get_preset("deepseek-v4-flash-q2-q4")
    sizes = layout.expert_bytes_per_layer()
    assert prefill_staging_bytes([256] * 43, sizes) == int(3.375 * GiB)
    assert prefill_staging_bytes([256] * 37 + [0] * 6, sizes) == int(1.6875 * GiB)
    assert prefill_staging_bytes([10] * 43, sizes, current_staging_bytes=GiB) == GiB  # grow-only
    with pytest.raises(InputError, match="one union size per layer"):
        prefill_staging_bytes([1, 2], sizes)


# ------------------------------------------------------------------------------------ hotlist seeding (§1.9)


def test_preload_is_the_budget_capped_at_4096_unless_set():
    from sim.engines.ds4.settings import hotlist_preload_experts

    assert hotlist_preload_experts(9472) == 4096  # "preload = min(budget, 4096)"
    assert hotlist_preload_experts(1000) == 1000
    assert hotlist_preload_experts(9472, preload_flag=50) == 50  # --ssd-streaming-preload-experts N overrides
    assert hotlist_preload_experts(9472, auto_cap_env="100") == 100  # DS4_METAL_STREAMING_EXPERT_AUTO_PRELOAD_CAP
    with pytest.raises(InputError, match="AUTO_PRELOAD_CAP"):
        hotlist_preload_experts(9472, auto_cap_env="lots")


def test_seed_plan_takes_the_first_preload_entries_on_seeded_layers_grouped_by_layer():
    from sim.engines.ds4.sizing import hotlist_seed_plan

    n = 16
    ranking = [1 * n + 5, 0 * n + 3, 2 * n + 7, 0 * n + 1, 1 * n + 9]  # layer 2 is not an IQ2 layer
    plan = hotlist_seed_plan(ranking, n, seeded_layers=[0, 1], preload_experts=3)
    assert [(layer, experts.tolist()) for layer, experts in plan] == [(0, [3, 1]), (1, [5])]
    assert hotlist_seed_plan(ranking, n, [0, 1], 0) == []


@pytest.mark.parametrize("ctx, chunk, printed_mib, source", [
    (65665, 2048, 1311.89, "ds4-bench on a GB10, antirez/ds4#158 (comment of 2026-05-16)"),
    (16777, 2048, 479.38, "ds4-eval on an M4 Max, antirez/ds4#201"),
])
def test_kv_and_context_buffers_match_what_ds4_prints(ctx, chunk, printed_mib, source):
    # ds4 logs "context buffers X MiB (ctx=..., prefill_chunk=..., raw_kv_rows=2304, ...)": the KV cache plus
    # the prefill's attention context buffers. A measured figure of the engine itself, not of this model.
    assert flash_raw_rows(ctx, chunk) == 2304, source  # printed raw_kv_rows
    ours = (flash_kv_bytes(ctx, chunk) + flash_context_buffer_bytes(ctx, chunk)) / MiB
    assert ours == pytest.approx(printed_mib, abs=0.005), source


def test_raw_rows_hold_a_chunk_and_a_window_padded_and_capped():
    assert flash_raw_rows(100, 4096) == 256  # the context caps the rows before the padding, not after
    assert flash_raw_rows(32768, 4096) == 4352  # 4096 + 128 -> the next multiple of 256
    assert flash_raw_rows(1_000_000, 16384) == 8192  # capped
    assert flash_raw_rows(1000, 1) == 256  # one padded block


# ---------------------------------------------------------------------------------------------- the budget planner
# Known answers from the engine's own logs: #780 (12 GB laptop), #488 (8 GB card), #1036 (Strix Halo, V4.1).

Q2 = 7_077_888  # a DeepSeek-V4-Flash q2 expert, 6.75 MiB
V41 = 9_953_280  # a DeepSeek-V4.1-Flash Q2 expert, 9.49 MiB


def test_780_a_12gb_request_is_capped_to_10_gib_and_split():
    # "capped to 10.00 GiB"; "3.38 GiB prefill headroom + 6.62 GiB dynamic cache" (antirez/ds4#780), on a 12 GiB
    # card whose context takes ~0.42 GiB at --ctx 4096 (its "planned 11.41 GiB" less 10 GiB and 0.99 GiB resident)
    plan = budget_plan("planner", api="cuda", working_set=12 * GIB, requested_bytes=12 * GIB,
                          requested_experts=None, expert_size=Q2, n_experts=256, cacheable_layers=43,
                          non_routed=int(8.20 * GIB), context_bytes=int(0.42 * GIB))
    assert plan.headroom_bytes == 2 * 256 * Q2 and f"{plan.headroom_bytes / GIB:.2f}" == "3.38"
    assert f"{plan.cache_experts * Q2 / GIB:.2f}" == "6.62"
    assert any("capped to 10.00 GiB" in n for n in plan.notices)


def test_488_auto_budget_keeps_one_expert_when_weights_fill_the_target():
    # "cuda recommends 7.62 GiB working set": 80 % = 6.10 GiB < 8.20 GiB non-routed -> a one-expert cache
    plan = budget_plan("auto-488", api="cuda", working_set=int(7.62 * GIB), requested_bytes=None,
                          requested_experts=None, expert_size=Q2, n_experts=256, cacheable_layers=43,
                          non_routed=int(8.20 * GIB), context_bytes=0)
    assert plan.cache_experts == 1 and plan.headroom_bytes == 0


def test_the_later_planner_refuses_what_488_kept():
    # @54b36ed the same one-expert auto budget cannot hold two layers of prefill headroom: startup fails
    with pytest.raises(InputError, match="routed prefill headroom needs 3.38 GiB"):
        budget_plan("planner", api="hip", working_set=int(7.62 * GIB), requested_bytes=None,
                       requested_experts=None, expert_size=Q2, n_experts=256, cacheable_layers=43,
                       non_routed=int(8.20 * GIB), context_bytes=0)


def test_1036_v41_strix_halo_cap_split_and_fit():
    # "89.00 GiB capped to 51.00 GiB"; "7.12 GiB two-layer staging + 43.87 GiB dynamic (4733 experts)"; "fitted
    # from 4733 to 4427"; static 9.37 GiB, graph 1.82 GiB, 2.00 GiB allowance, 59.34 GiB planned (PR #1036). The
    # working set: the planned total plus the allowance; the context as printed (graph 1.82 GiB).
    working_set = int((59.34 + 2.00) * GIB)
    plan = budget_plan("planner-v41", api="hip", working_set=working_set, requested_bytes=89 * GIB,
                          requested_experts=None, expert_size=V41, n_experts=384, cacheable_layers=40,
                          non_routed=int(9.37 * GIB), context_bytes=int(1.82 * GIB),
                          fixed_bytes=int((9.37 + 1.82) * GIB))
    assert f"{plan.headroom_bytes / GIB:.2f}" == "7.12"
    assert any("capped to 51.00 GiB" in n for n in plan.notices)
    assert any("(4733 experts" in n for n in plan.notices)
    assert abs(plan.cache_experts - 4427) <= 1  # the printed GiB figures are rounded to 0.01


def test_a_count_is_neither_capped_nor_split():
    plan = budget_plan("planner", api="cuda", working_set=12 * GIB, requested_bytes=None, requested_experts=5000,
                          expert_size=Q2, n_experts=256, cacheable_layers=43, non_routed=int(8.2 * GIB),
                          context_bytes=0)
    assert (plan.cache_experts, plan.headroom_bytes, plan.notices) == (5000, 0, ())


@given(st.integers(1, 512), st.integers(0, 64))
def test_graph_cap_is_whole_gib_and_at_least_one(working_gib, context_gib):
    cap = graph_pressure_cap_bytes(working_gib * GIB, context_gib * GIB)
    assert cap % GIB == 0 and cap >= GIB
    assert cap <= max(GIB, working_gib * GIB * 7 // 8 - context_gib * GIB)


@pytest.mark.parametrize(("text", "n_bytes"), [("89GB", 89 * GIB), ("12GB", 12 * GIB), ("9472", None), (None, None)])
def test_a_gib_budget_is_bytes_to_the_planner_and_a_count_is_not(text, n_bytes):
    assert cache_budget_bytes(text) == n_bytes


@pytest.mark.parametrize("text, threads", [(None, 9), ("4", 4), ("0", 1), ("40", 18)])
def test_metal_pread_pool_is_9_threads_clamped_to_1_18(text, threads):
    # ds4_gpu_stream_expert_pread_thread_limit (ds4_metal.m @b0309611): 9 unless
    # DS4_METAL_STREAMING_EXPERT_PREAD_THREADS says otherwise; 0 counts as 1, more than 18 as 18
    from sim.engines.ds4.settings import Env, metal_pread_threads

    env = Env() if text is None else Env(DS4_METAL_STREAMING_EXPERT_PREAD_THREADS=text)
    assert metal_pread_threads(env) == threads
