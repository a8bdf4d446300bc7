"""Stream epochs: when may a block freed on one stream be used by another (Note [Streams]).

A block freed on stream ``s`` carries ``s``'s current epoch and is reused at once on
``s``.  An event recorded on ``s`` closes the epoch; once the event has completed,
every block freed in that epoch or before may cross to any stream.  Events are
recorded lazily, only for streams with frees since their last event, and only
when some other stream is short of memory.

Note [Streams]
~~~~~~~~~~~~~~
A block freed on stream A carries A's current epoch and is reused at once on A.
Another stream may take it only after an event recorded on A, closing that
epoch, has completed. Events are recorded lazily, only when another stream is
short of memory; ``empty_cache``, compaction and the ladder's ``streams`` step
synchronize the device instead, which makes every freed block usable by all.
"""

from __future__ import annotations

import collections
from typing import Any

from .heap import Heap


class StreamEpochs:
    def __init__(self, device: Any) -> None:
        self._device = device
        self._epoch: dict[Any, int] = {}
        self._events: dict[Any, collections.deque[Any]] = {}
        self._dirty: set[Any] = set()
        self._done: dict[Any, int] = {}  # each stream's newest epoch known complete

    def freed(self, stream: Any) -> int:
        """Note a free on ``stream``; returns the epoch the freed block carries."""
        self._dirty.add(stream)
        return self._epoch.get(stream, 0)

    def settle(self, heaps: tuple[Heap, ...], wait: bool) -> int:
        """Let other streams use blocks whose freeing stream is known to be done with them.

        Without ``wait`` this records an event on every stream with new frees and
        reassigns blocks covered by events that have completed; with ``wait`` it
        synchronizes the device first, so every freed block qualifies.  Returns the
        bytes that became usable by all streams.
        """
        if wait:
            self._device.synchronize()
        moved = 0
        # Each stream's done epoch is read once for all heaps: reading it consumes the stream's
        # completed events, so a second heap would find none and keep the stream's blocks.
        done_of: dict[Any, int | None] = {}
        for heap in heaps:
            for stream in heap.streams():
                if stream is None:
                    continue
                if stream not in done_of:
                    done_of[stream] = self._done_epoch(stream, wait)
                done = done_of[stream]
                if done is None:
                    continue
                for b in heap.free_blocks(stream):
                    # A merge earlier in this loop may have absorbed b: skip stale entries.
                    if b.free and b.stream == stream and b.epoch <= done and heap.is_indexed(b):
                        moved += b.size
                        heap.reassign(b, None)
        return moved

    def _done_epoch(self, stream: Any, wait: bool) -> int | None:
        """The newest epoch of ``stream`` whose frees are known complete, or None while none is.

        Remembered across calls: a stream with nothing new since its last completed event still
        answers it, so free memory it grew and never used (a fresh tail, epoch 0) goes to every
        stream at the next settle.  Answering only the events completed in this call kept such a
        tail the stream's own until the stream freed something again (docs/benchmarks.md, "Why
        small/4s/0 maps a fifth granule"); the numba engine's ``settle`` remembers the same.
        """
        epoch = self._epoch.get(stream, 0)
        if wait:
            self._events.pop(stream, None)
            self._dirty.discard(stream)
            self._epoch[stream] = epoch + 1
            self._done[stream] = epoch
            return epoch
        q = self._events.setdefault(stream, collections.deque())
        if stream in self._dirty:
            q.append((epoch, self._device.record_event(stream)))
            self._epoch[stream] = epoch + 1
            self._dirty.discard(stream)
        while q and self._device.event_done(q[0][1]):
            self._done[stream] = q.popleft()[0]
        return self._done.get(stream)
