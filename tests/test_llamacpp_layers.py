"""sim/calibrate/llamacpp_layers.py (the measurement of llama.cpp's fixed decode-layer costs) and the records the
llama.cpp engine reads from it (sim/engines/llamacpp/graph.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.calibrate import llamacpp_layers as ll
from sim.engines.llamacpp import graph
from sim.engines.records import BY_ID

MEASURED = Path(__file__).resolve().parent.parent / "scenarios/hardware/calibration/llamacpp-layers-h100.json"
# a cut of the scheduler's dump as llama-bench -v prints it with GGML_SCHED_DEBUG=2: a reserve's assignment, then the
# last one, whose CPU split holds two nodes and whose CUDA0 splits three
DUMP = """sched_reserve: graph: nodes = 9, splits = 2
## SPLIT #0: CPU # 0 inputs
node #  0 (  GET_ROWS):                 embd (   2K) [  CPU         ]
## SPLIT #1: CUDA0 # 1 inputs: [embd (   2K)]
node #  1 (  RMS_NORM):               norm-0 (   2K) [CUDA0         ]
something else
## SPLIT #0: CPU # 0 inputs
node #  0 (  GET_ROWS):                 embd (   2K) [  CPU         ]
## SPLIT #1: CUDA0 # 1 inputs: [embd (   2K)]
node #  1 (  RMS_NORM):               norm-0 (   2K) [CUDA0         ]
node #  2 (       MUL):          attn_norm-0 (   2K) [CUDA0         ]
## SPLIT #2: CPU # 2 inputs: [ffn_norm-0 (reshaped) (   2K)]
node # 48 (MUL_MAT_ID):       ffn_moe_gate-0 (   2K) [  CPU         ]
## SPLIT #3: CUDA0 # 1 inputs: [ffn_moe_down-0 (  16K)]
node # 52 (       MUL):   ffn_moe_weighted-0 (  16K) [CUDA0         ]
"""


def test_the_last_assignment_counts_nodes_per_backend():
    assert ll.split_nodes(DUMP) == {"CPU": 2, "CUDA0": 3}


def test_nodes_a_layer_adds_are_the_difference_of_two_models():
    assert ll.per_layer_nodes({8: {"CPU": 1, "CUDA0": 333}, 48: {"CPU": 1, "CUDA0": 1973}}) == {"CPU": 0.0,
                                                                                                "CUDA0": 41.0}


def test_figures_recover_the_costs_times_were_made_of():
    # times of 8, 24 and 48 layers made from chosen costs (us): 1.1 a GPU node (41 a layer), 2.3 launched, a split
    # of 30 plus 20 of switches at every thread count, the thin experts' 8 x 3 x 512 x 64 Q8_0 weights (835,584 B)
    # at 7.5 GB/s a core; 150 us of the token outside the layers
    node, launch, split, switches, core = 1.1, 2.3, 30.0, 20.0, 7.5
    expert_bytes = 8 * 3 * 512 * 64 // 32 * 34
    per_layer = {"gpu": 41 * node, "gpu_no_graphs": 41 * launch}
    for t in (1, 4, 16):
        per_layer[f"cpu_moe_t{t}"] = 37 * node + switches + split + expert_bytes / (t * core * 1e3)
    seconds = {k: [(150 + n * v) * 1e-6 for n in ll.LAYER_COUNTS] for k, v in per_layer.items()}
    got = ll.figures(seconds, {"gpu": {"CPU": 0, "CUDA0": 41}, "cpu_moe": {"CPU": 4, "CUDA0": 37}}, switches, core)
    assert got["gpu_node_us_graphs"] == pytest.approx(node)
    assert got["gpu_node_us_launch"] == pytest.approx(launch)
    assert got["cpu_moe_split_us"] == pytest.approx({1: split, 4: split, 16: split})


def test_the_records_are_the_committed_measurements():
    """Each record's figure is what the command's fit gives on its committed times (the second run), and its spread
    spans both runs."""
    runs = [r["result"] for r in json.loads(MEASURED.read_text())["runs"]]
    fits = [ll.figures(r["seconds_per_token"], r["nodes_per_layer"], 20.78, 7.49) for r in runs]
    final = fits[-1]
    assert BY_ID["llamacpp-gpu-node-graphs"].value == pytest.approx(final["gpu_node_us_graphs"], abs=5e-4)
    assert BY_ID["llamacpp-gpu-node-launch"].value == pytest.approx(final["gpu_node_us_launch"], abs=5e-4)
    assert BY_ID["llamacpp-cpu-moe-split"].value == pytest.approx(final["cpu_moe_split_us_mean"], abs=0.05)
    for record, key in (("llamacpp-gpu-node-graphs", "gpu_node_us_graphs"),
                        ("llamacpp-gpu-node-launch", "gpu_node_us_launch")):
        low, high = BY_ID[record].spread
        assert low == pytest.approx(min(f[key] for f in fits), abs=5e-4)
        assert high == pytest.approx(max(f[key] for f in fits), abs=5e-4)
    splits = [v for f in fits for v in f["cpu_moe_split_us"].values()]
    assert BY_ID["llamacpp-cpu-moe-split"].spread == pytest.approx((min(splits), max(splits)), abs=0.05)


def test_the_engine_counts_the_nodes_the_dump_counted():
    runs = [r["result"] for r in json.loads(MEASURED.read_text())["runs"]]
    for r in runs:
        gpu = r["nodes_per_layer"]["gpu"]
        cpu_moe = r["nodes_per_layer"]["cpu_moe"]
        assert graph.DECODE_NODES_PER_LAYER == gpu["CUDA0"]
        assert graph.CPU_MOE_NODES == cpu_moe["CPU"] == gpu["CUDA0"] - cpu_moe["CUDA0"]
    assert list(graph.decode_gpu_nodes([False, True])) == [41, 37]


def test_without_the_box_figures_no_split_is_fitted():
    """--switch-us and --core-gbps price the switches and the experts on the measured box: without them the split
    is left out, not computed against made-up figures."""
    saved = json.loads(MEASURED.read_text())["runs"][-1]["result"]
    got = ll.figures(saved["seconds_per_token"], saved["nodes_per_layer"], None, None)
    assert "cpu_moe_split_us" not in got and got["gpu_node_us_graphs"] == pytest.approx(
        BY_ID["llamacpp-gpu-node-graphs"].value, abs=5e-4)


def test_refit_of_the_calibration_file_gives_each_runs_figures(capsys):
    ll.main(["--refit", str(MEASURED), "--switch-us", "20.78", "--core-gbps", "7.49"])
    runs = json.loads(capsys.readouterr().out)
    assert len(runs) == 2
    assert runs[-1]["cpu_moe_split_us_mean"] == pytest.approx(BY_ID["llamacpp-cpu-moe-split"].value, abs=0.05)


def test_refit_of_another_file_is_one_line(tmp_path, capsys):
    other = tmp_path / "other.json"
    other.write_text('{"gbps_per_core": {"Q8_0": 7.49}}')
    with pytest.raises(SystemExit) as info:
        ll.main(["--refit", str(other)])
    assert info.value.code == 2
    assert f"--refit {other}: seconds_per_token and nodes_per_layer absent" in capsys.readouterr().err
