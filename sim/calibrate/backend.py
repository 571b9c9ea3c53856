"""The expert-copy hot loop on a GPU, host side: the memory arenas, one stream, and a step's copies issued the
engines' way or as launches of the gather kernel (sim/calibrate/kernel.py), side by side.

A *descriptor* is one copy: (source offset, destination offset, length), in 8-byte words, between two
memories. Three paths exist:

    d2d  device -> device   a cache hit: slab slot -> compact staging buffer
    h2d  host   -> device   a miss: pinned host memory -> slab slot (copy engine) or mapped host memory read
                            by the kernel (zero-copy)
    d2h  device -> host     an eviction to RAM (Strata-style)

Two ways to do a step's copies:

- the engines' way (`run_ce`): one cudaMemcpyAsync per descriptor, optionally a stream sync after each (ds4
  syncs after every expert part);
- the gather kernel (`run_gather`): per path, the step's descriptor table is written to pinned memory,
  copied to the device (or read by the kernel from pinned memory) and one kernel launch copies every
  descriptor; one sync at the end of the step.

Memory is two arenas of 8-byte words: `dev` (cudaMalloc) and `host` (pinned, mapped into the device's
address space, so the kernel can read and write it and the copy engine can DMA it). Offsets are in words
so every access is 8 bytes wide; callers round copy lengths up to whole words.

On a GPU the timed paths call the driver directly (cuda.bindings: cuMemcpyAsync, cuStreamSynchronize,
cuLaunchKernel with a parameter block packed once) on a kernel compiled for raw pointers, so the Python cost
per call stays near a microsecond; numba's own launch paths remain as fallbacks (LAUNCH_MODES). Under
NUMBA_ENABLE_CUDASIM=1 the same kernel body runs in Numba's simulator on arrays, and copies go through the
array API: slow, but byte-exact, which is what the tests check.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field

import numpy as np

from sim.calibrate import cudaenv
from sim.calibrate.kernel import MAX_DESCRIPTORS_PER_LAUNCH, SIM_VARIANT, Variant, gather_kernel
from sim.errors import InputError

WORD = 8  # bytes per copied element
PATHS = ("d2d", "h2d", "d2h")
# (source memory, destination memory) of each path
MEMORIES = {"d2d": ("dev", "dev"), "h2d": ("host", "dev"), "d2h": ("dev", "host")}
POISON = np.uint64(0xA5A5_5A5A_DEAD_BEEF)
# raw: cuLaunchKernel with a parameter block packed once (about a microsecond of Python per launch);
# pointer: numba's compiled-kernel launch with raw pointers; dispatch: numba's dispatcher with arrays
LAUNCH_MODES = ("raw", "pointer", "dispatch")
# The host probe (Backend.host_probe): copies of 4 KiB take well under a microsecond on the copy engine, so the
# step's ~150 us on an H200 is the driver's call and sync per copy, the host's part of the engines' way.
PROBE_COPIES, PROBE_BYTES, PROBE_REPS = 16, 4096, 200


@dataclass
class CeStep:
    """A step's copies the engines' way: driver arguments (GPU) or array slices (simulator)."""

    ops: list
    n: int
    nbytes: int


@dataclass
class GatherStep:
    """A step's copies as gather launches: per launch the path, the descriptor table and the grid."""

    launches: list
    n: int
    nbytes: int


@dataclass
class Timing:
    wall_us: float  # host time from the first call to the return of the last sync
    enqueue_us: float  # host time spent issuing the calls (before the final sync)


@dataclass
class Backend:
    """Two arenas (device and mapped host memory, in 8-byte words), one stream, the compiled kernels."""

    dev_words: int
    host_words: int
    variants: dict = field(default_factory=dict)  # path -> Variant (missing paths: Variant())
    desc_capacity: int = 3 * 8 * MAX_DESCRIPTORS_PER_LAUNCH
    # how gather launches are issued (see LAUNCH_MODES) and where the kernel reads its descriptor table:
    # "device" (copied there with one cudaMemcpyAsync per launch) or "mapped" (read from pinned memory)
    launch_mode: str = "raw"
    desc_in: str = "device"
    notes: list = field(default_factory=list)

    def __post_init__(self):
        self.cuda = cudaenv.require_gpu()
        self.sim = cudaenv.simulating()
        default = SIM_VARIANT if self.sim else Variant()
        self.variants = {p: self.variants.get(p, default) for p in PATHS}
        if self.sim:
            self.launch_mode, self.desc_in = "dispatch", "device"
        if self.launch_mode not in LAUNCH_MODES or self.desc_in not in ("device", "mapped"):
            raise InputError("calibrate", "launch", f"{self.launch_mode}/{self.desc_in}",
                             f"launch modes are {', '.join(LAUNCH_MODES)}; descriptors in device or mapped memory")
        self.sms = 1 if self.sim else int(self.cuda.get_current_device().MULTIPROCESSOR_COUNT)
        self.stream = self.cuda.stream()
        self.dev = self.cuda.device_array(int(self.dev_words), np.uint64)
        if self.sim:
            self.host = np.zeros(int(self.host_words), np.uint64)
            self.ddesc = None
            self.stage = None
        else:
            self.host = self.cuda.mapped_array(int(self.host_words), np.uint64)
            self.ddesc = self.cuda.device_array(int(self.desc_capacity), np.int64)
            self.stage = self.cuda.mapped_array(int(self.desc_capacity), np.int64)
            from cuda.bindings import driver as binding

            self.binding = binding
            self.ok = binding.CUresult.CUDA_SUCCESS
            self.hstream = self.stream.handle
            self.dev_ptr = int(self.dev.device_ctypes_pointer.value)
            self.host_ptr = int(self.host.ctypes.data)  # == its device address under unified addressing
            self.host_dptr = int(self.host.device_ctypes_pointer.value)
            self.ddesc_ptr = int(self.ddesc.device_ctypes_pointer.value)
            self.stage_ptr = int(self.stage.ctypes.data)
            self.stage_dptr = int(self.stage.device_ctypes_pointer.value)
            if 0 in (self.dev_ptr, self.host_ptr, self.host_dptr, self.ddesc_ptr, self.stage_ptr, self.stage_dptr):
                raise RuntimeError("an arena has no device address")
            # cuLaunchKernel's parameter block, packed once: three pointer-sized values and their addresses
            self._argv = (ctypes.c_uint64 * 3)()
            self._argp = (ctypes.c_void_p * 3)(*[ctypes.addressof(self._argv) + 8 * i for i in range(3)])
            self._params = ctypes.addressof(self._argp)
            # settle()'s own two words and one-descriptor table, apart from the arenas a step reads and writes
            self.scratch = self.cuda.device_array(2, np.uint64)
            self.scratch_ptr = int(self.scratch.device_ctypes_pointer.value)
            self.scratch_desc = self.cuda.to_device(np.array([0, 1, 1], np.int64))
            self.scratch_desc_ptr = int(self.scratch_desc.device_ctypes_pointer.value)
        self.kernels: dict = {}
        self.pkernels: dict = {}
        self.functions: dict = {}
        for variant in self.variants.values():
            self._kernels_for(variant)

    def _kernels_for(self, variant: Variant) -> None:
        u = variant.unroll
        if u not in self.kernels:
            self.kernels[u] = gather_kernel(u, pointers=False)
        if self.launch_mode in ("raw", "pointer") and u not in self.pkernels:
            self.pkernels[u] = self._pointer_kernel(gather_kernel(u, pointers=True))
        if self.launch_mode == "raw" and u not in self.functions:
            self.functions[u] = self._cufunction(self.pkernels[u])

    def _cufunction(self, kernel):
        """The driver function handle of a compiled kernel (loaded into this context)."""
        b = self.binding
        kernel.bind()
        handle = kernel._codelibrary.get_cufunc().handle
        if isinstance(handle, b.CUfunction):
            return handle
        err, func = b.cuKernelGetFunction(b.CUkernel(int(handle)))  # a library kernel: its function here
        if err != self.ok:
            raise RuntimeError(f"cuKernelGetFunction failed: {err}")
        return func

    def set_variant(self, path: str, variant: Variant) -> None:
        self._kernels_for(variant)
        self.variants[path] = variant

    def set_launch(self, mode: str, desc_in: str = "device", why: str | None = None) -> None:
        """Switch how gather launches are issued (prepared steps keep working: they hold no pointers)."""
        if self.sim:
            return
        self.launch_mode = mode
        self.desc_in = desc_in if mode != "dispatch" else "device"
        for variant in self.variants.values():
            self._kernels_for(variant)
        if why:
            self.notes.append(f"gather launches: {mode}, descriptors in {self.desc_in} memory: {why}")

    # ---- plumbing ----

    def _check(self, result, what: str):
        err = result[0] if isinstance(result, tuple) else result
        if err != self.ok:
            raise RuntimeError(f"{what} failed: {err}")
        return result

    @staticmethod
    def _pointer_kernel(dispatcher):
        overloads = list(dispatcher.overloads.values())
        if len(overloads) != 1:
            raise RuntimeError(f"expected one compiled overload, found {len(overloads)}")
        return overloads[0]

    def sync(self) -> None:
        if self.sim:
            return
        self._check(self.binding.cuStreamSynchronize(self.hstream), "cuStreamSynchronize")

    def settle(self) -> None:
        """Put the host in the state an engine issues a step in: right after a GPU call and its sync (ds4's
        router readback, Strata's layer sync), not after whatever the measuring loop did before. One one-word
        device copy and one one-descriptor gather launch, then a sync. Measured on an H200 (docs/calibration.md),
        the same 43 MB gather step costs 46 us right after another step, 70 us after 1.2 ms of Python
        bookkeeping and 87 us after a 3 ms sleep: the grid and the replay each time a step after this call, so
        that both measure the same state."""
        if self.sim:
            return
        b, h = self.binding, self.hstream
        self._check(b.cuMemcpyAsync(self.scratch_ptr + WORD, self.scratch_ptr, WORD, h), "cuMemcpyAsync (settle)")
        if self.launch_mode == "raw":
            argv = self._argv
            argv[0], argv[1], argv[2] = self.scratch_ptr, self.scratch_ptr, self.scratch_desc_ptr
            variant = self.variants["d2d"]
            self._check(b.cuLaunchKernel(self.functions[variant.unroll], 1, 1, 1, variant.threads, 1, 1, 0, h,
                                         self._params, 0), "cuLaunchKernel (settle)")
        else:  # the compiled kernel's own launch (the same kernel, array arguments)
            variant = self.variants["d2d"]
            self.kernels[variant.unroll][(1, 1), (variant.threads,), self.stream](self.scratch, self.scratch,
                                                                                  self.scratch_desc)
        self.sync()

    def host_probe(self, reps: int = PROBE_REPS) -> float:
        """The host's state, as one number: the median host time (us) of a step the engines' way whose cost is
        all host and driver time (PROBE_COPIES device copies of PROBE_BYTES, a sync after each), each run right
        after settle(). On a VM it moves with what the host's other tenants do (docs/calibration.md: one H200's
        grid ran 19 % slower than its replays minutes later); a calibration records it as it goes, a replay
        before and after, so a replay's error can be told apart from a host that changed in between."""
        words = max(1, min(PROBE_BYTES // WORD, self.words("dev") // (2 * PROBE_COPIES)))
        src = np.arange(PROBE_COPIES, dtype=np.int64) * 2 * words
        step = self.ce_step("d2d", src, src + words, np.full(PROBE_COPIES, words, np.int64))
        times = []
        for _ in range(reps):
            self.settle()
            times.append(self.run_ce(step, sync_each=True).wall_us)
        return float(np.median(times))

    def validate(self, path: str, desc: np.ndarray) -> None:
        if path not in MEMORIES:
            raise InputError("plan", "path", path, f"must be one of {', '.join(PATHS)}")
        s_mem, d_mem = MEMORIES[path]
        validate_descriptors("plan", path, desc, self.words(s_mem), self.words(d_mem))

    def mem(self, name: str):
        return self.dev if name == "dev" else self.host

    def words(self, name: str) -> int:
        return int(self.dev_words if name == "dev" else self.host_words)

    def read(self, name: str, off: int = 0, n: int | None = None) -> np.ndarray:
        """Words [off, off+n) of an arena, copied to a new host array (after the stream's work is done)."""
        self.sync()
        n = self.words(name) - off if n is None else n
        if name == "host":
            return np.array(self.host[off: off + n], copy=True)
        return self.dev[off: off + n].copy_to_host()

    def write(self, name: str, off: int, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data, dtype=np.uint64)
        self.sync()
        if name == "host":
            self.host[off: off + len(data)] = data
        else:
            self.dev[off: off + len(data)].copy_to_device(data)
        self.sync()

    def fill(self, name: str, pattern: np.ndarray) -> None:
        """Fill an arena by repeating `pattern` (tiled through host memory in chunks)."""
        total = self.words(name)
        pattern = np.ascontiguousarray(pattern, dtype=np.uint64)
        chunk_words = max(len(pattern), min(total, 1 << 24))
        reps = -(-chunk_words // len(pattern))
        chunk = np.tile(pattern, reps)[:chunk_words]
        for off in range(0, total, chunk_words):
            n = min(chunk_words, total - off)
            self.write(name, off, chunk[:n])

    def poison(self, name: str, off: int, n: int) -> None:
        self.write(name, off, np.full(int(n), POISON, np.uint64))

    # ---- the engines' way ----

    def ce_step(self, path, src, dst, nwords) -> CeStep:
        """Descriptors of one path (word offsets and lengths, array-likes) as cudaMemcpyAsync calls."""
        src, dst, nwords = (np.asarray(x, np.int64).ravel() for x in (src, dst, nwords))
        self.validate(path, np.column_stack([src, dst, nwords]))
        s_mem, d_mem = MEMORIES[path]
        if self.sim:
            ops = [(path, int(s), int(d), int(n)) for s, d, n in zip(src, dst, nwords)]
        else:
            sbase = self.dev_ptr if s_mem == "dev" else self.host_ptr
            dbase = self.dev_ptr if d_mem == "dev" else self.host_ptr
            ops = [(int(dbase + WORD * d), int(sbase + WORD * s), int(WORD * n)) for s, d, n in zip(src, dst, nwords)]
        return CeStep(ops, len(ops), int(nwords.sum()) * WORD)

    @staticmethod
    def join_ce(steps: list[CeStep]) -> CeStep:
        ops = [op for s in steps for op in s.ops]
        return CeStep(ops, len(ops), sum(s.nbytes for s in steps))

    def run_ce(self, step: CeStep, sync_each: bool) -> Timing:
        if self.sim:
            t0 = time.perf_counter_ns()
            for path, s, d, n in step.ops:
                self._sim_copy(path, s, d, n)
            t1 = time.perf_counter_ns()
            return Timing((t1 - t0) / 1e3, (t1 - t0) / 1e3)
        memcpy, sync, h, ok = self.binding.cuMemcpyAsync, self.binding.cuStreamSynchronize, self.hstream, self.ok
        t0 = time.perf_counter_ns()
        if sync_each:
            for dst, src, nb in step.ops:
                if memcpy(dst, src, nb, h)[0] != ok or sync(h)[0] != ok:
                    self._raise_last("cuMemcpyAsync/cuStreamSynchronize")
            t1 = t2 = time.perf_counter_ns()
        else:
            for dst, src, nb in step.ops:
                if memcpy(dst, src, nb, h)[0] != ok:
                    self._raise_last("cuMemcpyAsync")
            t1 = time.perf_counter_ns()
            if sync(h)[0] != ok:
                self._raise_last("cuStreamSynchronize")
            t2 = time.perf_counter_ns()
        return Timing((t2 - t0) / 1e3, (t1 - t0) / 1e3)

    def enqueue_ce(self, step: CeStep) -> None:
        """Issue the copies without any sync (for event timing)."""
        if self.sim:
            for path, s, d, n in step.ops:
                self._sim_copy(path, s, d, n)
            return
        for dst, src, nb in step.ops:
            self._check(self.binding.cuMemcpyAsync(dst, src, nb, self.hstream), "cuMemcpyAsync")

    def _raise_last(self, what: str):
        err = self.binding.cuStreamSynchronize(self.hstream)[0]
        raise RuntimeError(f"{what} failed ({err})")

    def _sim_copy(self, path: str, s: int, d: int, n: int) -> None:
        if path == "d2d":
            self.dev[d: d + n].copy_to_device(self.dev[s: s + n])
        elif path == "h2d":
            self.dev[d: d + n].copy_to_device(self.host[s: s + n])
        else:
            self.dev[s: s + n].copy_to_host(self.host[d: d + n])

    # ---- the gather kernel ----

    def gather_step(self, launches: list[tuple[str, np.ndarray]]) -> GatherStep:
        """Launches of one step: (path, descriptors as an (n, 3) int64 array of src, dst, words)."""
        prepared = []
        cursor = 0
        n_all = nbytes = 0
        for path, desc in launches:
            desc = np.ascontiguousarray(desc, dtype=np.int64).reshape(-1, 3)
            self.validate(path, desc)
            for first in range(0, len(desc), MAX_DESCRIPTORS_PER_LAUNCH):
                part = desc[first: first + MAX_DESCRIPTORS_PER_LAUNCH]
                if not len(part):
                    continue
                flat = part.ravel()
                variant = self.variants[path]
                grid = (variant.grid_x(len(part), int(part[:, 2].max()), self.sms), len(part))
                if not self.sim and cursor + len(flat) > self.desc_capacity:
                    raise InputError("replay", "descriptors", cursor + len(flat),
                                     f"more than {self.desc_capacity // 3} descriptors in one step")
                prepared.append((path, flat, grid, cursor, variant))
                cursor += len(flat)
                n_all += len(part)
                nbytes += int(part[:, 2].sum()) * WORD
        return GatherStep(prepared, n_all, nbytes)

    def _launch(self, path: str, flat: np.ndarray, grid: tuple, cursor: int, variant: Variant) -> None:
        s_mem, d_mem = MEMORIES[path]
        block = (variant.threads,)
        if self.sim:
            src, dst = self.mem(s_mem), self.mem(d_mem)
            self.kernels[variant.unroll][grid, block](src, dst, flat)
            return
        # the table goes to pinned memory, then (desc_in "device") to the device, as an engine would upload
        # its slot map; with "mapped" the kernel reads it from pinned memory over the bus
        self.stage[cursor: cursor + len(flat)] = flat
        if self.desc_in == "mapped":
            desc_ptr = self.stage_dptr + WORD * cursor
        else:
            desc_ptr = self.ddesc_ptr + WORD * cursor
            if self.binding.cuMemcpyAsync(desc_ptr, self.stage_ptr + WORD * cursor, WORD * len(flat),
                                          self.hstream)[0] != self.ok:
                self._raise_last("cuMemcpyAsync (descriptors)")
        sp = self.dev_ptr if s_mem == "dev" else self.host_dptr
        dp = self.dev_ptr if d_mem == "dev" else self.host_dptr
        if self.launch_mode == "raw":
            argv = self._argv
            argv[0], argv[1], argv[2] = sp, dp, desc_ptr
            if self.binding.cuLaunchKernel(self.functions[variant.unroll], grid[0], grid[1], 1, block[0], 1, 1, 0,
                                           self.hstream, self._params, 0)[0] != self.ok:
                self._raise_last("cuLaunchKernel")
        elif self.launch_mode == "pointer":
            self.pkernels[variant.unroll].launch([sp, dp, desc_ptr], grid, block, self.stream)
        else:
            src, dst = self.mem(s_mem), self.mem(d_mem)
            self.kernels[variant.unroll][grid, block, self.stream](src, dst, self.ddesc[cursor: cursor + len(flat)])

    def run_gather(self, step: GatherStep) -> Timing:
        t0 = time.perf_counter_ns()
        for launch in step.launches:
            self._launch(*launch)
        t1 = time.perf_counter_ns()
        self.sync()
        t2 = time.perf_counter_ns()
        return Timing((t2 - t0) / 1e3, (t1 - t0) / 1e3)

    def enqueue_gather(self, step: GatherStep) -> None:
        for launch in step.launches:
            self._launch(*launch)

    # ---- event timing (GPU time of enqueued work) ----

    def gpu_ms(self, enqueue, reps: int) -> list[float]:
        """GPU time of `enqueue()` (work issued without sync), `reps` times, in milliseconds."""
        if self.sim:
            t0 = time.perf_counter()
            for _ in range(reps):
                enqueue()
            return [(time.perf_counter() - t0) * 1e3 / reps] * reps
        out = []
        for _ in range(reps):
            e0, e1 = self.cuda.event(timing=True), self.cuda.event(timing=True)
            e0.record(self.stream)
            enqueue()
            e1.record(self.stream)
            e1.synchronize()
            out.append(float(e0.elapsed_time(e1)))
        return out


def validate_descriptors(where: str, path: str, desc: np.ndarray, src_words: int, dst_words: int) -> None:
    """Every descriptor inside its arenas, lengths positive: else one InputError naming the first bad one."""
    desc = np.asarray(desc, np.int64).reshape(-1, 3)
    if path not in MEMORIES:
        raise InputError(where, "path", path, f"must be one of {', '.join(PATHS)}")
    bad = np.flatnonzero((desc[:, 2] <= 0) | (desc[:, 0] < 0) | (desc[:, 1] < 0)
                         | (desc[:, 0] + desc[:, 2] > src_words) | (desc[:, 1] + desc[:, 2] > dst_words))
    if len(bad):
        i = int(bad[0])
        s, d, n = (int(x) for x in desc[i])
        raise InputError(where, f"descriptor {i} ({path})", f"src {s * WORD} dst {d * WORD} bytes {n * WORD}",
                         f"out of range: source arena {src_words * WORD} bytes, destination arena "
                         f"{dst_words * WORD} bytes, length must be > 0")
