"""Every knob of every engine's search space moves the result the way the engine's code says it does.

A user turns one knob and asks "does it help, and by how much?": the sign of each knob's effect is the least the
model must get right. Each knob of an engine's search space (`Engine.search_space`, the knobs `expertsim plan`
tunes and the report labels) has a row below: a small scenario, two settings of the knob, and the direction of
the metrics that the engine's code makes them move, with the code that says so. docs/concepts/knobs.md explains
each tradeoff. A knob added to an engine without a row here fails `test_every_knob_has_a_direction`.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sim.engines import ENGINES
from sim.explore.runner import make_point, run_points

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
UP, DOWN = +1, -1


@dataclass(frozen=True)
class Direction:
    knob: str                 # the knob's scenario key (Knob.key)
    scenario: str             # a file under scenarios/
    low: object               # the knob's two settings: `moves` says how each metric goes from low to high
    high: object
    moves: dict[str, int]     # metric -> UP or DOWN
    why: str                  # the engine's code that makes it so
    also: dict = field(default_factory=dict)  # other settings both runs share (a shorter workload, say)


SHORT_DS4 = {"workload.requests": [{"prompt_tokens": 2048, "decode_tokens": 24, "measured": True}]}
SHORT_STRATA = {"workload.requests": [{"prompt_tokens": 16384, "decode_tokens": 16, "measured": True}]}
SHORT_LLAMA = {"workload.requests": [{"prompt_tokens": 2048, "decode_tokens": 8, "measured": True}]}

DIRECTIONS = {
    ("ds4", "engine.variant"): Direction(
        "engine.variant", "ds4-504-per-class.toml", "pre-504", "pr504", {"decode_tok_s": UP, "decode_hit_rate": UP},
        "PR #504: one slab shared by q2 and q4 experts evicts by slot, so a q4 miss in a q2-sized hole thrashes it "
        "(~0.9 tok/s); a cache per size class keeps each class's hot set (~25 tok/s at 97 % hits)", SHORT_DS4),
    ("ds4", "engine.flags.ssd-streaming-cache-experts"): Direction(
        "engine.flags.ssd-streaming-cache-experts", "ds4-504-per-class.toml", "2048", "9472",
        {"cache_slots": UP, "decode_hit_rate": UP, "decode_tok_s": UP},
        "ds4.c --ssd-streaming-cache-experts N: the cache holds N experts (capped by free VRAM less the reserve); "
        "a miss is an SSD or page-cache read and a PCIe copy, a hit neither", SHORT_DS4),
    ("ds4", "engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB"): Direction(
        "engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB", "ds4-504-per-class.toml", "12", "72",
        {"cache_slots": DOWN, "decode_hit_rate": DOWN},
        "ds4-engine.md §1.12: the cache takes at most the free VRAM less the reserve; a larger reserve leaves "
        "room for other allocations and fewer experts", SHORT_DS4),
    ("ds4", "engine.flags.prefill-chunk"): Direction(
        "engine.flags.prefill-chunk", "ds4-504-per-class.toml", 1024, 4096, {"prefill_tok_s": UP},
        "ds4 prefill reads each routed expert of a layer once per chunk: a bigger chunk reads the layer's experts "
        "for more tokens at once (fewer loads per token)", SHORT_DS4),
    ("strata", "engine.flags.expert-cache"): Direction(
        "engine.flags.expert-cache", "strata-658-borrow.toml", 3000, 5400,
        {"cache_slots": UP, "decode_hit_rate": UP},
        "strata-engine.md §3.1: --expert-cache N sizes the GPU cache (N x the largest blob); decode reads a "
        "cached expert in VRAM and runs a missed one on the CPU pool", SHORT_STRATA),
    ("strata", "engine.env.STRATA_PREFILL_OWN_AUTO"): Direction(
        "engine.env.STRATA_PREFILL_OWN_AUTO", "strata-658-borrow.toml", "0", "1",
        {"prefill_tok_s": UP, "file_blob_reads": DOWN},
        "the #658 fork: with independent buffers nothing is lent, so no lent expert is streamed per chunk and no "
        "slot is refilled after the prompt (measured 2,901.7 vs 2,311.6 tok/s)", SHORT_STRATA),
    ("strata", "engine.flags.no-prefill-borrow"): Direction(
        "engine.flags.no-prefill-borrow", "conversation-aba.toml", False, True, {"cache_slots": DOWN},
        "strata-engine.md §3.3: --no-prefill-borrow gives the prompt path owned buffers (a fixed 2048-token chunk); "
        "the auto cache is sized after them, so it holds fewer experts", {}),
    ("strata", "engine.flags.prefill"): Direction(
        "engine.flags.prefill", "strata-658-borrow.toml", 2048, 8192, {"prefill_tok_s": UP, "lent_slots": UP},
        "strata-engine.md §3.2: every non-resident expert streams once per chunk, so a bigger chunk streams fewer "
        "bytes per token; its buffers are bigger, so it borrows more of the cache's tail", SHORT_STRATA),
    ("strata", "engine.flags.vram-reserve-mib"): Direction(
        "engine.flags.vram-reserve-mib", "strata-658-auto-borrow.toml", 700, 4096,
        {"cache_slots": DOWN},
        "strata-engine.md §3.1: --expert-cache auto takes the free VRAM less --vram-reserve-mib", SHORT_STRATA),
    ("strata", "engine.env.STRATA_RESIDENT_HEADROOM_GIB"): Direction(
        "engine.env.STRATA_RESIDENT_HEADROOM_GIB", "strata-658-borrow.toml", "4.75", "12",
        {"file_blob_reads": UP},
        "strata-engine.md §3.5: resident RAM mode keeps available RAM less the headroom for expert copies; what "
        "it cannot cover of a loan is read back from the files after the prompt", SHORT_STRATA),
    ("strata", "engine.flags.conversation-cache-mib"): Direction(
        "engine.flags.conversation-cache-mib", "conversation-aba.toml", 0, 2048, {"ttft_s": DOWN},
        "strata-engine.md §3.7: a parked conversation's K/V and state are restored from RAM when it returns; "
        "without the cache its turn re-reads the whole conversation as a prompt", {}),
    ("llama.cpp", "engine.flags.n-cpu-moe"): Direction(
        "engine.flags.n-cpu-moe", "llamacpp-qwen3.8-ncmoe.toml", 32, 44,
        {"decode_tok_s": DOWN, "vram_peak_mib": DOWN},
        "llamacpp-engine.md §4: each MoE layer whose experts sit in host RAM adds its k experts to the CPU's read of "
        "every token, and takes its expert tensors off the GPU", SHORT_LLAMA),
    ("llama.cpp", "engine.flags.n-gpu-layers"): Direction(
        "engine.flags.n-gpu-layers", "llamacpp-qwen3.8-ncmoe.toml", 33, 49, {"decode_tok_s": UP, "prefill_tok_s": UP},
        "src/llama-model.cpp load_tensors: blocks before i_gpu_start = n_layer + 1 - N run whole on the CPU, which "
        "reads their weights, experts and K/V every token and copies their weights whole for every offloaded ubatch; "
        "more layers on the GPU leave it fewer", SHORT_LLAMA),
    ("llama.cpp", "engine.flags.ubatch-size"): Direction(
        "engine.flags.ubatch-size", "llamacpp-qwen3.8-ncmoe.toml", 512, 2048, {"prefill_tok_s": UP},
        "llamacpp-engine.md §5.3: op offload copies a CPU layer's used experts once per ubatch, so a larger ubatch "
        "pays that copy for more tokens", SHORT_LLAMA),
    ("llama.cpp", "engine.flags.load-mode"): Direction(
        "engine.flags.load-mode", "llamacpp-qwen3.8-ncmoe.toml", "auto", "none", {"prefill_tok_s": UP, "ram_peak_mib": UP},
        "llamacpp-engine.md §2.2, §5.5: without the mapping the CPU experts are read into a pinned CUDA_Host buffer, "
        "which op offload copies at the pinned rate, and which RAM must hold", SHORT_LLAMA),
    ("llama.cpp", "engine.flags.no-op-offload"): Direction(
        "engine.flags.no-op-offload", "llamacpp-qwen3.8-ncmoe.toml", False, True, {"prefill_tok_s": DOWN},
        "llamacpp-engine.md §5.4: --no-op-offload keeps every ubatch's expert matmuls on the CPU's -tb threads, a pass "
        "over each selected expert per token where the GPU would take a copy of the ubatch's used experts", SHORT_LLAMA),
    ("llama.cpp", "engine.variant"): Direction(
        "engine.variant", "llamacpp-qwen3.8-ncmoe.toml", "mainline-pre-15346", "mainline", {"prefill_tok_s": UP},
        "llama.cpp PR #15346: op offload copies only the experts the ubatch uses, where it copied every expert of "
        "each CPU layer", SHORT_LLAMA),
    ("replay", "engine.flags.slots"): Direction(
        "engine.flags.slots", "replay-qwen3.8-lru.toml", 64, 256, {"decode_hit_rate": UP, "prefill_hit_rate": UP},
        "LRU is a stack algorithm (Mattson et al. 1970): a bigger cache holds everything a smaller one holds, so "
        "its hit rate is never lower, and higher wherever a reuse distance falls between the two sizes", {}),
    ("replay", "engine.flags.policy"): Direction(
        "engine.flags.policy", "replay-qwen3.8-lru.toml", "lru", "opt", {"decode_hit_rate": UP},
        "Belady's OPT evicts the expert used furthest in the future: no policy hits more at any size (Belady "
        "1966), and LRU misses whatever returns after the cache has cycled", {}),
}


def _knobs() -> list[tuple[str, str]]:
    return [(engine.name, knob.key) for engine in ENGINES.values() for knob in engine.knobs]


def test_every_knob_has_a_direction():
    missing = [key for key in _knobs() if key not in DIRECTIONS]
    assert not missing, f"knobs without a direction test: {missing}"
    assert set(DIRECTIONS) <= set(_knobs()), "a direction for a knob no engine has"


def _run(direction: Direction) -> tuple[dict, dict]:
    path = SCENARIOS / direction.scenario
    data = tomllib.loads(path.read_text())
    points = [make_point(path, data, {**direction.also, direction.knob: value}, "knob")
              for value in (direction.low, direction.high)]
    for point in points:
        assert point.error is None, point.error
    rows = dict((p.point_id, row) for p, row in run_points(points, "inline"))
    low, high = (rows[p.point_id] for p in points)
    for row in (low, high):
        assert row["error"] is None, row["error"]
    return low, high


@pytest.mark.parametrize("key", sorted(DIRECTIONS), ids=lambda key: f"{key[0]}:{key[1].split('.')[-1]}")
def test_a_knob_moves_its_metrics_the_engines_way(key):
    direction = DIRECTIONS[key]
    low, high = _run(direction)
    for metric, sign in direction.moves.items():
        assert (high[metric] - low[metric]) * sign > 0, (
            f"{direction.knob} {direction.low} -> {direction.high}: {metric} {low[metric]} -> {high[metric]}, "
            f"expected {'up' if sign > 0 else 'down'} ({direction.why})")
