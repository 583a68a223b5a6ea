"""Which LoRA adapters are resident on the device: at most `max_loras`, swapped LRU.

An engine keeps every adapter it serves in host memory (`LLMEngine.load_lora`) and at
most `capacity` of them on its device, where a step can use them. The scheduler admits
a waiting sequence of an adapter only if that adapter is resident or can become so: a
free slot, or a resident adapter no running sequence uses (the least recently used one
is evicted). A sequence whose adapter cannot get a slot (every slot serves running
sequences) waits, and the scheduler goes on with the ones behind it. The engine copies
in and drops what `take_changes` reports before the step runs.

A load is what placement tries to avoid (router/placement.py): `loads` counts them,
`evictions` the adapters swapped out for them. Plain Python.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection


class LoRASlots:
    """The resident adapters of one engine, least recently used first.

    Args:
        capacity: How many adapters may be resident at once (`max_loras`).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"max_loras must be at least 1, got {capacity}")
        self.capacity = capacity
        self._resident: OrderedDict[str, None] = OrderedDict()
        self._changes: list[tuple[str, str]] = []
        self.loads = 0
        self.evictions = 0

    @property
    def resident(self) -> list[str]:
        """The resident adapters, least recently used first."""
        return list(self._resident)

    def __contains__(self, name: object) -> bool:
        return name in self._resident

    def can_admit(self, name: str, in_use: Collection[str]) -> bool:
        """Whether a sequence of adapter `name` can run beside sequences of `in_use`."""
        return (
            name in self._resident
            or len(self._resident) < self.capacity
            or any(other not in in_use for other in self._resident)
        )

    def admit(self, name: str, in_use: Collection[str]) -> None:
        """Make `name` resident (the most recently used), evicting the least recently used
        adapter outside `in_use` when every slot is taken. Call after `can_admit`."""
        if name in self._resident:
            self._resident.move_to_end(name)
            return
        if len(self._resident) >= self.capacity:
            victim = next((other for other in self._resident if other not in in_use), None)
            if victim is None:
                raise RuntimeError(f"no slot for LoRA adapter {name!r}: every one is in use")
            del self._resident[victim]
            self._changes.append(("evict", victim))
            self.evictions += 1
        self._resident[name] = None
        self._changes.append(("load", name))
        self.loads += 1

    def touch(self, names: Collection[str]) -> None:
        """The adapters a step uses are the most recently used."""
        for name in names:
            if name in self._resident:
                self._resident.move_to_end(name)

    def forget(self, name: str) -> None:
        """The adapter was unloaded from the engine: drop its slot (no eviction counted)."""
        if self._resident.pop(name, 0) is None:
            self._changes.append(("evict", name))

    def free(self, in_use: Collection[str]) -> int:
        """Slots an adapter could take now without waiting: empty ones, and those of
        adapters no running sequence uses."""
        return self.capacity - len(self._resident) + sum(n not in in_use for n in self._resident)

    def take_changes(self) -> list[tuple[str, str]]:
        """("load" | "evict", adapter) since the last call, in order."""
        changes, self._changes = self._changes, []
        return changes
