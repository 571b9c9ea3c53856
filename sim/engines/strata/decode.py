"""Strata's decode: verify windows, each through the 48 layers (verify.cpp @ 0165063d), and the adaptive tier.

A decode step is a verify window: the MTP draft proposes tokens, one CUDA graph runs the window's T tokens through
the 48 layers, and the window emits the accepted drafts + 1. Per layer the GPU runs the dense chain, then the host
plans each distinct routed expert: a VRAM hit, a PCIe read by the GPU (a share of the misses whose blob is in pinned
RAM), or the CPU expert pool; the GPU's hits and PCIe share run while the pool computes its misses, and the next
layer waits for both (expert_pool_dispatch_multi). Every adapt-every rounds the adaptive tier swaps hot pairs in on
a side stream. The PCIe share crosses the link as a job of the H2D copy engine's (machine.host_read), so it waits
for the swaps issued before it, and the pool's kernels share host DRAM with the DMA in flight
(machine.cpu_kernel).
"""

from __future__ import annotations

import numpy as np

from sim.engines.strata.geometry import KV_BYTES_PER_CELL_LAYER, qsa_layers
from sim.engines.strata.memory import pack_weights
from sim.engines.strata.pricing import Q2_0_BLOB_BYTES
from sim.engines.strata.startup import FILE, RAM_PINNED
from sim.trace.format import MISSING
from sim.units import MIB

# fmt: off
PCIE_FRAC_NATIVE = 0.55                            # default share of the misses read over PCIe, native packs
PCIE_FRAC_CANONICAL_Q2_0 = 0.2                     # the canonical Q2_0 pack's fixed share ("never measured
                                                   # against the link")
PCIE_PROBE_FULL_GBPS = 20.0                        # probe >= 20 GB/s: the full default share
PCIE_PROBE_NONE_GBPS = 4.0                         # probe < 4 GB/s: no PCIe share
PCIE_PROBE_SCALE_GBPS = 26.0                       # between: base x bw / 26 ("measured on x16 links (~26-28 GB/s)")
PCIE_FRAC_FLOOR = 0.05                             # ... but at least 0.05
PCIE_SHARE_UNITS = 256                             # m = floor(nmiss x round(256 f) / 256)
PCIE_STAGING_BLOBS = 16                            # kStagingBlobs: at most 16 PCIe blobs per window layer
MAX_VERIFY_TOKENS = 8                              # kVerifyMaxT: a verify window's tokens (o.spec = min(spec + 2, 8))
# fmt: on


def pcie_frac(probe_gbps: float, canonical_q2_0: bool) -> float:
    """--pcie-frac when not given (generate.cpp probe_pcie_h2d_gbps): 0.2 for the canonical Q2_0 pack; for native
    packs 0.55 at >= 20 GB/s, none below 4 GB/s, else min(0.55, max(0.05, 0.55 x bw / 26))."""
    if canonical_q2_0:
        return PCIE_FRAC_CANONICAL_Q2_0
    if probe_gbps >= PCIE_PROBE_FULL_GBPS:
        return PCIE_FRAC_NATIVE
    if probe_gbps < PCIE_PROBE_NONE_GBPS:
        return 0.0
    return min(PCIE_FRAC_NATIVE, max(PCIE_FRAC_FLOOR, PCIE_FRAC_NATIVE * probe_gbps / PCIE_PROBE_SCALE_GBPS))


def pcie_share(misses: np.ndarray, pinned_misses: np.ndarray, frac: float) -> np.ndarray:
    """Per layer, how many of its distinct missed experts the GPU reads over PCIe: floor(nmiss x round(256 f) /
    256), at most the 16 staging blobs, and only blobs in pinned host memory."""
    num = round(PCIE_SHARE_UNITS * frac)
    m = (np.asarray(misses, np.int64) * num) // PCIE_SHARE_UNITS
    return np.minimum(np.minimum(m, PCIE_STAGING_BLOBS), np.asarray(pinned_misses, np.int64))


def spread(mean: float, count: int) -> np.ndarray:
    """`count` whole numbers whose running sum follows count x mean as closely as whole numbers can (a window of
    2.8 tokens on average: 3, 3, 2, 3, 3, ...)."""
    edges = np.floor(np.arange(count + 1) * mean + 0.5).astype(np.int64)
    return np.diff(edges)

# fmt: off
QSA_ATTENDED_CELLS = 2048                 # QSA reads ~2048 selected cells per query (§2.1)
QSA_POOLED_KEY_BYTES_PER_CELL = 128       # the indexer scores one 512 B pooled key per 4 cells, per query (qsa.hpp)
MTP_DRAFT_DENSE_BYTES = 111 * MIB         # the draft layer's dense weights ("experts 675, dense 111" MiB, logs)
DECODE_COMMIT_S = 0.5e-3                  # commit + emit after a window: 0.4-0.6 ms on 4090 / V100 decode logs
ADAPT_MIN_USAGE = 2.0                     # adaptive tier: candidates need usage >= 2.0 (§3.1)
ADAPT_MARGIN = 1.5                        # swap while candidate >= victim + 1.5 (§3.1)
ADAPT_DECAY = 0.7                         # usage x 0.7 after each adapt (§3.1)
# fmt: on


class Decode:
    """The figures a verify window is built from, its windows, and the adaptive tier's swaps."""

    def __init__(self, run, domain):
        self.run = run  # the StrataProcess: its figures, machine, placement and recorder
        layout, host = run.scenario.layout, run.hw.host
        weights = pack_weights(layout.name)
        self.head_bytes = weights.head_bytes
        self.dense_layer_bytes = (weights.dense_bytes - weights.head_bytes) / run.n_layers
        self.layer_latency_s = domain.use("strata-decode-layer-latency",
                                          "Strata's GPU time per decode layer beyond its weights").value * 1e-6
        # the pool: a worker per physical core but the host's, and the host thread joining each drain; its expert
        # kernels share host DRAM with the copies in flight (machine.cpu_kernel)
        self.pool_threads = int(host.physical_cores.value)
        self.pool = run.m.threads(f"strata expert pool ({self.pool_threads} threads)")
        flags = run.flags
        self.pcie_frac = pcie_frac(run.m.probe_h2d_gbps(), run.canonical_q2_0) if flags.pcie_frac is None \
            else flags.pcie_frac
        self.qsa_layer = qsa_layers(run.n_layers)
        drafts = run.scenario.engine.drafts
        widest = min(flags.spec + 2, MAX_VERIFY_TOKENS) if flags.spec else 1
        self.window_tokens = min(drafts.window_tokens, widest)
        self.tokens_per_window = min(drafts.tokens_per_window, self.window_tokens)
        # one draft step: the draft layer's dense weights and its top-k Q2_0 experts (all in VRAM), one layer's latency
        self.draft_step_s = run.m.vram_read_s(MTP_DRAFT_DENSE_BYTES + run.top_k * Q2_0_BLOB_BYTES) + self.layer_latency_s
        self.usage = np.zeros(run.n_layers * run.n_experts, dtype=np.float64)
        self.rounds = 0
        self.swaps = 0


    def _window(self, request: int, step_no: int, rows: np.ndarray, emitted: int, context_tokens: int):
        """One verify window of len(rows) tokens emitting `emitted` of them, layer by layer: the GPU's dense chain
        (the layer's weights read from VRAM + its fixed latency; on QSA layers the indexer's scan of every cell's
        pooled key, and the K/V blocks outside the VRAM window read from host RAM over PCIe first), then the
        layer's distinct routed experts: once the router is done the host starts the CPU pool on its misses and
        the GPU reads the PCIe share over the link, then runs the VRAM hits and that share; the next layer waits
        for both. A layer with no miss off the GPU needs no wait: its kernels and the next layer's queue on the
        stream. Then the head, the draft steps and the commit."""
        run = self.run
        place = self.run.place
        m = run.m
        E = run.n_experts
        pairs = (rows.astype(np.int64) + run.layer_offsets)[rows != MISSING]
        routed = np.unique(pairs)
        layer_of = routed // E
        hit = place.on_gpu[routed]
        L = run.n_layers
        n_hit = np.bincount(layer_of[hit], minlength=L)
        miss = routed[~hit]
        miss_layer = layer_of[~hit]
        n_miss = np.bincount(miss_layer, minlength=L)
        n_pinned_miss = np.bincount(miss_layer[place.home[miss] == RAM_PINNED], minlength=L)
        n_pcie = pcie_share(n_miss, n_pinned_miss, self.pcie_frac)
        blob = run.layer_blob.astype(np.float64)
        cpu_bytes = (n_miss - n_pcie) * blob
        pcie_bytes = n_pcie * blob
        start = m.env.now
        # the pool's misses whose blob is in no RAM tier are read from the mapped files first (page faults)
        file_miss = miss[place.home[miss] == FILE]
        if len(file_miss):
            missed = file_miss[~m.page_cache.access(file_miss)]
            drive = int(run.pair_blob[missed].sum())
            if drive:
                yield m.ssd.read(drive, m.ssd.fault_reads(drive), min(self.pool_threads, len(missed)), at_once=True)
        T = len(rows)
        dense_s = np.full(L, self.layer_latency_s + m.vram_read_s(self.dense_layer_bytes))
        dense_s[self.qsa_layer] += m.vram_read_s(T * context_tokens * QSA_POOLED_KEY_BYTES_PER_CELL)
        kv_host_bytes = 0.0
        if run.kv_cells is not None and context_tokens > run.kv_cells:  # selected blocks outside the VRAM window
            kv_host_bytes = QSA_ATTENDED_CELLS * (context_tokens - run.kv_cells) / context_tokens \
                * KV_BYTES_PER_CELL_LAYER[run.flags.kv]
        expert_s = m.vram_read_s((n_hit + n_pcie) * blob)
        off_gpu = (cpu_bytes > 0) | (pcie_bytes > 0)
        gpu, env = m.gpu, m.env
        # each layer's figures as Python values: a numpy scalar reaching the servers' clocks makes every sum after
        # it numpy arithmetic
        layers = zip(self.qsa_layer.tolist(), dense_s.tolist(), off_gpu.tolist(), expert_s.tolist(),
                     (n_hit * blob).tolist(), ((n_hit + n_pcie) * blob).tolist(), cpu_bytes.tolist(),
                     pcie_bytes.tolist())
        for qsa, dense, off, experts_s, hit_bytes, vram_bytes, cpu, pcie in layers:
            if kv_host_bytes and qsa:
                yield from m.host_read(kv_host_bytes, "decode K/V blocks from host")
            gpu.book(dense, self.dense_layer_bytes, 1, "decode dense chain")
            if not off:
                gpu.book(experts_s, hit_bytes, 1, "decode experts (VRAM hits, PCIe share)")
                continue
            yield gpu.drained()  # the router's choice: the host plans the layer's experts
            pool = m.cpu_kernel(self.pool, cpu, self.pool_threads, "decode misses (CPU pool)") if cpu else None
            if pcie:
                yield from m.host_read(pcie, "decode experts (PCIe share)")
            gpu.book(experts_s, vram_bytes, 1, "decode experts (VRAM hits, PCIe share)")
            if pool is not None:
                yield pool
            if gpu.idle_at() > env.now:
                yield gpu.drained()
        gpu.book(m.vram_read_s(self.head_bytes) + (T - 1) * self.draft_step_s + DECODE_COMMIT_S, self.head_bytes, 1,
                 "head, draft, commit")
        yield gpu.drained()
        np.add.at(self.usage, pairs, 1.0)
        self.rounds += 1
        inserts = d2h = h2d = file_reads = 0
        if run.flags.adapt_every and self.rounds % run.flags.adapt_every == 0 and run.flags.adapt_swaps:
            inserts, h2d, d2h, file_reads = self._adapt()
        pair_hits = place.on_gpu[pairs]
        run.rec.step(request=request, phase="decode", step=step_no, layer=-1, start_s=start, end_s=m.env.now,
                     tokens=emitted, lookups=len(pairs), hits=int(pair_hits.sum()), inserts=inserts,
                     evictions=inserts, h2d_bytes=int((n_pcie * blob).sum()) + h2d, d2h_bytes=d2h,
                     file_read_bytes=int(run.pair_blob[file_miss].sum()), file_blob_reads=len(file_miss) + file_reads,
                     vram_used_bytes=m.memory.used("vram"), ram_used_bytes=m.memory.used("ram"))

    def decode(self, request: int, rows: np.ndarray, context_tokens: int):
        """The decode loop: windows of window_tokens routed tokens (the next rows of the trace) that emit
        tokens_per_window of them on average, until every output token is out."""
        n = len(rows)
        if not n:
            return
        count = int(np.ceil(n / self.tokens_per_window)) + 1
        widths, emits = spread(self.window_tokens, count), spread(self.tokens_per_window, count)
        done = step = 0
        while done < n:
            width = max(1, int(widths[step % count]))
            emit = max(1, min(int(emits[step % count]), width, n - done))
            yield from self._window(request, step, rows[done: done + width], emit, context_tokens + done)
            done += emit
            step += 1

    def _adapt(self) -> tuple[int, int, int, int]:
        """Adaptive tier: per layer pair the hottest non-resident pairs (usage >= 2) with the coldest resident
        ones while candidate >= victim + 1.5; best gains first, at most adapt-swaps. The incoming blob is copied
        into the victim's slot on a side stream (the decode does not wait). RAM copies follow
        exchange_cache_complement (src/core/expert_source.cpp, indexed copy 70874746903) and resident_stage_swaps
        (generate.cpp @ 0083bb7a, which skips the exchange when the victim's lend-region copy is in RAM already or
        the incoming pair has none): only when the incoming pair has a RAM copy and the victim has none do the
        victim's bytes go device -> host into the incoming pair's RAM place (homes exchanged); otherwise each keeps
        what it had, so an incoming pair from the file tier lands in the victim's slot without a RAM copy and a
        covered victim keeps its lend copy ("Adaptive swaps left later borrowers outside RAM", LIVE_MEMORY.md)."""
        run = self.run
        place = self.run.place
        E = run.n_experts
        usage = self.usage.reshape(run.n_layers, E)
        on_gpu = place.on_gpu.reshape(run.n_layers, E)
        gains, cands, victims = [], [], []
        for layer in range(run.n_layers):
            u = usage[layer]
            free_pair = place.slot_of[layer * E: (layer + 1) * E] < 0
            cand = np.flatnonzero(~on_gpu[layer] & (u >= ADAPT_MIN_USAGE) & free_pair)
            res = np.flatnonzero(on_gpu[layer])
            if not len(cand) or not len(res):
                continue
            cand = cand[np.argsort(-u[cand], kind="stable")]
            res = res[np.argsort(u[res], kind="stable")]
            n = min(len(cand), len(res))
            gain = u[cand[:n]] - u[res[:n]]
            ok = gain >= ADAPT_MARGIN
            gains.append(gain[ok])
            cands.append(cand[:n][ok] + layer * E)
            victims.append(res[:n][ok] + layer * E)
        self.usage *= ADAPT_DECAY
        if not gains:
            return 0, 0, 0, 0
        gain, cand, victim = np.concatenate(gains), np.concatenate(cands), np.concatenate(victims)
        keep = np.argsort(-gain, kind="stable")[: run.flags.adapt_swaps]
        cand, victim = cand[keep], victim[keep]
        if not len(cand):
            return 0, 0, 0, 0
        slots = place.slot_of[victim]
        homes_in = place.home[cand].copy()
        blobs = run.pair_blob[cand]
        place.slot_of[cand], place.slot_of[victim] = slots, -1
        place.pair_of_slot[slots] = cand
        place.on_gpu[cand], place.on_gpu[victim] = True, False
        # the arena holds every pair, so no victim lacks a RAM copy there and nothing is exchanged
        exchange = (homes_in != FILE) & (place.home[victim] == FILE)
        place.home[victim[exchange]] = homes_in[exchange]
        place.home[cand[exchange]] = FILE
        h2d = int(blobs.sum())
        pageable = h2d - int(blobs[homes_in == RAM_PINNED].sum())
        # a side stream: nobody waits for the copies, which hold the link against the next windows' PCIe reads
        run.m.h2d.book_copy(h2d, len(cand), "adaptive swap", pageable_bytes=pageable)
        d2h = 0
        if exchange.any():
            d2h = int(run.pair_blob[victim[exchange]].sum())
            run.m.d2h.book_copy(d2h, int(exchange.sum()), "adaptive swap", pageable_bytes=d2h)
        self.swaps += len(cand)
        return len(cand), h2d, d2h, int((homes_in == FILE).sum())
