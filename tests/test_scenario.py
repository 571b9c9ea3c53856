"""Scenarios: the seed files load, hashes are deterministic and content-sensitive, bad input is one line."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.engines.ds4.settings import Settings as Ds4Engine
from sim.engines.strata.settings import Settings as StrataEngine
from sim.errors import InputError
from sim.scenario import load_scenario, scenario_hash
from sim.trace.format import Trace, TraceHeader, write_trace

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = sorted((ROOT / "scenarios").glob("*.toml"))
EXPECTED = {"ds4-504-slab", "ds4-504-per-class", "strata-658-borrow", "strata-658-own", "strata-658-auto-borrow",
            "strata-658-auto-own", "conversation-aba", "glm52-mtp-slab", "glm52-mtp-per-class", "replay-qwen3.8-lru",
            "llamacpp-qwen3.8-ncmoe"}


def test_the_seed_scenarios_ship():
    assert {p.stem for p in SCENARIOS} == EXPECTED


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_scenario_loads_and_says_what_it_covers(path):
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# Scenario: ")
    assert any(line.startswith("# Covers: ") for line in lines[:8])
    s = load_scenario(path)
    assert s.hardware_profile.name == s.hardware
    assert s.layout.name == s.model
    if s.engine.name != "replay":  # a cache-only replay times nothing: it needs no compute figures
        assert s.compute.prefill_us_per_token_layer.value > 0
    assert len(s.measured) == 1
    assert scenario_hash(s) == scenario_hash(load_scenario(path))


def test_hashes_differ_between_the_seed_scenarios():
    hashes = {scenario_hash(load_scenario(p)) for p in SCENARIOS}
    assert len(hashes) == len(SCENARIOS)


def _settings(path):
    return tomllib.loads(path.read_text())


@pytest.mark.parametrize("a, b, differ", [
    ("ds4-504-slab", "ds4-504-per-class", {("engine", "variant")}),
    ("glm52-mtp-slab", "glm52-mtp-per-class", {("engine", "variant")}),
    ("strata-658-borrow", "strata-658-own", {("engine", "env", "STRATA_PREFILL_OWN_AUTO")}),
    ("strata-658-auto-borrow", "strata-658-auto-own", {("engine", "env", "STRATA_PREFILL_OWN_AUTO")}),
    ("strata-658-borrow", "strata-658-auto-borrow", {("engine", "flags", "expert-cache")}),
])
def test_twin_scenarios_differ_in_exactly_one_setting(a, b, differ):
    def flat(node, prefix=()):
        if isinstance(node, dict):
            for key, value in node.items():
                yield from flat(value, (*prefix, key))
        else:
            yield prefix, json.dumps(node)

    left = dict(flat(_settings(ROOT / "scenarios" / f"{a}.toml")))
    right = dict(flat(_settings(ROOT / "scenarios" / f"{b}.toml")))
    assert {k for k in left.keys() | right.keys() if left.get(k) != right.get(k)} == differ


def test_seed_settings_are_the_engines_own():
    ds4 = load_scenario(ROOT / "scenarios" / "ds4-504-per-class.toml")
    assert isinstance(ds4.engine, Ds4Engine)
    assert ds4.engine.flags.ssd_streaming_cache_experts == "9472"
    assert ds4.engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB == "12"
    assert "DS4_CUDA_NO_DIRECT_IO=1" in ds4.command_line()
    strata = load_scenario(ROOT / "scenarios" / "strata-658-own.toml")
    assert isinstance(strata.engine, StrataEngine)
    flags = strata.engine.flags
    assert (flags.expert_cache, flags.vram_reserve_mib, flags.prefill) == (5400, 1536, "auto")
    assert (flags.conversation_cache_mib, flags.conversation_cache_slots,
            flags.conversation_cache_min_free_mib) == (2048, 2, 2560)
    assert flags.ram_mode == "resident-experts"
    assert (flags.adapt_every, flags.adapt_swaps) == (4, 96)  # engine defaults when unset
    requests = strata.workload.requests
    assert [r.prompt_tokens for r in requests] == [20, 17944, 17944] and requests[2].measured
    assert all(r.decode_tokens <= 16 for r in requests)
    aba = load_scenario(ROOT / "scenarios" / "conversation-aba.toml")
    assert [r.conversation for r in aba.workload.requests] == ["A", "B", "A"]
    assert aba.engine.flags.conversation_cache_mib > 0


# ------------------------------------------------------------------------------- hashing, in a copy


@pytest.fixture()
def tree(tmp_path):
    """A copy of scenarios/ (profiles included) that a test may edit."""
    shutil.copytree(ROOT / "scenarios", tmp_path / "scenarios")
    return tmp_path / "scenarios"


def test_hash_follows_content_not_names_or_comments(tree):
    path = tree / "ds4-504-per-class.toml"
    before = scenario_hash(load_scenario(path))
    assert before == scenario_hash(load_scenario(ROOT / "scenarios" / "ds4-504-per-class.toml"))
    text = path.read_text()
    path.write_text("# another comment\n" + text.replace(
        'hardware = "rtx-pro-6000-96gb"', f'hardware = "{tree / "hardware" / "rtx-pro-6000-96gb.toml"}"\n'
                                          'description = "the same run, spelled differently"'))
    assert scenario_hash(load_scenario(path)) == before
    path.write_text(text.replace('prompt_tokens = 5000', 'prompt_tokens = 5001'))
    assert scenario_hash(load_scenario(path)) != before


def test_hash_changes_when_a_profile_number_changes(tree):
    path = tree / "strata-658-own.toml"
    before = scenario_hash(load_scenario(path))
    profile = tree / "hardware" / "rtx-5090-48gb-windows.toml"
    text = profile.read_text()
    assert "value = 28, unit" in text
    profile.write_text(text.replace("value = 28, unit", "value = 29, unit", 1))  # same size, same second
    after = scenario_hash(load_scenario(path))
    assert after != before
    profile.write_text(text)
    assert scenario_hash(load_scenario(path)) == before


def test_hash_is_the_same_in_a_fresh_process():
    path = ROOT / "scenarios" / "strata-658-borrow.toml"
    code = f"from sim.scenario import load_scenario, scenario_hash; print(scenario_hash(load_scenario({str(path)!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == scenario_hash(load_scenario(path))


# ------------------------------------------------------------------------------------------- errors


def _error(path: Path, text: str) -> str:
    path.write_text(text)
    with pytest.raises(InputError) as info:
        load_scenario(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    return message


DS4 = (ROOT / "scenarios" / "ds4-504-per-class.toml").read_text()
STRATA = (ROOT / "scenarios" / "strata-658-own.toml").read_text()


@pytest.mark.parametrize("base, old, new, expected", [
    (DS4, "[engine]", "flavour = 1\n[engine]", "flavour = 1: unknown key; known: description, hardware, model"),
    (DS4, "ssd-streaming = true", "ssd-streaming = true\nprefill-chunks = 3",
     "engine.flags.prefill-chunks = 3: unknown ds4 flag; known: ssd-streaming, ssd-streaming-cache-experts"),
    (DS4, 'DS4_CUDA_NO_DIRECT_IO = "1"', 'DS4_CUDA_NO_DIRECTIO = "1"',
     "engine.env.DS4_CUDA_NO_DIRECTIO = 1: unknown ds4 environment variable; known: DS4_CUDA_STREAMING_EXPERT"),
    (STRATA, "prefill = \"auto\"", "prefill = \"auto\"\nprefill-borrow = true",
     "engine.flags.prefill-borrow = True: unknown strata flag; known: expert-cache, vram-reserve-mib"),
    (DS4, "prompt_tokens = 5000", 'prompt_tokens = "5000"',
     "workload.requests[0].prompt_tokens = '5000': must be an integer, not a string"),
    (DS4, "ssd-streaming = true", "ssd-streaming = 1", "engine.flags.ssd-streaming = 1: must be true or false"),
    (DS4, "ssd-streaming = true", "ssd-streaming = true\nprefill-chunk = 0",
     "engine.flags.prefill-chunk = 0: must be >= 1"),
    (STRATA, 'prefill = "auto"', "prefill = 0", "engine.flags.prefill = 0: must be >= 1"),
    (STRATA, 'prefill = "auto"', 'prefill = "auto:0"', 'engine.flags.prefill = auto:0: must be "auto", "auto:N"'),
    (DS4, 'RESERVE_GB = "12"', 'RESERVE_GB = "96"',
     "engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB = 96: a reserve >= the GPU's VRAM"),
    (STRATA, "vram-reserve-mib = 1536", "vram-reserve-mib = 32768",
     "engine.flags.vram-reserve-mib = 32768: a reserve >= the GPU's VRAM"),
    (DS4, "decode_tokens = 270", "decode_tokens = -270", "workload.requests[0].decode_tokens = -270: must be >= 0"),
    (STRATA, "conversation-cache-mib = 2048", "conversation-cache-mib = -1",
     "engine.flags.conversation-cache-mib = -1: must be >= 0"),
    (STRATA, "vram-reserve-mib = 1536", "resident-budget-gib = -4.0",
     "engine.flags.resident-budget-gib = -4.0: must be > 0"),
    (DS4, 'hardware = "rtx-pro-6000-96gb"', 'hardware = "rtx-9090"', "hardware = rtx-9090: no hardware profile"),
    (DS4, 'hardware = "rtx-pro-6000-96gb"', 'hardware = "hw/box.toml"', "hardware = hw/box.toml: no such file"),
    (DS4, 'model = "deepseek-v4-flash-q2-q4"', 'model = "deepseek-v5"',
     "model = deepseek-v5: unknown model preset; valid: deepseek-v2-lite-q4_k_m, deepseek-v3.2-q8_0, "
     "deepseek-v4-flash-q2,"),
    (DS4, 'model = "deepseek-v4-flash-q2-q4"', 'model = "models/flash.gguf"',
     "model = models/flash.gguf: no such file"),
    (DS4, '"9472"', '"11009"', "ssd-streaming-cache-experts = 11009: 11009 experts is more than the model's 11008"),
    (DS4, '"9472"', '"80GB"', "ssd-streaming-cache-experts = 80GB: 12136 experts is more than"),
    (DS4, '"9472"', '"9k"', "ssd-streaming-cache-experts = 9k: must be N (experts) or \"NGB\""),
    (STRATA, "expert-cache = 5400", "expert-cache = 30000",
     "engine.flags.expert-cache = 30000: more than the model's 24576"),
    (DS4, 'name = "ds4"', 'name = "vllm"', "engine.name = vllm: must be one of 'ds4', 'strata'"),
    (DS4, 'variant = "pr504"', 'variant = "pr-504"', "engine.variant = pr-504: must be 'pre-504', 'pr504', 'pr605-cache', 'pr605', 'pr1031', 'pr1082', 'pr488', 'main-0728', 'main-v41', 'main-0814', 'neutronstar-glm-slab' or 'neutronstar-glm'"),
    (DS4, 'DS4_CUDA_NO_DIRECT_IO = "1"', 'DS4_CUDA_NO_DIRECT_IO = "1"\nDS4_CUDA_HITS_FIRST = "0"',
     "engine.env.DS4_CUDA_HITS_FIRST = 0: read only by variant pr1082; this scenario's variant is pr504"),
    (DS4, "ssd-streaming = true", 'ssd-streaming = true\nmtp = "mtp.gguf"',
     "engine.flags.mtp = mtp.gguf: ds4 rejects --mtp"),
    (DS4, 'RESERVE_GB = "12"', "RESERVE_GB = 0.5", 'RESERVE_GB = 0.5: write environment values as strings, e.g. "0.5"'),
    (STRATA, 'variant = "fork-658"', 'variant = "v0.1.35"',
     "STRATA_PREFILL_OWN_AUTO = 1: read only by variant fork-658"),
    (STRATA, "resident-experts = true", "resident-experts = true\nresident-budget-gib = 20.0",
     "engine.flags.resident-budget-gib = 20.0: choose one RAM mode"),
    (STRATA, 'model = "qwen3.8-flash-next-iq3s"', 'model = "deepseek-v4-flash-q2"\nmodel_class = "deepseek-v4-flash"',
     "model = deepseek-v4-flash-q2: Strata runs only Qwen3.8-Flash-Next geometry"),
    (STRATA, 'generator = "qwen3.8-flash-next-iq3s"', 'generator = "qwen3-30b-a3b"',
     "trace.generator = qwen3-30b-a3b: generates 48 layers x 128 experts, top-8; model qwen3.8-flash-next-iq3s has "
     "48 x 512, top-10"),
    (DS4, 'generator = "deepseek-v4-flash-q2-q4"', 'generator = "nope"',
     "trace.generator = nope: unknown generator preset"),
    (DS4, "seed = 0", 'path = "t.parquet"', "trace = ['generator', 'path']: give exactly one of"),
    (DS4, 'model = "deepseek-v4-flash-q2-q4"', 'model = "mixtral-8x7b"',
     "model = mixtral-8x7b: hardware profile rtx-pro-6000-96gb has no compute figures for model 'mixtral-8x7b'"),
    (DS4, "[[workload.requests]]", "[workload]\nrequests = []\n[[nothing]]", "workload.requests = [0 items]"),
    (DS4, "[[workload.requests]]", "[[[workload.requests]]", "toml = "),
    # issue 34: a second measured request was taken and the headline silently described the last
    (STRATA, 'label = "first long prompt', 'measured = true\nlabel = "first long prompt',
     "workload.requests = [3 items]: requests 1, 2 each set measured = true: the summary describes one request"),
])
def test_bad_scenarios_fail_in_one_line(tree, base, old, new, expected):
    assert old in base
    message = _error(tree / "bad.toml", base.replace(old, new, 1))
    assert expected in message, message


def test_conversation_turns_must_grow(tree):
    text = STRATA.replace('label = "first long prompt', 'conversation = "X"\nlabel = "first long prompt', 1)
    text = text.replace('label = "measured:', 'conversation = "X"\nlabel = "measured:', 1)
    message = _error(tree / "turns.toml", text)
    assert "workload.requests[2].prompt_tokens = 17944: a turn of conversation 'X' repeats its earlier turns: " \
           "needs >= 17946 tokens" in message
    (tree / "turns.toml").write_text(text.replace("prompt_tokens = 17944  #", "prompt_tokens = 18000  #"))
    assert load_scenario(tree / "turns.toml").workload.requests[2].conversation == "X"


@pytest.mark.parametrize("reserve", ["0.5", "60", "48", "-1", "12GB", ""])
def test_ds4_reserve_text_the_engine_handles_is_accepted(tree, reserve):
    # ds4 parses an integer GiB (anything else keeps the 16 GiB default) and clamps to VRAM / 2: its business.
    path = tree / "reserve.toml"
    path.write_text(DS4.replace('RESERVE_GB = "12"', f'RESERVE_GB = "{reserve}"'))
    assert load_scenario(path).engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB == reserve


def test_env_integers_are_taken_as_their_text(tree):
    path = tree / "ints.toml"
    path.write_text(DS4.replace('RESERVE_GB = "12"', "RESERVE_GB = 12"))
    assert load_scenario(path).engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB == "12"


def test_missing_scenario_and_absolute_hardware_path(tree, tmp_path):
    with pytest.raises(InputError, match="no such file"):
        load_scenario(tmp_path / "nope.toml")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    path = elsewhere / "x.toml"
    path.write_text(DS4.replace('"rtx-pro-6000-96gb"', f'"{tree / "hardware" / "rtx-pro-6000-96gb.toml"}"'))
    assert load_scenario(path).hardware_profile.name == "rtx-pro-6000-96gb"


# --------------------------------------------------------------------------------------- trace files


def _trace(path: Path, n_layers: int, n_experts: int, top_k: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    rows = 4
    experts = np.stack([rng.permutation(n_experts)[:top_k] for _ in range(rows * n_layers)])
    header = TraceHeader(model="test", n_layers=n_layers, n_experts=n_experts, top_k=top_k, source="test",
                         source_sha256="0" * 64)
    write_trace(Trace(header, np.zeros(rows), np.arange(rows), np.zeros(rows),
                      experts.reshape(rows, n_layers, top_k)), path)


def test_trace_file_must_match_the_model_shape(tree):
    (tree / "traces").mkdir()
    _trace(tree / "traces" / "small.parquet", n_layers=3, n_experts=8, top_k=2)
    text = STRATA.replace('generator = "qwen3.8-flash-next-iq3s"\nseed = 0', 'path = "traces/small.parquet"')
    message = _error(tree / "t.toml", text)
    assert "trace.path = traces/small.parquet: trace has 3 layers x 8 experts, top-2; model " \
           "qwen3.8-flash-next-iq3s has 48 x 512, top-10" in message
    _trace(tree / "traces" / "small.parquet", n_layers=48, n_experts=512, top_k=10)
    s = load_scenario(tree / "t.toml")
    assert s.trace_path == (tree / "traces" / "small.parquet").resolve() and len(s.trace_sha256) == 64
    before = scenario_hash(s)
    _trace(tree / "traces" / "small.parquet", n_layers=48, n_experts=512, top_k=10, seed=1)
    assert scenario_hash(load_scenario(tree / "t.toml")) != before
    assert "a seed applies to generator traces only" in _error(tree / "t2.toml", text.replace(
        'path = "traces/small.parquet"', 'path = "traces/small.parquet"\nseed = 3'))
    assert "trace.path = traces/none.parquet: no such file" in _error(tree / "t3.toml", text.replace(
        "small.parquet", "none.parquet"))


# ------------------------------------------------------------------------------------------- fuzzing


def _string(text: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's, once astral characters stay unescaped (JSON would write
    surrogate pairs) and DEL is escaped (JSON leaves it raw)."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return "{" + ", ".join(f"{_string(k)} = {_toml(v)}" for k, v in value.items()) + "}"


def _document(data: dict) -> str:
    return "".join(f"{_string(k)} = {_toml(v)}\n" for k, v in data.items())


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, (*prefix, i))


KEYS = ["name", "variant", "flags", "env", "hardware", "model", "trace", "path", "generator", "seed", "workload",
        "requests", "prompt_tokens", "expert-cache", "prefill", "prefill-chunk", "ssd-streaming-cache-experts",
        "DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB", "STRATA_PREFILL_OWN_AUTO", "conversation", "model_class",
        "policy", "scope", "slots", "prefill-mode", "profile"]
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1), st.integers(-3, 30000),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["auto", "auto:8192", "9472", "70GB", "0.5", "96", "ds4", "strata", "pre-504", "pr1082",
                     "fork-658", "v0.1.35", "h200", "rtx-4090", "../hardware/h200.toml", "x.gguf", "t.parquet",
                     "qwen3.8-flash-next-iq3s", "deepseek-v4-flash-q2", "deepseek-v4-flash", "A", "a" * 300,
                     "hardware/rtx-4090.toml", "/", "", "@trace", "replay", "opt", "ds4-slab", "class", "append"]))
PRESENT = SCALARS.filter(lambda v: v is not None)  # TOML has no null: None means "delete the key"
VALUES = st.one_of(SCALARS, st.lists(PRESENT, max_size=3),
                   st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), PRESENT, max_size=3))
BASES = [tomllib.loads(DS4), tomllib.loads(STRATA),
         tomllib.loads((ROOT / "scenarios" / "conversation-aba.toml").read_text()),
         tomllib.loads((ROOT / "scenarios" / "replay-qwen3.8-lru.toml").read_text())]


def _mutate(data, draw) -> None:
    paths = [p for p in _paths(data) if p]
    path = draw(st.sampled_from(paths))
    parent = data
    for part in path[:-1]:
        parent = parent[part]
    op = draw(st.sampled_from(["set", "set", "delete", "add"]))
    if op == "add" and isinstance(parent, dict):
        key = draw(st.sampled_from(KEYS) | st.text(min_size=1, max_size=8))
        parent[key] = draw(VALUES.filter(lambda v: v is not None))
        return
    value = draw(VALUES)
    if value is None or op == "delete":
        if isinstance(parent, dict):
            del parent[path[-1]]
        elif len(parent) > 1:
            parent.pop(path[-1])
        return
    parent[path[-1]] = value


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(ROOT / "scenarios" / "hardware", folder / "hardware")
    return folder


@settings(max_examples=500, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_fuzzed_scenarios_raise_only_input_errors(fuzz_dir, data):
    doc = json.loads(json.dumps(data.draw(st.sampled_from(BASES))))
    for _ in range(data.draw(st.integers(1, 3))):
        _mutate(doc, data.draw)
    text = _document(doc)
    if data.draw(st.integers(0, 4)) == 0:  # break the text itself now and then
        at = data.draw(st.integers(0, len(text)))
        text = text[:at] + data.draw(st.sampled_from(["", "[", "]", "=", '"', "\\", "\x00", "\n[x]\n", "é"])) + \
            text[at + data.draw(st.integers(0, 3)):]
    path = fuzz_dir / "fuzz.toml"
    path.write_text(text, encoding="utf-8")
    try:
        scenario = load_scenario(path)
    except InputError as exc:
        assert "\n" not in str(exc)
        return
    assert len(scenario_hash(scenario)) == 64


def test_a_gguf_model_is_read_relative_to_the_scenario(tree):
    from tests.test_gguf_reader import Q, expert_tensors, moe_kv, write_gguf

    (tree / "models").mkdir()
    tensors = [t for block in (0, 1, 2) for t in expert_tensors(block, 4, 512, 256, (Q.IQ2_XXS, Q.IQ2_XXS, Q.Q2_K))]
    write_gguf(tree / "models" / "tiny.gguf", tensors, moe_kv(3, 4, 2) | {"general.name": "tiny-moe"})
    (tree / "traces").mkdir()
    _trace(tree / "traces" / "tiny.parquet", n_layers=3, n_experts=4, top_k=2)
    text = DS4.replace('model = "deepseek-v4-flash-q2-q4"', 'model = "models/tiny.gguf"') \
        .replace('generator = "deepseek-v4-flash-q2-q4"\nseed = 0', 'path = "traces/tiny.parquet"') \
        .replace('"9472"', '"8"')
    assert "has no compute figures for model 'tiny-moe'; set model_class to one of: deepseek-v4-flash" in \
        _error(tree / "g.toml", text)
    text = text.replace('model = "models/tiny.gguf"', 'model = "models/tiny.gguf"\nmodel_class = "deepseek-v4-flash"')
    (tree / "g.toml").write_text(text)
    s = load_scenario(tree / "g.toml")
    assert (s.layout.name, s.layout.n_experts, s.compute_key) == ("tiny-moe", 4, "deepseek-v4-flash")
    assert "ssd-streaming-cache-experts = 13: 13 experts is more than the model's 12" in \
        _error(tree / "g2.toml", text.replace('"8"', '"13"'))
    shutil.copy(tree / "models" / "tiny.gguf", tree / "models" / "renamed.gguf")
    (tree / "g3.toml").write_text(text.replace("tiny.gguf", "renamed.gguf"))
    assert scenario_hash(load_scenario(tree / "g3.toml")) == scenario_hash(s)


@pytest.mark.parametrize("scenario, flags, prompt, refusal", [
    # ds4_session_sync refuses a prompt of ctx tokens or more (default --ctx 32768, ds4_cli.c)
    ("ds4-504-per-class.toml", {}, 300_000, "prompt exceeds context (--ctx 32768"),
    ("ds4-504-per-class.toml", {"ctx": 8192}, 8192, "prompt exceeds context (--ctx 8192"),
    # Strata refuses a request (prompt + decode) beyond --max-context
    ("strata-658-own.toml", {"max-context": 16384}, 17_944, "beyond --max-context 16384"),
])
def test_a_prompt_longer_than_the_context_is_refused_by_the_engines_rule(scenario, flags, prompt, refusal):
    path = Path(__file__).resolve().parents[1] / "scenarios" / scenario
    data = tomllib.loads(path.read_text())
    data["engine"]["flags"].update(flags)
    data["workload"]["requests"][-1]["prompt_tokens"] = prompt
    with pytest.raises(InputError, match=re.escape(refusal)):
        load_scenario(path, data=data)
    for request in data["workload"]["requests"]:
        request["prompt_tokens"] = min(request["prompt_tokens"], 4096)  # well inside: loads
    assert load_scenario(path, data=data).workload.requests[-1].prompt_tokens == 4096


def test_an_input_error_raised_inside_a_simpy_process_keeps_its_line():
    # SimPy re-raises a process's exception as type(exc)(*exc.args): the one-line message must survive that
    from sim.errors import InputError

    error = InputError("run.toml", "engine.flags.x", 3, "must be even")
    assert str(type(error)(*error.args)) == str(error) == "run.toml: engine.flags.x = 3: must be even"


def _number_keys(data: dict) -> list[tuple]:
    """The key path of every number (not a boolean) in a scenario's TOML data."""
    def at(keys):
        node = data
        for key in keys:
            node = node[key]
        return node

    return [keys for keys in _paths(data) if isinstance(at(keys), (int, float)) and not isinstance(at(keys), bool)]


SCENARIO_NUMBERS = [(path, keys) for path in SCENARIOS for keys in _number_keys(tomllib.loads(path.read_text()))]


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(SCENARIO_NUMBERS),
       bad=st.sampled_from([float("nan"), float("inf"), float("-inf"), -1, -0.5, 1e30, 2**63, 2**70, -2**70]))
def test_fuzz_every_number_of_every_scenario_refuses_what_no_setting_has(case, bad):
    """Issue 34: every number of every shipped scenario (engine flags, the workload, the trace's seed), set to a
    value no setting has (non-finite, negative, huge), ends in one InputError naming its key: a max-context of
    2**70 and a think time of 1e30 s were taken."""
    path, keys = case
    data = tomllib.loads(path.read_text())
    node = data
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = bad
    with pytest.raises(InputError) as info:
        load_scenario(path, data)
    message = str(info.value)
    dotted = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in keys).lstrip(".")
    assert "\n" not in message and dotted in message, (dotted, message)


@pytest.mark.parametrize("case", ["L10", "S4"])
def test_a_validation_case_given_as_a_scenario_says_what_runs_it(case):
    """A case file nests its scenario one level down: read as a scenario it used to fail on `hardware = (missing)`,
    which names a key the file has."""
    path = ROOT / "scenarios" / "validation" / f"{case}.toml"
    with pytest.raises(InputError) as refused:
        load_scenario(path)
    assert refused.value.field == "id" and refused.value.value == case
    assert f"expertsim validate --case {case}" in refused.value.why
