"""Strata's sessions (strata-engine.md §3.7): in-session checkpoints, and the conversation cache's parking and
restoring of sessions as a workload switches conversations (the rules: conversations.py)."""

from __future__ import annotations

from sim.engines.strata.conversations import ParkedConversation, park_conversation

# fmt: off
RUNNING_STATE_BYTES = 118_000_000         # GDN recurrences + conv, QSA indexer tails, PLE history (§2.1, §3.7)
# Parked K/V per token: a 162,150-token snapshot is 3.85 GB (IQ3_S, INT8 KV; §3.7) less one running state.
PARKED_BYTES_PER_TOKEN = (3_850_000_000 - RUNNING_STATE_BYTES) // 162_150          # 23,016 B
# Copies per capture/restore: K and V of 12 QSA layers + the draft layer, recurrence and conv state of 36 GDN
# layers, 12 indexer tails, the PLE history (§2.1; our count of the tensors, each one cudaMemcpy).
SESSION_COPIES = 2 * (12 + 1) + 2 * 36 + 12 + 1
RESTORE_CHECK_TOKENS = 984                # the fork's A->B->A check restored a 984-token checkpoint in ~26 ms
# fmt: on


def session_bytes(tokens: int) -> int:
    """Bytes of a parked session or restore: K/V of `tokens` plus one running state."""
    return RUNNING_STATE_BYTES + tokens * PARKED_BYTES_PER_TOKEN


class Sessions:
    """The live session, the parked ones, each conversation's tokens so far, and the copies between them."""

    def __init__(self, run):
        self.run = run  # the StrataProcess: its machine, placement and recorder
        self.live: dict | None = None  # {"conv", "tokens"}
        self.parked: tuple[ParkedConversation, ...] = ()
        self.context: dict[str, int] = {}  # a conversation's tokens so far (prompt + output of its last turn)
        self.stats = {"parks": 0, "park_skips": [], "evictions": 0, "restores": []}
        self.checkpoints = 0


    def _parked_bytes(self) -> int:
        return sum(e.bytes for e in self.parked)

    def restore_seconds(self, tokens: int) -> float:
        """A restore of a session of `tokens` tokens on an idle link: one running state + the K/V, copied tensor by
        tensor from pageable host memory, then one sync (the copy engine prices the copies)."""
        m = self.run.m
        n_bytes = session_bytes(tokens)
        return m.h2d.cost_s(n_bytes, SESSION_COPIES, pageable_bytes=n_bytes) + m.sync_s

    def _copy_and_sync(self, link, n_bytes: int, n_copies: int, kind: str):
        """Copies of a session's tensors from or to pageable host memory, then the main thread's sync."""
        run = self.run
        yield link.copy(n_bytes, n_copies, kind, pageable_bytes=n_bytes)
        yield run.main.hold(run.m.sync_s, 0, 1, f"{kind} sync")

    def checkpoint(self, request: int, step_no: int):
        """An in-session checkpoint: the running state copied device -> host; the compute stream waits."""
        run = self.run
        m = run.m
        yield m.gpu.drained()
        start = m.env.now
        yield from self._copy_and_sync(m.d2h, RUNNING_STATE_BYTES, 1, "checkpoint")
        self.checkpoints += 1
        sid = run.rec.step(request=request, phase="prefill", step=step_no, layer=-1, start_s=start, end_s=m.env.now,
                           d2h_bytes=RUNNING_STATE_BYTES, vram_used_bytes=m.memory.used("vram"),
                           ram_used_bytes=m.memory.used("ram"))
        run.rec.copy(sid, "D2H", 1, RUNNING_STATE_BYTES, "running-state", "checkpoint")

    def _park_live(self, request: int, held: int):
        """Park the outgoing live session: make_room, the physical-RAM floor, capture (device -> host)."""
        run = self.run
        place = self.run.place
        live = self.live
        self.live = None
        if live is None or live["tokens"] <= 0:
            return
        entry = ParkedConversation(live["conv"], session_bytes(live["tokens"]), live["tokens"])
        free_ram = run.m.memory.ram_available() - held
        result = park_conversation(self.parked, entry, slots=run.flags.conversation_cache_slots,
                                   budget_bytes=place.conv_budget, held_bytes=held,
                                   available_ram_bytes=free_ram, min_free_bytes=place.conv_floor)
        self.stats["evictions"] += len(result.evicted)
        if not result.parked:
            self.parked = result.entries
            run.m.memory.set("ram", "parked conversations", self._parked_bytes())
            if result.reason != "conversation cache disabled":
                self.stats["park_skips"].append({"request": request, "conversation": live["conv"],
                                                 "reason": result.reason})
            return
        m = run.m
        yield m.gpu.drained()
        start = m.env.now
        yield from self._copy_and_sync(m.d2h, entry.bytes, SESSION_COPIES, "park")
        self.parked = result.entries
        m.memory.set("ram", "parked conversations", self._parked_bytes())
        self.stats["parks"] += 1
        sid = run.rec.step(request=request, phase="prefill", step=-2, layer=-1, start_s=start, end_s=m.env.now,
                           tokens=0, d2h_bytes=entry.bytes, vram_used_bytes=m.memory.used("vram"),
                           ram_used_bytes=m.memory.used("ram"))
        run.rec.copy(sid, "D2H", 1, entry.bytes, "session", "parked")

    def _restore(self, request: int, entry: ParkedConversation, tokens: int):
        run = self.run
        m = run.m
        yield m.gpu.drained()
        start = m.env.now
        nbytes = session_bytes(tokens)
        yield from self._copy_and_sync(m.h2d, nbytes, SESSION_COPIES, "restore")
        self.stats["restores"].append({"request": request, "conversation": entry.name, "tokens": tokens,
                                       "ms": (m.env.now - start) * 1e3})
        sid = run.rec.step(request=request, phase="prefill", step=-1, layer=-1, start_s=start, end_s=m.env.now,
                           tokens=0, h2d_bytes=nbytes, vram_used_bytes=m.memory.used("vram"),
                           ram_used_bytes=m.memory.used("ram"))
        run.rec.copy(sid, "H2D", 1, nbytes, "parked", "session")

    def begin(self, request: int, conv: str, n: int):
        """Pick the resume point (live session or a parked entry of this conversation), park the outgoing
        session if needed, restore the incoming one. Returns the resumed tokens."""
        run = self.run
        resume = 0
        if self.live is not None and self.live["conv"] == conv:
            resume = min(self.live["tokens"], n - 1)
        incoming = None
        for entry in reversed(self.parked):  # newest first
            if entry.name == conv and min(entry.tokens, n - 1) > resume:
                incoming, resume = entry, min(entry.tokens, n - 1)
                break
        if incoming is not None:
            self.parked = tuple(e for e in self.parked if e is not incoming)
            run.m.memory.set("ram", "parked conversations", self._parked_bytes())
        if self.live is not None and (self.live["conv"] != conv or incoming is not None):
            yield from self._park_live(request, incoming.bytes if incoming is not None else 0)
        if incoming is not None:
            yield from self._restore(request, incoming, resume)
        return resume
