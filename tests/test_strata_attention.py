"""A prompt chunk's attention beyond the fixed figure per token (sim/engines/strata/attention.py): the QSA indexer's
work that grows with the position, and the streamed K/V staged per chunk on the copy engine."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from sim.engines.strata.attention import position_share
from sim.results import link_frame
from sim.scenario import load_scenario
from sim.simulate import run_scenario

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "strata-658-own.toml"


def test_position_share_by_hand():
    # 12 of 48 layers are QSA, each scoring 4 heads x 128 values per block of 4 cells: 32 multiply-adds per cell
    # of position, averaged over the layers; a token's layer costs 134.04 M at the figure's position 21,787
    per_cell = 12 / 48 * 4 * 128 / 4
    assert position_share(21_787, 1) == pytest.approx(0.0, abs=1e-15)
    assert position_share(0, 1) == pytest.approx(per_cell * -21_787 / 134.04e6)
    # a chunk counts at its mean position: 8,192 tokens from 114,688 average 118,783.5
    assert position_share(114_688, 8192) == pytest.approx(per_cell * (118_783.5 - 21_787) / 134.04e6)
    assert position_share(114_688, 8192) == pytest.approx(0.02316, abs=5e-5)


def _run(prompt_tokens: int, chunk: int, kv_resident: int | None):
    data = tomllib.loads(SCENARIO.read_text())
    data["engine"]["flags"].update({"prefill": chunk, "max-context": 65536})
    if kv_resident is not None:
        data["engine"]["flags"]["kv-resident"] = kv_resident
    data["workload"]["requests"] = [{"prompt_tokens": prompt_tokens, "decode_tokens": 2, "measured": True}]
    return run_scenario(load_scenario(SCENARIO, data))


def test_streamed_kv_is_staged_per_qsa_layer_and_chunk_on_the_copy_engine():
    # three 4,096-token chunks, K/V streamed from 16,384 resident cells of a 65,536 context: each of the 12 QSA
    # layers stages the INT8 K/V (1,056 B a cell) of the cells before its chunk: 0, 4,096 and 8,192 of them
    streamed = _run(12_288, 4096, 16_384)
    links = link_frame(streamed.links)
    staged = links[links["kind"] == "prompt K/V stage from host"]
    by_link = staged.groupby("link")["bytes"].sum()
    assert by_link["H2D copy engine (PCIe)"] == 12 * 1056 * (4096 + 8192)  # the bytes cross the link
    assert by_link["GPU compute stream"] == 0 and len(by_link) == 2  # and hold the stream while they do
    resident = _run(12_288, 4096, None)
    assert not (link_frame(resident.links)["kind"] == "prompt K/V stage from host").any()
    assert streamed.summary["prefill_tok_s"] < resident.summary["prefill_tok_s"]
