"""Strata engine model (sim/engines/strata/): the #658 fork's figures, then the model's mechanisms.

Targets: seeds/strata-658-prefill-buffer-and-ram-budget.txt and reference/strata-engine.md §5.1, each with
the tolerance band of the brief. The assertion message prints ours, the target and the error. A target the
model does not meet is pinned by a test of its CURRENT band, with the target and the error in a comment.
Every seed scenario is simulated once per session (cached); the synthetic ones use short prompts.
"""

from __future__ import annotations

import re
import tomllib
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import simpy
import tomli_w

from sim.engines import ENGINES
from sim.engines.recorder import Recorder
from sim.engines.records import Domain
from sim.engines.strata.decode import pcie_frac, pcie_share, spread
from sim.engines.strata.memory import PINNED_STAGING_BUFFERS
from sim.engines.strata.pricing import RING_SLOTS_UNPINNED, bytes_needed, ring_slots
from sim.engines.strata.sessions import RUNNING_STATE_BYTES, session_bytes
from sim.engines.strata.settings import MIN_KEEP_SLOTS
from sim.engines.strata.startup import FILE as FILE_HOME
from sim.engines.strata.startup import RAM_PAGEABLE as RAM_HOME
from sim.errors import InputError
from sim.machine import Machine
from sim.simulate import extent_bytes, run_scenario
from sim.scenario import load_scenario
from sim.units import GIB, MIB
from sim.workload import workload_routing
from tests.conftest import profile_with

ROOT = Path(__file__).resolve().parents[1]
MiB, GiB = MIB, GIB
SEEDS = ("strata-658-borrow", "strata-658-own", "strata-658-auto-borrow", "strata-658-auto-own", "conversation-aba")


@lru_cache(maxsize=None)
def seed(name: str):
    return run_scenario(load_scenario(ROOT / "scenarios" / f"{name}.toml"))


def summary(name: str) -> dict:
    return seed(name).summary


def state(name: str) -> dict:
    return seed(name).summary["engine_state"]


def check(what: str, ours: float, target: float, tolerance: float) -> None:
    error = (ours - target) / target
    assert abs(error) <= tolerance, \
        f"{what}: ours {ours:,.1f} vs target {target:,.1f} ({error:+.2%}, band ±{tolerance:.0%})"


# ------------------------------------------------------------------------------------------ #658 targets

# (what, scenario, summary key, target, relative tolerance): the brief's bands
TARGETS = [
    ("--expert-cache 5400 slots", "strata-658-borrow", "cache_slots", 7056, 0.01),
    ("--expert-cache 5400 MiB", "strata-658-borrow", "cache_mib", 13709, 0.01),
    ("own arm: same cache slots", "strata-658-own", "cache_slots", 7056, 0.01),
    ("borrowing: lent slots", "strata-658-borrow", "lent_slots", 1972, 0.03),
    ("borrowing: file-blob reads per long prefill", "strata-658-borrow", "file_blob_reads", 1799, 0.10),
    ("borrowing: prefill tok/s", "strata-658-borrow", "prefill_tok_s", 2311.6, 0.15),
    ("own: independent buffers MiB", "strata-658-own", "prefill_buffer_mib", 3805, 0.02),
    ("own: prefill tok/s", "strata-658-own", "prefill_tok_s", 2901.7, 0.15),
    ("auto cache, upstream policy: prefill tok/s", "strata-658-auto-borrow", "prefill_tok_s", 2924.7, 0.15),
    ("auto cache, fork default: prefill tok/s", "strata-658-auto-own", "prefill_tok_s", 2919.0, 0.15),
]


@pytest.mark.parametrize("what, name, key, target, tolerance", TARGETS, ids=[t[0] for t in TARGETS])
def test_fork_target(what, name, key, target, tolerance):
    check(what, summary(name)[key], target, tolerance)


def test_own_arm_reads_no_file_blobs_and_lends_nothing():
    s = summary("strata-658-own")
    assert s["file_blob_reads"] == 0 and s["lent_slots"] == 0
    assert state("strata-658-own")["owned"] and state("strata-658-own")["chunk"] == 8192


def test_own_over_borrow_speedup_is_in_band():
    ratio = summary("strata-658-own")["prefill_tok_s"] / summary("strata-658-borrow")["prefill_tok_s"]
    assert 1.15 <= ratio <= 1.35, f"own/borrow {ratio:.3f} (measured 2901.7 / 2311.6 = 1.255)"


def test_auto_cache_arms_both_borrow_and_agree():
    a, b = state("strata-658-auto-borrow"), state("strata-658-auto-own")
    assert not a["owned"] and not b["owned"] and b["independent_chunk"] == 0
    assert any("no independent buffer fits" in n for n in b["notices"])
    ta, tb = summary("strata-658-auto-borrow")["prefill_tok_s"], summary("strata-658-auto-own")["prefill_tok_s"]
    assert abs(ta - tb) / tb <= 0.03  # measured 2924.7 vs 2919.0 (0.2 %)
    # the smaller complement leaves RAM for every lend copy (strata-engine.md §0, "very likely fits")
    assert summary("strata-658-auto-borrow")["file_blob_reads"] == 0


@pytest.mark.xfail(strict=True, reason="simulated ~19.4 ms vs the fork's measured ~26 ms (-25.4 %, just past the "
                                      "absolute tolerance of 25 %): see docs/validation.md, 'Strata's checkpoint restore'")
def test_restore_of_a_984_token_checkpoint_within_25_percent_of_26_ms():
    ms = state("conversation-aba")["conversation_cache"]["restore_ms_984_tokens"]
    assert abs(ms - 26.0) / 26.0 <= 0.25


# ------------------------------------------------------------------------------------------ mechanisms


def steps(name: str) -> pd.DataFrame:
    return seed(name).steps


def refill_rows(name: str, request: int) -> pd.DataFrame:
    s = steps(name)
    return s[(s["request"] == request) & (s["phase"] == "prefill") & (s["tokens"] == 0) & (s["inserts"] > 0)]


def test_borrow_refill_copies_back_every_lent_slot():
    st = state("strata-658-borrow")
    measured = summary("strata-658-borrow")["measured_request"]
    rows = refill_rows("strata-658-borrow", measured)
    assert len(rows) == 1
    refill = rows.iloc[0]
    assert refill["inserts"] == st["lent_slots"] == st["plan_lend"]["lent_slots"]
    # the loan is the cache tail: refill bytes = the lent slots' blobs (sized slots: blob = slot bytes here)
    assert refill["h2d_bytes"] == pytest.approx(st["plan_lend"]["lend_mib"] * MiB)
    assert refill["file_blob_reads"] == st["file_blob_reads_per_refill"]
    assert refill["file_blob_reads"] == summary("strata-658-borrow")["file_blob_reads"]
    assert refill["file_blob_reads"] == st["lent_slots"] - st["ram_plan"]["covered_lent_slots"]


def test_full_chunks_stream_every_non_resident_expert():
    scenario = load_scenario(ROOT / "scenarios" / "strata-658-own.toml")
    layout = scenario.layout
    lend_bytes = state("strata-658-borrow")["plan_lend"]["lend_mib"] * MiB
    for name, lent in (("strata-658-own", 0.0), ("strata-658-borrow", lend_bytes)):
        s = steps(name)
        chunk = s[(s["request"] == 2) & (s["phase"] == "prefill") & (s["step"] == 0) & (s["layer"] >= 0)]
        assert len(chunk) == 48 and (chunk["tokens"] == 8192).all()
        non_resident = layout.total_expert_bytes - state(name)["cache_mib"] * MiB
        assert chunk["h2d_bytes"].sum() == pytest.approx(non_resident + lent)


def test_prompt_path_is_bounded_by_its_copy_stream():
    # 3 chunks of every non-resident expert through the copy engine at the box's 16 GB/s (strata-engine.md §6)
    st = state("strata-658-own")
    s = steps("strata-658-own")
    prompt = s[(s["request"] == 2) & (s["phase"] == "prefill") & (s["layer"] >= 0)]
    pp_s = st["requests"][2]["pp_ms"] / 1e3
    assert pp_s >= prompt["h2d_bytes"].sum() / 16e9
    assert pp_s >= 17_943 * 48 * 3.958e-6  # and by its compute
    assert pp_s <= prompt["h2d_bytes"].sum() / 16e9 + 17_943 * 48 * 3.958e-6  # overlapped, not serial


def test_prefill_time_includes_the_refill_and_the_last_token():
    for name in ("strata-658-borrow", "strata-658-auto-borrow"):
        log = state(name)["requests"][2]
        assert log["refill_ms"] > 0 and log["prefill_ms"] > log["pp_ms"] + log["refill_ms"]
    assert state("strata-658-own")["requests"][2]["refill_ms"] == 0


def test_resident_ram_plan_of_the_capped_cache():
    ram = state("strata-658-borrow")["ram_plan"]
    assert ram["headroom_gib"] == pytest.approx(4.75)
    # available = RAM - what the OS and other programs hold (9.31 GiB, the profile) - the stager's pinned buffers
    assert ram["available_gib"] == pytest.approx(48 - 9.31 - PINNED_STAGING_BUFFERS * 2_662_400 / GiB, abs=1e-6)
    assert ram["resident_alloc_gib"] <= ram["budget_gib"]  # complement + lend copies stop at the budget
    own = state("strata-658-own")["ram_plan"]
    assert own["covered_lent_slots"] == 0 and own["kept_lend_gib"] == 0  # no copies for would-be lent slots


def test_conversation_aba_parks_and_restores():
    st = state("conversation-aba")
    conv = st["conversation_cache"]
    logs = st["requests"]
    assert [r["resumed_tokens"] for r in logs] == [0, 0, 4200]  # A's 4000 + 200 tokens come back
    assert conv["parks"] == 2 and conv["evictions"] == 0  # A parked for B, B parked for A
    assert [(r["conversation"], r["tokens"]) for r in conv["restores"]] == [("A", 4200)]
    assert [p["conversation"] for p in conv["parked"]] == ["B"]
    restore = conv["restores"][0]["ms"]
    assert conv["restore_ms_984_tokens"] < restore < 40  # 118 MB of state + 4,200 tokens of K/V
    # only A's 300 new tokens are read on its second turn
    s = steps("conversation-aba")
    chunks = s[(s["request"] == 2) & (s["layer"] == 0) & (s["phase"] == "prefill")]
    assert chunks["tokens"].sum() == 299  # the last prompt token goes through a decode window


def test_session_bytes():
    assert session_bytes(0) == RUNNING_STATE_BYTES == 118_000_000
    assert session_bytes(162_150) == pytest.approx(3.85e9, rel=1e-4)  # the 3.85 GB snapshot (§3.7)


@pytest.mark.parametrize("name", SEEDS)
def test_seed_scenarios_stay_coarse(name):
    r = seed(name)
    assert len(r.steps) < 50_000 and len(r.copies) < 50_000
    assert (r.timings["end_s"] >= r.timings["prefill_end_s"]).all()
    assert (r.timings["prefill_end_s"] > r.timings["arrival_s"]).all()


def test_runs_are_deterministic():
    again = run_scenario(load_scenario(ROOT / "scenarios" / "strata-658-borrow.toml"))
    first = seed("strata-658-borrow")
    assert again.summary == first.summary
    pd.testing.assert_frame_equal(again.steps, first.steps)
    pd.testing.assert_frame_equal(again.copies, first.copies)
    pd.testing.assert_frame_equal(again.timings, first.timings)


# ------------------------------------------------------------------------------------------ synthetic settings


def scenario_file(tmp_path: Path, name: str, *, variant: str = "fork-658", flags: dict | None = None,
                  env: dict | None = None, requests=((3000, 8),), hardware: str = "rtx-5090-48gb-windows",
                  model: str = "qwen3.8-flash-next-iq3s") -> Path:
    flags = {"expert-cache": 5400, "vram-reserve-mib": 1536, "prefill": "auto", "expert-profile": "@trace",
             "resident-experts": True, "max-context": 262144, "kv": "int8", **(flags or {})}
    flags = {k: v for k, v in flags.items() if v is not None}

    def value(v):
        return ("true" if v else "false") if isinstance(v, bool) else (f'"{v}"' if isinstance(v, str) else str(v))

    lines = [f'hardware = "{hardware}"', f'model = "{model}"', "", "[engine]", 'name = "strata"',
             f'variant = "{variant}"', "", "[engine.flags]", *(f"{k} = {value(v)}" for k, v in flags.items()), "",
             "[engine.env]", *(f'{k} = "{v}"' for k, v in (env or {}).items()), "",
             "[trace]", 'generator = "qwen3.8-flash-next-iq3s"', "seed = 0"]
    for i, (prompt, decode) in enumerate(requests):
        lines += ["", "[[workload.requests]]", f"prompt_tokens = {prompt}", f"decode_tokens = {decode}"]
        if i == len(requests) - 1:
            lines.append("measured = true")
    path = tmp_path / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_file(path: Path):
    r = run_scenario(load_scenario(path))
    return r, r.summary["engine_state"]


def test_fork_headroom_rule_shrinks_the_lend_copies(tmp_path):
    # fork: headroom = max(4 GiB, 2048 + 2560 + 256 MiB) = 4.75 GiB; upstream keeps 4 GiB (§3.5): ~390 more
    # lend copies upstream (docs/planning.md: +393 with the interleaved ranking)
    conv = {"conversation-cache-mib": 2048, "conversation-cache-slots": 2, "conversation-cache-min-free-mib": 2560}
    _, fork = run_file(scenario_file(tmp_path, "fork", flags=conv, env={"STRATA_PREFILL_OWN_AUTO": "0"}))
    _, up = run_file(scenario_file(tmp_path, "up", variant="v0.1.35", flags=conv))
    assert fork["ram_plan"]["headroom_gib"] == pytest.approx(4.75) and up["ram_plan"]["headroom_gib"] == 4
    gained = up["ram_plan"]["covered_lent_slots"] - fork["ram_plan"]["covered_lent_slots"]
    assert 350 <= gained <= 430
    assert up["file_blob_reads_per_refill"] == fork["file_blob_reads_per_refill"] - gained


def test_own_auto_is_on_by_default_in_the_fork(tmp_path):
    r, st = run_file(scenario_file(tmp_path, "default"))
    assert st["owned"] and st["independent_chunk"] == 8192 and r.summary["file_blob_reads"] == 0
    r, st = run_file(scenario_file(tmp_path, "upstream", variant="v0.1.35"))
    assert not st["owned"] and st["lent_slots"] > 0


def test_short_prompts_lend_only_what_they_need(tmp_path):
    r, st = run_file(scenario_file(tmp_path, "short", env={"STRATA_PREFILL_OWN_AUTO": "0"},
                                   requests=((40, 2), (300, 2), (3000, 2))))
    loans = [x["loan_slots"] for x in st["requests"]]
    assert loans[0] == 0  # <= 64 tokens: decode windows only
    # roundup256(299) = 512 tokens, ring 8, at 262,144 cells (the QSA set outgrows the MoE set at 512 tokens)
    need = bytes_needed(512, ring_slots(512, 0.0), max_cells=262_144)
    assert 0 < loans[1] < loans[2] < st["plan_lend"]["lent_slots"]
    assert loans[1] == pytest.approx(need / (1.95 * MiB), rel=0.05)


def test_mmap_fallback_when_the_complement_does_not_fit(tmp_path):
    r, st = run_file(scenario_file(tmp_path, "mmap", env={"STRATA_PREFILL_OWN_AUTO": "0",
                                                          "STRATA_RESIDENT_HEADROOM_GIB": "20"}))
    assert st["ram_plan"]["outcome"] == "mmap-fallback"
    assert any("falling back to mmap" in n for n in st["notices"])
    assert r.summary["file_blob_reads"] == st["lent_slots"]  # no RAM copy of any lent expert
    decode = r.steps[r.steps["phase"] == "decode"]
    assert decode["file_blob_reads"].sum() > 0  # decode misses come from the mapped files too


def test_arena_mode_pins_everything(tmp_path):
    r, st = run_file(scenario_file(tmp_path, "arena", variant="v0.1.35", flags={"resident-experts": None}))
    assert st["ram_mode"] == "arena" and st["pinned_share"] == 1.0 and st["ram_plan"] is None
    assert st["plan_lend"]["buffer_mib"] == pytest.approx(bytes_needed(8192, 384) / MiB)  # ring 384
    assert r.summary["file_blob_reads"] == 0
    assert any("arena" in n and "exceed" in n for n in st["notices"])  # 46.9 GiB of experts, 38.5 GiB of RAM


def test_owned_prompt_buffers_an_explicit_cache_leaves_no_room_for_are_refused(tmp_path):
    """Without an expert profile the prompt path owns 2048-token buffers (strata-engine.md §3.3); an explicit cache of
    5,400 x 2.54 MiB IQ3_S blobs leaves less than their ~1.2 GiB on a 12 GB card (rtx-4070-12gb-wsl2.toml). Before,
    the run went on past the card's VRAM with a notice, and plan recommended that cache."""
    path = scenario_file(tmp_path, "no-room", variant="v0.1.40", hardware="rtx-4070-12gb-wsl2", requests=((300, 8),),
                         flags={"expert-profile": None, "vram-reserve-mib": 700, "max-context": 4096,
                                "kv": "fp16"})
    with pytest.raises(InputError) as refused:
        run_file(path)
    assert refused.value.field == "engine.flags.expert-cache" and refused.value.value == 5400
    assert "this card cannot hold both: owned prompt buffers" in refused.value.why


def test_adaptive_tier_swaps_within_a_layer(tmp_path):
    r, st = run_file(scenario_file(tmp_path, "adapt", requests=((200, 64),)))
    decode = r.steps[r.steps["phase"] == "decode"]  # one row per verify window
    assert st["adaptive_swaps"] > 0 and decode["inserts"].sum() == st["adaptive_swaps"]
    assert decode["inserts"].sum() <= 96 * (len(decode) // 4)  # at most adapt-swaps per adapt round (4 windows)
    assert st["cache_slots"] == r.summary["cache_slots"]  # the cache never grows or shrinks
    assert decode["tokens"].sum() == 64  # the windows emit every output token


def test_the_auto_cache_derived_from_the_loading_logs_gives_the_seeds_slot_count():
    # #658: the auto cache held 10,222 slots. Nothing was fitted to it: VRAM before the cache is the driver's
    # context + Strata's runtime buffers (a record fitted on two Linux boxes' logs, out of domain here) + the
    # pack's dense weights, the draft layer and the session at 262,144 INT8 cells, all from other boxes' logs.
    st = state("strata-658-auto-borrow")
    check("auto cache slots", summary("strata-658-auto-borrow")["cache_slots"], 10222, 0.02)
    assert set(st["vram_before_cache"]) == {"runtime reserved (driver, context)", "runtime buffers (modules, cuBLAS)",
                                            "dense weights", "MTP draft layer", "session (K/V, indexer keys, RoPE)"}
    assert st["vram_record"] == "strata-runtime-windows-cuda"


@pytest.mark.parametrize("name, text, why", [
    ("STRATA_RESIDENT_HEADROOM_GIB", "lots", "must be a number"),
    ("STRATA_PREFILL_OWN_AUTO", "yes", "must be an integer"),
    ("STRATA_STAGER_THREADS", "0", "must be >= 1"),
    ("STRATA_ARENA_PIN_GIB", "nan", "must be >= 0"),
])
def test_a_bad_environment_value_is_refused_when_the_scenario_loads_naming_its_file(tmp_path, name, text, why):
    path = scenario_file(tmp_path, "bad-env", env={name: text})
    with pytest.raises(InputError) as info:
        load_scenario(path)
    assert str(info.value) == f"{path}: engine.env.{name} = {text}: {why}"


def test_a_context_whose_kv_does_not_fit_the_card_is_refused_naming_the_flag(tmp_path):
    # 1,056 B per QSA cell (strata-engine.md: 264 MiB per layer at 262,144): at 2**21 cells that is 2 GiB per
    # QSA layer, more than the 32 GiB card holds with the weights; a modest context on the same card runs.
    path = scenario_file(tmp_path, "huge-context", flags={"max-context": 2**21})
    with pytest.raises(InputError) as info:
        run_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}: engine.flags.max-context = {2**21}: Strata cannot allocate it")
    need, have = (float(x) for x in re.findall(r"([\d.]+) GiB", message)[:2])
    assert need > have == pytest.approx(32_607 / 1024, abs=0.01)  # the 5090 reports 32,607 MiB
    assert run_file(scenario_file(tmp_path, "modest", flags={"max-context": 2**15}))[0].summary["cache_slots"] > 0


# ------------------------------------------------------------------------------------------ decode windows


def test_pcie_frac_follows_the_probe_rule():
    # generate.cpp's probe: 0.55 at >= 20 GB/s (a 5090 at Gen4 x16 probed 28.3 -> 0.55); an A3000's starts at 6.9
    # and 5.8 GB/s logged pcie_frac 0.15 and 0.12 (Strata #485); none below 4 GB/s; Q2_0's canonical pack 0.2
    assert pcie_frac(28.3, False) == 0.55
    assert round(pcie_frac(6.9, False), 2) == 0.15 and round(pcie_frac(5.8, False), 2) == 0.12
    assert pcie_frac(3.9, False) == 0.0 and pcie_frac(28.3, True) == 0.2


def test_pcie_share_takes_a_share_of_the_pinned_misses_and_at_most_16():
    share = pcie_share(np.array([0, 10, 40, 100, 10]), np.array([0, 10, 40, 100, 3]), 0.55)
    # round(256 x 0.55) = 141: floor(10 x 141 / 256) = 5, floor(40 x 141 / 256) = 22 -> 16; 3 pinned of 10 -> 3
    assert share.tolist() == [0, 5, 16, 16, 3]


def test_windows_spread_their_means_over_whole_tokens():
    assert spread(2.8, 5).tolist() == [3, 3, 2, 3, 3] and spread(3.0, 4).sum() == 12


def test_a_slower_cpu_pool_slows_a_miss_bound_decode(tmp_path):
    # a 12 GB card holds a tenth of the experts: most decode misses are computed by the CPU pool, so its cores
    # decide the window time; a 32 GB card's cache keeps the pool idle
    small = dict(hardware="rtx-5070-12gb-windows", flags={"expert-cache": "auto", "max-context": 4096},
                 requests=((600, 64),))
    fast, _ = run_file(scenario_file(tmp_path, "fast", **small))
    slow_hw = profile_with(tmp_path, "rtx-5070-12gb-windows", "two-cores", {"host.physical_cores": 2})
    slow, _ = run_file(scenario_file(tmp_path, "slow", **{**small, "hardware": str(slow_hw)}))
    assert slow.summary["decode_tok_s"] < 0.6 * fast.summary["decode_tok_s"]
    pool = [lk for lk in fast.summary["links"] if lk["link"].startswith("strata expert pool")]
    assert pool and pool[0]["busy_s"] > 0


def startup(path: Path):
    """A Strata process after startup (cache filled, loan planned, RAM laid out), before it serves anything."""
    scenario = load_scenario(path)
    machine = Machine(simpy.Environment(), scenario.hardware_profile, extent_bytes(scenario.layout))
    domain = Domain("strata", scenario.layout.name, scenario.hardware_profile.name, None)
    domain.use_profile(scenario.hardware_profile, scenario.compute_key)
    return ENGINES["strata"].process(scenario, workload_routing(scenario), Recorder(), machine, domain)


BUDGET_1900 = {"expert-cache": 1900, "resident-experts": None, "resident-budget-gib": 32, "max-context": 65536}


def budget_box(tmp_path, name, variant, requests=((2000, 8),)):
    return scenario_file(tmp_path, name, variant=variant, flags=BUDGET_1900, requests=requests,
                         hardware="rtx-5080-16gb-windows", model="qwen3.8-flash-next-huihui-iq3s")


def test_an_adaptive_swap_exchanges_ram_copies_only_when_the_victim_has_none(tmp_path):
    # exchange_cache_complement (src/core/expert_source.cpp): "out takes in's place in the compact copy ... False,
    # and nothing changed, unless in is in the copy and out is not"
    e = startup(budget_box(tmp_path, "swap", "v0.1.40-live-guarded"))
    E, layer, place, decode = e.n_experts, 0, e.place, e.decode
    pairs = np.arange(layer * E, (layer + 1) * E)
    resident, absent = pairs[place.on_gpu[pairs]], pairs[~place.on_gpu[pairs]]
    victims, cands = resident[:3], absent[:3]  # ascending ids: the tier pairs victims and candidates in this order
    place.home[victims] = [FILE_HOME, RAM_HOME, RAM_HOME]
    place.home[cands] = [RAM_HOME, FILE_HOME, RAM_HOME]
    decode.usage[:] = 0.0
    decode.usage[resident] = 5.0
    decode.usage[victims], decode.usage[cands] = 0.0, 10.0
    slots = place.slot_of[victims].copy()
    swapped, _, d2h, file_reads = decode._adapt()
    assert swapped == 3 and (place.slot_of[cands] == slots).all() and place.on_gpu[cands].all() and not place.on_gpu[victims].any()
    # in RAM, victim without a copy: exchanged (the victim's bytes go device -> host into the candidate's place)
    assert place.home[victims[0]] == RAM_HOME and place.home[cands[0]] == FILE_HOME
    assert d2h == e.pair_blob[victims[0]]
    # from the file tier into a covered slot: the victim keeps its copy, the candidate has none
    assert place.home[victims[1]] == RAM_HOME and place.home[cands[1]] == FILE_HOME and file_reads == 1
    # both in RAM: each keeps its own (the candidate's copy becomes a GPU-backed duplicate)
    assert place.home[victims[2]] == RAM_HOME and place.home[cands[2]] == RAM_HOME


def test_a_donor_is_a_gpu_backed_duplicate_before_a_ram_only_expert(tmp_path):
    # LIVE_MEMORY.md: "GPU-backed duplicates are preferred, followed by the coldest measured RAM occupant"
    e = startup(budget_box(tmp_path, "donor", "v0.1.40-live"))
    E, layer, place = e.n_experts, 0, e.place
    pairs = np.arange(layer * E, (layer + 1) * E)
    resident, absent = pairs[place.on_gpu[pairs]], pairs[~place.on_gpu[pairs]]
    lent, duplicate = resident[:1], resident[1]
    place.home[pairs] = FILE_HOME
    place.home[duplicate] = RAM_HOME
    place.home[absent[:2]] = RAM_HOME  # RAM-only experts
    list(e.loans._donate(lent))
    assert place.home[lent[0]] == RAM_HOME and place.home[duplicate] == FILE_HOME and (place.home[absent[:2]] == RAM_HOME).all()


def test_swaps_leave_guarded_loans_outside_ram_and_donors_cover_them(tmp_path):
    # LIVE_MEMORY.md: guarded borrowing's later prompts needed file fallback after adaptive swaps; with current-loan
    # coverage "every candidate loan ... had complete RAM coverage and zero additional refill file-blob reads"
    requests = ((2000, 256), (2000, 256))
    guarded, _ = run_file(budget_box(tmp_path, "guarded", "v0.1.40-live-guarded", requests))
    covered, st = run_file(budget_box(tmp_path, "covered", "v0.1.40-live", requests))
    first = guarded.steps[(guarded.steps["request"] == 0) & (guarded.steps["phase"] == "prefill")]
    assert first["file_blob_reads"].sum() == 0  # the startup loan is covered from the budget
    assert guarded.summary["file_blob_reads"] > 0
    assert covered.summary["file_blob_reads"] == 0 and st["live_memory_donor_copies"] > 0


def test_a_default_reserve_adapts_to_fund_the_smallest_loan_and_a_given_one_does_not(tmp_path):
    # #496 (vram_plan.cpp): an 8 GB laptop's default 700 MiB reserve leaves fewer slots than a 256-token loan + 128;
    # the startup plan lowers it to what leaves that many; a reserve on the command line is kept
    flags = {"expert-cache": "auto", "vram-reserve-mib": None, "resident-experts": None, "resident-budget-gib": 40.0,
             "max-context": 65536, "kv-resident": 32768}
    box = dict(variant="v0.1.40-live", hardware="rtx-4070-laptop-8gb-windows", requests=((1137, 2),))
    r, st = run_file(scenario_file(tmp_path, "default", flags=flags, **box))
    assert 300 <= st["vram_reserve_mib"] < 700 and any("(#496)" in n for n in st["notices"])
    assert r.summary["lent_slots"] > 0 and st["cache_slots"] >= st["plan_lend"]["lent_slots"] + MIN_KEEP_SLOTS
    # kept, the 700 MiB leave too few slots for a loan: the prompt path owns 1024-token buffers (§3.3), which #765's
    # startup plan books before it sizes the cache ("the same decision before the cache is committed"). Before, the
    # cache was sized for a loan and the owned buffers went on top of it, past the card
    r, given = run_file(scenario_file(tmp_path, "given", flags={**flags, "vram-reserve-mib": 700}, **box))
    assert given["vram_reserve_mib"] == 700 and given["plan_lend"]["owned"]
    assert any("(#765)" in n for n in given["notices"]) and r.summary["vram_peak_mib"] <= 8188


def test_mapped_experts_have_no_ram_copy_and_take_the_unpinned_ring(tmp_path):
    # --mmap-experts alone (docker/entrypoint-hip.sh): every expert the GPU lacks is read from the mapped files, so
    # nothing is pinned: the 96-slot ring and the 85 % lend share (strata-engine.md §3.2, §3.3); a lent expert is
    # refilled from the files
    r, st = run_file(scenario_file(tmp_path, "mmap", variant="v0.1.39b",
                                   flags={"resident-experts": None, "mmap-experts": True}, requests=((9000, 8),)))
    assert st["ram_mode"] == "mmap" and st["pinned_share"] == 0.0 and st["ram_plan"] is None
    assert st["ring_slots"] == RING_SLOTS_UNPINNED
    assert r.summary["file_blob_reads"] == st["lent_slots"] > 0


def test_the_decode_knobs_of_the_rocm_container(tmp_path):
    # --pcie-frac 0: no missed expert crosses PCIe; --adapt-every 0: no adaptive swap (docker/entrypoint-hip.sh)
    flags = {"pcie-frac": 0.0, "adapt-every": 0}
    r, st = run_file(scenario_file(tmp_path, "knobs", flags=flags, requests=((200, 64),)))
    decode = r.steps[r.steps["phase"] == "decode"]
    assert st["adaptive_swaps"] == 0 and decode["inserts"].sum() == 0 and decode["h2d_bytes"].sum() == 0


def test_a_driver_pin_limit_pins_the_arena_layer_by_layer(tmp_path):
    # the 64 GB Windows PC pins 30 GiB (rtx-5070-12gb-windows.toml): a Q2_0 layer is 512 x 1,382,400 B = 0.6592 GiB,
    # so 45 layers (29.66 GiB) fit and the 46th (30.32) does not: 45/48 = 0.9375 pinned, the 384-slot ring (>= 0.9)
    box = dict(variant="v0.1.35", hardware="rtx-5070-12gb-windows", requests=((3000, 1),),
               flags={"expert-cache": "auto", "max-context": 4096, "resident-experts": None})
    _, q2 = run_file(scenario_file(tmp_path, "q2", model="qwen3.8-flash-next-q2_0", **box))
    assert q2["pinned_share"] == pytest.approx(45 / 48)
    assert any("ring 384" in n for n in q2["notices"])
    # STRATA_ARENA_PIN_GIB = 10 pins whole slices under 10 GiB: 15 layers (9.89 GiB); 0 is no cap (pinned.cu)
    _, capped = run_file(scenario_file(tmp_path, "q2-10", model="qwen3.8-flash-next-q2_0",
                                       env={"STRATA_ARENA_PIN_GIB": "10"}, **box))
    assert capped["pinned_share"] == pytest.approx(15 / 48)
    _, uncapped = run_file(scenario_file(tmp_path, "q2-0", model="qwen3.8-flash-next-q2_0",
                                         env={"STRATA_ARENA_PIN_GIB": "0"}, **box))
    assert uncapped["pinned_share"] == pytest.approx(45 / 48)
    # the 46.84 GiB IQ3_S arena keeps under 30 GiB of whole layers: ~0.6 pinned, the 96-slot ring (a 5070 Ti's log
    # on Windows: "cudaHostRegister of the whole arena FAILED ... 31 slices pinned (29 GiB)", "a 96-slot ring")
    _, iq3 = run_file(scenario_file(tmp_path, "iq3s", **box))
    assert 0.55 < iq3["pinned_share"] < 30 * GiB / (46.84 * GiB)
    assert any("ring 96" in n for n in iq3["notices"])


def test_the_attention_half_share_is_the_kernels_multiply_adds():
    # per token and layer (reference/strata-engine.md §2.1): n_embd 2560, hc 4 x 2560 = 10240 with low rank 320
    from sim.engines.strata.prompt_stream import ATTENTION_HALF_SHARE
    hc_read = 10240 * 320 * 2 + 10240 * 4
    gdn = 2560 * 10240 + 2560 * 6144 + 2 * 2560 * 48 + 6144 * 2560 + 4 * 48 * 128 * 128
    qsa = 2560 * 12288 + 2 * 2560 * 512 + 2560 * 128 + 2560 * 512 + 6144 * 2560 + 2048 * 24 * 256 * 2 + 16384 * 128
    attention = hc_read + (36 * gdn + 12 * qsa) / 48
    moe = hc_read + 2560 * 512 + 3 * 2560 * 640 + 10 * (1280 * 2560 + 2560 * 640)
    assert ATTENTION_HALF_SHARE == pytest.approx(attention / (attention + moe), abs=5e-4)


def test_a_small_ring_stalls_the_copy_stream_through_the_attention_half(tmp_path, monkeypatch):
    # Every expert streams (owned 8192-token buffers leave the 12 GB card no cache) and the arena is pinned whole
    # (no driver limit), so each blob is one DMA at the profile's 16 GB/s. During a layer's attention half the copy
    # stream can run at most `ring` blobs ahead (prefill.cpp: a slot is reused only once the compute stream is done
    # with it), so a layer takes at least its attention half plus the copies the ring could not take in it. The
    # compute stream's WDDM stalls per stream event are taken out (tests/test_strata_stream_events.py)
    import sim.machine
    from sim.engines.strata.prompt_stream import ATTENTION_HALF_SHARE

    monkeypatch.setattr(sim.machine, "WDDM_STREAM_EVENT_S", 0.0)
    data = tomllib.loads((ROOT / "scenarios" / "hardware" / "rtx-5070-12gb-windows.toml").read_text())
    data["name"] = "rtx-5070-unbounded-pin"
    del data["host"]["gpu_pinnable_gib"]
    data.pop("calibration", None)
    hw = tmp_path / "rtx-5070-unbounded-pin.toml"
    hw.write_text(tomli_w.dumps(data))
    box = dict(variant="v0.1.35", hardware=str(hw), requests=((8193, 1),),
               flags={"expert-cache": "auto", "prefill": 8192, "no-prefill-borrow": True, "resident-experts": None,
                      "max-context": 16384})
    runs = {}
    for ring in (96, 384):
        r, st = run_file(scenario_file(tmp_path, f"ring{ring}", env={"STRATA_PREFILL_RING": str(ring)}, **box))
        assert st["pinned_share"] == 1.0 and r.summary["cache_slots"] == 0
        runs[ring] = st["requests"][0]["pp_ms"] / 1e3
    layout = load_scenario(scenario_file(tmp_path, "layout", **box)).layout
    blob = np.asarray(layout.expert_bytes_per_layer()[:48], dtype=float)
    rate = data["pcie"]["h2d_pinned_gbps"]["value"] * 1e9
    attention = 8192 * data["compute"]["qwen3.8-flash-next"]["prefill_us_per_token_layer"]["value"] * 1e-6 \
        * ATTENTION_HALF_SHARE
    stall_bound = float(np.sum(attention + (512 - 96) * blob / rate))
    assert runs[96] >= stall_bound
    assert runs[384] < 0.9 * runs[96]
    assert runs[384] >= float(np.sum(512 * blob)) / rate  # and the copies themselves bound the big ring


def test_a_run_past_the_hosts_ram_is_refused(tmp_path):
    """The arena (46.84 GiB of IQ3_S experts in RAM, strata-engine.md §2.2) and the host copy of a 262,144-cell K/V
    cache streamed from 1,024 resident cells exceed the 48 GiB of rtx-5090-48gb-windows.toml. Before, the run
    reported figures with a 51,209 MiB RAM peak."""
    path = scenario_file(tmp_path, "over", flags={"resident-experts": None, "kv-resident": 1024},
                         requests=((300, 2),))
    with pytest.raises(InputError) as refused:
        run_file(path)
    assert refused.value.field == "hardware" and "of host RAM at its peak" in refused.value.why
    assert "more than the 49,152 MiB this box has" in refused.value.why
