"""The bytes of a ds4 miss and the hand-over of a layer's experts to its kernels, as work on the machine.

A miss's three parts (gate, up, down) come from the drive: with DS4_CUDA_NO_DIRECT_IO a buffered pread through
the page cache (a hit is a host memcpy; a miss reads the drive, then copies), the pages dropped again unless
DS4_CUDA_KEEP_MODEL_PAGES; otherwise O_DIRECT reads from the drive into pinned staging (ds4-engine.md §1.8). Each
load records its layer step (steps.parquet) and its copies (copy_plan.parquet).
"""

from __future__ import annotations

import numpy as np

from sim.engines.ds4.geometry import Layers
from sim.engines.ds4.settings import Knobs

PARTS_PER_EXPERT = 3  # gate, up, down: three file ranges, three copies (§1.8)
# A step's copy rows, part by part (gate, up, down), each part's in this order: its loaded experts into their cache
# slots, its experts loaded directly into the compact staging, its experts handed over from their slots to the
# staging; as (kind, source, destination) [part][copy]
COPY_ROUTES = tuple((("H2D", "file", f"slab:{part}"), ("H2D", "file", f"staging:{part}"),
                     ("D2D", f"slab:{part}", f"staging:{part}")) for part in ("gate", "up", "down"))
_ROUTE_COLUMNS = [np.array(column, object) for column in zip(*(route for part in COPY_ROUTES for route in part))]


class Loads:
    """How one run's loader threads move experts: reads, uploads, the pread pool, the hand-over to staging."""

    def __init__(self, machine, layers: Layers, knobs: Knobs, pool: list | None, recorder):
        self.m, self.layers, self.knobs, self.pool, self.rec = machine, layers, knobs, pool, recorder
        self.variant = knobs.variant
        self.page_cache_reads = {"hits": 0, "misses": 0}
        # per layer, Python ints for the step and copy rows (read once per layer step)
        self.expert_bytes = layers.expert_bytes.tolist()
        self.part_bytes = layers.part_bytes.tolist()

    def read(self, thread, layer: int, experts: np.ndarray, depth: int = 1):
        """Read these experts' 3 parts each into pinned staging, the thread waiting (§1.8): buffered preads go
        through the page cache (a hit is a host memcpy, a miss a drive read plus the copy); O_DIRECT reads the
        drive. Returns the bytes that came from the drive."""
        if not len(experts):
            return 0
        m = self.m
        n_bytes = self.expert_bytes[layer] * len(experts)
        if self.knobs.buffered:
            drop_later = not self.knobs.keep_pages  # posix_fadvise / madvise DONTNEED after the copy
            drop_now = drop_later and m.env.runs_alone()  # (see page_cache_read)
            n_miss, drive = self.page_cache_read(layer, experts, drop_now)
            if drive:
                yield m.ssd.read(drive, PARTS_PER_EXPERT * n_miss, depth, at_once=True)
            yield m.memcpy(thread, n_bytes, 1, "pread copy")
            if drop_later and not drop_now:
                m.page_cache.drop(experts, layer * self.layers.n_experts)
            return drive
        yield m.ssd.read(n_bytes, PARTS_PER_EXPERT * len(experts), depth, at_once=True)
        return n_bytes

    def load(self, thread, layer: int, experts: np.ndarray):
        """The engine's streamed copy for each expert: 3 x (read -> H2D on the upload stream -> stream sync),
        one part after another (QD1). Grouped per call: with one thread the chain's time is the sum either way.
        #605's later commits: with no O_DIRECT fd each part is a plain cudaMemcpy from the mapped file (the
        driver's pageable copy, 5930a3f); with one, the ring is kept across an expert's three parts and synced
        once (1c055bb), so the gate and up uploads run while the next part is read."""
        if not len(experts):
            return 0
        m = self.m
        n_parts = PARTS_PER_EXPERT * len(experts)
        n_bytes = self.expert_bytes[layer] * len(experts)
        pr605 = self.variant.miss_copy == "pr605"
        if pr605 and self.knobs.buffered:
            drive = yield from self._map_in(layer, experts)
            # the driver's pageable copy; the call's fixed cost is the thread's cudaMemcpy, not the copy engine's
            m.h2d.book_copy(n_bytes, n_parts, "pageable H2D", pageable_bytes=n_bytes, fixed_costs=0)
            yield m.h2d.synchronize(thread, n_parts * m.memcpy_call_s, n_parts, "cudaMemcpy (pageable)")
            return drive
        drive = yield from self.read(thread, layer, experts)
        if pr605:  # 1c055bb: only the down parts' uploads are left after the reads
            m.h2d.book_copy(int(self.layers.part_bytes[layer, 2]) * len(experts), len(experts))
            n_syncs = len(experts)
        else:
            m.h2d.book_copy(n_bytes, n_parts)
            n_syncs = n_parts
        # the thread's stream syncs: its copy is the last one issued, so the copy engine's queue ends with it
        yield m.h2d.synchronize(thread, n_syncs * m.sync_s, n_syncs, "stream sync")
        return drive

    def _map_in(self, layer: int, experts: np.ndarray):
        """The pages of these experts in the mapped file, as a copy from the mapping touches them: page-cache
        hits are in RAM, misses fault in from the drive one after another; the pages dropped again unless
        DS4_CUDA_KEEP_MODEL_PAGES (as after a buffered pread). Returns the bytes that came from the drive."""
        m = self.m
        drop_later = not self.knobs.keep_pages
        drop_now = drop_later and m.env.runs_alone()  # (see page_cache_read)
        _, drive = self.page_cache_read(layer, experts, drop_now)
        if drive:
            yield m.ssd.read(drive, m.ssd.fault_reads(drive), 1, at_once=True)
        if drop_later and not drop_now:
            m.page_cache.drop(experts, layer * self.layers.n_experts)
        return drive

    def page_cache_lookup(self, layer: int, experts: np.ndarray) -> tuple[np.ndarray, int]:
        """These experts' file extents looked up (and inserted) in the page cache: which were resident, and the
        bytes the others read from the drive; the hits and misses counted."""
        in_ram = self.m.page_cache.access(layer * self.layers.n_experts + experts.astype(np.int64), insert=True)
        n_miss = len(in_ram) - int(np.count_nonzero(in_ram))
        return in_ram, self._count_page_cache_reads(layer, len(in_ram) - n_miss, n_miss)

    def page_cache_read(self, layer: int, experts: np.ndarray, drop: bool) -> tuple[int, int]:
        """`page_cache_lookup` counting the misses only: how many, and the bytes they read from the drive. `drop`:
        the extents dropped again in the same call, where the caller drops them after its copy and nothing else
        can reach the page cache before then: its process runs alone (Environment.runs_alone), and the drive read
        and the copy it waits on in between are its own (a job on a drive or DRAM with another job in flight
        has a completion timer queued, so the process would not run alone)."""
        n_hit = self.m.page_cache.read(layer * self.layers.n_experts, experts, drop)
        n_miss = len(experts) - n_hit
        return n_miss, self._count_page_cache_reads(layer, n_hit, n_miss)

    def _count_page_cache_reads(self, layer: int, n_hit: int, n_miss: int) -> int:
        """The hits and misses counted; the misses' bytes from the drive."""
        self.page_cache_reads["hits"] += n_hit
        self.page_cache_reads["misses"] += n_miss
        return n_miss * self.expert_bytes[layer]

    def stream_whole_layer(self, thread, layer: int):
        """Every expert of the layer through the weight cache's staged copy (cuda_model_range_ptr_from_fd,
        neutronstar @253cfb1 ds4_cuda.cu L1300-1390): one copy chunk read at a time into the pinned ring, each
        uploaded on the upload stream while the next is read, one stream sync at the end. Whole experts per
        chunk (the tensors' chunks do not end on experts; the bytes are the same). Returns the drive's bytes."""
        per_expert = self.expert_bytes[layer]
        per_chunk = max(1, self.knobs.copy_chunk_bytes // per_expert)
        drive = 0
        for first in range(0, self.layers.n_experts, per_chunk):
            group = np.arange(first, min(first + per_chunk, self.layers.n_experts))
            drive += yield from self.read(thread, layer, group)
            self.m.h2d.book_copy(per_expert * len(group), 1)
        yield self.m.h2d.synchronize(thread, self.m.sync_s, 1, "stream sync")
        return drive

    def pool_load(self, layer: int, experts: np.ndarray):
        """#1082's pread pool (and the ROCm runtime's): the misses split over the workers, each reading (its own
        QD1) into its own pinned staging and uploading on its own stream; the reads overlap at the drive, the
        uploads queue on the copy engine. Returns the bytes that came from the drive."""
        env = self.m.env
        workers = len(self.pool)
        shares = [experts[i::workers] for i in range(workers)]
        jobs = [env.process(self.load(worker, layer, share)) for worker, share in zip(self.pool, shares) if len(share)]
        if jobs:
            yield env.all_of(jobs)
        return sum(job.value for job in jobs)

    def to_staging(self, thread, layer: int, n_experts: int, then_s: float = 0.0, then_kind: str = ""):
        """Hand hits (and loaded experts) to the kernels (§1.5): 3 synchronous D2D cudaMemcpy each on the
        default stream (the thread waits; the copies queue behind the kernels); #605 one gather kernel; #1031
        nothing, the kernels read the slots. Then the thread's next call of then_s (the slot-map upload)."""
        n_ops = 1 if then_s else 0
        if not n_experts or self.variant.hit_copy == "none":
            yield thread.hold(then_s, 0, n_ops, then_kind)
            return
        n_bytes = n_experts * self.expert_bytes[layer]
        if self.variant.hit_copy == "memcpy":
            self.m.stream_d2d(n_bytes, PARTS_PER_EXPERT * n_experts, "D2D memcpy")
        else:
            self.m.stream_d2d(n_bytes, 1, "D2D gather kernel", gather_kernel=True)
        yield self.m.gpu.synchronize(thread, then_s, n_ops, then_kind)

    def record(self, row: dict, layer: int, hits: int = 0, loaded: int = 0, direct: int = 0, handed: int = 0,
               drive_bytes: int = 0) -> None:
        """The layer step's row and its copies: loaded into cache slots, loaded directly into staging, handed over."""
        eb = self.expert_bytes[layer]
        fetched = loaded + direct
        memory = self.m.memory
        sid = self.rec.step(**row, end_s=self.m.env.now, h2d_bytes=fetched * eb, d2d_bytes=handed * eb,
                            file_read_bytes=drive_bytes, file_blob_reads=fetched, direct_loads=direct,
                            vram_used_bytes=memory.used("vram"), ram_used_bytes=memory.used("ram"))
        if self.rec.copy_plan:  # (a run that keeps no copy rows, a sweep point, names none)
            self._copies(sid, layer, loaded, direct, handed)

    def record_steps(self, row: dict, layers: list, k: int, hits: list, inserts: list, evictions: list, direct: list,
                     drive_bytes: list, starts: list, ends: list, vram_used: list | None = None) -> None:
        """`record` for layer steps done at once (sim/engines/ds4/decode_chain.py), each figure a list over them:
        `row` the columns they share, each step's experts all looked up (k) and handed over (hits and loads);
        vram_used where the VRAM in use changed between them (None: it is what it is now)."""
        eb = self.expert_bytes
        loaded = [i + e for i, e in zip(inserts, evictions)]
        fetched = [n + d for n, d in zip(loaded, direct)]
        memory = self.m.memory
        ids = self.rec.steps_of(len(layers), **row, layer=layers, start_s=starts, end_s=ends, lookups=k, hits=hits,
                                inserts=inserts, evictions=evictions,
                                h2d_bytes=[n * eb[layer] for n, layer in zip(fetched, layers)],
                                d2d_bytes=[(h + n) * eb[layer] for h, n, layer in zip(hits, loaded, layers)],
                                file_read_bytes=drive_bytes, file_blob_reads=fetched, direct_loads=direct,
                                vram_used_bytes=memory.used("vram") if vram_used is None else vram_used,
                                ram_used_bytes=memory.used("ram"))
        if self.rec.copy_plan:
            self._copies_of_steps(ids, layers, loaded, direct, [h + n for h, n in zip(hits, loaded)])

    def _copies(self, sid: int, layer: int, loaded: int, direct: int, handed: int) -> None:
        """A step's copy rows (COPY_ROUTES): loaded into cache slots, loaded directly into staging, handed over."""
        copy = self.rec.copy
        counts = (loaded, direct, handed if self.variant.hit_copy != "none" else 0)
        for routes, part_bytes in zip(COPY_ROUTES, self.part_bytes[layer]):
            for (kind, source, destination), count in zip(routes, counts):
                if count:
                    copy(sid, kind, count, part_bytes, source, destination)

    def _copies_of_steps(self, ids: range, layers: list, loaded: list, direct: list, handed: list) -> None:
        """`_copies` of steps done at once, as arrays: [step, part, copy] flattened in `_copies`' order."""
        n = len(layers)
        counts = np.array([loaded, direct, handed if self.variant.hit_copy != "none" else [0] * n], np.int64).T
        count = np.broadcast_to(counts[:, None, :], (n, PARTS_PER_EXPERT, 3)).ravel()
        size = np.broadcast_to(self.layers.part_bytes[layers][:, :, None], (n, PARTS_PER_EXPERT, 3)).ravel()
        rows = np.flatnonzero(count)
        route = rows % (3 * PARTS_PER_EXPERT)
        kinds, sources, destinations = (column[route] for column in _ROUTE_COLUMNS)
        self.rec.copies_of(rows // (3 * PARTS_PER_EXPERT) + ids.start, kinds, count[rows], size[rows], sources,
                           destinations)
