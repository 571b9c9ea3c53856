"""Strata's conversation cache (strata-engine.md §3.7), as pure functions: make_room and the physical-RAM floor
admission of a parked session (park_conversation)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sim.schema import check_int
from sim.units import MIB


@dataclass(frozen=True)
class ParkedConversation:
    name: str
    bytes: int
    tokens: int = 0
    pinned: bool = False


@dataclass(frozen=True)
class ParkResult:
    entries: tuple[ParkedConversation, ...]  # oldest first
    evicted: tuple[ParkedConversation, ...]
    parked: bool
    reason: str | None  # why parking was skipped


def conversation_budget_bytes(conv_cache_mib: int, prompt_cache_entries: int) -> int:
    """ConversationCache(budget = M MiB if prompt_cache > 0, else 0 = off) (§3.7)."""
    return check_int("conversation cache", "mib", conv_cache_mib) * MIB if prompt_cache_entries > 0 else 0


def make_room(entries: Sequence[ParkedConversation], slots: int, budget_bytes: int, held_bytes: int,
              incoming_bytes: int) -> tuple[tuple[ParkedConversation, ...], tuple[ParkedConversation, ...], bool]:
    """ConversationCache::make_room (§3.7): evict the oldest non-pinned entries while size >= slots or
    parked bytes > budget - held - incoming. Returns (kept, evicted, room); room False when only pinned
    entries remain and the condition still holds (parking is then skipped)."""
    kept, evicted = list(entries), []

    def crowded() -> bool:
        return len(kept) >= slots or sum(e.bytes for e in kept) > budget_bytes - held_bytes - incoming_bytes

    while crowded():
        victim = next((e for e in kept if not e.pinned), None)
        if victim is None:
            return tuple(kept), tuple(evicted), False
        kept.remove(victim)
        evicted.append(victim)
    return tuple(kept), tuple(evicted), True


def physical_ram_admits(available_ram_bytes: int, min_free_bytes: int, additional_bytes: int) -> bool:
    """Physical-RAM admission (conversation_memory.cpp, §3.7): available - floor >= additional bytes."""
    return available_ram_bytes - min_free_bytes >= additional_bytes


def park_conversation(entries: Sequence[ParkedConversation], incoming: ParkedConversation, *, slots: int,
                      budget_bytes: int, held_bytes: int, available_ram_bytes: int,
                      min_free_bytes: int) -> ParkResult:
    """Park a session (§3.7): make_room for its estimate, check the physical-RAM floor, then put it as the
    newest entry. A disabled cache (budget 0 or no slots) parks nothing. The engine checks the floor
    again after capture; with a fixed estimate that second check is the same one."""
    if budget_bytes <= 0 or slots <= 0:
        return ParkResult(tuple(entries), (), False, "conversation cache disabled")
    kept, evicted, room = make_room(entries, slots, budget_bytes, held_bytes, incoming.bytes)
    if not room:
        return ParkResult(kept, evicted, False, "only pinned entries remain")
    if not physical_ram_admits(available_ram_bytes, min_free_bytes, incoming.bytes):
        return ParkResult(kept, evicted, False, "below the physical-RAM floor")
    return ParkResult(kept + (incoming,), evicted, True, None)
