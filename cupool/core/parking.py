"""The parked stacks uncompiled: ``park.Parking``'s methods over a dict of lists, for a fast path
without a compiler.

Charter: this module knows what ``park.pyx`` knows (blocks, streams as keys, the log) and
nothing more; compiled, the fast path uses ``park.Parking`` instead, and tests/test_park.py
holds the two to the same answers over any sequence of parks, hits and sweeps.
"""

from __future__ import annotations

from typing import Any


class ParkedStack(list[Any]):
    """One of ``DictParking``'s stacks: its blocks, and its last request (park.pxd's ``Stack``)."""

    __slots__ = ("asked", "again")

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0  # the tick of the last request of this size on this stream (0: none)
        self.again = False  # that request came within warm_ticks of the one before it (Note [Cold stacks])


class DictParking:
    """The parked stacks uncompiled: a list per (block size, stream) in a dict, with
    ``park.Parking``'s methods (compiled, a C++ map of vectors that a C caller reaches without
    the GIL); each hit and park is logged (Note [Fast path]).  The pool's lock is held.
    """

    def __init__(self, lock: Any, pending: Any, log: list[int], log_max: int, warm_ticks: int) -> None:
        self.slots: dict[tuple[int, Any], ParkedStack] = {}
        self.tick = 1  # 1 + the requests of sizes not remembered: the stacks' clock
        self.warm_ticks = warm_ticks
        self.cold: list[tuple[int, Any]] = []  # slots parked on empty and cold since the last sweep
        self.log = log
        self.count = 0
        self.ready = False  # no C caller reaches this one: kept as Parking's

    def __len__(self) -> int:
        return self.count

    def is_warm(self, stack: ParkedStack) -> bool:
        """Last asked for within ``warm_ticks``, by a hit or within ``warm_ticks`` of the request before
        (Note [Cold stacks])."""
        return stack.again and self.tick - stack.asked < self.warm_ticks

    def take(self, n: int, size: int, stream: Any) -> Any:
        """A parked block of ``size`` bytes on ``stream`` for ``n`` bytes asked, logged; None if none,
        and the request remembered (Note [Cold stacks])."""
        slot = (size, stream)
        stack = self.slots.get(slot)
        if not stack:
            if stack is None:  # a size not remembered: the clock ticks
                stack = self.slots[slot] = ParkedStack()
                self.tick += 1
            stack.again = stack.asked != 0 and self.tick - stack.asked < self.warm_ticks
            stack.asked = self.tick
            return None
        block = stack.pop()
        stack.asked = self.tick
        stack.again = True  # a parked block asked for: the size recurred
        self.count -= 1
        block.requested = n
        self.log.append(n + 1)
        return block

    def put(self, block: Any, requested: int, stream: Any) -> None:
        """Park ``block`` (its requested size was ``requested``), logged; list a cold stack it starts."""
        slot = (block.size, stream)
        stack = self.slots.get(slot)
        if stack is None:
            stack = self.slots[slot] = ParkedStack()
        if not stack and not (stack.again and self.tick - stack.asked < self.warm_ticks):  # is_warm, inlined
            self.cold.append(slot)
        stack.append(block)
        self.count += 1
        self.log.append(-1 - requested)

    def unpark(self) -> list[tuple[Any, list[Any]]]:
        """Empty every stack: ``[(stream, [blocks])]``, a stream once per block size."""
        out: list[tuple[Any, list[Any]]] = []
        for slot, stack in self.slots.items():
            self.take_all(slot, stack, out)
        self.cold.clear()
        return out

    def unpark_cold(self) -> list[tuple[Any, list[Any]]]:
        """Empty the cold stacks blocks were parked on since the last call, as ``unpark`` (Note [Cold stacks])."""
        out: list[tuple[Any, list[Any]]] = []
        for slot in self.cold:
            stack = self.slots[slot]
            if not self.is_warm(stack):
                self.take_all(slot, stack, out)
        self.cold.clear()
        return out

    def take_all(self, slot: tuple[int, Any], stack: ParkedStack, out: list[tuple[Any, list[Any]]]) -> None:
        """Move a stack's blocks to ``out``; the stack stays, with what was asked of it."""
        if stack:
            out.append((slot[1], stack[:]))
            self.count -= len(stack)
            stack.clear()

    def warm(self) -> set[tuple[int, Any]]:
        """The (block size, stream) of every warm stack, empty or not (Note [Cold stacks])."""
        return {slot for slot, stack in self.slots.items() if self.is_warm(stack)}

    def addresses(self) -> dict[int, Any]:
        """The parked blocks' addresses, each with its stack's stream: ``{address: stream}``."""
        return {b.addr: slot[1] for slot, stack in self.slots.items() for b in stack}

    def rebind(self, lock: Any) -> None:
        """Nothing to do: only a C caller would take the lock from here."""

    def state_address(self) -> int:
        """0: no C caller reaches these stacks (``Parking.state_address``)."""
        return 0
