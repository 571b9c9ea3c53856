"""The gather kernel: one launch copies every descriptor of a step's path, a descriptor being one copy
(source offset, destination offset, length) in 8-byte words. The host side that feeds it, and the engines' own
way of copying beside it, is sim/calibrate/backend.py. A `Variant` is the kernel's launch shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.calibrate import cudaenv
from sim.errors import InputError

MAX_DESCRIPTORS_PER_LAUNCH = 65_535  # gridDim.y

# One block row (blockIdx.y) per descriptor; the blocks of a row stride over its words. Each thread loads
# UNROLL words (blockDim apart, so a warp's accesses are contiguous) before storing any, to keep several
# loads in flight. The same Python body compiles for arrays (simulator, fallback) and raw pointers (timed).


def _gather4(src, dst, desc):
    d = cuda_mod.blockIdx.y
    s0 = desc[3 * d]
    d0 = desc[3 * d + 1]
    n = desc[3 * d + 2]
    t = cuda_mod.blockDim.x
    i = cuda_mod.blockIdx.x * (t * 4) + cuda_mod.threadIdx.x
    stride = cuda_mod.gridDim.x * (t * 4)
    while i + 3 * t < n:
        a0 = src[s0 + i]
        a1 = src[s0 + i + t]
        a2 = src[s0 + i + 2 * t]
        a3 = src[s0 + i + 3 * t]
        dst[d0 + i] = a0
        dst[d0 + i + t] = a1
        dst[d0 + i + 2 * t] = a2
        dst[d0 + i + 3 * t] = a3
        i += stride
    while i < n:  # the last, partial chunk (owned by this block: at most 3 more words of it)
        dst[d0 + i] = src[s0 + i]
        i += t


def _gather8(src, dst, desc):
    d = cuda_mod.blockIdx.y
    s0 = desc[3 * d]
    d0 = desc[3 * d + 1]
    n = desc[3 * d + 2]
    t = cuda_mod.blockDim.x
    i = cuda_mod.blockIdx.x * (t * 8) + cuda_mod.threadIdx.x
    stride = cuda_mod.gridDim.x * (t * 8)
    while i + 7 * t < n:
        a0 = src[s0 + i]
        a1 = src[s0 + i + t]
        a2 = src[s0 + i + 2 * t]
        a3 = src[s0 + i + 3 * t]
        a4 = src[s0 + i + 4 * t]
        a5 = src[s0 + i + 5 * t]
        a6 = src[s0 + i + 6 * t]
        a7 = src[s0 + i + 7 * t]
        dst[d0 + i] = a0
        dst[d0 + i + t] = a1
        dst[d0 + i + 2 * t] = a2
        dst[d0 + i + 3 * t] = a3
        dst[d0 + i + 4 * t] = a4
        dst[d0 + i + 5 * t] = a5
        dst[d0 + i + 6 * t] = a6
        dst[d0 + i + 7 * t] = a7
        i += stride
    while i < n:
        dst[d0 + i] = src[s0 + i]
        i += t


_BODIES = {4: _gather4, 8: _gather8}
cuda_mod = None  # numba.cuda, bound by gather_kernel before the bodies are compiled
_compiled: dict = {}


def gather_kernel(unroll: int, pointers: bool):
    """The gather kernel for `unroll`, with array or raw-pointer arguments (compiled once)."""
    global cuda_mod
    key = (unroll, pointers)
    if key in _compiled:
        return _compiled[key]
    cuda = cudaenv.load()
    cuda_mod = cuda
    if unroll not in _BODIES:
        raise InputError("calibrate", "unroll", unroll, f"must be one of {sorted(_BODIES)}")
    if cudaenv.simulating():
        kernel = cuda.jit(_BODIES[unroll])
    else:
        from numba import types

        if pointers:
            sig = types.void(types.CPointer(types.uint64), types.CPointer(types.uint64), types.CPointer(types.int64))
        else:
            sig = types.void(types.uint64[::1], types.uint64[::1], types.int64[::1])
        kernel = cuda.jit(sig)(_BODIES[unroll])
    _compiled[key] = kernel
    return kernel


@dataclass(frozen=True)
class Variant:
    """Launch shape of the gather kernel: threads per block, words per thread per iteration, and how many
    blocks (per multiprocessor) a launch aims for in all."""

    threads: int = 256
    unroll: int = 4
    blocks_per_sm: int = 8

    def grid_x(self, n_desc: int, max_words: int, sms: int) -> int:
        per_block = self.threads * self.unroll
        needed = max(1, -(-int(max_words) // per_block))
        target = max(1, -(-(sms * self.blocks_per_sm) // max(1, n_desc)))
        return int(min(needed, target))

    def as_dict(self) -> dict:
        return {"threads": self.threads, "unroll": self.unroll, "blocks_per_sm": self.blocks_per_sm}


SIM_VARIANT = Variant(threads=8, unroll=4, blocks_per_sm=2)
