"""What a replay reports (``ReplayResult``), and its progress bar."""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

#: What max/mean fragmentation are, for the CLI and the report.
FRAGMENTATION_NOTE = "after each alloc/free while anything is allocated"


@dataclass
class ReplayResult:
    """What a replay found.

    ``max_fragmentation`` / ``mean_fragmentation`` are (reserved - allocated) /
    reserved sampled after every event the replay acts on, but only while
    something is allocated: a pool that holds nothing but cache has
    fragmentation 1.0 by that formula, which says nothing about placement and
    would make every run's maximum 1.0 at its teardown.
    ``fragmentation_at_peak`` is the first of those samples taken at the peak
    reserved, where fragmentation costs the most, so it is never above the
    maximum (0.0 when nothing was allocated while reserved memory peaked).  ``seeded_blocks`` counts the blocks
    alive before the recording started, which the replay began from (see
    ``cupool.trace.load_torch_snapshot``); ``events`` counts the trace's events
    read, seed included, and ``replayed`` those replayed after the seed (what
    ``seconds`` timed); ``history`` is False for a still picture, a snapshot
    with no events to replay.  ``peak_segments``, ``segment_allocs`` and
    ``segment_frees`` count segments as ``Pool.stats()``'s ``segment.all.peak``,
    ``.allocated`` and ``.freed`` do; ``device_allocs`` and ``device_frees``
    count the calls to the device that made and gave back their memory, as
    ``num_device_alloc`` and ``num_device_free`` do: on expandable segments a
    segment grows and shrinks by many map and unmap calls (Note [Segments]).
    ``warnings`` says what the
    engine could not model for this trace.  ``peak_oversubscribed`` is the most
    the sim device held past its capacity: on managed memory
    (``upstream="managed"``) a pool may reserve more than the device has, and a
    GPU would page that much out to the host; 0 on any other upstream.
    """

    config: dict[str, Any]
    engine: str
    events: int
    replayed: int
    peak_reserved: int
    peak_allocated: int
    max_fragmentation: float
    mean_fragmentation: float
    fragmentation_at_peak: float
    ooms: int
    peak_segments: int
    segment_allocs: int
    segment_frees: int
    device_allocs: int
    device_frees: int
    unmatched_frees: int
    seeded_blocks: int
    history: bool
    capacity: int
    seconds: float
    peak_oversubscribed: int = 0
    warnings: list[str] = field(default_factory=list)
    timeline: dict[str, np.ndarray] | None = field(default=None, repr=False)

    @property
    def events_per_second(self) -> float | None:
        """Events replayed per second; None for a still picture (nothing replayed) or an untimed run.

        Seeded blocks are the state a replay starts from, not events it replays: they are not counted.
        """
        return self.replayed / self.seconds if self.replayed and self.seconds > 0 else None

    @property
    def upstream(self) -> str:
        """Where the replay's plain segments came from (``device``, ``managed`` or ``async``)."""
        return str(self.config.get("upstream", "device"))

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("timeline")
        return d


def progress_bar(n: int, enabled: bool, desc: str) -> Any:
    """A tqdm bar on stderr over ``n`` events (None when not ``enabled``)."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=n, desc=desc, unit="ev", unit_scale=True, file=sys.stderr, mininterval=0.2)
