"""Importers (sim.trace.importers): known answers on hand-written inputs, the real Mixtral vLLM traces
(read from ../shared/data, skipped when absent), bad input (always one InputError line) and fuzzing."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.errors import InputError
from sim.trace import import_readers
from sim.trace.format import MISSING, PHASE_DECODE, PHASE_PREFILL, read_trace, write_trace
from sim.trace.importers import FORMATS, import_trace

FIXTURES = Path(__file__).resolve().parents[1] / "traces" / "fixtures"
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mixtral-routing"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="real traces not present (../shared/data absent)")
M = int(MISSING)


def cells(trace):
    """experts as nested lists with None for missing cells (easy to compare with a hand-written answer)."""
    return [[None if c[0] == M else c.tolist() for c in row] for row in trace.experts.astype(int)]


def adjacent_reuse(trace, phase=PHASE_DECODE):
    """Share of a token's k experts that the previous token (same request and phase) used in the same layer,
    over the (token, layer) pairs where both cells are recorded."""
    e, recorded = trace.experts, ~trace.missing_cells()
    same = (trace.request[1:] == trace.request[:-1]) & (trace.phase[1:] == phase) & (trace.phase[:-1] == phase)
    pairs = recorded[1:] & recorded[:-1] & same[:, None]
    hits = (e[1:, :, :, None] == e[:-1, :, None, :]).any(axis=3).sum(axis=2)
    return hits[pairs].sum() / (pairs.sum() * trace.header.top_k)


# -------------------------------------------------------------------------------- known answers


def test_vllm_raw_fixture():
    path = FIXTURES / "vllm_raw_3layer.jsonl"
    t = import_trace(path)
    assert t.header.n_layers == 3 and t.header.top_k == 2 and t.header.n_experts == 4
    assert t.header.model == "unknown (vllm-jsonl)"
    assert t.header.source == "vllm_raw_3layer.jsonl"
    assert t.header.source_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert t.header.generator == {"importer": "vllm-jsonl", "variant": "prefill+decode",
                                  "n_experts": "inferred from max id", "requests": ["toy/7"]}
    assert t.request.tolist() == [0] * 5
    assert t.position.tolist() == [0, 1, 2, 3, 4]
    assert t.phase.tolist() == [PHASE_PREFILL] * 3 + [PHASE_DECODE] * 2
    assert cells(t) == [
        [[1, 2], [3, 0], [2, 0]],
        [[2, 3], None, [2, 1]],
        [[0, 1], [1, 3], [3, 2]],
        [[0, 3], [1, 0], [2, 3]],
        [[3, 1], [0, 2], None],
    ]
    assert t.weights.dtype == np.float32
    assert t.weights[0, 1].tolist() == [0.875, 0.125] and t.weights[4, 0].tolist() == [0.625, 0.375]
    assert t.weights[1, 1].tolist() == [0, 0]
    assert t.n_lookups == 13 * 2


def test_vllm_decode_only_fixture():
    t = import_trace(FIXTURES / "vllm_decode_2req.jsonl")
    assert t.header.generator["variant"] == "decode-only"
    assert t.header.generator["requests"] == ["toy/3", "toy/1"]  # order of first appearance
    assert t.request.tolist() == [0, 0, 1, 1, 1]
    assert t.position.tolist() == [0, 1, 0, 1, 2]
    assert (t.phase == PHASE_DECODE).all()
    assert cells(t) == [
        [[1, 0], [3, 2]],
        [[2, 1], [0, 3]],
        [[0, 2], [1, 2]],
        [None, [3, 0]],
        [[2, 3], [1, 3]],
    ]


GENERIC_CELLS = [
    [[1, 2], [3, 0]],
    [[0, 1], [2, 3]],
    [[3, 2], [1, 0]],
    [[1, 3], [0, 2]],
    [None, [2, 1]],
]


@pytest.mark.parametrize("name", ["generic.csv", "generic.jsonl"])
def test_generic_fixtures(name):
    t = import_trace(FIXTURES / name)
    assert t.header.generator["importer"] == name.split(".")[1]
    assert t.header.model == f"unknown ({name.split('.')[1]})"
    # rows: distinct (request, position, phase) in order of first appearance
    assert t.request.tolist() == [0, 0, 5, 0, 5]
    assert t.position.tolist() == [0, 1, 0, 2, 1]
    assert t.phase.tolist() == [0, 0, 0, 1, 1]
    assert cells(t) == GENERIC_CELLS
    assert t.weights[2, 1].tolist() == [0.625, 0.375]


def test_csv_and_jsonl_agree():
    a, b = import_trace(FIXTURES / "generic.csv"), import_trace(FIXTURES / "generic.jsonl")
    for name in ("request", "position", "phase", "experts", "weights"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("name", ["generic.csv", "generic.jsonl", "vllm_raw_3layer.jsonl"])
def test_a_byte_order_mark_is_read_past(tmp_path, name):
    """Issue 34: a CSV saved with a UTF-8 byte-order mark (Excel's "CSV UTF-8") was refused as "missing column
    'request'". The same cells as without it; the source hash is the file's own."""
    with_mark = tmp_path / name
    with_mark.write_bytes(b"\xef\xbb\xbf" + (FIXTURES / name).read_bytes())
    a, b = import_trace(with_mark), import_trace(FIXTURES / name)
    for field in ("request", "position", "phase", "experts", "weights"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    assert a.header.source_sha256 == hashlib.sha256(with_mark.read_bytes()).hexdigest()


@pytest.mark.parametrize("name, fmt", [("vllm_raw_3layer.jsonl", "vllm-jsonl"), ("generic.jsonl", "jsonl"),
                                       ("generic.csv", "csv")])
def test_explicit_format_matches_auto(name, fmt):
    assert import_trace(FIXTURES / name, fmt).sha256() == import_trace(FIXTURES / name).sha256()


def test_fast_and_slow_readers_agree(monkeypatch, tmp_path):
    """The Arrow reader and the line-by-line fallback give the same trace."""
    fast = {n: import_trace(FIXTURES / n) for n in ("vllm_raw_3layer.jsonl", "vllm_decode_2req.jsonl",
                                                   "generic.csv", "generic.jsonl")}

    def refuse(*args):
        raise import_readers._Slow

    def fail(*args):
        raise AssertionError("a clean file must take the Arrow reader")

    with monkeypatch.context() as m:
        m.setattr(import_readers, "_read_jsonl_slow", fail)
        m.setattr(import_readers, "_read_csv_slow", fail)
        for name in ("vllm_raw_3layer.jsonl", "vllm_decode_2req.jsonl", "generic.csv"):
            import_trace(FIXTURES / name)
        crlf = (FIXTURES / "generic.csv").read_bytes().replace(b"\n", b"\r\n\r\n")
        path = tmp_path / "crlf.csv"
        path.write_bytes(crlf)
        assert import_trace(path).sha256() != fast["generic.csv"].sha256()  # same cells, other source hash
        assert cells(import_trace(path)) == GENERIC_CELLS

    monkeypatch.setattr(import_readers, "_read_jsonl_fast", refuse)
    monkeypatch.setattr(import_readers, "_read_csv_fast", refuse)
    for name, trace in fast.items():
        assert import_trace(FIXTURES / name).sha256() == trace.sha256(), name


def test_n_experts_and_top_k_given():
    t = import_trace(FIXTURES / "vllm_raw_3layer.jsonl", n_experts=8, top_k=2)
    assert t.header.n_experts == 8 and "n_experts" not in t.header.generator


def test_model_preset(monkeypatch):
    class Preset:
        n_experts, n_routed_layers, layers, top_k = 8, 3, (0, 1, 2), 2  # the fixture's shape

    def get_preset(name):
        if name != "toy-moe":
            raise KeyError(name)
        return Preset()

    monkeypatch.setitem(sys.modules, "sim.model.presets", types.SimpleNamespace(get_preset=get_preset))
    t = import_trace(FIXTURES / "vllm_raw_3layer.jsonl", model="toy-moe")
    assert t.header.model == "toy-moe" and t.header.n_experts == 8
    assert t.header.generator["n_experts"] == "from model preset toy-moe"
    with pytest.raises(InputError, match="model = nope"):
        import_trace(FIXTURES / "vllm_raw_3layer.jsonl", model="nope")
    with pytest.raises(InputError, match="n_experts"):
        import_trace(FIXTURES / "vllm_raw_3layer.jsonl", model="toy-moe", n_experts=4)
    Preset.n_experts = 3  # the fixture uses expert 3
    with pytest.raises(InputError, match=r"vllm_raw_3layer.jsonl:2: experts = \[2, 3\]: .*n_experts=3"):
        import_trace(FIXTURES / "vllm_raw_3layer.jsonl", model="toy-moe")


def test_a_trace_of_another_shape_than_its_model_is_refused():
    # the fixture has 3 layers of top-2 routing; Mixtral 8x7B has 32 layers, OLMoE routes to 8 of 64 experts
    with pytest.raises(InputError, match="n_layers = 3: model mixtral-8x7b has 32 routed layers"):
        import_trace(FIXTURES / "vllm_raw_3layer.jsonl", model="mixtral-8x7b")


def test_round_trip_and_stable_hash(tmp_path):
    for name in ("vllm_raw_3layer.jsonl", "generic.csv"):
        t = import_trace(FIXTURES / name)
        assert import_trace(FIXTURES / name).sha256() == t.sha256()
        write_trace(t, tmp_path / "t.parquet")
        back = read_trace(tmp_path / "t.parquet")
        assert back.header == t.header and back.sha256() == t.sha256()
        assert np.array_equal(back.experts, t.experts) and np.array_equal(back.weights, t.weights)


def test_raw_phase_split_rules(tmp_path):
    """Per layer: prefill until the first token_pos 0 after the layer's first record; P = max prefill
    position + 1 over layers; decode step d of a layer is its d-th decode record."""
    recs = []
    for layer in (0, 1):
        recs += [dict(layer=layer, token_pos=p, experts=[p % 4, (p + 1) % 4]) for p in range(4)]
    recs.append(dict(layer=1, token_pos=5, experts=[0, 1]))  # a prefill tail only layer 1 has
    for step in range(3):
        for layer in (0, 1):
            if (step, layer) != (1, 0):
                recs.append(dict(layer=layer, token_pos=0, experts=[step, 3]))
    path = tmp_path / "raw.jsonl"
    path.write_text("".join(json.dumps({"dataset": "d", "problem_id": "x", **r}) + "\n" for r in recs))
    t = import_trace(path)
    assert t.phase.tolist() == [0] * 6 + [1] * 3
    assert t.position.tolist() == list(range(9))
    assert cells(t)[4] == [None, None] and cells(t)[5] == [None, [0, 1]]
    # layer 0 has only 2 decode records: they fill decode steps 0 and 1 (the file cannot say which was lost)
    assert [c[0] for c in cells(t)[6:]] == [[0, 3], [2, 3], None]
    assert [c[1] for c in cells(t)[6:]] == [[0, 3], [1, 3], [2, 3]]


def test_raw_one_token_prompt(tmp_path):
    recs = [dict(layer=0, token_pos=0, experts=[1, 2])] * 3  # prompt of 1 token, then 2 decode steps
    path = tmp_path / "raw1.jsonl"
    path.write_text("".join(json.dumps({"dataset": "d", "problem_id": 1, **r}) + "\n" for r in recs))
    t = import_trace(path)
    assert t.phase.tolist() == [0, 1, 1] and t.position.tolist() == [0, 1, 2]


def test_blank_lines_and_crlf(tmp_path):
    text = (FIXTURES / "vllm_raw_3layer.jsonl").read_text()
    path = tmp_path / "blank.jsonl"
    path.write_bytes(("\n" + text.replace("\n", "\r\n\r\n  \n")).encode())
    assert import_trace(path).sha256() != ""
    assert cells(import_trace(path)) == cells(import_trace(FIXTURES / "vllm_raw_3layer.jsonl"))
    bad = ("\n\n" + text.replace('"token_pos": 2, "experts": [0, 1]', '"token_pos": 2, "experts": [0, 9, 1]'))
    path.write_text(bad.replace("\n", "\n\n"))
    # line numbers count the blank lines: the bad record is file line 3 -> 2 + 2*3 + 1 = 9
    with pytest.raises(InputError, match=r"blank.jsonl:9: experts"):
        import_trace(path)


# ------------------------------------------------------------------------------------ real data


@pytest.fixture(scope="module")
def real():
    return {name: import_trace(DATA / f"{name}.jsonl") for name in ("routing_raw", "humaneval_2_routing",
                                                                     "gsm8k_2_routing")}


@needs_data
def test_real_raw_file(real):
    t = real["routing_raw"]
    assert t.experts.shape == (135 + 83, 32, 2)
    assert (t.phase == PHASE_PREFILL).sum() == 135 and (t.phase == PHASE_DECODE).sum() == 83
    assert t.position.tolist() == list(range(218)) and (t.request == 0).all()
    recorded = int((~t.missing_cells()).sum())
    assert recorded == 6777 and t.missing_cells().size == 6976
    assert round(1 - recorded / 6976, 3) == 0.029
    assert (t.header.n_experts, t.header.top_k, t.header.n_layers) == (8, 2, 32)
    assert t.header.generator["requests"] == ["humaneval/0"]
    assert t.weights is not None and np.isfinite(t.weights).all()
    # published figures (routing-traces.md): prefill 0.390, decode 0.359
    assert abs(adjacent_reuse(t, PHASE_PREFILL) - 0.390) < 0.0015
    assert abs(adjacent_reuse(t, PHASE_DECODE) - 0.359) < 0.0015


@needs_data
@pytest.mark.parametrize("name, recorded, total, tokens, reuse", [
    ("humaneval_2_routing", 10_779, 10_816, [83, 255], 0.399),
    ("gsm8k_2_routing", 7_889, 7_904, [168, 79], 0.344),
])
def test_real_decode_files(real, name, recorded, total, tokens, reuse):
    t = real[name]
    assert (t.phase == PHASE_DECODE).all()
    assert np.bincount(t.request).tolist() == tokens
    assert int((~t.missing_cells()).sum()) == recorded and t.missing_cells().size == total
    for r, n in enumerate(tokens):
        assert t.position[t.request == r].tolist() == list(range(n))
    assert abs(adjacent_reuse(t) - reuse) < 0.001


@needs_data
def test_real_files_round_trip_and_hash(real, tmp_path, monkeypatch):
    for name, t in real.items():
        data = (DATA / f"{name}.jsonl").read_bytes()
        assert t.header.source_sha256 == hashlib.sha256(data).hexdigest()
        write_trace(t, tmp_path / f"{name}.parquet")
        back = read_trace(tmp_path / f"{name}.parquet")
        assert back.header == t.header and back.sha256() == t.sha256()
        for field in ("request", "position", "phase", "experts", "weights"):
            assert np.array_equal(getattr(back, field), getattr(t, field))

    def no_slow_path(*args):
        raise AssertionError("the real files must take the Arrow reader")

    monkeypatch.setattr(import_readers, "_read_jsonl_slow", no_slow_path)
    assert import_trace(DATA / "routing_raw.jsonl", "vllm-jsonl").sha256() == real["routing_raw"].sha256()


@needs_data
def test_real_raw_decode_matches_decode_only_file(real):
    """The raw file's decode part and humaneval_2's problem 0 are the same generation (layer 0, first steps
    before any dropped record)."""
    raw, dec = real["routing_raw"], real["humaneval_2_routing"]
    a = raw.experts[raw.phase == PHASE_DECODE][:20, 0]
    b = dec.experts[dec.request == 0][:20, 0]
    assert np.array_equal(a, b)


# ------------------------------------------------------------------------------------- bad input

V = '{"dataset": "d", "problem_id": 0, "layer": %s, "token_idx": %s, "experts": %s, "gating_probs": [0.5, 0.5]}'
R = '{"dataset": "d", "problem_id": 0, "layer": %s, "token_pos": %s, "experts": %s}'
G = '{"request": %s, "position": %s, "phase": %s, "layer": %s, "experts": %s}'
CSV_HEAD = "request,position,phase,layer,e0,e1\n"


def vlines(*rows):
    return "".join(V % r + "\n" for r in rows)


GOOD_V = [(0, 0, "[1, 2]"), (0, 1, "[2, 3]"), (1, 0, "[0, 1]"), (1, 1, "[3, 1]")]


def v_with(i, row=None, text=None):
    rows = [V % r for r in GOOD_V]
    rows[i] = text if text is not None else V % row
    return "\n".join(rows) + "\n"


BAD = [
    # (id, fmt, content, kwargs, expected substrings)
    ("malformed", "auto", v_with(1, text='{"dataset": "d", "problem_id": 0,, "layer": 0}'), {}, [":2: json", "malformed"]),
    ("truncated", "auto", vlines(*GOOD_V)[:-30], {}, [":4: json"]),
    ("not-object", "auto", v_with(2, text="[1, 2]"), {}, [":3: json", "object"]),
    ("two-objects", "auto", v_with(2, text=V % GOOD_V[2] + " " + V % GOOD_V[3]), {}, [":3: json"]),
    ("duplicate-key", "auto", v_with(1, text=(V % GOOD_V[1])[:-1] + ', "layer": 3}'), {}, [":2: json", "duplicate"]),
    ("nan", "auto", v_with(1, text=(V % GOOD_V[1]).replace("0.5]", "NaN]")), {}, [":2: gating_probs", "finite"]),
    ("bad-utf8", "auto", None, {}, [":3: json"]),
    ("missing-layer", "auto", v_with(2, text=(V % GOOD_V[2]).replace('"layer": 1, ', "")), {}, [":3: layer", "missing"]),
    ("null-layer", "auto", v_with(2, text=(V % GOOD_V[2]).replace('"layer": 1', '"layer": null')), {}, [":3: layer"]),
    ("missing-experts", "auto", v_with(3, text=(V % GOOD_V[3]).replace('"experts": [3, 1], ', "")), {}, [":4: experts", "missing"]),
    ("missing-dataset", "auto", v_with(1, text=(V % GOOD_V[1]).replace('"dataset": "d", ', "")), {}, [":2: dataset"]),
    ("missing-token", "vllm-jsonl", v_with(0, text=(V % GOOD_V[0]).replace('"token_idx": 0', '"x": 0')), {}, [":1: token_pos", "missing"]),
    ("mixed-kinds", "auto", v_with(2, text=R % (1, 0, "[0, 1]")), {}, [":3: token_pos", "mixes"]),
    ("float-id", "auto", v_with(1, (0, 1, "[2, 1.5]")), {}, [":2: experts", "integer"]),
    ("string-id", "auto", v_with(1, (0, 1, '[2, "3"]')), {}, [":2: experts", "integer"]),
    ("bool-id", "auto", v_with(1, (0, 1, "[2, true]")), {}, [":2: experts", "integer"]),
    ("null-id", "auto", v_with(1, (0, 1, "[2, null]")), {}, [":2: experts"]),
    ("id-not-list", "auto", v_with(1, (0, 1, "3")), {}, [":2: experts", "list"]),
    ("id-too-big", "auto", v_with(3, (1, 1, "[8, 1]")), {"n_experts": 8}, [":4: experts = [8, 1]", "n_experts=8"]),
    ("id-huge", "auto", v_with(3, (1, 1, "[70000, 1]")), {}, [":4: experts", "65534"]),
    ("id-overflow", "auto", v_with(3, (1, 1, "[1, 99999999999999999999999]")), {}, [":4: experts", "range"]),
    ("id-negative", "auto", v_with(2, (1, 0, "[-1, 2]")), {}, [":3: experts", "negative"]),
    ("id-repeated", "auto", v_with(2, (1, 0, "[2, 2]")), {}, [":3: experts", "distinct"]),
    ("wrong-width", "auto", v_with(3, (1, 1, "[1, 2, 3]")), {}, [":4: experts = [1, 2, 3]", "expected 2"]),
    ("empty-list", "auto", vlines((0, 0, "[]")), {}, [":1: experts"]),
    ("top-k-given", "auto", vlines(*GOOD_V), {"top_k": 3}, [":1: experts", "top_k=3"]),
    ("weights-width", "auto", v_with(1, text=(V % GOOD_V[1]).replace("[0.5, 0.5]", "[1.0]")), {}, [":2: gating_probs"]),
    ("weights-missing", "auto", v_with(3, text=(V % GOOD_V[3]).replace(', "gating_probs": [0.5, 0.5]', "")), {}, [":4: gating_probs"]),
    ("weights-string", "auto", v_with(1, text=(V % GOOD_V[1]).replace("[0.5, 0.5]", '["a", 1]')), {}, [":2: gating_probs"]),
    ("float-problem", "auto", v_with(1, text=(V % GOOD_V[1]).replace('"problem_id": 0', '"problem_id": 0.5')), {}, [":2: problem_id"]),
    ("duplicate-cell", "auto", v_with(3, (1, 0, "[3, 1]")), {}, [":4: token_idx", "duplicated", "first at line 3"]),
    ("negative-layer", "auto", v_with(1, (-1, 1, "[2, 3]")), {}, [":2: layer", "0.."]),
    ("huge-token", "auto", v_with(1, (0, 10**9, "[2, 3]")), {}, [":2: token_idx", "corrupt"]),
    ("huge-layer", "auto", v_with(1, (10**7, 1, "[2, 3]")), {}, [":2: layer", "never recorded"]),
    # issue 34: a CSV with layer=100000 was taken as a trace of 100,001 layers, all but two empty
    ("layer-gap", "auto", v_with(1, (3, 1, "[2, 3]")), {}, [":2: layer = 3", "never recorded (2)"]),
    ("float-layer", "auto", v_with(1, ("1.0", 1, "[2, 3]")), {}, [":2: layer", "integer"]),
    ("raw-duplicate", "auto", R % (0, 0, "[1, 2]") + "\n" + R % (0, 1, "[1, 2]") + "\n" + R % (0, 1, "[2, 3]") + "\n",
     {}, [":3: token_pos", "duplicated", "first at line 2"]),
    ("raw-decode-pos", "auto", "\n".join([R % (0, 0, "[1, 2]"), R % (0, 1, "[1, 2]"), R % (0, 0, "[1, 2]"),
                                          R % (0, 3, "[1, 2]")]) + "\n", {}, [":4: token_pos", "decode"]),
    ("raw-huge-pos", "auto", R % (0, 0, "[1, 2]") + "\n" + R % (0, 2**31 - 5, "[1, 2]") + "\n", {}, [":2: token_pos"]),
    # generic jsonl
    ("phase-unknown", "auto", G % (0, 0, '"prefill"', 0, "[0, 1]") + "\n" + G % (0, 1, '"warmup"', 0, "[0, 1]") + "\n",
     {}, [":2: phase", "unknown phase"]),
    ("phase-2", "jsonl", G % (0, 0, 2, 0, "[0, 1]") + "\n", {}, [":1: phase"]),
    ("phase-float", "jsonl", G % (0, 0, 1.0, 0, "[0, 1]") + "\n", {}, [":1: phase"]),
    ("position-negative", "auto", G % (0, -3, 0, 0, "[0, 1]") + "\n", {}, [":1: position"]),
    ("request-string", "auto", G % ('"a"', 0, 0, 0, "[0, 1]") + "\n", {}, [":1: request", "integer"]),
    ("request-huge", "auto", G % (2**40, 0, 0, 0, "[0, 1]") + "\n", {}, [":1: request"]),
    ("generic-duplicate", "auto", G % (0, 0, 0, 0, "[0, 1]") + "\n" + G % (0, 0, '"prefill"', 0, "[2, 1]") + "\n",
     {}, [":2: layer", "duplicated", "first at line 1"]),
    ("generic-missing-phase", "jsonl", '{"request": 0, "position": 0, "layer": 0, "experts": [1, 2]}\n', {}, [":1: phase"]),
    ("generic-weights", "jsonl", '{"request": 0, "position": 0, "phase": 0, "layer": 0, "experts": [1, 2], '
     '"weights": [0.5]}\n', {}, [":1: weights"]),
    # csv
    ("csv-no-layer", "csv", "request,position,phase,e0,e1\n0,0,0,1,2\n", {}, [":1: header", "'layer'"]),
    ("csv-e-gap", "csv", "request,position,phase,layer,e0,e2\n0,0,0,0,1,2\n", {}, [":1: header", "e0..e"]),
    ("csv-w-count", "csv", "request,position,phase,layer,e0,e1,w0\n0,0,0,0,1,2,1\n", {}, [":1: header", "w0..w1"]),
    ("csv-dup-col", "csv", "request,position,phase,layer,e0,e1,e1\n0,0,0,0,1,2,2\n", {}, [":1: header", "duplicated"]),
    ("csv-bad-id", "csv", CSV_HEAD + "0,0,0,0,1,2\n0,1,0,0,1,x\n", {}, [":3: e1", "integer"]),
    ("csv-float-id", "csv", CSV_HEAD + "0,0,0,0,1,2.0\n", {}, [":2: e1", "integer"]),
    ("csv-empty-cell", "csv", CSV_HEAD + "0,0,0,0,1,2\n0,1,0,0,,2\n", {}, [":3: e0", "empty"]),
    ("csv-fields", "csv", CSV_HEAD + "0,0,0,0,1,2\n0,1,0,0,1,2\n0,2,0,0,1\n", {}, [":4: fields"]),
    ("csv-extra-field", "csv", CSV_HEAD + "0,0,0,0,1,2,7\n", {}, [":2: fields"]),
    ("csv-phase", "csv", CSV_HEAD + "0,0,pre,0,1,2\n", {}, [":2: phase", "unknown phase"]),
    ("csv-position", "csv", CSV_HEAD + "0,1.5,0,0,1,2\n", {}, [":2: position", "integer"]),
    ("csv-big-id", "csv", CSV_HEAD + "0,0,0,0,1,9\n", {"n_experts": 8}, [":2: experts", "n_experts=8"]),
    ("csv-weight", "csv", "request,position,phase,layer,e0,e1,w0,w1\n0,0,0,0,1,2,0.5,abc\n", {}, [":2: w1"]),
    ("csv-weight-nan", "csv", "request,position,phase,layer,e0,e1,w0,w1\n0,0,0,0,1,2,0.5,nan\n", {}, [":2: w1"]),
    ("csv-duplicate", "csv", CSV_HEAD + "0,0,0,0,1,2\n0,0,prefill,0,1,2\n", {}, [":3: layer", "duplicated"]),
    ("csv-header-only", "csv", CSV_HEAD, {}, ["no records"]),
    # issue 34: decode rows before a request's prompt, and one position twice, were taken
    ("csv-decode-before-prefill", "csv", CSV_HEAD + "0,1,decode,0,1,2\n0,0,prefill,0,1,2\n", {},
     ["phase[row 1] = prefill", "decode row before it (row 0)"]),
    ("csv-position-twice", "csv", CSV_HEAD + "0,0,prefill,0,1,2\n0,0,decode,0,1,2\n", {},
     ["position[row 1] = 0", "already has a token at this position (row 0)"]),
    ("csv-blank-line", "csv", CSV_HEAD + "0,0,0,0,1,2\n   \n", {}, [":3: fields"]),
    # files and formats
    ("empty", "auto", "", {}, ["empty file"]),
    ("blank", "jsonl", "\n \n\t\n", {}, ["empty file"]),
    ("unknown-format", "xml", vlines(*GOOD_V), {}, ["format = xml", "unknown format"]),
    ("undetectable", "auto", "hello world\n", {}, ["format", "cannot tell"]),
    ("unknown-keys", "auto", '{"a": 1}\n', {}, [":1: keys", "cannot tell"]),
    ("bad-n-experts", "auto", vlines(*GOOD_V), {"n_experts": 0}, ["n_experts = 0"]),
    ("bad-top-k", "auto", vlines(*GOOD_V), {"top_k": 0}, ["top_k = 0"]),
    ("top-k-over-n", "auto", vlines(*GOOD_V), {"n_experts": 4, "top_k": 2}, None),  # valid: sanity row
]


@pytest.mark.parametrize("fmt, content, kwargs, words", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_input(tmp_path, fmt, content, kwargs, words):
    suffix = ".csv" if fmt == "csv" else ".jsonl"
    path = tmp_path / f"in{suffix}"
    if content is None:  # invalid UTF-8 on line 3
        path.write_bytes(vlines(*GOOD_V[:2]).encode() + b'{"dataset": "\xff\xfe"}\n' + vlines(*GOOD_V[3:]).encode())
    else:
        path.write_text(content)
    if words is None:
        import_trace(path, fmt, **kwargs)
        return
    with pytest.raises(InputError) as info:
        import_trace(path, fmt, **kwargs)
    text = str(info.value)
    assert "\n" not in text and text.startswith(str(path))
    for word in words:
        assert word in text, (word, text)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        import_trace(tmp_path / "absent.jsonl")
    with pytest.raises(InputError, match="is a folder, not a trace file"):
        import_trace(tmp_path)


def test_formats_constant():
    assert FORMATS == ("auto", "vllm-jsonl", "csv", "jsonl")


# ---------------------------------------------------------------------------------------- fuzzing


def fuzz(n: int) -> settings:
    """n deterministic cases, so the suite is reproducible and its runtime stable. EXPERTSIM_FUZZ_SCALE=k
    runs k*n random (not derandomized) cases instead, for a longer hunt."""
    scale = int(os.environ.get("EXPERTSIM_FUZZ_SCALE", "1"))
    return settings(max_examples=n * scale, deadline=None, derandomize=scale == 1, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def fuzz_dir():
    with tempfile.TemporaryDirectory() as d:
        yield d


def import_or_input_error(path, fmt="auto", **kwargs):
    """Import; the only acceptable failure is a one-line InputError. A success must be a valid trace."""
    try:
        trace = import_trace(path, fmt, **kwargs)
    except InputError as exc:
        assert "\n" not in str(exc)
        return None
    trace.validate()
    assert trace.n_rows > 0 and (~trace.missing_cells()).any()
    return trace


SOURCES = {name: (FIXTURES / name).read_bytes() for name in
           ("vllm_raw_3layer.jsonl", "vllm_decode_2req.jsonl", "generic.csv", "generic.jsonl")}
TOKENS = st.sampled_from(["0", "1", "7", "-1", "1.5", "1e400", "99999999999999999999", "65535", "null", "true",
                          "NaN", '"x"', '"decode"', "[", "]", "{", "}", ",", ":", '"', "\n", "\r\n", " ", "[]",
                          "[1, 2, 3]", "[0]", '"layer"', '"experts": [1, 1]', '"token_pos": 0', "é",
                          "prefill", "e2", "w0", ",,"]).map(str.encode) | st.sampled_from([b"\xff", b"\xc3", b"\x00"])


@st.composite
def mutated(draw):
    name = draw(st.sampled_from(sorted(SOURCES)))
    data = SOURCES[name]
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["replace", "insert", "delete", "truncate", "dup-line", "swap-lines"]))
        i = draw(st.integers(0, len(data)))
        j = min(len(data), i + draw(st.integers(0, 12)))
        token = draw(TOKENS)
        if op == "replace":
            data = data[:i] + token + data[j:]
        elif op == "insert":
            data = data[:i] + token + data[i:]
        elif op == "delete":
            data = data[:i] + data[j:]
        elif op == "truncate":
            data = data[:i]
        else:
            lines = data.split(b"\n")
            a = draw(st.integers(0, len(lines) - 1))
            b = draw(st.integers(0, len(lines) - 1))
            if op == "dup-line":
                lines.insert(b, lines[a])
            else:
                lines[a], lines[b] = lines[b], lines[a]
            data = b"\n".join(lines)
    return name, data


@fuzz(1200)
@given(mutated(), st.sampled_from(FORMATS), st.sampled_from([{}, {"n_experts": 4}, {"top_k": 2}]))
def test_fuzz_mutated_inputs(fuzz_dir, case, fmt, kwargs):
    name, data = case
    path = os.path.join(fuzz_dir, "m" + Path(name).suffix)
    with open(path, "wb") as f:
        f.write(data)
    import_or_input_error(path, fmt, **kwargs)


ANY_VALUE = st.one_of(st.integers(-3, 9), st.integers(-2**70, 2**70), st.floats(allow_nan=False, allow_infinity=False),
                      st.text(max_size=4), st.none(), st.booleans(), st.lists(st.integers(-2, 9), max_size=3))
ID_LIST = st.one_of(st.lists(st.integers(0, 7), min_size=2, max_size=2, unique=True),
                    st.lists(st.one_of(st.integers(-1, 9), st.floats(0, 9), st.text(max_size=1)), max_size=3))


def maybe(value_strategy):
    """Mostly the valid strategy, sometimes an arbitrary JSON value or an absent key."""
    return st.one_of(value_strategy, value_strategy, value_strategy, ANY_VALUE, st.just(KeyError))


@st.composite
def generic_records(draw):
    n = draw(st.integers(1, 12))
    recs = []
    for _ in range(n):
        rec = {"request": draw(maybe(st.integers(0, 2))), "position": draw(maybe(st.integers(0, 5))),
               "phase": draw(maybe(st.sampled_from(["prefill", "decode", 0, 1]))),
               "layer": draw(maybe(st.integers(0, 3))), "experts": draw(maybe(ID_LIST))}
        if draw(st.booleans()):
            rec["weights"] = draw(maybe(st.lists(st.floats(0, 1), min_size=2, max_size=2)))
        recs.append({k: v for k, v in rec.items() if v is not KeyError})
    return recs


@st.composite
def vllm_records(draw):
    n = draw(st.integers(1, 12))
    pos_key = draw(st.sampled_from(["token_pos", "token_idx"]))
    recs = []
    for _ in range(n):
        rec = {"dataset": draw(maybe(st.sampled_from(["a", "b"]))), "problem_id": draw(maybe(st.integers(0, 1))),
               "layer": draw(maybe(st.integers(0, 3))), pos_key: draw(maybe(st.integers(0, 4))),
               "experts": draw(maybe(ID_LIST)),
               "gating_probs": draw(maybe(st.lists(st.floats(0, 1), min_size=2, max_size=2)))}
        recs.append({k: v for k, v in rec.items() if v is not KeyError})
    return recs


@fuzz(300)
@given(st.one_of(generic_records().map(lambda r: ("jsonl", r)), vllm_records().map(lambda r: ("vllm-jsonl", r))),
       st.booleans())
def test_fuzz_structured_jsonl(fuzz_dir, case, auto):
    fmt, recs = case
    path = os.path.join(fuzz_dir, "s.jsonl")
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
    import_or_input_error(path, "auto" if auto else fmt)


@fuzz(200)
@given(generic_records())
def test_fuzz_structured_csv(fuzz_dir, recs):
    path = os.path.join(fuzz_dir, "s.csv")
    lines = [CSV_HEAD.strip()]
    for r in recs:
        e = r.get("experts")
        e = e if isinstance(e, list) else [e]
        lines.append(",".join("" if v is None or v is KeyError else str(v) for v in
                              [r.get("request"), r.get("position"), r.get("phase"), r.get("layer"), *e]))
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    import_or_input_error(path)


@st.composite
def valid_cells(draw):
    """A valid generic trace as {(request, position, phase): {layer: ids}} plus the record order: each (request,
    position) one token, a request's prompt tokens before its decode steps, every layer id 0..n_layers-1 recorded
    somewhere (the first token records them all; the others any of them)."""
    n_layers, top_k = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    tokens = draw(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6)), min_size=1, max_size=8, unique=True))
    prompt_length = {req: draw(st.integers(0, 7)) for req in range(4)}
    keys = [(req, pos, int(pos >= prompt_length[req])) for req, pos in tokens]
    records = []
    for number, key in enumerate(keys):
        layers = (range(n_layers) if number == 0 else
                  draw(st.lists(st.integers(0, n_layers - 1), min_size=1, max_size=n_layers, unique=True)))
        for layer in layers:
            ids = draw(st.lists(st.integers(0, 9), min_size=top_k, max_size=top_k, unique=True))
            records.append((key, layer, ids))
    records = draw(st.permutations(records))
    return sorted(records, key=lambda record: record[0][2])  # stable: prefill records first, else in drawn order


@fuzz(200)
@given(valid_cells(), st.sampled_from(["jsonl", "csv"]))
def test_generic_import_reconstructs_cells(fuzz_dir, records, fmt):
    """Property: every record lands in its (row, layer) cell; rows follow first appearance; the rest is MISSING."""
    path = os.path.join(fuzz_dir, "v." + fmt)
    k = len(records[0][2])
    with open(path, "w") as f:
        if fmt == "csv":
            f.write("request,position,phase,layer," + ",".join(f"e{i}" for i in range(k)) + "\n")
            for (req, pos, ph), layer, ids in records:
                f.write(f"{req},{pos},{['prefill', 'decode'][ph]},{layer}," + ",".join(map(str, ids)) + "\n")
        else:
            for (req, pos, ph), layer, ids in records:
                f.write(json.dumps({"request": req, "position": pos, "phase": ph, "layer": layer, "experts": ids})
                        + "\n")
    t = import_trace(path, n_experts=10)
    order = list(dict.fromkeys(key for key, _, _ in records))
    assert list(zip(t.request.tolist(), t.position.tolist(), t.phase.tolist())) == order
    assert t.header.n_layers == max(layer for _, layer, _ in records) + 1
    expected = np.full(t.experts.shape, M)
    for key, layer, ids in records:
        expected[order.index(key), layer] = ids
    assert np.array_equal(t.experts, expected)
