"""ggml's CPU kernels per core and GGML type, measured with a llama.cpp build's own llama-bench and llama-quantize:
the figures llama.cpp's CPU expert matmuls run at (sim/engines/llamacpp/kernels.py, records llamacpp-ggml-*; with
--ik, an ik_llama.cpp build's: records llamacpp-ik-*).

    python -m sim.calibrate.ggml_kernels --llama-cpp ~/llama.cpp --bin ~/llama.cpp/build/bin --work /tmp/ggml-kernels
    python -m sim.calibrate.ggml_kernels --llama-cpp ~/llama.cpp --bin ~/ik_llama.cpp/build/bin --work /tmp/ik --ik \
        --types IQ3_XXS IQ4_XS Q4_K Q6_K Q5_0 MXFP4

Two synthetic Qwen3-30B-A3B-shaped models are written (8 and 16 layers: hidden 2048, 32 query and 4 K/V heads of 128,
16 experts of width 768, 8 used; every weight Q8_0 blocks of random int8 under one scale; the Qwen2 vocabulary of
llama.cpp's models/ggml-vocab-qwen2.gguf), their experts requantized to each type (llama-quantize --tensor-type), and
decode timed on one thread with every layer on the CPU (llama-bench -p 0 -n 16 -t 1), the two models in turn, each its
fastest of 15 runs. The 8 layers the larger model adds cost the difference of the two times, which removes the token
embedding's and the output layer's share. The Q8_0 pair gives the Q8_0 kernel's rate over those layers' bytes (their
attention and the 8 experts a token reads); another type's pair gives its experts' time once the attention's time at
that Q8_0 rate is taken off. The layers' other work (norms, RoPE, attention over a short context, the router) is
counted as Q8_0 kernel time: the rates are lower bounds.
Writing is `gguf`'s (GGUFWriter); timing is the llama.cpp build's; this module only arranges and divides.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.model.quant import tensor_bytes

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128  # Qwen3-30B-A3B's attention (its config.json)
EXPERTS, TOP_K, EXPERT_WIDTH = 16, 8, 768  # Qwen3-30B-A3B's expert width and top-k; 16 experts keep the file small
LAYER_PAIR = (8, 16)
TYPES = ("Q4_K", "Q6_K", "MXFP4", "IQ4_XS", "IQ3_S", "Q5_0")  # besides Q8_0: the families of the stored presets
ROUNDS = 3  # each pair of models timed in turn this many times
Q8_0_BLOCK = 34  # bytes: an f16 scale and 32 int8 weights (ggml-common.h block_q8_0)


@dataclass(frozen=True)
class Shape:
    """A synthetic qwen3moe model's dimensions (heads of HEAD_DIM)."""

    hidden: int = HIDDEN
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    experts: int = EXPERTS
    top_k: int = TOP_K
    expert_width: int = EXPERT_WIDTH


def attention_weights() -> int:
    """Weights of one layer's attention projections (q, k, v, output)."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    return HIDDEN * q + 2 * HIDDEN * kv + q * HIDDEN


def layer_bytes(expert_type: str) -> tuple[int, int]:
    """Bytes one decode token's kernels read in one layer: (the attention at Q8_0, the TOP_K experts at their type)."""
    # gate and up rows run along the hidden size, down's along the expert width (ik's types store bytes per row)
    gate_up, down = (tensor_bytes(expert_type, HIDDEN * EXPERT_WIDTH, row) for row in (HIDDEN, EXPERT_WIDTH))
    return tensor_bytes("Q8_0", attention_weights()), TOP_K * (2 * gate_up + down)


def rates(seconds: dict[str, tuple[float, float]]) -> dict[str, float]:
    """GB/s of one core per type, from each type's decode seconds per token of the (8, 16)-layer models."""
    extra = LAYER_PAIR[1] - LAYER_PAIR[0]
    per_layer = {t: (s16 - s8) / extra for t, (s8, s16) in seconds.items()}
    attention, experts = layer_bytes("Q8_0")
    q8 = (attention + experts) / per_layer["Q8_0"]
    out = {"Q8_0": q8 / 1e9}
    for t, s in per_layer.items():
        if t != "Q8_0":
            attention, experts = layer_bytes(t)
            out[t] = experts / (s - attention / q8) / 1e9
    return out


def write_model(path: Path, n_layers: int, vocab: Path, shape: Shape = Shape()) -> None:
    """A qwen3moe GGUF of `shape` (by default the module's), every matrix Q8_0 (random int8 blocks under a 0.02 scale),
    the norms ones, the router random F32; the tokenizer's keys copied from `vocab`."""
    import gguf

    hidden, q_width, kv_width = shape.hidden, shape.heads * HEAD_DIM, shape.kv_heads * HEAD_DIM
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_context_length(32768)
    writer.add_embedding_length(hidden)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(6144)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.top_k)
    writer.add_expert_feed_forward_length(shape.expert_width)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    n_vocab = 0
    for field in gguf.GGUFReader(str(vocab)).fields.values():
        if field.name.startswith("tokenizer."):
            kind = field.types[0]
            value = field.contents()
            n_vocab = len(value) if field.name == "tokenizer.ggml.tokens" else n_vocab
            writer.add_key_value(field.name, value, kind,
                                 sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    rng = np.random.default_rng(0)
    pool = np.empty((4096, Q8_0_BLOCK), np.uint8)
    pool[:, :2] = np.full(4096, 0.02, np.float16).view(np.uint8).reshape(4096, 2)
    pool[:, 2:] = rng.integers(-64, 64, (4096, 32), dtype=np.int8).view(np.uint8)
    q8 = gguf.GGMLQuantizationType.Q8_0

    def matrix(*dims):  # numpy order: (..., rows, columns)
        *lead, columns = dims
        blocks = int(np.prod(lead)) * (columns // 32)
        return np.resize(pool, (blocks, Q8_0_BLOCK)).reshape(*lead, columns // 32 * Q8_0_BLOCK)

    ones = np.ones(hidden, np.float32)
    writer.add_tensor("token_embd.weight", matrix(n_vocab, hidden), raw_dtype=q8)
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", matrix(n_vocab, hidden), raw_dtype=q8)
    for i in range(n_layers):
        block = f"blk.{i}."
        writer.add_tensor(block + "attn_norm.weight", ones)
        writer.add_tensor(block + "attn_q.weight", matrix(q_width, hidden), raw_dtype=q8)
        writer.add_tensor(block + "attn_k.weight", matrix(kv_width, hidden), raw_dtype=q8)
        writer.add_tensor(block + "attn_v.weight", matrix(kv_width, hidden), raw_dtype=q8)
        writer.add_tensor(block + "attn_output.weight", matrix(hidden, q_width), raw_dtype=q8)
        writer.add_tensor(block + "attn_q_norm.weight", np.ones(HEAD_DIM, np.float32))
        writer.add_tensor(block + "attn_k_norm.weight", np.ones(HEAD_DIM, np.float32))
        writer.add_tensor(block + "ffn_norm.weight", ones)
        writer.add_tensor(block + "ffn_gate_inp.weight",
                          rng.standard_normal((shape.experts, hidden)).astype(np.float32))
        for part in ("gate", "up"):
            writer.add_tensor(block + f"ffn_{part}_exps.weight", matrix(shape.experts, shape.expert_width, hidden),
                              raw_dtype=q8)
        writer.add_tensor(block + "ffn_down_exps.weight", matrix(shape.experts, hidden, shape.expert_width),
                          raw_dtype=q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def fastest_token_s(args: list[str], env: dict | None = None) -> float:
    """Seconds per decoded token of a llama-bench run (args: the command without -o): the fastest of its repetitions
    (on a shared machine other load only ever slows a run down)."""
    out = subprocess.run(args + ["-o", "json"], check=True, capture_output=True, text=True,
                         env=None if env is None else {**os.environ, **env}).stdout
    return 1.0 / max(json.loads(out)[-1]["samples_ts"])  # json: both builds print it (ik's has no jsonl)


def decode_seconds(bench: Path, model: Path, threads: int) -> float:
    """Seconds per decoded token on the CPU alone: the fastest of llama-bench's 5 runs of 16 tokens."""
    return fastest_token_s([str(bench), "-m", str(model), "-p", "0", "-n", "16", "-r", "5", "-t", str(threads),
                            "-ngl", "0", "-fa", "0"])


def expert_type_flags(type_name: str, ik: bool) -> list[str]:
    """llama-quantize's flags that give the expert tensors (gate, up, down) one type: mainline's --tensor-type per
    tensor, ik_llama.cpp's --custom-q list of regex=type rules (its examples/quantize/quantize.cpp)."""
    # ggml's own type names (ggml.c type_traits: the k-quants "q4_K", every other "iq3_xxs", ik's "iq4_k"): ik's
    # parser takes no other spelling
    name = type_name.lower()
    if re.fullmatch(r"q\d_k", name):
        name = name[:-1] + "K"
    rules = [f"ffn_{part}_exps={name}" for part in ("gate", "up", "down")]
    if ik:
        return ["--custom-q", ",".join(rules)]
    return [a for rule in rules for a in ("--tensor-type", rule)]


def measure(llama_cpp: Path, bin_dir: Path, work: Path, types=TYPES, threads: int = 1, ik: bool = False) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    vocab = llama_cpp / "models" / "ggml-vocab-qwen2.gguf"
    seconds, skipped = {}, {}
    for kind in ("Q8_0", *types):
        pair = []
        for n in LAYER_PAIR:
            base = work / f"L{n}.gguf"
            if not base.exists():
                write_model(base, n, vocab)
            model = base if kind == "Q8_0" else work / f"L{n}_{kind.lower()}.gguf"
            if not model.exists():
                done = subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize",
                                       *expert_type_flags(kind, ik), str(base), str(model), "Q8_0"],
                                      capture_output=True, text=True)
                if done.returncode:  # this build cannot write the type: the other types are still measured
                    model.unlink(missing_ok=True)
                    lines = (done.stderr or done.stdout).strip().splitlines()
                    skipped[kind] = f"llama-quantize exit {done.returncode}: {lines[-1] if lines else ''}"
                    print(f"{kind}: skipped ({skipped[kind]})", file=sys.stderr)
                    break
            pair.append(model)
        if kind in skipped:
            continue
        # the two models in turn, ROUNDS times, each its fastest: load that comes and goes hits both alike
        times = [[decode_seconds(bin_dir / "llama-bench", m, threads) for m in pair] for _ in range(ROUNDS)]
        pair = [min(t[i] for t in times) for i in range(2)]
        seconds[kind] = tuple(pair)
        print(f"{kind}: {pair[0] * 1e3:.2f} / {pair[1] * 1e3:.2f} ms a token", file=sys.stderr)
    return {"seconds_per_token": seconds, "gbps_per_core": rates(seconds), "threads": threads,
            "layers": LAYER_PAIR, "build": "ik_llama.cpp" if ik else "llama.cpp", "skipped": skipped}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True,
                        help="a llama.cpp source tree (its models/ggml-vocab-qwen2.gguf; ik_llama.cpp's lacks it)")
    parser.add_argument("--bin", type=Path, required=True, help="the build's bin/ (llama-bench, llama-quantize)")
    parser.add_argument("--work", type=Path, required=True, help="where the models are written (~12 GB)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--types", nargs="+", default=list(TYPES), help="the expert types besides Q8_0")
    parser.add_argument("--ik", action="store_true", help="the build is ik_llama.cpp's (its llama-quantize flags)")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.llama_cpp, args.bin, args.work, tuple(args.types), args.threads, args.ik),
                     indent=1))


if __name__ == "__main__":
    main()
