"""llama.cpp's memory at load, in the order it allocates (the reference's §2.2, §5.1, §6): the runtime, the weights on
the GPU (non-expert tensors and the expert tensors nobody overrode to the CPU), the K/V cache of the context, and
the compute buffer; in host RAM, the CPU experts when they are read into a buffer (--load-mode none: pinned, or
plain RAM with GGML_CUDA_NO_PINNED; ik_llama.cpp's default). In the file mapping (mainline's default) they are
page-cache pages: no allocation.

The GPU refusing an allocation is llama.cpp's refusal to load ("CUDA error: out of memory"): the plan says why
(plan prunes such a placement) and the run refuses to start. A pinned buffer larger than the RAM available fails
the load too (ollama #11772: pinning 15 GB of experts failed with CUDA out of memory): refused with the scenario.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.engines.base import Allocation, MemoryPlan
from sim.engines.llamacpp.settings import KEY_CTX, KEY_NCMOE, KEY_NGL, KEY_UBATCH, Knobs
from sim.engines.llamacpp.vram import (COMPUTE_BUFFER, KV_CACHE, NON_EXPERT_WEIGHTS, part_bytes, split_by_device,
                                       vram_allocations)
from sim.engines.llamacpp.weights import file_weights
from sim.errors import InputError
from sim.units import GIB

# the way out of a host buffer that exceeds the RAM, the end of that refusal's text (scenario init takes it for ik)
KEEP_THE_MAPPING = "keep the file mapping (mainline's default; GGML_CUDA_NO_PINNED=1 on ik_llama.cpp)"
# the way out of a load the GPU refuses, by its largest part: the setting that shrinks it first (the plan's knob)
WAYS_OUT = {
    KV_CACHE: (KEY_CTX, "lower --ctx-size, or put more expert layers on the CPU (--n-cpu-moe)"),
    COMPUTE_BUFFER: (KEY_UBATCH, "lower --ubatch-size, or put more expert layers on the CPU (--n-cpu-moe)"),
    NON_EXPERT_WEIGHTS: (KEY_NGL, "keep fewer layers on the GPU (--n-gpu-layers): their experts on the CPU free "
                                  "less than their other weights take"),
}
PUT_EXPERTS_ON_THE_CPU = (KEY_NCMOE, "put more expert layers on the CPU (--n-cpu-moe), or lower --ctx-size / "
                                     "--ubatch-size")
HOST_WORDS = {"mapped": "file mapping, pageable", "pinned": "pinned CUDA_Host buffer", "ram": "pageable RAM buffer"}


@dataclass(frozen=True)
class LlamaMemory(MemoryPlan):
    cpu_expert_bytes: int = 0  # every expert slice in host memory


def plan_memory(scenario, knobs: Knobs, where: str) -> LlamaMemory:
    layout, profile = scenario.layout, scenario.hardware_profile
    parts = part_bytes(layout) * layout.n_experts
    cpu_bytes = int(parts[knobs.on_cpu].sum())
    gpu_expert_bytes = int(parts[~knobs.on_cpu].sum())
    weights = file_weights(layout, where)
    host = split_by_device(layout, weights, knobs.cpu_layers, knobs.output_on_gpu, knobs.ctx, knobs.ubatch)
    allocations = vram_allocations(layout, profile, weights, knobs.on_cpu, knobs.ctx, knobs.ubatch, knobs.op_offload,
                                   host)
    vram_used = sum(a.bytes for a in allocations)
    why, knob = None, KEY_NCMOE
    if vram_used > profile.vram_bytes:
        largest = max(allocations, key=lambda a: a.bytes)
        knob, way_out = WAYS_OUT.get(largest.name, PUT_EXPERTS_ON_THE_CPU)
        why = (f"llama.cpp would fail to load: CUDA error: out of memory ({vram_used / GIB:.2f} GiB of "
               f"{profile.vram_bytes / GIB:.2f} GiB, the largest part {largest.name} {largest.bytes / GIB:.2f} GiB): "
               f"{way_out}")
    if host["cpu_cache"]:  # the K/V of the layers on the CPU is allocated in host RAM (-ngl)
        allocations.append(Allocation("ram", "K/V cache of the CPU layers", host["cpu_cache"]))
    if knobs.host != "mapped" and cpu_bytes:
        kind = "pinned CUDA_Host" if knobs.pinned else "pageable RAM"
        allocations.append(Allocation("ram", f"CPU experts ({kind})", cpu_bytes))
        if host["cpu_weights"]:
            allocations.append(Allocation("ram", f"CPU layers' other weights ({kind})", host["cpu_weights"]))
        available = profile.ram_bytes - profile.os_reserved_bytes
        if cpu_bytes + host["cpu_weights"] > available:
            failure = "fails (CUDA out of memory)" if knobs.pinned else "fails (out of memory)"
            raise InputError(where, "engine.flags", f"CPU experts in {kind}",
                             f"llama.cpp would fail to load: reading {(cpu_bytes + host['cpu_weights']) / GIB:.2f} "
                             f"GiB of weights into "
                             f"{kind} {failure} with {available / GIB:.2f} GiB of RAM available: {KEEP_THE_MAPPING}")
    notices = [f"experts in host memory: {cpu_bytes / GIB:.2f} GiB ({HOST_WORDS[knobs.host]}), on the GPU: "
               f"{gpu_expert_bytes / GIB:.2f} GiB"]
    if knobs.places_layers:
        blocks = (f"blocks 0-{knobs.cpu_blocks - 1} run whole on the CPU" if knobs.cpu_blocks
                  else "every block on the GPU")
        notices.append(f"-ngl: {blocks}, the output layer on the {'GPU' if knobs.output_on_gpu else 'CPU'}; "
                       f"{host['cpu_weights'] / GIB:.2f} GiB of their other weights and "
                       f"{host['cpu_cache'] / GIB:.2f} GiB of K/V in host memory")
    return LlamaMemory(tuple(allocations), profile.vram_bytes - vram_used, why, knob, notices=tuple(notices),
                       cpu_expert_bytes=cpu_bytes)
