"""The simulated machine: the resources an engine's processes issue work to and wait on.

    gpu        the GPU's compute stream (the legacy default stream of ds4's CUDA path): a FIFO server
    h2d, d2h   the copy engines (PCIe DMA; on unified memory a copy inside the pool)
    d2d        device-to-device copies issued on their own (the engines' D2D on the default stream hold
               `gpu` instead: the legacy stream serialises them with the kernels)
    dram       host DRAM bandwidth, shared by the CPU's copies (a copy reads and writes) and the DMA of the copy
               engines; on unified memory the GPU's own copies too
    ssd        the drive, shared by every read in flight (sim/machine/storage.py)
    page_cache the OS page cache of the model files, sized by the RAM nobody holds
    memory     who holds which bytes: device memory and host RAM, one pool on unified memory
    threads()  host threads an engine creates (its main thread, a loader, a pread pool, stager threads)

The machine owns every rate: an engine asks it to move bytes (a copy, a read, a kernel streaming weights out of
host DRAM) at the simulated time it issues the work and waits on the event it gets back, so two transfers on one
link or one bandwidth slow each other. The few figures an engine adds up itself are compute: the GPU's time to
read weights from VRAM (vram_read_s) and the engines' own per-token compute figures.

Every server logs its busy intervals (links.parquet, the report's lanes). The machine knows nothing of the
engines: they take what they need from it (docs/design.md has the picture).
"""

from __future__ import annotations

import numpy as np
import simpy

from sim.machine import chains
from sim.machine.servers import Server, SharedBandwidth
from sim.machine.storage import INACTIVE_SHARE_BY_OS, LRU_SHARE, PageCache, Ssd
from sim.units import GIB, KIB

__all__ = ["Machine", "Memory", "PageCache", "Server", "SharedBandwidth", "Ssd"]

# A GPU kernel streaming weights out of VRAM reaches this share of the spec DRAM rate: llama.cpp's decode reaches
# 80 % of the roofline on an RTX 5090 under Linux (ggml-org/llama.cpp#28196, hardware-and-gguf.md §1.2).
VRAM_READ_EFFICIENCY = 0.80
# Under WDDM each cross-stream event a CUDA stream waits on or records stalls that stream ~10 us: the GPU sits idle
# while the kernel-mode driver schedules the dependency (Niko1221/Strata prefill.cpp, the comment above
# STRATA_PREFILL_GROUP_GATHER: ~10 us a wait or record, "226 ms of a 32K prompt"). Linux's driver resolves an
# event on the GPU, in the order of a kernel launch: not modelled (0).
WDDM_STREAM_EVENT_S = 10e-6
# A CPU copy reads each byte from DRAM and writes it back: two bytes of DRAM traffic per byte copied.
MEMCPY_TRAFFIC = 2


class Memory:
    """Allocations by name in device memory ("vram") and host RAM ("ram"), with the page cache's capacity
    following what is left of RAM. On unified memory both names are one pool: a GPU allocation shrinks the
    page cache too, and the GPU may hold at most the profile's gpu_allocatable share of the pool."""

    def __init__(self, profile, page_cache: PageCache | None = None):
        self.unified = profile.is_unified
        self.vram_total = profile.vram_bytes
        self.ram_total = profile.ram_bytes
        self.os_reserved = profile.os_reserved_bytes
        self.held: dict[tuple[str, str], int] = {}
        self.totals = {"vram": 0, "ram": 0}
        self.page_cache = page_cache
        self.peak = {"vram": 0, "ram": 0}
        self._resize_page_cache()

    def set(self, pool: str, name: str, n_bytes: int) -> None:
        """The allocation `name` in `pool` is now n_bytes (0 frees it)."""
        old = self.held.get((pool, name), 0)
        if old == int(n_bytes):
            return
        if n_bytes:
            self.held[(pool, name)] = int(n_bytes)
        else:
            self.held.pop((pool, name), None)
        self.totals[pool] += int(n_bytes) - old
        self.peak[pool] = max(self.peak[pool], self.totals[pool])
        self._resize_page_cache()

    def get(self, pool: str, name: str) -> int:
        return self.held.get((pool, name), 0)

    def used(self, pool: str) -> int:
        return self.totals[pool]

    def vram_free(self) -> int:
        """What cudaMemGetInfo reports free: device memory nobody holds. On unified memory the pool's free
        part, page cache included (the OS reclaims it on demand), within the GPU's allocatable share."""
        gpu_free = self.vram_total - self.used("vram")
        if not self.unified:
            return gpu_free
        return max(0, min(gpu_free, self.ram_total - self.os_reserved - self.used("vram") - self.used("ram")))

    def ram_available(self) -> int:
        """What the OS reports available (MemAvailable / ullAvailPhys): RAM nobody holds, page cache included."""
        taken = self.os_reserved + self.used("ram") + (self.used("vram") if self.unified else 0)
        return max(0, self.ram_total - taken)

    def _resize_page_cache(self) -> None:
        if self.page_cache is not None:
            self.page_cache.set_capacity(self.ram_available())

    def allocations(self) -> list[dict]:
        return [{"pool": p, "name": n, "bytes": b} for (p, n), b in sorted(self.held.items())]


class Machine:
    """One machine built from a hardware profile for one run (fresh state every run)."""

    def __init__(self, env: simpy.Environment, profile, extent_bytes: np.ndarray, whole_logs: bool = True):
        """whole_logs: the FIFO servers log every job (links.parquet, the report), else only their first, which is
        all a run's summary reads of them: which servers worked (their totals are counted either way)."""
        self.env, self.profile = env, profile
        self.whole_logs = whole_logs
        rates = profile.copy_rates()
        self.rates = rates
        self.unified = profile.is_unified
        link = "in-pool copies" if self.unified else "PCIe"
        self.dram = SharedBandwidth(env, "host DRAM", profile.host.dram_bandwidth_gbps.value * 1e9)
        # a DMA over PCIe reads (or writes) host DRAM once per byte; a copy inside a unified pool does both
        traffic = 2.0 if self.unified else 1.0
        self.gpu = Server(env, "GPU compute stream", whole_log=whole_logs)
        self.h2d = Server(env, f"H2D copy engine ({link})", bytes_per_s=rates["h2d_pinned"],
                          op_latency_s=rates["latency_s"], dram=self.dram, dram_traffic=traffic,
                          pageable_bytes_per_s=rates["h2d_pageable"], whole_log=whole_logs)
        self.d2h = Server(env, f"D2H copy engine ({link})", bytes_per_s=rates["d2h_pinned"],
                          op_latency_s=rates["latency_s"], dram=self.dram, dram_traffic=traffic,
                          pageable_bytes_per_s=rates["d2h_pageable"], whole_log=whole_logs)
        lat = profile.latency
        self.d2d = Server(env, "D2D copies", bytes_per_s=profile.d2d.copy_gbps.value * 1e9,
                          op_latency_s=lat.memcpy_call_us.value * 1e-6, whole_log=whole_logs)
        ssd = profile.ssd
        self.ssd = Ssd(env, "SSD", [(p.queue_depth, p.value * 1e9) for p in ssd.read_gbps_by_queue_depth],
                       ssd.read_request_kib.value * KIB, ssd.request_latency_us.value * 1e-6,
                       ssd.max_request_kib.value * KIB)
        self.page_cache = PageCache(extent_bytes, 0, INACTIVE_SHARE_BY_OS.get(profile.os, LRU_SHARE))
        self.memory = Memory(profile, self.page_cache)
        self.memcpy_bytes_per_s = profile.host.memcpy_gbps.value * 1e9
        self.expert_kernel_bytes_per_s = profile.host.expert_kernel_gbps.value * 1e9  # one core's
        # one core's rate in mainline ggml's CPU kernel per GGML type, where the profile measured this host
        self._own_ggml_kernel = {t: q.value * 1e9 for t, q in (profile.host.ggml_kernel_gbps or {}).items()}
        # threads beyond the physical cores share a core's vector units (SMT): they add no expert-kernel throughput
        # [E: the kernels are compute-bound per core]; llama.cpp's default -t is the physical cores for this reason
        self.physical_cores = int(profile.host.physical_cores.value)
        self.vram_read_bytes_per_s = profile.gpu.dram_bandwidth_gbps.value * 1e9 * VRAM_READ_EFFICIENCY
        attention = profile.gpu.attention_tflops
        self.attention_flops_per_s = None if attention is None else attention.value * 1e12
        self.sync_s = lat.device_sync_us.value * 1e-6
        self.memcpy_call_s = lat.memcpy_call_us.value * 1e-6
        self.kernel_launch_s = lat.kernel_launch_us.value * 1e-6
        self.stream_event_s = WDDM_STREAM_EVENT_S if profile.wddm else 0.0
        self._servers: list = [self.gpu, self.h2d, self.d2h, self.d2d, self.ssd, self.dram]

    def own_ggml_kernel(self, type_name: str) -> float | None:
        """One core of this host in ggml's CPU kernel for a GGML type (bytes/s) where the profile measured it
        (host.ggml_kernel_gbps, python -m sim.calibrate.ggml_kernels); None elsewhere."""
        return self._own_ggml_kernel.get(type_name)

    def threads(self, name: str, n: int = 1) -> Server:
        """A pool of n host threads of the engine (a FIFO server with n lanes)."""
        server = Server(self.env, name, lanes=n, host_thread=True, whole_log=self.whole_logs)
        self._servers.append(server)
        return server

    def memcpy(self, thread: Server, n_bytes: float, n_threads: int = 1, kind: str = "memcpy") -> simpy.Event:
        """`n_threads` CPU threads copying n_bytes in host RAM (page cache -> pinned staging, say): a DRAM job
        of twice the bytes (read + write), each thread at most the profile's one-thread copy rate. The calling
        process yields the event at once (`yield machine.memcpy(...)`); the thread server logs the copy."""
        return self._dram_job(thread, MEMCPY_TRAFFIC * n_bytes, n_bytes, self.memcpy_cap(n_threads), kind,
                              at_once=True)

    def compiled_step_figures(self) -> np.ndarray:
        """The rates and latencies a compiled engine step prices its lone jobs with (sim/machine/chains.py names
        their places)."""
        figures = np.empty(chains.N_STEP_FIGURES)
        h2d, d2d, ssd = self.h2d, self.d2d, self.ssd
        figures[chains.H2D_OP_LATENCY_S], figures[chains.H2D_RATE] = h2d.op_latency_s, h2d.bytes_per_s
        figures[chains.H2D_PAGEABLE_RATE], figures[chains.H2D_DRAM_TRAFFIC] = h2d.pageable_bytes_per_s, h2d.dram_traffic
        figures[chains.DRAM_CAPACITY], figures[chains.PREAD_CAP] = self.dram.capacity, self.memcpy_cap(1)
        figures[chains.MEMCPY_TRAFFIC_PER_BYTE] = MEMCPY_TRAFFIC
        figures[chains.DRIVE_LATENCY_S], figures[chains.DRIVE_RATE_QD1] = ssd.latency_s, ssd.rate_at(1)
        figures[chains.D2D_RATE], figures[chains.D2D_PAGEABLE_RATE] = d2d.bytes_per_s, d2d.pageable_bytes_per_s
        return figures

    def memcpy_cap(self, n_threads: int) -> float:
        """The DRAM traffic `n_threads` copying threads can draw at most, bytes/s."""
        return MEMCPY_TRAFFIC * n_threads * self.memcpy_bytes_per_s

    def cpu_kernel(self, thread: Server, n_bytes: float, n_threads: int, kind: str = "CPU kernel") -> simpy.Event:
        """`n_threads` threads running an expert kernel over n_bytes of weights in host RAM (a CPU expert pool): a
        DRAM job of the bytes read, each physical core at most the profile's expert kernel rate, sharing DRAM with the
        copies and DMA in flight. Issued now; the event fires when it is done, the thread server logs it."""
        return self._dram_job(thread, n_bytes, n_bytes, self._cores(n_threads) * self.expert_kernel_bytes_per_s, kind)

    def cpu_expert_matmul(self, thread: Server, read_bytes: float, work_bytes: float, n_threads: int,
                          kind: str = "CPU expert matmul", core_bytes_per_s: float | None = None) -> simpy.Event:
        """`n_threads` cores multiplying a batch of tokens by experts in host RAM (llama.cpp's mul_mat_id on the
        CPU): each distinct expert's weights come out of DRAM once (read_bytes), while the dot products pass over
        work_bytes of weights (an expert's bytes once per token routed to it) at a kernel rate per core: the
        engine's own kernels' (`core_bytes_per_s`, their code on this CPU), else the profile's expert kernel rate.
        A DRAM job of the bytes read that lasts at least work_bytes / (n_threads x that rate); with one token the
        two are equal. The calling process yields the event at once."""
        if work_bytes <= 0:
            return self.env.timeout(0)
        per_core = self.expert_kernel_bytes_per_s if core_bytes_per_s is None else core_bytes_per_s
        cap = self._cores(n_threads) * per_core * read_bytes / work_bytes
        return self._dram_job(thread, read_bytes, work_bytes, cap, kind, at_once=True)

    def _cores(self, n_threads: int) -> int:
        return min(n_threads, self.physical_cores)

    def _dram_job(self, thread: Server, traffic: float, n_bytes: float, cap_bytes_per_s: float,
                  kind: str, at_once: bool = False) -> simpy.Event:
        """A DRAM job the thread server logs when it ends. `at_once`: the caller yields the event at once
        (SharedBandwidth.transfer), so it may be over already, the clock moved to its end."""
        start = self.env.now
        done = self.dram.transfer(traffic, cap_bytes_per_s, kind, at_once=at_once)
        if done.callbacks is None:  # processed: the job ended where the clock is now
            thread.record(start, self.env.now, n_bytes, 1, kind)
        else:
            done.callbacks.append(lambda _e: thread.record(start, self.env.now, n_bytes, 1, kind))
        return done

    def vram_read_s(self, n_bytes):
        """GPU time to stream n_bytes of weights out of VRAM (a number or an array of them): compute, not a
        transfer, since nothing else queues for the GPU's memory while its stream runs the kernel."""
        return n_bytes / self.vram_read_bytes_per_s

    def attention_s(self, flops, default_s_per_flop: float):
        """GPU time of a prompt's attention FLOPs (QK and AV over the context) at the profile's measured attention
        throughput; a profile without one leaves the rate to the caller's default (an engine's own figure)."""
        rate = self.attention_flops_per_s
        return flops * (default_s_per_flop if rate is None else 1.0 / rate)

    def stream_events_s(self, n_events: int) -> float:
        """The compute stream's idle time for n_events cross-stream waits and records issued on it."""
        return n_events * self.stream_event_s

    def host_read(self, n_bytes: float, kind: str = "host read over PCIe"):
        """A kernel on the GPU stream reading n_bytes of (pinned or mapped) host memory in place, over the link:
        it starts when the stream reaches it, its bytes cross the link as a job of the H2D copy engine's (no
        copy call, so no fixed cost: it queues behind the copies issued before it and slows those after it),
        and the stream is held until they are in. A process: `yield from machine.host_read(...)`."""
        if not n_bytes:
            return
        if self.gpu.idle_at() > self.env.now:
            yield self.gpu.drained()
        start = self.env.now
        yield self.h2d.copy(n_bytes, 0, kind)
        self.gpu.record(start, self.env.now, 0, 0, kind)

    def stream_d2d(self, n_bytes: float, n_copies: int, kind: str = "D2D memcpy", gather_kernel: bool = False) -> None:
        """Device-to-device copies enqueued on the GPU's compute stream (the legacy default stream serialises
        them with the kernels): a cudaMemcpy's call cost per copy, or one gather kernel's launch, plus the bytes
        at the device's copy rate. Enqueued now; a sync on the stream waits for them."""
        self.gpu.book(self.stream_d2d_s(n_bytes, n_copies, gather_kernel), n_bytes, n_copies, kind)

    def stream_d2d_s(self, n_bytes: float, n_copies: int, gather_kernel: bool = False) -> float:
        """The stream's time for `stream_d2d`'s copies."""
        fixed = self.kernel_launch_s if gather_kernel else n_copies * self.memcpy_call_s
        return fixed + self.d2d.cost_s(n_bytes, 0)

    def probe_h2d_gbps(self) -> float:
        """What an engine's startup bandwidth probe of pinned host -> device copies measures, GB/s."""
        return self.h2d.bytes_per_s / 1e9

    def alloc_seconds(self, n_bytes: int, release: bool) -> float:
        """cudaMalloc / cudaFree of n_bytes, host time (the profile's fixed + per-GiB fit)."""
        lat = self.profile.latency
        if release:
            return (lat.cuda_free_us.value + lat.cuda_free_us_per_gib.value * n_bytes / GIB) * 1e-6
        return (lat.cuda_malloc_us.value + lat.cuda_malloc_us_per_gib.value * n_bytes / GIB) * 1e-6

    def servers(self) -> list:
        """Every resource with a busy log, in a stable order (links.parquet, the report)."""
        return [s for s in self._servers if s.log]
