"""The cache-only replay engine: known answers against an OrderedDict LRU and a hand-worked static cache, the
run summary's shape, one-line errors for bad replay settings."""

import json
import os
import subprocess
import sys
import typing
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from sim.cache import replay as cache_replay
from sim.simulate import run_scenario
from sim.errors import InputError
from sim.engines.replay.settings import ReplayFlags
from sim.scenario import load_scenario
from sim.trace.format import Trace, TraceHeader, write_trace
from tests.test_gguf_reader import expert_tensors, moe_kv, write_gguf
from sim.units import MIB

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "replay-qwen3.8-lru.toml"
HARDWARE = ROOT / "scenarios" / "hardware" / "rtx-4090.toml"

# A 3-layer, 4-expert, top-2 model: layers 0 and 1 in IQ2_XXS, layer 2 in Q2_K (two size classes).
HIDDEN, WIDTH, N_EXPERTS, TOP_K = 512, 256, 4, 2
TYPES = (Q.IQ2_XXS, Q.IQ2_XXS, Q.Q2_K)


def expert_bytes(qtype) -> int:
    """gate + up + down of one expert, from gguf's own block table (not sim.model.quant)."""
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    return 3 * HIDDEN * WIDTH // block_weights * block_bytes


# Request 0 of the hand-made trace: 4 prompt rows, then 3 decode rows; [row][layer] = the top-2 experts.
PROMPT = [[[0, 1], [2, 3], [0, 1]],
          [[1, 2], [2, 3], [1, 0]],
          [[0, 3], [0, 1], [2, 3]],
          [[0, 1], [2, 3], [0, 1]]]
DECODE = [[[2, 1], [3, 2], [0, 2]],
          [[0, 2], [1, 0], [3, 1]],
          [[1, 0], [3, 2], [0, 1]]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A folder with the tiny GGUF, the hand-made trace and a replay scenario writer."""
    folder = tmp_path_factory.mktemp("tiny")
    tensors = [t for block, qtype in enumerate(TYPES)
               for t in expert_tensors(block, N_EXPERTS, HIDDEN, WIDTH, (qtype, qtype, qtype))]
    write_gguf(folder / "tiny.gguf", tensors, moe_kv(3, N_EXPERTS, TOP_K) | {"general.name": "tiny-moe"})
    rows = np.array(PROMPT + DECODE, np.uint16)
    phase = np.array([0] * len(PROMPT) + [1] * len(DECODE))
    header = TraceHeader("tiny-moe", 3, N_EXPERTS, TOP_K, "hand", "")
    write_trace(Trace(header, np.zeros(len(rows)), np.arange(len(rows)), phase, rows), folder / "tiny.parquet")
    return folder


def scenario_text(flags: str, requests: int = 2) -> str:
    workload = "".join(f"\n[[workload.requests]]\nprompt_tokens = {len(PROMPT)}\ndecode_tokens = {len(DECODE)}\n"
                       for _ in range(requests))
    return (f'hardware = "{HARDWARE}"\nmodel = "tiny.gguf"\n[engine]\nname = "replay"\n[engine.flags]\n{flags}\n'
            f'[trace]\npath = "tiny.parquet"\n{workload}')


def replay_summary(folder: Path, flags: str, requests: int = 2) -> dict:
    path = folder / "s.toml"
    path.write_text(scenario_text(flags, requests))
    return run_scenario(load_scenario(path)).summary


def ordered_dict_lru(pool_of_layer: list[int], capacity: int, requests: int) -> dict:
    """Hits and lookups per phase and misses per layer of per-pool LRUs over the workload: each request replays
    request 0 of the trace (prompt, then decode), the caches kept from one request to the next."""
    pools = {p: OrderedDict() for p in set(pool_of_layer)}
    hits, lookups = [0, 0], [0, 0]
    misses = [0, 0, 0]
    for _ in range(requests):
        for phase, rows in ((0, PROMPT), (1, DECODE)):
            for row in rows:
                for layer, experts in enumerate(row):
                    cache = pools[pool_of_layer[layer]]
                    for expert in experts:
                        key = (layer, expert)
                        lookups[phase] += 1
                        if key in cache:
                            hits[phase] += 1
                            cache.move_to_end(key)
                            continue
                        misses[layer] += 1
                        if capacity == 0:
                            continue
                        if len(cache) == capacity:
                            cache.popitem(last=False)
                        cache[key] = True
    return {"hits": hits, "lookups": lookups, "misses": misses}


@pytest.mark.parametrize("scope, pool_of_layer, capacity", [
    ("layer", [0, 1, 2], 2),
    ("layer", [0, 1, 2], 3),
    ("class", [0, 0, 1], 3),
    ("global", [0, 0, 0], 5),
    ("global", [0, 0, 0], 0),
])
def test_lru_replay_hits_equal_an_ordered_dict_lru(tiny, scope, pool_of_layer, capacity):
    s = replay_summary(tiny, f'policy = "lru"\nscope = "{scope}"\nslots = {capacity}')
    oracle = ordered_dict_lru(pool_of_layer, capacity, requests=2)
    phases = {row["phase"]: row for row in s["per_phase"]}
    assert [phases["prefill"]["hits"], phases["decode"]["hits"]] == oracle["hits"]
    assert [phases["prefill"]["lookups"], phases["decode"]["lookups"]] == oracle["lookups"]
    assert s["hits"] == sum(oracle["hits"]) and s["lookups"] == 2 * 7 * 3 * TOP_K
    assert s["misses"] == sum(oracle["misses"])
    assert s["prefill_hit_rate"] == oracle["hits"][0] / oracle["lookups"][0]
    assert s["decode_hit_rate"] == oracle["hits"][1] / oracle["lookups"][1]
    sizes = [expert_bytes(t) for t in TYPES]
    assert s["load_bytes"] == sum(m * b for m, b in zip(oracle["misses"], sizes))
    classes = {row["class"]: row for row in s["per_class"]}
    assert classes[0]["misses"] == oracle["misses"][0] + oracle["misses"][1]  # layers 0 and 1 share a size
    assert classes[1]["misses"] == oracle["misses"][2] and classes[1]["expert_bytes"] == sizes[2]
    pools = max(pool_of_layer) + 1
    assert s["cache_slots"] == capacity * pools
    slot_bytes = {"layer": sum(sizes), "class": sizes[0] + sizes[2], "global": max(sizes)}[scope]
    assert s["cache_mib"] == capacity * slot_bytes / MIB


def test_the_cache_is_kept_from_one_request_to_the_next(tiny):
    one = replay_summary(tiny, 'slots = 4', requests=1)
    two = replay_summary(tiny, 'slots = 4', requests=2)
    # every layer's 4 experts fit: request 1 misses each key it uses once, request 2 (the same routing) never
    used = sum(len({e for row in PROMPT + DECODE for e in row[layer]}) for layer in range(3))
    assert one["misses"] == two["misses"] == used
    assert two["lookups"] == 2 * one["lookups"]


def test_static_cache_with_a_profile_file(tiny):
    # ranks (layer, expert): (0,3) (2,2) (1,0) (0,0) (1,1); one slot per layer keeps (0,3), (1,0), (2,2)
    (tiny / "profile.csv").write_text("rank,layer,expert\n0,0,3\n1,2,2\n2,1,0\n3,0,0\n4,1,1\n")
    s = replay_summary(tiny, 'policy = "static"\nscope = "layer"\nslots = 1\nprofile = "profile.csv"', requests=1)
    rows = PROMPT + DECODE
    resident = {(0, 3), (1, 0), (2, 2)}
    expected = sum((layer, e) in resident for row in rows for layer, experts in enumerate(row) for e in experts)
    assert s["hits"] == expected and s["direct_loads"] == s["misses"] == s["lookups"] - expected
    assert s["engine_state"]["profile"] == "file"
    assert s["provenance"]["profile"] == str(tiny / "profile.csv") and len(s["provenance"]["profile_sha256"]) == 64


def test_summary_nulls_what_a_cache_only_run_has_no_figure_for(tiny):
    s = replay_summary(tiny, 'slots = 2')
    for key in ("lent_slots", "prefill_buffer_mib", "file_blob_reads", "prefill_tok_s", "decode_tok_s", "ttft_s",
                "simulated_s", "gpu_idle_s", "belady_decode_hit_rate", "measured_request", "variant"):
        assert s[key] is None, key
    assert s["engine"] == "replay" and s["model"] == "tiny-moe" and s["requests"] == 2
    assert s["engine_state"] == {"policy": "lru", "scope": "layer", "prefill_mode": "evict",
                                 "capacity_slots": [2, 2, 2]}
    assert s["provenance"]["command_line"] == "replay --slots 2"
    assert len(s["provenance"]["scenario_sha256"]) == 64 and len(s["provenance"]["trace_sha256"]) == 64
    json.dumps(s, allow_nan=False)  # plain JSON values only


def test_the_flag_literals_are_the_cache_modules_names():
    def literal(name):
        return typing.get_args(ReplayFlags.model_fields[name].annotation)

    assert literal("policy") == cache_replay.POLICIES
    assert literal("scope") == cache_replay.SCOPES
    assert literal("prefill_mode") == tuple(cache_replay.PREFILL_MODES)


def test_expertsim_run_prints_the_replay_and_writes_its_results(tmp_path):
    env = {**os.environ, "COLUMNS": "160"}
    cmd = [sys.executable, "-m", "sim", "run", str(SCENARIO)]
    proc = subprocess.run([*cmd, "--json", "-o", str(tmp_path / "out")], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["decode_tok_s"] is None and 0 < summary["decode_hit_rate"] < 1
    assert summary["cache_slots"] == 48 * 128
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["hits"] == summary["hits"]
    bad = subprocess.run([*cmd, "--perfetto", str(tmp_path / "t.json")], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no timeline" in bad.stderr


SLOTS = "slots = 128"
ENGINE = '[engine]\nname = "replay"'


@pytest.mark.parametrize("edits, expected", [
    ({'policy = "lru"': 'policy = "fifo"'},
     "engine.flags.policy = fifo: must be 'lru', 'lfu', 'opt', 'static' or 'ds4-slab'"),
    ({'scope = "layer"': 'scope = "expert"'}, "engine.flags.scope = expert: must be 'layer', 'class' or 'global'"),
    ({SLOTS: "slots = -1"}, "engine.flags.slots = -1: must be a slot count >= 0"),
    ({SLOTS: 'slots = "128"'}, "engine.flags.slots = 128: must be a slot count >= 0"),
    ({SLOTS: "slots = []"}, "engine.flags.slots = [0 items]: must be a slot count >= 0"),
    ({SLOTS: "slots = [1, 2]"}, "engine.flags.slots = [1, 2]: 2 counts; policy lru, scope layer on "
                                "qwen3.8-flash-next-iq3s takes one count, or one per layer (48)"),
    ({SLOTS: "slots = 513"}, "engine.flags.slots = 513: 513 slots in pool 0, which has only 512 experts"),
    ({'scope = "layer"': 'scope = "class"', SLOTS: "slots = 2000"},
     "engine.flags.slots = 2000: 2000 slots in pool 0, which has only 1024 experts"),
    ({SLOTS: ""}, "engine.flags.slots = (missing): required"),
    ({SLOTS: f"{SLOTS}\nslot = 128"}, "engine.flags.slot = 128: unknown replay flag; known: policy, scope, slots, "
                                      "prefill-mode, profile"),
    ({'prefill-mode = "evict"': 'prefill-mode = "lazy"'}, "engine.flags.prefill-mode = lazy: must be 'evict' or"),
    ({'policy = "lru"': 'policy = "opt"', 'prefill-mode = "evict"': 'prefill-mode = "append"'},
     "engine.flags.prefill-mode = append: opt is the bound of an evicting cache"),
    ({SLOTS: f'{SLOTS}\nprofile = "p.csv"'}, "engine.flags.profile = p.csv: read only by policy static"),
    ({'policy = "lru"': 'policy = "static"\nprofile = "p.csv"'}, "engine.flags.profile = p.csv: no such file"),
    ({ENGINE: f'{ENGINE}\nvariant = "x"'}, "engine.variant = x: unknown replay engine key"),
    ({ENGINE: '[engine]\nname = "replays"'}, "engine.name = replays: must be one of 'ds4', 'strata', 'llama.cpp', 'replay'"),
])
def test_bad_replay_settings_fail_in_one_line(tmp_path, edits, expected):
    text = SCENARIO.read_text().replace('"rtx-5090-48gb-windows"', f'"{HARDWARE}"')
    for old, new in edits.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(InputError) as info:
        load_scenario(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: ") and expected in message, message


def test_a_bad_profile_row_is_a_one_line_error_naming_the_file(tiny):
    (tiny / "bad.csv").write_text("rank,layer,expert\n0,0,1\n1,7,0\n")
    with pytest.raises(InputError) as info:
        replay_summary(tiny, 'policy = "static"\nslots = 1\nprofile = "bad.csv"')
    message = str(info.value)
    assert "\n" not in message and str(tiny / "bad.csv") in message and "row 3" in message


def test_a_slab_takes_one_count_per_size_class(tiny):
    s = replay_summary(tiny, 'policy = "ds4-slab"\nslots = [2, 1]')
    assert s["engine_state"]["scope"] == "global" and s["engine_state"]["capacity_slots"] == [2, 1]
    assert s["cache_slots"] == 2  # the slab is rebuilt per class: at most its largest build
    (tiny / "s.toml").write_text(scenario_text('policy = "ds4-slab"\nslots = [2, 1, 1]'))
    with pytest.raises(InputError, match="one per size class \\(2\\)"):
        load_scenario(tiny / "s.toml")
