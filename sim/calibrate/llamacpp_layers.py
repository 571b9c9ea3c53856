"""llama.cpp's fixed costs of a decode layer on a GPU box, measured with a CUDA build's own llama-bench: what a layer
costs when its weights are too small to matter (records llamacpp-gpu-node-graphs, llamacpp-gpu-node-launch and
llamacpp-cpu-moe-split; sim/engines/llamacpp/graph.py).

    python -m sim.calibrate.llamacpp_layers --llama-cpp ~/llama.cpp --bin ~/llama.cpp/build/bin --work /tmp/layers

Three synthetic qwen3moe models that differ only in their layer count (8, 24, 48) are written with weights small
enough that reading them takes a few microseconds a layer on any GPU (hidden 512, 4 query heads and one K/V head of
128, 128 experts of width 64, 8 used; ggml_kernels.write_model). Decode is timed (llama-bench -ngl 99 -p 0 -n 64, the
fastest of 5 runs) with every layer's experts on the GPU and on the CPU (-ncmoe = the layer count), with CUDA graphs
(the build's default) and without (GGML_CUDA_DISABLE_GRAPHS=1), and on the CPU at several thread counts. The slope of
the time over the layer count is what one layer costs; the intercept (embedding, output layer, the token's own
calls) drops out. The scheduler's dump (GGML_SCHED_DEBUG=2, llama-bench -v) of the smallest and largest model gives
the graph nodes a layer adds on each backend: the per-layer times divided by those counts are the per-node figures.
Timing and counting are the build's; this module writes, runs and fits a line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from sim.calibrate.ggml_kernels import Shape, fastest_token_s, write_model
from sim.model.quant import tensor_bytes

THIN = Shape(hidden=512, heads=4, kv_heads=1, experts=128, top_k=8, expert_width=64)
LAYER_COUNTS = (8, 24, 48)
CPU_THREADS = (1, 4, 16)
GRAPHS_OFF = {"GGML_CUDA_DISABLE_GRAPHS": "1"}  # ggml-cuda.cu: the variable turns CUDA graphs off
NODE_LINE = re.compile(r"^node #\s*\d+ \(")
SPLIT_LINE = re.compile(r"^## SPLIT #(\d+): (\S+)")


def _bench_args(bench: Path, model: Path, cpu_moe_layers: int, gpu_layers: int, tokens: int) -> list[str]:
    return [str(bench), "-m", str(model), "-ngl", str(gpu_layers), "-ncmoe", str(cpu_moe_layers), "-p", "0", "-n",
            str(tokens), "-fa", "0"]


def decode_seconds(bench: Path, model: Path, cpu_moe_layers: int, threads: int, env: dict | None = None,
                   gpu_layers: int = 99) -> float:
    """Seconds per decoded token: the fastest of llama-bench's 5 runs of 64 tokens."""
    return fastest_token_s(_bench_args(bench, model, cpu_moe_layers, gpu_layers, 64) + ["-r", "5", "-t", str(threads)],
                           env)


def split_nodes(dump: str) -> dict[str, int]:
    """Graph nodes per backend in the scheduler's last printed assignment (GGML_SCHED_DEBUG=2): the text from the
    last '## SPLIT #0' on; a node line belongs to the split above it."""
    last = dump.rfind("## SPLIT #0:")
    counts: dict[str, int] = {}
    backend = None
    for line in dump[last:].splitlines():
        split = SPLIT_LINE.match(line)
        if split:
            backend = split.group(2)
        elif backend and NODE_LINE.match(line):
            counts[backend] = counts.get(backend, 0) + 1
    return counts


def scheduler_dump(bench: Path, model: Path, cpu_moe_layers: int, gpu_layers: int = 99) -> str:
    """llama-bench -v's output of one token with the scheduler's assignments printed (GGML_SCHED_DEBUG=2)."""
    run = subprocess.run(_bench_args(bench, model, cpu_moe_layers, gpu_layers, 1) + ["-r", "1", "-v"],
                         capture_output=True, text=True, env={**os.environ, "GGML_SCHED_DEBUG": "2"})
    return run.stdout + run.stderr


def slope(layers, seconds) -> float:
    """Seconds a layer: the slope of the least-squares line through the points (its intercept, the token's work
    outside the layers, is not a figure of the model)."""
    return float(np.polyfit(np.asarray(layers, float), np.asarray(seconds, float), 1)[0])


def per_layer_nodes(dumps: dict[int, dict[str, int]]) -> dict[str, float]:
    """Nodes one layer adds on each backend: the difference of the largest and the smallest model's counts."""
    small, large = min(dumps), max(dumps)
    backends = set(dumps[small]) | set(dumps[large])
    return {b: (dumps[large].get(b, 0) - dumps[small].get(b, 0)) / (large - small) for b in sorted(backends)}


def figures(seconds: dict[str, list[float]], nodes: dict[str, dict[str, float]], switch_us: float | None,
            core_gbps: float | None) -> dict:
    """The per-layer slopes (us) and the figures the engine model reads, from the timings (configuration -> seconds
    per token at LAYER_COUNTS) and the nodes a layer adds per backend ("gpu": every node on the GPU, "cpu_moe": the
    experts' on the CPU). A CPU MoE layer's split cost is what its time leaves once its GPU nodes (at the graphs'
    per-node time), the two GPU<->CPU switches as the simulator prices them on this box (`switch_us`) and its experts'
    Q8_0 kernel time on `t` cores of `core_gbps` GB/s are taken off; without those two, the split is not given."""
    us = {name: slope(LAYER_COUNTS, s) * 1e6 for name, s in seconds.items()}
    gpu_nodes = next(n for backend, n in nodes["gpu"].items() if backend != "CPU")
    cpu_moe_nodes = nodes["cpu_moe"].get("CPU", 0.0)
    graph_node_us = us["gpu"] / gpu_nodes
    expert_bytes = THIN.top_k * tensor_bytes("Q8_0", 3 * THIN.hidden * THIN.expert_width)
    out = {"us_per_layer": us, "gpu_nodes_per_layer": gpu_nodes, "cpu_moe_nodes_per_layer": cpu_moe_nodes,
           "gpu_node_us_graphs": graph_node_us, "gpu_node_us_launch": us["gpu_no_graphs"] / gpu_nodes}
    if switch_us is None or core_gbps is None:
        return out
    split_us = {}
    for name in us:
        if name.startswith("cpu_moe_t"):
            threads = int(name.removeprefix("cpu_moe_t"))
            split_us[threads] = (us[name] - (gpu_nodes - cpu_moe_nodes) * graph_node_us - switch_us
                                 - expert_bytes / (threads * core_gbps * 1e3))
    return {**out, "cpu_moe_split_us": split_us, "cpu_moe_split_us_mean": float(np.mean(list(split_us.values()))),
            "switch_us": switch_us, "core_gbps": core_gbps}


def measure(llama_cpp: Path, bin_dir: Path, work: Path, threads=CPU_THREADS, switch_us: float | None = None,
            core_gbps: float | None = None) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    vocab = llama_cpp / "models" / "ggml-vocab-qwen2.gguf"
    bench = bin_dir / "llama-bench"
    models = {}
    for n in LAYER_COUNTS:
        models[n] = work / f"thin{n}.gguf"
        if not models[n].exists():
            write_model(models[n], n, vocab, THIN)
    top = max(threads)
    configs = {"gpu": (0, top, None, 99), "gpu_no_graphs": (0, top, GRAPHS_OFF, 99),
               **{f"cpu_moe_t{t}": ("all", t, None, 99) for t in threads},
               "cpu_moe_no_graphs": ("all", top, GRAPHS_OFF, 99),
               **{f"cpu_only_t{t}": (0, t, None, 0) for t in threads}}
    seconds = {}
    for name, (moe, t, env, ngl) in configs.items():
        seconds[name] = [decode_seconds(bench, models[n], n if moe == "all" else 0, t, env, ngl)
                         for n in LAYER_COUNTS]
        print(f"{name}: " + " / ".join(f"{s * 1e3:.3f}" for s in seconds[name]) + " ms a token", file=sys.stderr)
    ends = (min(LAYER_COUNTS), max(LAYER_COUNTS))
    nodes_gpu = per_layer_nodes({n: split_nodes(scheduler_dump(bench, models[n], 0)) for n in ends})
    nodes_cpu_moe = per_layer_nodes({n: split_nodes(scheduler_dump(bench, models[n], n)) for n in ends})
    nodes_cpu_only = per_layer_nodes({n: split_nodes(scheduler_dump(bench, models[n], 0, 0)) for n in ends})
    nodes = {"gpu": nodes_gpu, "cpu_moe": nodes_cpu_moe, "cpu_only": nodes_cpu_only}
    return {"seconds_per_token": seconds, "layers": LAYER_COUNTS, "shape": vars(THIN), "nodes_per_layer": nodes,
            **figures(seconds, nodes, switch_us, core_gbps)}


def _saved_results(parser: argparse.ArgumentParser, path: Path) -> list[dict]:
    """The results in a saved file: the command's output, or a calibration file of its runs ({"runs": [{"result":
    ...}]}); anything else is refused in one line."""
    try:
        saved = json.loads(path.read_text())
        results = [run["result"] for run in saved["runs"]] if "runs" in saved else [saved]
        if all("seconds_per_token" in r and "nodes_per_layer" in r for r in results):
            return results
    except (OSError, ValueError, TypeError, KeyError) as exc:
        parser.error(f"--refit {path}: {exc}")
    parser.error(f"--refit {path}: seconds_per_token and nodes_per_layer absent: not a result of this command")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, help="a llama.cpp source tree (its vocab model)")
    parser.add_argument("--bin", type=Path, help="a CUDA build's bin/ (llama-bench)")
    parser.add_argument("--work", type=Path, help="where the models are written (~1.7 GB)")
    parser.add_argument("--threads", type=int, nargs="+", default=list(CPU_THREADS),
                        help="-t values of the CPU MoE and CPU-only runs")
    parser.add_argument("--switch-us", type=float,
                        help="the simulator's two GPU<->CPU switches of a decode layer on this box (us); with "
                             "--core-gbps, the CPU MoE layer's split is fitted")
    parser.add_argument("--core-gbps", type=float,
                        help="this box's Q8_0 kernel rate on one core (GB/s; python -m sim.calibrate.ggml_kernels)")
    parser.add_argument("--refit", type=Path,
                        help="a saved result of this command: its figures again, from its times and node counts")
    args = parser.parse_args(argv)
    if args.refit:
        out = [figures(r["seconds_per_token"], r["nodes_per_layer"], args.switch_us, args.core_gbps)
               for r in _saved_results(parser, args.refit)]
        out = out[0] if len(out) == 1 else out
    elif args.llama_cpp and args.bin and args.work:
        out = measure(args.llama_cpp, args.bin, args.work, tuple(args.threads), args.switch_us, args.core_gbps)
    else:
        parser.error("--llama-cpp, --bin and --work, or --refit")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
