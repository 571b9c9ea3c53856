"""Strata v0.1.35 / #658 memory planning (sim/engines/strata: sizing, pricing, lending, ram, conversations, memory): rules, then the fork's numbers.

Validation setup (docs/planning.md, "Strata validation"): the qwen3.8-flash-next-iq3s preset (stand-in
per-layer blob mix), the interleaved profile ranking (rank r -> layer r % 48), the fork's 1536 MiB reserve,
borrowing, resident RAM mode (pinned share 0: ring 96, LendPct 85), 262,144-token context.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.engines.strata.conversations import ParkedConversation, conversation_budget_bytes, make_room, park_conversation
from sim.engines.strata.lending import (
    INDEPENDENT_CHUNKS_FORK,
    independent_candidates,
    independent_prefill_chunk,
    lend,
    plan_lend,
    tail_slots_for,
)
from sim.engines.strata.memory import draft_head_bind_bytes, mtp_bytes, pack_weights, session_bytes
from sim.engines.strata.pricing import IQ3S_MAX_BLOB_BYTES, bytes_needed, kv_stage_bytes, per_token_bytes, ring_slots
from sim.engines.strata.ram import U64_MAX, conversation_expert_headroom, resident_headroom_bytes, resident_ram_plan
from sim.engines.strata.settings import BUILDS, FORK_VRAM_RESERVE_MIB
from sim.engines.strata.sizing import (
    POST_WRITE_MAX_ROUNDS,
    adapted_vram_reserve,
    auto_cache_free_vram_range,
    auto_expert_cache,
    expert_cache_budget_bytes,
    interleaved_profile_layers,
    owned_prefill_mib,
    post_write_shrink,
    ranked_blob_bytes,
    roundup,
    sized_slot_walk,
)
from sim.errors import InputError
from sim.model import get_preset
from sim.units import GIB, MIB

MiB, GiB = MIB, GIB


def toy_cache(n: int, blob: int = 4 * MiB) -> np.ndarray:
    return np.full(n, blob, dtype=np.int64)


# ------------------------------------------------------------------------------------------ sized cache


def test_sized_walk_rounds_to_256_and_stops_at_the_first_misfit():
    blobs = np.array([1000, 300, 5000, 10], dtype=np.int64)  # slots 1024, 512, 5120, 256
    cache = sized_slot_walk(blobs, budget_bytes=1024 + 512 + 5119)
    assert (cache.slots, cache.bytes) == (2, 1536)  # the 10-byte blob after the misfit is not taken
    assert cache.slot_offsets.tolist() == [0, 1024] and cache.slot_bytes.tolist() == [1024, 512]
    full = sized_slot_walk(blobs, budget_bytes=10**9)
    assert full.slots == 4 and full.slot_offsets.tolist() == [0, 1024, 1536, 6656]
    by_free = sized_slot_walk(blobs, 10**9, free_vram_bytes=4000, vram_reserve_bytes=1000, other_bytes=1000)
    assert by_free.budget_bytes == 2000 and by_free.slots == 2
    assert sized_slot_walk(blobs, 10**9, free_vram_bytes=100, vram_reserve_bytes=1000).slots == 0


@given(st.lists(st.integers(1, 3 * MiB), min_size=1, max_size=200), st.integers(0, 300 * MiB))
def test_sized_walk_never_exceeds_its_limit(blobs, budget):
    cache = sized_slot_walk(np.array(blobs), budget)
    assert cache.bytes <= budget and cache.bytes == int(cache.slot_bytes.sum())
    if cache.slots < len(blobs):
        assert cache.bytes + roundup(blobs[cache.slots], 256) > budget


def test_expert_cache_n_is_a_byte_budget_of_max_blobs():
    assert expert_cache_budget_bytes(5400, IQ3S_MAX_BLOB_BYTES) == 14_376_960_000  # 13,710.9 MiB (§2.3)


def test_auto_cache_counts_prefill_only_without_borrowing():
    blobs = toy_cache(10_000, 2 * MiB)
    free = 10 * GiB
    borrow = auto_expert_cache(blobs, 2 * MiB, free, 700 * MiB)
    assert borrow.slots == (10 * 1024 - 700) // 2
    owned = auto_expert_cache(blobs, 2 * MiB, free, 700 * MiB, borrowing=False, owned_chunk_tokens=2048)
    assert owned_prefill_mib(2048) == 160 + 1360
    assert owned.slots == (10 * 1024 - 700 - 1520) // 2
    assert auto_expert_cache(blobs[:50], 2 * MiB, free, 0).slots == 50  # capped at the profile length
    mtp = auto_expert_cache(blobs, 2 * MiB, free, 700 * MiB, mtp_bind_bytes=100 * MiB)
    assert mtp.slots == borrow.slots - 50


def test_post_write_shrink_gives_back_deficit_plus_64_mib():
    blobs = toy_cache(1000, MiB)
    cache = sized_slot_walk(blobs, 1000 * MiB)
    device_free = 1000 * MiB + 500 * MiB  # free before the cache; the driver then needs 300 MiB more
    out = post_write_shrink(blobs, cache, 700 * MiB, lambda used: device_free - used - 300 * MiB)
    assert out.rounds == ((200 * MiB, 564 * MiB),)
    assert out.cache.slots == 436  # free after: 1500 - 436 - 300 = 764 MiB >= 700
    fine = post_write_shrink(blobs, cache, 700 * MiB, lambda used: 640 * MiB)  # within 64 MiB: kept
    assert fine.cache is cache and fine.rounds == ()


def test_post_write_shrink_wddm_zero_reads():
    blobs = toy_cache(10_000, MiB)
    cache = sized_slot_walk(blobs, 10_000 * MiB)
    out = post_write_shrink(blobs, cache, 700 * MiB, lambda used: 0, wddm=True)
    gives = [give for _, give in out.rounds]
    assert gives[:2] == [GiB, GiB] and len(gives) == POST_WRITE_MAX_ROUNDS
    assert gives[2] == (10_000 - 2048) * MiB // 4  # then a quarter of what is left


def test_auto_cache_free_vram_range_inverts_the_rule():
    blobs = np.array([3 * MiB, MiB, 2 * MiB, MiB] * 100, dtype=np.int64)
    lo, hi = auto_cache_free_vram_range(blobs, 3 * MiB, 6, 700 * MiB)
    assert (lo, hi) == (712 * MiB, 715 * MiB)
    assert auto_expert_cache(blobs, 3 * MiB, lo, 700 * MiB).slots == 6
    assert auto_expert_cache(blobs, 3 * MiB, hi - 1, 700 * MiB).slots == 6
    assert auto_expert_cache(blobs, 3 * MiB, lo - 1, 700 * MiB).slots < 6
    assert auto_expert_cache(blobs, 3 * MiB, hi, 700 * MiB).slots > 6
    assert auto_cache_free_vram_range(blobs, 3 * MiB, 7, 700 * MiB) is None  # 13 MiB: 12 too few, 15 too many


# ------------------------------------------------------------------------------------------ bytes_needed


@pytest.mark.parametrize("tokens, pinned, ring", [(256, 0.0, 8), (2047, 1.0, 8), (2048, 0.0, 96), (8192, 0.89, 96),
                                                  (8192, 0.9, 384), (32768, 1.0, 384)])
def test_ring_slots(tokens, pinned, ring):
    assert ring_slots(tokens, pinned) == ring


def test_ring_override_clamped():
    assert ring_slots(4096, 0.0, ring_override_slots=4) == 16
    assert ring_slots(4096, 0.0, ring_override_slots=4096) == 512
    assert ring_slots(1024, 0.0, ring_override_slots=200) == 8


# strata-engine.md §4.3: (T, ring 96 no KV stage MiB, ring 384 + 264 MiB KV stage MiB), rounded to 1 MiB
TABLE_4_3 = [(256, 290, 554), (512, 396, 660), (1024, 608, 872), (2048, 1256, 2251), (3072, 1681, 2676),
             (4096, 2105, 3101), (6144, 2954, 3950), (8192, 3803, 4799), (12288, 5502, 6497), (16384, 7200, 8195),
             (24576, 10596, 11591), (32768, 13992, 14987)]


@pytest.mark.parametrize("tokens, fork_mib, big_mib", TABLE_4_3)
def test_bytes_needed_reproduces_table_4_3(tokens, fork_mib, big_mib):
    fork = bytes_needed(tokens, ring_slots(tokens, 0.0)) / MiB
    big = bytes_needed(tokens, ring_slots(tokens, 1.0), kv_stage_bytes(262_144)) / MiB
    assert abs(fork - fork_mib) <= 1 and abs(big - big_mib) <= 1


def test_kv_stage_at_full_context_is_264_mib():
    assert kv_stage_bytes(262_144) == 264 * MiB


# ------------------------------------------------------------------------------------------ lending


def test_tail_slots_for():
    slots = np.array([5, 4, 3, 2, 1], dtype=np.int64)
    assert [tail_slots_for(slots, need) for need in (1, 2, 3, 4, 6, 7, 15, 16)] == [1, 2, 2, 3, 3, 4, 5, None]


def test_plan_lend_auto_takes_the_first_chunk_within_both_caps():
    slots = toy_cache(3000)  # 4 MiB slots
    plan = plan_lend(slots, pinned_share=0.0, max_context_tokens=262_144)
    assert plan.chunk_tokens == 8192 and not plan.owned
    assert plan.lent_slots == -(-bytes_needed(8192, 96) // (4 * MiB)) == 951
    assert plan.first_lent_slot == 3000 - 951 and plan.lend_bytes == 951 * 4 * MiB
    # 1000 slots: 951 > 85 % of 1000; 6144 needs 739 <= 850 and 739 + 128 <= 1000
    assert plan_lend(toy_cache(1000), pinned_share=0.0, max_context_tokens=262_144).chunk_tokens == 6144
    # pinned: ring 384 (1134 slots at 8192) and LendPct 90: 1134 <= 90 % of 1300 but > 85 %
    pinned = plan_lend(toy_cache(1300), pinned_share=1.0, max_context_tokens=262_144)
    assert pinned.chunk_tokens == 8192 and pinned.lent_slots == -(-bytes_needed(8192, 384) // (4 * MiB)) == 1134
    capped = plan_lend(toy_cache(1300), pinned_share=1.0, max_context_tokens=262_144, lend_pct_override=85)
    assert capped.chunk_tokens == 6144
    assert plan_lend(slots, pinned_share=0.0, max_context_tokens=4096).chunk_tokens == 4096


def test_plan_lend_falls_back_to_owned_buffers():
    tiny = plan_lend(toy_cache(100), pinned_share=0.0, max_context_tokens=262_144)
    assert tiny.owned and tiny.chunk_tokens == 1024 and tiny.lent_slots == 0 and tiny.first_lent_slot is None
    assert tiny.buffer_bytes == bytes_needed(1024, 8)
    for kwargs in ({"borrow": False}, {"has_profile": False}):
        plan = plan_lend(toy_cache(3000), pinned_share=0.0, max_context_tokens=262_144, **kwargs)
        assert plan.owned and plan.chunk_tokens == 2048
    explicit = plan_lend(toy_cache(3000), pinned_share=0.0, max_context_tokens=262_144, explicit_chunk_tokens=3000,
                            borrow=False)
    assert explicit.owned and explicit.chunk_tokens == 3000


def test_plan_lend_explicit_chunk_halves_until_it_fits_without_the_percentage_cap():
    # 4 MiB slots: 16384 tokens need 1800 slots, 8192 need 951, 4096 need 527
    plan = plan_lend(toy_cache(1000), pinned_share=0.0, max_context_tokens=262_144, explicit_chunk_tokens=16384)
    assert plan.chunk_tokens == 4096 and plan.lent_slots == 527  # 951 + 128 > 1000
    # 1100 slots: auto refuses 8192 (951 > 85 % of 1100) but an explicit chunk has no percentage cap
    assert plan_lend(toy_cache(1100), pinned_share=0.0, max_context_tokens=262_144).chunk_tokens == 6144
    plan = plan_lend(toy_cache(1100), pinned_share=0.0, max_context_tokens=262_144, explicit_chunk_tokens=8192)
    assert plan.chunk_tokens == 8192 and plan.lent_slots == 951
    tiny = plan_lend(toy_cache(150), pinned_share=0.0, max_context_tokens=262_144, explicit_chunk_tokens=8192)
    assert tiny.owned and tiny.chunk_tokens == 1024  # halved below 256 tokens: owned (our choice)


def test_lend_per_request():
    slots = toy_cache(3000)
    plan = plan_lend(slots, pinned_share=0.0, max_context_tokens=262_144)
    short = lend(plan, slots, 300)
    assert short.want_tokens == 512 and short.lent_slots == -(-bytes_needed(512, 8) // (4 * MiB))
    assert short.first_lent_slot == 3000 - short.lent_slots and short.changed
    long = lend(plan, slots, 100_000)
    assert long.want_tokens == 8192 and long.first_lent_slot == plan.first_lent_slot
    kept = lend(plan, slots, 300, current_first_slot=long.first_lent_slot)
    assert not kept.changed and kept.lent_slots == long.lent_slots
    assert lend(plan_lend(slots, pinned_share=0.0, max_context_tokens=9, borrow=False), slots, 10).lent_slots == 0


# ------------------------------------------------------------------------------------------ #658 helpers

FORK_CANDIDATES = [(8192, 4 * GiB), (4096, 2 * GiB)]


@pytest.mark.parametrize("free, max_chunk, borrowed, chosen", [
    (6 * GiB, 8192, 0, 8192),              # 4 GiB <= 6 - 2 exactly
    (6 * GiB - 1, 8192, 0, 4096),          # one byte less
    (4 * GiB - 1, 8192, 0, 0),             # nothing fits: keep borrowing
    (6 * GiB - 1, 8192, 8192, 0),          # never smaller than the borrowed chunk
    (6 * GiB - 1, 8192, 4096, 4096),
    (6 * GiB, 4096, 0, 4096),              # respects max_chunk
    (GiB, 8192, 0, 0),                     # free below the reserve
])
def test_independent_prefill_chunk_boundaries(free, max_chunk, borrowed, chosen):
    assert independent_prefill_chunk(FORK_CANDIDATES, free, 2 * GiB, max_chunk, borrowed) == chosen


def test_conversation_expert_headroom():
    fork = conversation_expert_headroom(4 * GiB, 2048 * MiB, 2, 2560 * MiB)
    assert fork == 4864 * MiB == int(4.75 * GiB)
    assert conversation_expert_headroom(8 * GiB, 2048 * MiB, 2, 2560 * MiB) == 8 * GiB
    assert conversation_expert_headroom(4 * GiB, 0, 2, 2560 * MiB) == 4 * GiB
    assert conversation_expert_headroom(4 * GiB, 2048 * MiB, 0, 2560 * MiB) == 4 * GiB
    assert conversation_expert_headroom(4 * GiB, 2048 * MiB, 2, 2560 * MiB, prompt_cache_entries=0) == 4 * GiB
    assert conversation_expert_headroom(4 * GiB, 2048 * MiB, 2, 2560 * MiB, resident_experts=False) == 4 * GiB
    assert conversation_expert_headroom(0, U64_MAX, 2, U64_MAX) == U64_MAX


# ------------------------------------------------------------------------------------------ RAM tiers


def test_resident_headroom_defaults_and_override():
    assert resident_headroom_bytes("resident-experts") == 4 * GiB
    assert resident_headroom_bytes("resident-budget") == 4 * GiB
    assert resident_headroom_bytes("resident-cpu-experts") == 8 * GiB
    assert resident_headroom_bytes("resident-experts", "4.75") == 4864 * MiB
    with pytest.raises(InputError, match="STRATA_RESIDENT_HEADROOM_GIB"):
        resident_headroom_bytes("resident-experts", "lots")


def test_lend_region_covered_from_the_last_slot_backwards():
    blobs = np.array([10, 10, 10, 4, 3, 2], dtype=np.int64)  # lend region = slots 3..5
    plan = resident_ram_plan(100, blobs, 3, available_ram_bytes=70, headroom_bytes=10)
    assert plan.complement_bytes == 100 - 39 and plan.ram_budget_bytes == 60
    assert (plan.covered_lent_slots, plan.kept_lend_bytes, plan.keep_from_slot) == (0, 0, None)  # 61 > 60
    plan = resident_ram_plan(100, blobs, 3, available_ram_bytes=77, headroom_bytes=10)  # spare 6: 2 + 3
    assert (plan.covered_lent_slots, plan.file_blob_reads_per_refill, plan.keep_from_slot) == (2, 1, 4)
    assert plan.outcome == "resident" and plan.kept_lend_bytes == 5


def test_complement_that_does_not_fit():
    blobs = np.array([10, 10], dtype=np.int64)
    fallback = resident_ram_plan(100, blobs, 1, 50, 10)
    assert fallback.outcome == "mmap-fallback" and fallback.message.startswith("warning:")
    assert fallback.file_blob_reads_per_refill == 1
    fail = resident_ram_plan(100, blobs, 1, 50, 10, mode="resident-cpu-experts")
    assert fail.outcome == "startup-failure" and "do not fit" in fail.message
    budget = resident_ram_plan(100 * GiB, blobs, 1, 50 * GiB, 4 * GiB, mode="resident-budget",
                                  resident_budget_bytes=60 * GiB)
    assert budget.budget_copy_bytes == 46 * GiB - 256 * MiB and budget.file_blob_reads_per_refill == 1


def test_conversation_cache_make_room_and_admission():
    a, b, c = (ParkedConversation(n, 600 * MiB) for n in "abc")
    pinned = ParkedConversation("root", 600 * MiB, pinned=True)
    budget = conversation_budget_bytes(2048, prompt_cache_entries=6)
    assert budget == 2048 * MiB and conversation_budget_bytes(2048, 0) == 0
    # 2 slots: a third entry evicts the oldest
    out = park_conversation((a, b), c, slots=2, budget_bytes=budget, held_bytes=0, available_ram_bytes=32 * GiB,
                               min_free_bytes=2560 * MiB)
    assert out.parked and out.entries == (b, c) and out.evicted == (a,)
    # bytes: 1200 parked + 600 incoming + 400 held > 2048 evicts one
    kept, evicted, room = make_room((a, b), 4, budget, 400 * MiB, 600 * MiB)
    assert room and kept == (b,) and evicted == (a,)
    # pinned entries are never evicted: parking is skipped
    out = park_conversation((pinned, a), c, slots=2, budget_bytes=budget, held_bytes=0,
                               available_ram_bytes=32 * GiB, min_free_bytes=0)
    assert out.parked and out.entries == (pinned, c)
    out = park_conversation((pinned,), ParkedConversation("huge", 1900 * MiB), slots=2, budget_bytes=budget,
                               held_bytes=0, available_ram_bytes=32 * GiB, min_free_bytes=0)
    assert not out.parked and out.reason == "only pinned entries remain"
    # physical-RAM floor: 3 GiB available - 2.5 GiB floor < 600 MiB
    out = park_conversation((), a, slots=2, budget_bytes=budget, held_bytes=0, available_ram_bytes=3 * GiB,
                               min_free_bytes=2560 * MiB)
    assert not out.parked and out.reason == "below the physical-RAM floor"
    assert not park_conversation((), a, slots=2, budget_bytes=0, held_bytes=0, available_ram_bytes=32 * GiB,
                                    min_free_bytes=0).parked


# ------------------------------------------------------------------------------------------ validation (#658 fork)

# Calibrated assumptions (docs/planning.md):
FORK_RESERVE_BYTES = FORK_VRAM_RESERVE_MIB * MiB
# free VRAM at cache sizing (after weights, KV, MTP bind): the auto cache gave 10,222 slots; with the stand-in
# mix and ranking that happens for free VRAM in [21,500.65, 21,503.19) MiB; we take 21,502 MiB
FREE_VRAM_BYTES = 21_502 * MiB
# RAM available to the engine: the borrowing arm's resident allocation (complement + lend copies) was
# 33.78 GiB, which sits at the budget (within one slot), plus the 4.75 GiB headroom: 38.53 GiB of 48 GiB,
# i.e. 9.47 GiB held by Windows, other processes and the engine's other host memory (the free parameter)
BOX_RAM_BYTES = 48 * GiB
OTHER_HOST_RAM_BYTES = BOX_RAM_BYTES - round((33.78 + 4.75) * GiB)


def fork_numbers() -> dict:
    model = get_preset("qwen3.8-flash-next-iq3s")
    max_blob = model.max_expert_bytes
    ranked = ranked_blob_bytes(model.expert_bytes_per_layer(), interleaved_profile_layers(48, 512))
    capped = sized_slot_walk(ranked, expert_cache_budget_bytes(5400, max_blob), FREE_VRAM_BYTES,
                                FORK_RESERVE_BYTES)
    auto = auto_expert_cache(ranked, max_blob, FREE_VRAM_BYTES, FORK_RESERVE_BYTES)
    plan = plan_lend(capped.slot_bytes, pinned_share=0.0, max_context_tokens=262_144, max_blob_bytes=max_blob)
    headroom = conversation_expert_headroom(resident_headroom_bytes("resident-experts"), 2048 * MiB, 2,
                                               2560 * MiB)
    available = BOX_RAM_BYTES - OTHER_HOST_RAM_BYTES
    ram = resident_ram_plan(model.total_expert_bytes, ranked[: capped.slots], plan.first_lent_slot, available,
                               headroom)
    ram_upstream = resident_ram_plan(model.total_expert_bytes, ranked[: capped.slots], plan.first_lent_slot,
                                        available, 4 * GiB)
    auto_plan = plan_lend(auto.slot_bytes, pinned_share=0.0, max_context_tokens=262_144)
    ram_auto = resident_ram_plan(model.total_expert_bytes, ranked[: auto.slots], auto_plan.first_lent_slot,
                                    available, headroom)
    own = independent_prefill_chunk(independent_candidates(INDEPENDENT_CHUNKS_FORK, 0.0),
                                       FREE_VRAM_BYTES - capped.bytes, FORK_RESERVE_BYTES, 262_144, plan.chunk_tokens)
    kv = kv_stage_bytes(262_144)
    return dict(
        capped=capped, auto=auto, plan=plan, ram=ram, ram_upstream=ram_upstream, ram_auto=ram_auto, own=own,
        free_range=auto_cache_free_vram_range(ranked, max_blob, 10_222, FORK_RESERVE_BYTES),
        big_8192=bytes_needed(8192, 384, kv, max_blob_bytes=max_blob),
        big_32768=bytes_needed(32768, 384, kv, max_blob_bytes=max_blob),
    )


FORK = fork_numbers()
# (what, ours, target, relative tolerance, source)
VALIDATION = [
    ("capped cache slots", FORK["capped"].slots, 7056, 0.01, "§5.1 --expert-cache 5400"),
    ("capped cache MiB", FORK["capped"].bytes / MiB, 13709, 0.01, "§5.1"),
    ("lent slots at 8192, ring 96", FORK["plan"].lent_slots, 1972, 0.03, "§5.1 brief"),
    ("lend region MiB", FORK["plan"].lend_bytes / MiB, 3805, 0.02, "§4.2, §5.1"),
    ("independent buffers MiB (8192, ring 96)", FORK["plan"].buffer_bytes / MiB, 3805, 0.02, "§5.1"),
    ("bytes_needed(8192, ring 384, KV 264 MiB) GiB", FORK["big_8192"] / GiB, 4.69, 0.01, "§4.2"),
    ("bytes_needed(32768, ring 384, KV 264 MiB) GiB", FORK["big_32768"] / GiB, 14.64, 0.01, "§4.2"),
    ("file-blob reads per refill", FORK["ram"].file_blob_reads_per_refill, 1799, 0.03, "§3.6, §5.1"),
    ("lend copies gained at 4 GiB headroom", FORK["ram_upstream"].covered_lent_slots - FORK["ram"].covered_lent_slots,
     390, 0.05, "§0 (~390 slots)"),
    ("auto cache slots (calibrated)", FORK["auto"].slots, 10222, 0.0, "§5.1"),
]


def shown(x: float) -> str:
    return f"{x:,}" if float(x).is_integer() else f"{x:,.3f}" if abs(x) < 100 else f"{x:,.1f}"


@pytest.mark.parametrize("what, ours, target, tolerance, source", VALIDATION, ids=[
    f"{what}: {shown(ours)} vs {shown(target)} ({(ours - target) / target:+.2%})"
    for what, ours, target, _, _ in VALIDATION])
def test_fork_validation(what, ours, target, tolerance, source):
    error = (ours - target) / target
    assert abs(error) <= tolerance, \
        f"{what}: {shown(ours)} vs {shown(target)} ({source}): error {error:+.2%} > ±{tolerance:.0%}"


def test_fork_decisions():
    assert FORK["plan"].chunk_tokens == 8192 and not FORK["plan"].owned  # plan_lend at ring 96, LendPct 85
    assert FORK["own"] == 8192  # the fork's independent buffers fit beside the capped cache at 8192
    assert FORK["ram"].outcome == "resident"
    assert FORK["ram_auto"].file_blob_reads_per_refill == 0  # auto cache: the whole lend region fits in RAM
    lo, hi = FORK["free_range"]
    assert lo <= FREE_VRAM_BYTES < hi
    assert (round(lo / MiB, 2), round(hi / MiB, 2)) == (21500.65, 21503.19)


# ------------------------------------------------------------------------------------------ VRAM before the cache

# Strata loading logs: (box, total MiB, driver context MiB by the profiles' SM-count rule, pack, context cells,
# K/V type, --kv-resident, the engine's "N GiB free" at sizing, record). The first four fitted the runtime
# records; the V100 ledger (0.1.41, a 1M-token YaRN context) is held out.
def _context_mib(sms: int) -> float:  # ggml-org/llama.cpp#23604's line: 107 MiB at 34 SMs, 555 at 188
    return 107 + (sms - 34) * 448 / 154


LOADING_LOGS = [
    ("RTX 2080 Ti 11 GB, Linux", 11264, _context_mib(68), "qwen3.8-flash-next-iq3s", 262_144, "int8", 32_768, 4.15,
     "strata-runtime-linux-cuda"),
    ("RTX 4090 Laptop 16 GB, Linux", 16376, _context_mib(76), "qwen3.8-flash-next-iq3s", 262_144, "int8", None, 6.37,
     "strata-runtime-linux-cuda"),
    ("RTX 5070 Ti 16 GB, Windows", 16303, _context_mib(70), "qwen3.8-flash-next-iq3s", 65_536, "int8", 32_768, 9.07,
     "strata-runtime-windows-cuda"),
    ("RX 6700 XT 12 GB, ROCm", 12272, _context_mib(40), "qwen3.8-flash-next-iq2xs", 131_072, "int8", 32_768, 6.97,
     "strata-runtime-hip"),
    ("Tesla V100 16 GB, Linux (held out)", 16384, _context_mib(80), "qwen3.8-flash-next-iq3s", 1_048_576, "k8v4",
     32_768, 8.17, "strata-runtime-linux-cuda"),
]


@pytest.mark.parametrize("box, total, context, pack, cells, kv, resident, logged_gib, record", LOADING_LOGS,
                         ids=[row[0] for row in LOADING_LOGS])
def test_free_vram_at_sizing_follows_the_loading_logs(box, total, context, pack, cells, kv, resident, logged_gib,
                                                      record):
    from sim.engines.records import record as get_record

    before = (context * MiB + get_record(record).bytes() + pack_weights(pack).dense_bytes
              + mtp_bytes(cells, resident) + session_bytes(cells, kv, resident))
    free = total * MiB - before
    assert abs(free / (logged_gib * GiB) - 1) <= 0.03, f"{box}: {free / GiB:.2f} GiB free vs {logged_gib} logged"


def test_session_bytes_follow_the_engines_own_totals():
    # session_bytes as the engine printed it (indexed copy 71518311597: INT8 with --kv-resident 32768 at 524,288 /
    # 131,072 / 32,768 cells; INT8 all resident at 524,288)
    for cells, resident, gib in ((524_288, 32_768, 1.390), (131_072, 32_768, 0.728), (32_768, 32_768, 0.560),
                                 (524_288, None, 7.189)):
        assert session_bytes(cells, "int8", resident) / GiB == pytest.approx(gib, rel=0.02)


def test_the_draft_head_bind_follows_the_logged_figures():
    # "+218 MiB for the draft head" (IQ3_S), "+143" (IQ2_XS), "+184" (IQ3_XXS)
    for pack, mib in (("qwen3.8-flash-next-iq3s", 218), ("qwen3.8-flash-next-iq2xs", 143),
                      ("qwen3.8-flash-next-iq3xxs", 184)):
        assert draft_head_bind_bytes(pack_weights(pack)) / MiB == pytest.approx(mib, abs=1.5)


def test_the_minimum_loan_of_the_pressure_floor_case():
    # docs/PRESSURE_PREFILL_FLOOR.md: a 181-slot loan of 359.7 MiB for the 256-token minimum chunk at 65,536 cells,
    # K/V streamed (one QSA layer's stage), an 8-slot ring, 0.1.39b's buffer count (no xn)
    build = BUILDS["v0.1.40-live"]
    need = bytes_needed(256, 8, kv_stage_bytes(65_536), per_token_bytes=per_token_bytes(build),
                           max_cells=65_536)
    assert need / MiB == pytest.approx(359.7, rel=0.01)


def test_the_default_reserve_gives_way_to_a_working_cache():
    # tests/core/vram_plan_test.cpp Case F (Niko1221/Strata): 700 MiB free, the default 700 MiB reserve, 2 MiB slots,
    # a 256-token loan of 16 slots + the 128 kept = 144 slots: "the adapted reserve leaves 144 slots" = 412 MiB
    assert adapted_vram_reserve(700 * MiB, 700 * MiB, 0, 0, 144, 2 * MiB) == 412 * MiB
    assert adapted_vram_reserve(700 * MiB, 700 * MiB, 0, 144, 144, 2 * MiB) == 700 * MiB  # the cache suffices
    assert adapted_vram_reserve(500 * MiB, 700 * MiB, 0, 0, 144, 2 * MiB) == 700 * MiB  # 300 MiB cannot either
    assert adapted_vram_reserve(700 * MiB, 300 * MiB, 0, 0, 144, 2 * MiB) == 300 * MiB  # at the floor already
