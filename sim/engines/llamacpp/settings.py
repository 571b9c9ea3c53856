"""llama.cpp's [engine] table and its knobs, each parsed here once, as the engine parses it
(../shared/reference/llamacpp-engine.md, "the reference" below; its §N are cited).

The scenario's table uses the engine's own long flag names and environment variables; `Knobs` is what the engine
makes of them on a model:

  layers      -ngl/--n-gpu-layers N: the last N blocks (and the output layer) on the GPU, the blocks before them
              whole on the CPU, attention and K/V included (src/llama-model.cpp, i_gpu_start); default every layer
  placement   -ot/--override-tensor REGEX=BUFT (in order, the first match wins), then --cpu-moe and --n-cpu-moe N,
              added after the user's -ot so that those win (PR #15077); mainline takes the first N blocks, ik_llama.cpp
              the last N MoE layers (ik #2262); with none of them mainline's --fit keeps the last layers' experts
              in host RAM until the rest fits (§2.3)
  host buffer mainline: the file mapping (pageable, page cache) unless --load-mode none (pinned CUDA_Host, or
              plain RAM with GGML_CUDA_NO_PINNED); ik_llama.cpp: pinned whenever a tensor is overridden to the CPU,
              unless GGML_CUDA_NO_PINNED keeps the mapping (§2.2, §7)
  batches     -b / -ub, clamped n_ubatch <= n_batch <= n_ctx (src/llama-context.cpp:245-247)
  threads     -t for one-token graphs, -tb for larger ones; default the physical cores (common/common.cpp:288-310)
  op offload  mainline: ubatch >= GGML_OP_OFFLOAD_MIN_BATCH (32); ik: also ubatch x k >= 32 x E; --no-op-offload
  repacking   ik's -rtr/--run-time-repack: the tensors in host memory repacked into row-interleaved types that only
              the CPU's kernels read, so their matmuls stay on the CPU at any ubatch; mmap turned off (ik #147)
  graphs      a decode token's GPU splits replayed as CUDA graphs, unless GGML_CUDA_DISABLE_GRAPHS is set at all
              (ggml-cuda/common.cuh:1289, any value; graph.py)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import numpy as np
from pydantic import Field

from sim.engines.llamacpp.vram import fit_placement
from sim.errors import InputError
from sim.schema import Strict, digits, env_table

# fmt: off
DEFAULT_UBATCH_TOKENS = 512          # common/common.h:444 (n_ubatch), §2.1
DEFAULT_BATCH_TOKENS = 2048          # common/common.h:443 (n_batch), §2.1
DEFAULT_CTX_TOKENS = 4096            # common_params n_ctx, as --ctx-size's help states it (default: 4096, 0 = the
                                     # model's) [E: not in the reference's reading of the code]
OP_OFFLOAD_MIN_BATCH_DEFAULT = 32    # ggml-cuda.cu:5501/5524 (GGML_OP_OFFLOAD_MIN_BATCH), §3; ik: the same 32
RUN_PADDING_BYTES = 512              # ggml-backend.cpp:1676-1709: padding after a copied run of experts that is not
                                     # the tensor's last expert (keeps CUDA MMQ from reading NaNs), §3
EXPERT_PARTS = ("gate", "up", "down")  # the three expert tensors of a layer (a fused gate_up counts as gate + up)
# The regex behind --cpu-moe and --n-cpu-moe (LLM_FFN_EXPS_REGEX, common/common.h:1113): a substring match, so it also
# catches `..._exps.bias` and the fused `gate_up`.
FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
# ik_llama.cpp's --n-cpu-moe pattern keeps the expert biases on the GPU (ik #841): weight and scale only.
IK_FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps\.(weight|scale)"
# fmt: on

KEY_VARIANT = "engine.variant"
KEY_NCMOE = "engine.flags.n-cpu-moe"
KEY_NGL = "engine.flags.n-gpu-layers"
KEY_UBATCH = "engine.flags.ubatch-size"
KEY_CTX = "engine.flags.ctx-size"
KEY_LOAD_MODE = "engine.flags.load-mode"
KEY_NO_OP_OFFLOAD = "engine.flags.no-op-offload"


# ------------------------------------------------------------------------------------------ variants


@dataclass(frozen=True)
class Variant:
    """What a build of the family does differently (the reference's §1, §5.2, §7)."""

    name: str
    ik: bool  # ik_llama.cpp: the MoE-aware offload threshold, pinned CPU overrides, the last N layers, -no-ooae
    copy_used_only: bool  # op offload copies only the experts a ubatch uses (#15346); else whole expert tensors
    source: str


VARIANTS = {v.name: v for v in (
    Variant("mainline", False, True,
            "ggml-org/llama.cpp @ 34af94cd9 (2026-08-17): op offload of ubatches >= 32 tokens copying the used "
            "experts only (#15346), the CPU experts in the file mapping unless --load-mode none"),
    Variant("mainline-pre-15346", False, False,
            "ggml-org/llama.cpp before #15346 (2025-08-15): op offload copied each CPU layer's whole expert tensors "
            "for every ubatch (the 'master' arm of #15346's benchmark)"),
    Variant("ik", True, True,
            "ikawrakow/ik_llama.cpp @ 8337e4cd (2026-08-15): offload iff ubatch x k >= 32 x E (commit dc663fe63), "
            "only active experts copied (-ooae, default on since ik #842), CPU overrides pinned (ik #1508), "
            "--n-cpu-moe takes the last N MoE layers on one GPU (ik #2262)"),
)}
# Flags and variables one build reads and the other does not: set on the other, the scenario is refused.
ONLY_IN = {"load-mode": ("mainline", "mainline-pre-15346"), "no-ooae": ("ik",), "run-time-repack": ("ik",),
           "fit": ("mainline",),
           "GGML_OP_OFFLOAD_MIN_BATCH": ("mainline", "mainline-pre-15346"), "GGML_CUDA_MIN_BATCH_OFFLOAD": ("ik",)}

ENV_NAMES = ("GGML_OP_OFFLOAD_MIN_BATCH", "GGML_CUDA_MIN_BATCH_OFFLOAD", "GGML_CUDA_NO_PINNED",
             "GGML_CUDA_DISABLE_GRAPHS")
Env = env_table("LlamaCppEnv", "llama.cpp environment variable", ENV_NAMES)


class Flags(Strict):
    """llama.cpp's command-line flags (common/arg.cpp @ 34af94cd9, the reference's §2.1), long names. None = the
    engine's default."""

    KEY_KIND: ClassVar[str] = "llama.cpp flag"
    # -ot REGEX=BUFT,...: each entry one "regex=buffer type" pair (CPU, or a GPU's buffer such as CUDA0), in order
    override_tensor: list[Annotated[str, Field(min_length=3)]] = Field(default_factory=list, alias="override-tensor")
    # -ngl N: the last N blocks (and the output layer) on the GPU; None: every layer (mainline's default, -1)
    n_gpu_layers: Annotated[int, Field(ge=0)] | None = Field(None, alias="n-gpu-layers")
    cpu_moe: bool = Field(False, alias="cpu-moe")  # -cmoe: every layer's expert tensors on the CPU
    n_cpu_moe: Annotated[int, Field(ge=0)] | None = Field(None, alias="n-cpu-moe")  # -ncmoe N
    ubatch_size: Annotated[int, Field(ge=1)] = Field(DEFAULT_UBATCH_TOKENS, alias="ubatch-size")  # -ub
    batch_size: Annotated[int, Field(ge=1)] = Field(DEFAULT_BATCH_TOKENS, alias="batch-size")  # -b
    threads: Annotated[int, Field(ge=1)] | None = None  # -t; default: the physical cores
    threads_batch: Annotated[int, Field(ge=1)] | None = Field(None, alias="threads-batch")  # -tb; default: -t
    ctx_size: Annotated[int, Field(ge=1)] = Field(DEFAULT_CTX_TOKENS, alias="ctx-size")  # -c
    no_op_offload: bool = Field(False, alias="no-op-offload")
    # --load-mode (mainline, #20834): auto and mmap map the file; none reads it into pinned buffers; mlock pins pages
    load_mode: Literal["auto", "none", "mmap", "mlock", "mmap+mlock"] | None = Field(None, alias="load-mode")
    no_mmap: bool = Field(False, alias="no-mmap")  # the older spelling of --load-mode none (still parsed)
    mlock: bool = False  # the older spelling of --load-mode mmap+mlock
    no_ooae: bool = Field(False, alias="no-ooae")  # ik: copy whole expert tensors under op offload
    # ik -rtr: host tensors repacked for the CPU's kernels (ik #147: "turning on run time repacking will automatically
    # turn off mmap"); the GPU's kernels do not read the repacked types, so op offload never takes them [E from C]
    run_time_repack: bool = Field(False, alias="run-time-repack")
    # mainline --fit (#16653, default on): with no -ot / --cpu-moe / --n-cpu-moe, keep the experts of the last layers
    # in host RAM until the rest fits with a 1 GiB margin; any of those flags turns it off (common/fit.cpp:395-400)
    fit: Literal["on", "off"] = "on"


class Settings(Strict):
    KEY_KIND: ClassVar[str] = "llama.cpp engine key"
    name: Literal["llama.cpp"]
    variant: Literal[tuple(VARIANTS)] = "mainline"
    flags: Flags = Field(default_factory=Flags)
    env: Env = Field(default_factory=Env)


# ------------------------------------------------------------------------------------------ parsing, once


def tensor_names(block: int, fused_gate_up: bool) -> tuple[str, ...]:
    """The GGUF names of one block's expert tensors, in EXPERT_PARTS order (gguf TENSOR_NAMES, hardware-and-gguf.md
    §3.3); a fused gate_up tensor stands for both gate and up."""
    gate = f"blk.{block}.ffn_gate_up_exps.weight" if fused_gate_up else f"blk.{block}.ffn_gate_exps.weight"
    up = gate if fused_gate_up else f"blk.{block}.ffn_up_exps.weight"
    return gate, up, f"blk.{block}.ffn_down_exps.weight"


_GPU_BUFFER = re.compile(r"(CUDA|ROCm|Vulkan|SYCL|Metal)[0-9]*")


def _override(where: str, index: int, text: str) -> tuple[re.Pattern, bool]:
    """One -ot entry: (compiled pattern, on the CPU?). llama.cpp refuses an entry without '=' and an unknown buffer
    type ("unknown buffer type", common/arg.cpp:2714-2719)."""
    field = f"engine.flags.override-tensor[{index}]"
    pattern, sep, buffer = text.rpartition("=")
    if not sep or not pattern:
        raise InputError(where, field, text, "must be REGEX=BUFFER (e.g. exps=CPU)")
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise InputError(where, field, text, f"the regex does not compile ({exc})") from None
    if buffer == "CPU":
        return compiled, True
    if _GPU_BUFFER.fullmatch(buffer):
        return compiled, False
    raise InputError(where, field, text, "unknown buffer type: CPU or a GPU's buffer (CUDA0, ROCm0, ...)")


def cpu_placement(where: str, layout, flags: Flags, variant: Variant) -> np.ndarray:
    """bool [routed layers, 3]: which expert tensors (gate, up, down) live in host memory (§2.1, §2.2, §7)."""
    overrides = [_override(where, i, text) for i, text in enumerate(flags.override_tensor)]
    blocks = [layer.block for layer in layout.layers if not layer.mtp]
    n_layers = len(layout.layers)
    exps = IK_FFN_EXPS_REGEX if variant.ik else FFN_EXPS_REGEX
    if flags.cpu_moe:
        overrides.append((re.compile(exps), True))
    if flags.n_cpu_moe:
        if variant.ik:  # the last N MoE layers (src/llama-load-tensors.cpp:270-285)
            chosen = blocks[max(0, len(blocks) - flags.n_cpu_moe):]
        else:  # blk.0 .. blk.N-1, MoE or not, an MTP block too (common/common.h:1115-1117: a regex per block index)
            chosen = [layer.block for layer in layout.layers if layer.block < flags.n_cpu_moe]
        overrides += [(re.compile(rf"blk\.{b}{exps}"), True) for b in chosen]
    on_cpu = np.zeros((n_layers, len(EXPERT_PARTS)), bool)
    for i, layer in enumerate(layout.layers):
        for part, name in enumerate(tensor_names(layer.block, layer.fused_gate_up)):
            match = next((cpu for pattern, cpu in overrides if pattern.search(name)), False)
            on_cpu[i, part] = match
    return on_cpu


def gpu_layers(n_blocks: int, n_gpu_layers: int | None, variant: Variant) -> tuple[int, bool]:
    """(the first block on the GPU, whether the output layer is on the GPU) for -ngl N. Mainline counts the output
    layer as a slot after the last block: i_gpu_start = max(n_layer + 1 - N, 0), the output on the GPU from N = 1
    (src/llama-model.cpp, load_tensors @ 34af94cd9); ik_llama.cpp keeps the older rule: i_gpu_start = max(n_layer - N,
    0), the output on the GPU only when N > n_layer (src/llama.cpp, llm_load_tensors)."""
    if n_gpu_layers is None:
        return 0, True
    if variant.ik:
        return max(n_blocks - n_gpu_layers, 0), n_gpu_layers > n_blocks
    return min(max(n_blocks + 1 - n_gpu_layers, 0), n_blocks), n_gpu_layers >= 1


def fits_itself(flags: Flags, variant: Variant) -> bool:
    """Whether mainline's --fit places the experts (§2.3): on by default, given up once the user places tensors or
    layers (-ngl [E: the reference reads the overrides' check only])."""
    return not variant.ik and flags.fit == "on" and not (flags.override_tensor or flags.cpu_moe or flags.n_cpu_moe
                                                         or flags.n_gpu_layers is not None)


def _env_count(where: str, env, name: str) -> int | None:
    text = getattr(env, name, None)
    if text is None:
        return None
    if not digits(text.strip()):
        raise InputError(where, f"engine.env.{name}", text, "must be a whole number of tokens >= 0")
    return int(text)


@dataclass(frozen=True)
class Knobs:
    """What llama.cpp makes of a scenario's [engine] table on this model and box (module docstring)."""

    variant: Variant
    on_cpu: np.ndarray  # bool [routed layers, 3]: gate, up, down in host memory
    cpu_blocks: int  # blocks 0 .. cpu_blocks-1 run whole on the CPU (-ngl)
    whole_cpu: np.ndarray  # bool [routed layers]: the layer's block runs whole on the CPU
    output_on_gpu: bool
    host: str  # where the CPU experts live: "mapped" (file pages), "pinned" (CUDA_Host), "ram" (pageable malloc)
    mlock: bool  # the mapping's pages locked in RAM (never evicted)
    ubatch: int
    batch: int
    ctx: int
    threads: int
    threads_batch: int
    op_offload: bool
    offload_min_batch: int
    copy_used_only: bool
    cuda_graphs: bool

    @classmethod
    def of(cls, scenario, where: str) -> "Knobs":
        engine, layout, profile = scenario.engine, scenario.layout, scenario.hardware_profile
        flags, env = engine.flags, engine.env
        variant = VARIANTS[engine.variant]
        ctx = flags.ctx_size
        batch = min(flags.batch_size, ctx)
        ubatch = min(flags.ubatch_size, batch)
        if fits_itself(flags, variant):
            overridden = fit_placement(layout, profile, ctx, ubatch, not flags.no_op_offload, where)
        else:
            overridden = cpu_placement(where, layout, flags, variant)
        cpu_blocks, output_on_gpu = gpu_layers(layout.n_blocks, flags.n_gpu_layers, variant)
        whole_cpu = np.array([layer.block for layer in layout.layers]) < cpu_blocks
        on_cpu = overridden | whole_cpu[:, None]
        pinning = getattr(env, "GGML_CUDA_NO_PINNED", None) in (None, "0", "")  # else no CUDA_Host buffers
        # ik: mmap is disabled when a tensor is overridden to the CPU, unless pinning is off (§7), and by -rtr
        if variant.ik:
            mapped = not (flags.no_mmap or flags.run_time_repack) and not (overridden.any() and pinning)
            mlock = flags.mlock
        else:
            mode = flags.load_mode or ("none" if flags.no_mmap else "mmap+mlock" if flags.mlock else "auto")
            mapped = mode != "none"
            mlock = mode in ("mlock", "mmap+mlock")
        # without the mapping the CPU experts are read into a CUDA_Host (pinned) buffer, or plain RAM without pinning
        host = "mapped" if mapped else "pinned" if pinning else "ram"
        threads = flags.threads or int(profile.host.physical_cores.value)
        env_name = "GGML_CUDA_MIN_BATCH_OFFLOAD" if variant.ik else "GGML_OP_OFFLOAD_MIN_BATCH"
        min_batch = _env_count(where, env, env_name)
        return cls(variant, on_cpu, cpu_blocks, whole_cpu, output_on_gpu, host, mlock, ubatch, batch, ctx, threads,
                   flags.threads_batch or threads, not (flags.no_op_offload or flags.run_time_repack),
                   OP_OFFLOAD_MIN_BATCH_DEFAULT if min_batch is None else min_batch,
                   variant.copy_used_only and not flags.no_ooae,
                   getattr(env, "GGML_CUDA_DISABLE_GRAPHS", None) is None)

    @property
    def places_layers(self) -> bool:
        """Whether -ngl leaves anything on the CPU (a block or the output layer)."""
        return bool(self.cpu_blocks) or not self.output_on_gpu

    @property
    def cpu_layers(self) -> int:
        """Routed layers that run whole on the CPU (-ngl)."""
        return int(self.whole_cpu.sum())

    def cpu_computed(self, n_layers: int) -> dict[str, list[tuple[int, np.ndarray]]]:
        """The expert slices the CPU computes in decode, as (layer, gate/up/down mask) by why: "experts", a layer's
        host-resident slices; "whole", every slice of a layer -ngl leaves on the CPU; "output", the last layer's
        when the output layer runs on the CPU. The one owner of that choice: the process prices these slices' kernels
        and the engine's records_read names their records."""
        everything = np.ones(len(EXPERT_PARTS), bool)
        on_cpu = self.on_cpu[:n_layers]
        return {"experts": [(i, on_cpu[i]) for i in range(n_layers) if on_cpu[i].any()],
                "whole": [(int(i), everything) for i in np.flatnonzero(self.whole_cpu[:n_layers])],
                "output": [] if self.output_on_gpu else [(n_layers - 1, everything)]}

    @property
    def pinned(self) -> bool:
        return self.host == "pinned"

    def offload_threshold(self, top_k: int, n_experts: int) -> int | None:
        """The smallest ubatch whose CPU layers' expert matmuls the GPU takes (§3, §7), None without op offload:
        mainline the minimum batch; ik also needs n_tokens x k >= minimum x E (ggml-cuda.cu:5180-5210)."""
        if not self.op_offload:
            return None
        if not self.variant.ik:
            return self.offload_min_batch
        return max(self.offload_min_batch, -(-self.offload_min_batch * n_experts // top_k))  # ceil

    def offloads(self, n_tokens: int, top_k: int, n_experts: int) -> bool:
        threshold = self.offload_threshold(top_k, n_experts)
        return threshold is not None and n_tokens >= threshold
