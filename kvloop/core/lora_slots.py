"""Which LoRA adapters hold which of `max_loras` slots: least recently used out first.

Pure bookkeeping shared by the model runner (`kvloop.model.lora.LoRASlots`, which copies
weights into a slot) and the simulator (which models the copy's time). Owner: whoever holds
the `SlotLRU`; the scheduler guarantees a step needs at most `max_loras` adapters
(`kvloop.core.waiting.AdapterSlots`).
"""

from __future__ import annotations

from collections import OrderedDict


class SlotLRU:
    """name -> slot for at most `num_slots` names, in least-recently-used order."""

    def __init__(self, num_slots: int):
        self.resident: OrderedDict[str, int] = OrderedDict()   # oldest first
        self._free = list(range(num_slots - 1, -1, -1))

    def activate(self, names: set[str]) -> tuple[dict[str, int], list[str]]:
        """Give every name of `names` a slot, evicting least recently used names not in
        `names` -> (name -> slot, the names that were not resident and must be loaded).
        RuntimeError if `names` outnumber the slots."""
        if len(names) > len(self.resident) + len(self._free) or len(names) > self.num_slots:
            raise RuntimeError(f"a step uses {len(names)} adapters, over --max-loras")
        for name in sorted(names):
            if name in self.resident:
                self.resident.move_to_end(name)
        loads = sorted(n for n in names if n not in self.resident)
        for name in loads:
            self.resident[name] = self._take_slot(names)
        return {n: self.resident[n] for n in names}, loads

    @property
    def num_slots(self) -> int:
        return len(self.resident) + len(self._free)

    def drop(self, name: str) -> None:
        """Free `name`'s slot (if it has one)."""
        slot = self.resident.pop(name, None)
        if slot is not None:
            self._free.append(slot)

    def _take_slot(self, keep: set[str]) -> int:
        if self._free:
            return self._free.pop()
        victim = next(n for n in self.resident if n not in keep)
        return self.resident.pop(victim)
