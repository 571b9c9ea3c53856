"""Calibration records: every figure of an engine model that was fitted from a measurement.

A record is keyed by the run it was fitted on: (engine, model, hardware, context). A scenario whose engine,
model (by prefix), hardware profile or context differs still gets the figure (there is no better one),
but the run lists the record under `out_of_domain` in its summary, with the key parts that differ, so a
result built on a figure from another box never looks like a prediction for this one. Hardware-profile
figures that were fitted or derived from such a run name their record (`record = "..."` in the profile's
quantity table) and are checked the same way.

`case` names the validation case the record was fitted from (scenarios/validation/, docs/validation.md):
a case with any record is a calibration case, every other case a prediction case. A record fitted on other
published runs (no validation case) names none.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sim.units import GIB, MIB


@dataclass(frozen=True)
class Record:
    id: str
    figure: str  # what the engine model reads
    value: float
    unit: str
    engine: str
    model: str  # a model-name prefix
    hardware: str  # a hardware profile name
    context: int | None  # the run's context length (tokens), where the figure depends on it
    case: str | None  # the validation case the figure was fitted from (None: fitted on no validation case)
    source: str  # what the figure was fitted on, and how
    # The figure's spread over the runs it was fitted on (low, high, in `unit`), where there are several: the range
    # an uncertainty run samples when the figure is used outside its key (sim/explore/uncertainty.py).
    spread: tuple[float, float] | None = None
    spread_source: str | None = None

    def key_differences(self, engine: str, model: str, hardware: str, context: int | None) -> list[str]:
        """The parts of this record's key a run does not share (empty: in domain)."""
        out = []
        if engine != self.engine:
            out.append(f"engine {engine} (fitted on {self.engine})")
        if not model.startswith(self.model):
            out.append(f"model {model} (fitted on {self.model})")
        if hardware != self.hardware:
            out.append(f"hardware {hardware} (fitted on {self.hardware})")
        if self.context is not None and context is not None and context != self.context:
            out.append(f"context {context} (fitted at {self.context})")
        return out

    def bytes(self) -> int:
        scale = {"GiB": GIB, "MiB": MIB, "B": 1}[self.unit]
        return int(round(self.value * scale))


_ATTENTION_4080 = ("LLaMA-3.1-8B IQ3_KS on ikawrakow's RTX-4080 (ik_llama.cpp PR #566): a 512-token ubatch's time grows "
                   "3.563 us a position of context from N_KV 512 to 7,680 (least squares over 15 rows), for 512 x 32 "
                   "layers x 16,384 FLOPs")

def ggml_kernel_record_id(build: str, isa: str, type_name: str) -> str:
    """The record of a build's CPU kernel for one GGML type on one instruction set (sim/engines/llamacpp/kernels.py);
    build: "ggml" (mainline llama.cpp's ggml) or "ik" (ik_llama.cpp's)."""
    return f"llamacpp-{build}-{isa}-{type_name.lower()}"


# ggml's CPU kernels per core and type, measured by this project on no validation case: `python -m
# sim.calibrate.ggml_kernels` (one thread, the difference of a 16- and an 8-layer synthetic model, the fastest of 15
# runs of each) with llama.cpp@0c1e57098 (the tree llama-cpp-python 0.3.36 vendors), built once for the core's own
# instructions (AVX-512) and once for AVX2 only, on the development VM; and ik_llama.cpp's own kernels the same way
# (--ik) with ik_llama.cpp@8337e4cd3 built for the core. Every run on another CPU is told so: the rate of another
# core, AVX2 from another microarchitecture than Zen 4's above all, differs.
GGML_KERNEL_BOX = "expertsim's development VM (AMD EPYC, Zen 4, 2 vCPUs, KVM)"
GGML_KERNEL_COMMANDS = {
    "ggml": "python -m sim.calibrate.ggml_kernels --llama-cpp SRC --bin BUILD/bin --work DIR, llama.cpp@0c1e57098",
    "ik": "python -m sim.calibrate.ggml_kernels --llama-cpp SRC --bin IK_BUILD/bin --work DIR --ik --types TYPES, "
          "ik_llama.cpp@8337e4cd3 (-DGGML_IQK_FA_ALL_QUANTS=OFF)"}
GGML_KERNEL_BUILDS = {"avx512": "cmake -DGGML_NATIVE=ON: AVX-512F/BW/VNNI/BF16",
                      "avx2": "cmake -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
                              "-DGGML_AVX512=OFF"}
BUILD_NAMES = {"ggml": "ggml", "ik": "ik_llama.cpp"}
# the box of the llama.cpp layer costs (records llamacpp-gpu-node-*, llamacpp-cpu-moe-split)
LAYERS_BOX = "expertsim's nvidia-h100-x1 machine (H100 80GB HBM3, 16 vCPUs of an Intel Xeon, KVM)"
ISA_NAMES = {"avx512": "AVX-512", "avx2": "AVX2"}
# GB/s of one core, as the command printed them (gbps_per_core, 3 figures kept); its times per token are in
# scenarios/hardware/calibration/ggml-kernels-zen4.json (mainline) and ik-kernels-zen4.json (ik_llama.cpp). Zen 4 runs AVX-512 on 256-bit units, so its two builds are
# alike (their differences, up to ~20 % either way on Q4_K, are the shared machine's noise as much as the code's).
GGML_KERNEL_GBPS = {
    ("ggml", "avx512", "Q8_0"): 19.5, ("ggml", "avx512", "Q4_K"): 15.7, ("ggml", "avx512", "Q6_K"): 21.2,
    ("ggml", "avx512", "MXFP4"): 15.4, ("ggml", "avx512", "IQ4_XS"): 10.8, ("ggml", "avx512", "IQ3_S"): 3.92,
    ("ggml", "avx512", "Q5_0"): 12.4,
    ("ggml", "avx2", "Q8_0"): 19.0, ("ggml", "avx2", "Q4_K"): 19.7, ("ggml", "avx2", "Q6_K"): 18.5,
    ("ggml", "avx2", "MXFP4"): 16.1, ("ggml", "avx2", "IQ4_XS"): 11.3, ("ggml", "avx2", "IQ3_S"): 3.48,
    ("ggml", "avx2", "Q5_0"): 10.5,
    # ik_llama.cpp's, in two runs of the command (the first stopped after IQ4_XS at a flag ik's llama-quantize did
    # not take; its times are in ik-kernels-zen4.json): each type's rate against its own run's Q8_0 pair, Q8_0's
    # from the run whose models were both the faster (the command's fastest-of rule across the runs)
    ("ik", "avx512", "Q8_0"): 27.6, ("ik", "avx512", "Q4_K"): 15.5, ("ik", "avx512", "Q6_K"): 18.8,
    ("ik", "avx512", "MXFP4"): 5.41, ("ik", "avx512", "IQ4_XS"): 11.3, ("ik", "avx512", "IQ3_XXS"): 4.77,
    ("ik", "avx512", "Q5_0"): 14.6,
    # ik's own types (only its build loads them), in three later runs: the types of the least loaded one (its Q8_0
    # pair the fastest), and IQ4_K, which only the last measured, against that run's own Q8_0 pair
    ("ik", "avx512", "IQ3_KS"): 10.5, ("ik", "avx512", "IQ4_KS"): 13.2, ("ik", "avx512", "IQ2_KS"): 7.49,
    ("ik", "avx512", "IQ5_KS"): 14.3, ("ik", "avx512", "Q6_0"): 17.3, ("ik", "avx512", "IQ4_K"): 15.0,
}
# the kernels measured in more than one run (ik-kernels-zen4.json): each run's rate, the spread an uncertainty run takes
GGML_KERNEL_SPREAD = {("ik", "avx512", "IQ3_KS"): (8.95, 11.0), ("ik", "avx512", "IQ4_KS"): (13.1, 16.9),
                      ("ik", "avx512", "IQ4_K"): (13.6, 15.0)}

RECORDS: tuple[Record, ...] = (
    # ds4, DeepSeek-V4-Flash on the #503 box. ds4 printed "available 81.57 GiB" (ds4-engine.md §1.12) with the
    # q2-q4 file at --ctx 32768 on the 96 GB card, whose CUDA total is 94.97 GiB: VRAM before the cache =
    # 13.40 GiB. Of that the model derives the non-routed weights (8.20 GiB, antirez/ds4#488), the KV cache
    # and the prefill context buffers at that context and chunk (ds4.memory.flash_kv_bytes and
    # flash_context_buffer_bytes: 0.7770 + 0.2501 GiB; the formula gives ds4's own "context buffers" figure to
    # the byte at two other contexts, tests/test_ds4_plan.py) and the driver's own reservation (555 MiB, the
    # profile's gpu.runtime_reserved_mib);
    # what is left is ds4's compute buffers and scratch, fitted here.
    Record("ds4-flash-buffers-503", "compute_buffers", 3.6309, "GiB", "ds4", "deepseek-v4-flash",
           "rtx-pro-6000-96gb", 32768, "seed-504",
           "94.97 GiB CUDA total - 81.57 GiB available (#503 log) - 8.20 GiB non-routed - 0.7770 GiB KV - 0.2501 GiB "
           "context buffers at --ctx 32768, chunk 4096 - 0.542 GiB runtime reserved (rtx-pro-6000-96gb.toml)"),
    # ds4's copy rate out of the page cache on the #503 host (an EPYC 9124 VM): no figure was measured on that box.
    # The profile held a desktop core's 14.5 GB/s until the commit that reported D1's rows coming into tolerance
    # moved it to this project's H200 VM pread (8.37 GB/s). Whatever the reasoning, the figure was chosen while
    # looking at D1, so it is recorded as fitted there and D1 is a calibration case (issue 31's audit); the seed-504
    # per-class row on the same box moved with it (-2.8 % to -22 %).
    Record("ds4-503-host-copy", "host.memcpy_gbps", 8.37, "GB/s", "ds4", "deepseek-v4-flash", "rtx-pro-6000-96gb",
           None, "D1", "this project's H200 VM (Xeon KVM guest): a single-thread buffered pread from the page cache "
                       "into pinned memory at 4.5 MiB, 8.37 GB/s (h200.toml), taken for the #503 host's EPYC VM "
                       "while D1's rows were compared (rtx-pro-6000-96gb.toml host.memcpy_gbps)"),
    # ds4, DeepSeek-V4.1-Flash on Strix Halo (ROCm): the V4.1 planner prints its graph (KV and buffers) as one
    # figure. Two runs of antirez/ds4 PR #1036 at far-apart contexts: Piega's 92GB run at ctx 8192 printed a
    # 1.72 GiB graph (2026-09-13; the same commenter's 89GB run at --ctx-alloc 10240 is validation case D9), and
    # hitman249's at --ctx 400000 a 5.66 GB graph (2026-09-20). No V4.1 KV or buffer formula is in our notes:
    # ds4.memory.v41_graph_bytes draws the line through the two.
    Record("ds4-v41-graph-8k", "v41_graph", 1.72, "GiB", "ds4", "deepseek-v4.1-flash", "strix-halo-128gb-stock",
           None, None, "antirez/ds4 PR #1036, Piega's 92GB run at ctx 8192: 1.72 GiB graph beside a 41.13 GiB "
                       "dynamic cache and 9.37 GiB static weights"),
    Record("ds4-v41-graph-400k", "v41_graph", 5.66, "GiB", "ds4", "deepseek-v4.1-flash", "strix-halo-128gb",
           None, None, "antirez/ds4 PR #1036, hitman249's run at --ctx 400000 (GTT raised): graph 5.66 GB in its "
                       "memory table (static weights 9.37, staging 7.12, total planned 111.02 GiB)"),
    # ds4 (neutronstar GLM stack), GLM-5.2 on the 16 GB RTX 4060 Ti rig: "the resident weights want ~9-13
    # GiB VRAM plus ~8 GiB pinned host RAM" (giannisanni/neutronstar README). The upper 13 GiB is everything
    # before the expert cache; less the derived non-routed weights on the GPU (18.70 - 8 GiB), the f32 MLA
    # cache at --ctx 4096 (0.69 GiB) and the runtime reservation (107 MiB), the rest is buffers.
    Record("ds4-glm52-buffers-neutronstar", "compute_buffers", 1.5139, "GiB", "ds4", "glm-5.2",
           "rtx-4060ti-16gb", 4096, "seed-504-glm52",
           "13 GiB resident VRAM (neutronstar README) - 10.696 GiB non-routed on the GPU - 0.6855 GiB MLA cache at "
           "--ctx 4096 - 0.1045 GiB runtime reserved (rtx-4060ti-16gb.toml)"),
    # ds4's graph encode per decode token on the main thread, before the GPU runs the layer: "encode=9.8-10.6 ms
    # execute=45.0-45.7 ms ... total=55.0-56.0 ms" (DS4_METAL_GRAPH_TOKEN_PROFILE=1, antirez/ds4#773, GB10, q2
    # Flash): serial with the kernels. CPU work: its figure on another CPU is not known.
    Record("ds4-graph-encode-773", "graph_encode_ms_per_token", 10.2, "ms", "ds4", "deepseek-v4-flash",
           "dgx-spark-gb10", None, "D11", "the midpoint of encode = 9.8-10.6 ms per token (#773's token profile)"),
    # ds4's Metal streaming decode, per layer whose router picks its experts (the hash layers take theirs from the
    # token on the host): the GPU signals the ids, the load worker wakes on the event, looks them up and starts the
    # loads, the main thread wakes from its join, encodes and commits the next command buffer, which the GPU then
    # starts; a host round trip the resident path (the token's work in two command buffers, one wait) does not
    # make. antirez/ds4#437 ran one agentic session on an M4 Max 128 GiB with q2 Flash at cafc134 (the decode path
    # of @84cc882: the selected-id event, the async load worker, the early commit, the 9-thread pread pool)
    # resident ("full", 22.80 tok/s) and streaming, the file in the page cache, with caches holding every expert
    # (b80: 12,136 slots for 11,008 experts, 19.37 tok/s) or 88 % of them (b64: 9,709 slots, 20.27 tok/s): 7.77 and
    # 5.47 ms a token more. In the model's terms the resident token is the encode (record ds4-graph-encode-773,
    # 10.2 ms) and the GPU's work in turn, 782.8 us a layer on that box, and a streaming layer hides its shared
    # expert (12.01 % of a layer's bytes: 94.0 us) behind the host: the round trip is the difference / 40 + 94.0 us.
    Record("ds4-metal-round-trip-437", "metal_selected_round_trip_us", 259.5, "us", "ds4", "deepseek-v4-flash",
           "m4-max-128gb (#437)", None, None,
           "the mean of 288.2 us (b80: (1000/19.37 - 1000/22.80) ms / 40 + 94.0 us) and 230.9 us (b64: 1000/20.27); "
           "antirez/ds4#437, tkhr-sait/ds4 ssd-streaming-memo/README.md §2a and §6b (measured 2026-06-17)",
           (230.9, 288.2), "the two runs it is the mean of: b64 (88 % of the experts cached) and b80 (all of them)"),
    # llama.cpp, GLM-4.7-Flash on the RTX 3060 box of case L22: no routing of GLM-4.7-Flash is stored, so its generator
    # preset borrows another 64-expert model's measured popularity and reuse (sim/trace/generator_spec.py). The stand-in
    # was switched to OLMoE-1B-7B's after L22's prefill ratio had been seen failing (the ubatch's union of used experts
    # follows the reuse), so the choice is recorded as fitted there and L22 is a calibration case. The engine reads
    # nothing of it (the trace generator does): the figure is the borrowed decode reuse the preset targets.
    Record("llamacpp-glm47-routing-standin", "generator reuse_decode_mean (OLMoE-1B-7B stand-in)", 0.422, "share",
           "llama.cpp", "glm-4.7-flash", "rtx-3060-12gb", None, "L22",
           "OLMoE-1B-7B's measured reuse (colibri route200) and popularity (allenai/OLMoE counts), taken for "
           "GLM-4.7-Flash's routing while L22's prefill ratio was compared (generator preset glm-4.7-flash)"),
    # llama.cpp's CPU decode on ikawrakow's two boxes (cases L02 and L04): the rate the engine's own CPU kernels stream
    # weights at, from CPU-only sweep-benches of other models on the same machines. Taken for the profiles' DRAM rate
    # after L02's and L04's decode had been seen too fast on the AIDA-style estimates (62 and 132 GB/s), so each is
    # recorded as fitted on its case.
    Record("llamacpp-7950x-cpu-decode", "host.dram_bandwidth_gbps", 56.3, "GB/s", "llama.cpp", "gpt-oss",
           "rtx-4080-7950x", None, "L02",
           "GPT-OSS-20B-MXFP4 CPU-only on the Ryzen-7950X: 2.602 GB a token at 21.62 t/s (ik_llama.cpp PR #757, main "
           "branch, N_KV 0)", (54.0, 56.3),
           "LLaMA-3.1-8B IQ3_KS CPU-only on the same CPU: ~3.21 GB a token at 16.81 t/s (ik PR #566) = 54.0 GB/s"),
    Record("llamacpp-5975wx-cpu-decode", "host.dram_bandwidth_gbps", 59.3, "GB/s", "llama.cpp", "gpt-oss",
           "rtx-4080-5975wx", None, "L04",
           "LLaMA-3.1-8B IQ3_KS CPU-only on the Ryzen-5975WX: ~3.21 GB a token (its output at Q6_K [E]) at 18.46 t/s "
           "(ik_llama.cpp PR #566, N_KV 0)"),
    # FlashAttention's prompt rate on the RTX 4080 of both boxes (cases L02 and L04, ikawrakow's card): a sweep-bench of
    # another model on the same card, taken after L02's and L04's prompt at depth had been seen slowing three times
    # too much with the attention priced at the prompt figure's per-FLOP rate (~29 TFLOPS): recorded as fitted there.
    Record("llamacpp-4080-attention-7950x", "gpu.attention_tflops", 75.3, "TFLOPS", "llama.cpp", "gpt-oss",
           "rtx-4080-7950x", None, "L02", _ATTENTION_4080),
    Record("llamacpp-4080-attention-5975wx", "gpu.attention_tflops", 75.3, "TFLOPS", "llama.cpp", "gpt-oss",
           "rtx-4080-5975wx", None, "L04", _ATTENTION_4080),
    # Strata's own runtime buffers in VRAM before the cache is sized (the CUDA/HIP runtime's module images, cuBLAS
    # and cuBLASLt handles and workspaces, small session-adjacent buffers): what Strata's loading logs leave when
    # the card's total, its free VRAM at sizing and every other term are known (strata.memory.vram_before_cache:
    # dense weights, the MTP draft layer and the session from the same logs), less the driver's context (the
    # hardware profiles' SM-count rule: 206 MiB on a 68-SM 2080 Ti, 229 on a 76-SM 4090 Laptop, 212 on a 70-SM
    # 5070 Ti, 125 on a 40-CU RX 6700 XT). None of these boxes is a validation case.
    Record("strata-runtime-linux-cuda", "vram_runtime_buffers", 928.0, "MiB", "strata", "qwen3.8-flash-next",
           "rtx-2080ti-11gb+rtx-4090-laptop-16gb (Linux)", None, None,
           "the mean of 1,241 - 206 MiB (RTX 2080 Ti 11 GB, Linux, 0.1.33: '4.15 GiB free' at sizing, IQ3_S, 262K, "
           "INT8 K/V streamed from 32,768 cells) and 1,049 - 229 MiB (RTX 4090 Laptop 16 GB, Linux, 0.1.38: '6.37 "
           "GiB free', IQ3_S, 262K, INT8 K/V in VRAM); Strata community bench logs (indexed copy 70616566230, "
           "bench/results/2026-10-04-community-rtx-4090-laptop @ 84f2e9f4)",
           (820.0, 1035.0), "the two Linux boxes the mean is of: 820 MiB (RTX 4090 Laptop) and 1,035 MiB (RTX 2080 Ti)"),
    Record("strata-runtime-windows-cuda", "vram_runtime_buffers", 1368.0, "MiB", "strata", "qwen3.8-flash-next",
           "rtx-5070ti-16gb (Windows)", None, None,
           "1,580 - 212 MiB on an RTX 5070 Ti 16 GB under Windows 11 (0.1.39: '9.07 GiB free' at sizing, IQ3_S, 64K, "
           "INT8 K/V streamed from 32,768 cells): the runtime with the desktop and WDDM's share of the card "
           "(bench/results/2026-10-06-community-rtx5070ti-5900x/engine.log @ a2653966)"),
    Record("strata-runtime-hip", "vram_runtime_buffers", 181.0, "MiB", "strata", "qwen3.8-flash-next",
           "rx-6700xt-12gb (ROCm)", None, None,
           "306 - 125 MiB on an RX 6700 XT 12 GB under ROCm (0.1.39: '6.97 GiB free' at sizing, IQ2_XS, 131K, INT8 "
           "K/V streamed from 32,768 cells; bench/results/2026-10-05-community-rx-6700-xt/engine.log @ 282c55e9)"),
    # The #658 box's effective host -> device rate under WDDM: strata-engine.md §6 gives "PCIe B ~ 16 GB/s
    # effective on the 5090" with no derivation; it may come from the #658 runs, so it is recorded as fitted
    # there (the hardware profile's pcie.h2d_pinned_gbps names this record).
    Record("strata-658-h2d", "pcie.h2d_pinned_gbps", 16.0, "GB/s", "strata", "qwen3.8-flash-next",
           "rtx-5090-48gb-windows", None, "seed-658", "strata-engine.md §6, effective PCIe on the #658 box"),
    # Strata's decode: the GPU's fixed time per layer of a verify window (the kernels of the dense chain, the
    # doorbell to the host and back), beyond reading the layer's weights at 80 % of the DRAM rate. An RTX 3060 12 GB
    # log (Swift IQ2_XS, STRATA_DECODE_TIMING): the GPU's dense chain P = 21.4 ms per window for 48 layers whose
    # 2,941 MiB of dense weights (3,263 MiB less the 322 MiB head) take 10.7 ms at 360 GB/s x 0.8: 0.223 ms per
    # layer. Strata's own layer-split model prices "0.33 ms on an RTX 5080" for "the per-layer round trip and
    # kernels" (generate.cpp): less its IQ3_S dense weights' 0.095 ms at 960 GB/s x 0.8, 0.235 ms. A 3090's 0.50
    # ms in the same comment leaves 0.40: the spread of this figure.
    Record("strata-decode-layer-latency", "decode_layer_latency_us", 229.0, "us", "strata", "qwen3.8-flash-next",
           "rtx-3060-12gb+rtx-5080 (logs)", None, None,
           "the mean of 223 us (RTX 3060 decode log, indexed copies 71481068040, 70969607640: P = 21.4 ms per window) "
           "and 235 us (generate.cpp's layer-split model: 0.33 ms per layer on an RTX 5080)",
           (223.0, 400.0), "the cards behind the figure: 223 us (RTX 3060 log), 235 us (RTX 5080) and 400 us (RTX "
                           "3090: the same generate.cpp comment's 0.50 ms per layer less its dense weights' read)"),
    # Strata's decode-window reading of a short part (<= --short-read tokens): "about 16 ms/token" (strata-engine.md
    # §3.3, a comment in generate.cpp, validation case S7); the box it was measured on is not named.
    Record("strata-short-read", "short_read_ms_per_token", 16.0, "ms", "strata", "qwen3.8-flash-next",
           "not reported", None, "S7", "generate.cpp comment: a decode window of a short part ~16 ms per token"),
    # Strata's prompt compute per token on an RTX 5090: a community benchmark (RTX 5090 + Ryzen 9 5950X, PCIe 4.0
    # x16, 96 GB, Windows 11; IQ3_S, 0.1.34, arena, 65,536 context) read a 14,688- and a 28,886-token prompt in one
    # chunk each (--prefill auto:32768) at 5,406 and 6,150 tok/s: 2.717 s and 4.697 s. The slope between them is the
    # per-token cost (attention, GEMMs of the routed rows); the per-chunk part (streaming every expert the cache
    # lacks, reading each routed expert's weights) is simulated. 0.1.38 measured 6 % less per token (0.1316 ms).
    Record("strata-prefill-5090", "prefill_us_per_token_layer", 2.905, "us", "strata", "qwen3.8-flash-next",
           "rtx-5090-5950x (Windows)", None, None,
           "(4.697 - 2.717) s / (28,886 - 14,688) tokens = 0.13945 ms per token / 48 layers (Strata bench "
           "results 2026-10-01-community-rtx-5090-5950x, indexed copy 71558669205, IQ3_S table, 0.1.34 auto:32768)"),
    # llama.cpp's fixed costs of a decode layer (sim/engines/llamacpp/graph.py), measured by this project on no
    # validation case: `python -m sim.calibrate.llamacpp_layers` on the nvidia-h100-x1 machine, twice (raw times,
    # node counts and both runs' figures: scenarios/hardware/calibration/llamacpp-layers-h100.json). The figures are
    # the second, complete run's; the spreads span both runs.
    Record("llamacpp-gpu-node-graphs", "GPU time per decode graph node (CUDA graphs)", 1.084, "us", "llama.cpp", "",
           LAYERS_BOX, None, None,
           "44.43 us a layer (the slope of decode time over 8, 24 and 48 layers of a qwen3moe model whose weights "
           "take under a microsecond a layer to read) / 41 nodes a layer on the GPU (GGML_SCHED_DEBUG=2 dump)",
           (1.084, 1.089), "the two runs of the command (44.43 and 44.64 us a layer)"),
    Record("llamacpp-gpu-node-launch", "GPU time per decode graph node (no CUDA graphs: each kernel launched)", 2.272,
           "us", "llama.cpp", "", LAYERS_BOX, None, None,
           "93.13 us a layer with GGML_CUDA_DISABLE_GRAPHS=1 / 41 nodes a layer, as llamacpp-gpu-node-graphs",
           (2.079, 2.272), "the two runs of the command (85.25 and 93.13 us a layer)"),
    Record("llamacpp-cpu-moe-split", "a CPU MoE layer's split (the CPU backend's compute of its 4 nodes, the second "
           "GPU graph)", 26.7, "us", "llama.cpp", "", LAYERS_BOX, None, None,
           "a decode layer with its experts on the CPU, 98.4 / 114.4 / 196.5 us at -t 16 / 4 / 1, less its 37 GPU "
           "nodes at 1.084 us, the simulator's two GPU<->CPU switches on this box (2 x (6.35 us copy latency + "
           "3.85 us sync) + 4 KB pageable at 10.8 GB/s = 20.78 us: h200.toml's VM figures) and its 8 thin experts' "
           "835,584 B at 7.49 GB/s a core (this box's Q8_0 kernel, ggml-kernels-xeon-h100vm.json): 30.6 / 25.6 / "
           "24.0 us, mean 26.7 (--refit ... --switch-us 20.78 --core-gbps 7.49)",
           (24.0, 45.8), "both runs at -t 1, 4 and 16 (the first run's -t 16: 45.8 us)"),
    # ggml's CPU kernels on one core (llama.cpp's mul_mat_id on the CPU, sim/engines/llamacpp/kernels.py), below
    *(Record(ggml_kernel_record_id(build, isa, type_name),
             f"{BUILD_NAMES[build]} CPU kernel per core ({type_name}, {ISA_NAMES[isa]})",
             gbps, "GB/s", "llama.cpp", "", GGML_KERNEL_BOX, None, None,
             f"{GGML_KERNEL_COMMANDS[build]} ({GGML_KERNEL_BUILDS[isa]})",
             GGML_KERNEL_SPREAD.get((build, isa, type_name)),
             "ik-kernels-zen4.json: the three runs of ik's own types (IQ4_K: against the last run's own Q8_0 pair and "
             "the least loaded run's)" if (build, isa, type_name) in GGML_KERNEL_SPREAD else None)
      for (build, isa, type_name), gbps in GGML_KERNEL_GBPS.items()),
)

BY_ID = {r.id: r for r in RECORDS}


def record(record_id: str) -> Record:
    return BY_ID[record_id]


class Domain:
    """The out_of_domain notes of one run: which records it used outside their key. `values` (record id -> value)
    stands in for records' figures: an uncertainty sample of a record's spread."""

    def __init__(self, engine: str, model: str, hardware: str, context: int | None,
                 values: dict[str, float] | None = None):
        self.key = (engine, model, hardware, context)
        self.notes: dict[str, str] = {}
        self.values = dict(values or {})

    def use(self, record_id: str, what: str | None = None) -> Record:
        r = BY_ID[record_id]
        diff = r.key_differences(*self.key)
        if diff:
            self.notes[f"{r.id}:{what or r.figure}"] = \
                f"{what or r.figure} = {r.value:g} {r.unit} (record {r.id}): " + "; ".join(diff)
        return replace(r, value=self.values[r.id]) if r.id in self.values else r

    def use_profile_figure(self, path: str, quantity) -> float:
        """A hardware-profile figure; if it names a record (fitted there, or derived from it), check that
        record's key too."""
        if getattr(quantity, "record", None):
            r = BY_ID[quantity.record]
            diff = r.key_differences(*self.key)
            if diff:
                self.notes[f"{r.id}:{path}"] = (f"{path} = {quantity.value:g} {quantity.unit} (from record {r.id}, "
                                                f"{r.value:g} {r.unit}): " + "; ".join(diff))
        return quantity.value

    def use_profile(self, profile, compute_key: str | None) -> None:
        """Every figure of the hardware profile a run reads: the machine's (all but [compute]) and the compute
        table of the scenario's model class."""
        own_compute = f"compute.{compute_key}."
        for path, quantity in profile.quantities():
            if not path.startswith("compute.") or path.startswith(own_compute):
                self.use_profile_figure(path, quantity)

    def out_of_domain(self) -> list[str]:
        return [self.notes[k] for k in sorted(self.notes)]
