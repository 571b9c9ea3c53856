"""Strata's loans (strata-engine.md §3.3): the prompt path borrows the cold tail of the expert cache for a prompt's
part, and the refill after the last batched part copies every lent slot back from its source (one sync for the
batch); a lent expert without a RAM copy is a file-blob read. Parts no longer than --short-read run through the
decode verify windows instead."""

from __future__ import annotations

import numpy as np

from sim.engines.strata.lending import lend
from sim.engines.strata.startup import FILE, RAM_PAGEABLE, RAM_PINNED, SOURCE_NAMES, pair_counts


class Loans:
    """The loans of one run, the refills that end them, and the live-memory build's donors."""

    def __init__(self, run):
        self.run = run  # the StrataProcess: its machine, placement, main thread and recorder
        self.max_loan = 0
        self.donor_copies = 0


    def lend(self, tokens: int):
        """lend(tokens): the loan for this part; in the live-memory build a lent expert without a RAM copy
        first takes a same-layer RAM-only expert's place (its GPU bytes copied device -> host)."""
        run = self.run
        place = self.run.place
        loan = lend(place.lend_plan, place.cache.slot_bytes, tokens, place.loan_first, pricing=place.pricing)
        if loan.first_lent_slot is not None and loan.changed:
            first = loan.first_lent_slot
            lent_pairs = place.pair_of_slot[first:]
            if run.build.loan_donors:
                yield from self._donate(lent_pairs)
            place.on_gpu[lent_pairs] = False
            place.loan_first = first
        self.max_loan = max(self.max_loan, place.slots - place.loan_first if place.loan_first is not None else 0)
        return loan.want_tokens

    def _donate(self, lent_pairs: np.ndarray):
        """Live memory's donors ("Refreshing current loan coverage", docs/LIVE_MEMORY.md): for each lent pair whose
        bytes are only on the GPU, a same-layer pair that is not lent gives up its RAM slot, "GPU-backed duplicates
        ... preferred, followed by the coldest measured RAM occupant" (coldest by profile rank here); the lent
        pair's bytes go device -> host there."""
        run = self.run
        place = self.run.place
        uncovered = lent_pairs[place.home[lent_pairs] == FILE]
        if not len(uncovered):
            return
        lent_mask = np.zeros(len(place.home), np.bool_)
        lent_mask[lent_pairs] = True
        rank = np.empty(len(place.rank_pairs), np.int64)
        rank[place.rank_pairs] = np.arange(len(place.rank_pairs))
        moved = 0
        for layer in np.unique(uncovered // run.n_experts):
            want = uncovered[uncovered // run.n_experts == layer]
            lo, hi = layer * run.n_experts, (layer + 1) * run.n_experts
            pairs = np.arange(lo, hi)
            donors = pairs[(place.home[lo:hi] != FILE) & ~lent_mask[lo:hi]]
            # GPU-backed duplicates (their bytes stay in a GPU slot) first, then RAM-only pairs, coldest first
            donors = donors[np.lexsort((-rank[donors], ~place.on_gpu[donors]))]
            n = min(len(want), len(donors))
            place.home[want[:n]] = place.home[donors[:n]]
            place.home[donors[:n]] = FILE
            moved += int(run.pair_blob[want[:n]].sum())
            self.donor_copies += n
        if moved:
            yield run.m.d2h.copy(moved, int(self.donor_copies))

    def refill(self, request: int, step_no: int):
        """Copy every lent slot back from its source on the main thread (one sync for the batch): pinned RAM is
        DMA'd, pageable RAM goes through the driver's pageable copy, and a lent expert with no RAM copy is read
        from the mapped files (a file-blob read: a page-cache hit, or page faults to the drive)."""
        run = self.run
        place = self.run.place
        if place.loan_first is None:
            return 0.0
        m = run.m
        yield m.gpu.drained()
        start = m.env.now
        pairs = place.pair_of_slot[place.loan_first:]
        homes = place.home[pairs]
        blobs = run.pair_blob[pairs]
        b = {code: int(blobs[homes == code].sum()) for code in (RAM_PINNED, RAM_PAGEABLE, FILE)}
        file_pairs = pairs[homes == FILE]
        n_file = len(file_pairs)
        if n_file:
            missed = ~m.page_cache.access(file_pairs)
            drive = int(run.pair_blob[file_pairs[missed]].sum())
            if drive:  # the refill thread's page faults, one after another
                yield m.ssd.read(drive, m.ssd.fault_reads(drive), 1, at_once=True)
        yield m.h2d.copy(int(blobs.sum()), len(pairs), "refill", pageable_bytes=b[RAM_PAGEABLE] + b[FILE])
        yield run.main.hold(m.sync_s + m.memcpy_call_s, 0, 1, "refill sync")
        place.on_gpu[pairs] = True
        place.loan_first = None
        sid = run.rec.step(request=request, phase="prefill", step=step_no, layer=-1, start_s=start, end_s=m.env.now,
                           tokens=0, lookups=len(pairs), inserts=len(pairs), h2d_bytes=int(blobs.sum()),
                           file_read_bytes=b[FILE], file_blob_reads=n_file, lent_slots=len(pairs),
                           vram_used_bytes=m.memory.used("vram"), ram_used_bytes=m.memory.used("ram"))
        for code in (RAM_PINNED, RAM_PAGEABLE, FILE):
            sel = homes == code
            sizes, counts = np.unique(blobs[sel], return_counts=True)
            for size, count in zip(sizes, counts):
                run.rec.copy(sid, "H2D", int(count), int(size), SOURCE_NAMES[code], "cache-slot")
        return m.env.now - start

    def short_read(self, request: int, step_no: int, rows: np.ndarray):
        """A short part through the decode verify windows (every lent slot is back by now)."""
        run = self.run
        place = self.run.place
        routed = pair_counts(rows, run.n_layers, run.n_experts) > 0
        start = run.m.env.now
        per_token_s = run.domain.use("strata-short-read", "a short part's decode-window time per token").value * 1e-3
        yield run.m.gpu.hold(len(rows) * per_token_s, 0, 0, "short read (verify windows)")
        memory = run.m.memory
        run.rec.step(request=request, phase="prefill", step=step_no, layer=-1, start_s=start, end_s=run.m.env.now,
                     tokens=len(rows), lookups=int(routed.sum()), hits=int((routed & place.on_gpu).sum()),
                     vram_used_bytes=memory.used("vram"), ram_used_bytes=memory.used("ram"))
