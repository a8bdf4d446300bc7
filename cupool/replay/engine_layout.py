"""The replay engine's state: one named tuple of arrays, and the names of their rows and entries.

The engine's compiled functions (``engine``, ``engine_heap``,
``engine_memory``) take the whole state as one argument, ``E``, so that a
function's signature does not change when it needs one more table; the heap's
hot functions, called several times per event, take just the six tables they
touch (a call passes every field of every array it is given).  The tables grow
only between events (``engine.run``), which rebuilds the tuple.

Every function that allocates nothing compiles without Numba's reference
counting (``_nrt=False``): with it, each call that took ``E`` counted
references to each of its arrays atomically, which cost more than the rules
themselves (docs/benchmarks.md, "Replay engine speed").  Allocation happens in
a few functions only: growing the tables (``engine._roomy``), the live table's
rehash (``engine_live``), and stitching's and ``release_holes``' lists; a
function that calls one of them needs counting too.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import settings
from ..core import rules
from ..device.vmm import LANE_ARENAS, address_arena, region_span

#: st, fst, cfg: scalars, floats and settings; B/FB: blocks and free block ids; S/FS: segments and
#: free segment ids; IX, PS: the free index and its tables per stream (``engine_heap``); DT: per
#: stream, 1 with frees since its last settle, 3 settled before and clean since, 0 neither
#: (``engine_heap.settle``); EXT: the plain device's free extents; R/FR: virtual-memory regions and free region ids;
#: GR: each (size class, stream)'s growing region; VA: free address ranges for regions; W: two scratch
#: rows as long as B (a list of blocks and a walk's stack), so that a settle and the list of a stitch's
#: holes (``engine_memory.holes``) allocate nothing.
Engine = namedtuple("Engine", "st fst cfg B FB S FS IX PS DT EXT R FR GR VA W")

# Block fields (columns of B, a row per block: the fields a visit reads share a cache line; IX likewise).
# STREAM: a free block's stream, whose frees it holds (-1: anyone's); an allocated block's, the stream it serves.
ADDR, SIZE, PREV, NEXT, SEG, FREE, ALIVE, STREAM = range(8)
NBF = 8
# Segment fields (rows of S): S_TAIL is its last block, S_REGION its region (-1: a plain segment).
S_ADDR, S_SIZE, S_USED, S_HEAD, S_KEEP, S_KIND, S_ALIVE, S_TAIL, S_REGION = range(9)
NSF = 9
# Region fields (rows of R), as ``cupool.core.expandable.Region``: R_TAIL is the segment ending at
# the frontier (-1: none), R_GROW whether it is a stream's growing region, R_STITCHED whether its
# segment goes back as soon as it is free.
R_BASE, R_SIZE, R_FRONTIER, R_TAIL, R_NSEG, R_GROW, R_STITCHED, R_ALIVE = range(8)
NRF = 8
# Scalars (entries of st).  Tables with a free list keep two counts: X_IDS, the ids handed out so far
# (the next fresh one), and FREE_X_IDS, the released ids waiting in FB/FS/FR for reuse.  FREE_EXTENTS
# and FREE_VA_RANGES: how many free ranges EXT and VA hold.  FREE_INDEXED + h: free blocks in heap
# h's index; STREAMS_SEEN + h: the streams heap h's index has seen (the length of its first-seen order).
(BLOCK_IDS, FREE_BLOCK_IDS, SEGMENT_IDS, FREE_SEGMENT_IDS, FREE_EXTENTS, RES, ALLOC, PEAK_RES, PEAK_ALLOC, NSEG,
 PEAK_SEG, DEV_ALLOCS, OOMS, UNMATCHED, FREE_INDEXED, FREE_INDEXED_LARGE, DEV_USED, STREAMS_SEEN, STREAMS_SEEN_LARGE,
 DEV_FREES, SAMPLES, MOVING, REGION_IDS, FREE_REGION_IDS, FREE_VA_RANGES, STITCHES, PEAK_SAMPLED,
 PENDING, SEG_ALLOCS, SEG_FREES, MOST_RES) = range(31)
N_ST = 31  # MOVING: 1 + the block between a move_out and its move_in (0: none), kept across chunks
# NSEG, PEAK_SEG, SEG_ALLOCS, SEG_FREES: segments (Note [Segments]); DEV_ALLOCS, DEV_FREES: device calls.
# PEAK_SAMPLED: whether F_PEAK has a sample taken at the present peak reserved (see engine.run).
# PENDING: what engine._malloc returned for a request it left to stitching (see engine._fast).
# MOST_RES: the most ever reserved, which a seeded replay does not reset as it does PEAK_RES
# (``Expander.most``: ``rules.region_retires`` reads it).
# Floats (entries of fst): fragmentation sum and max over samples, and after the peak-setting event.
F_SUM, F_MAX, F_PEAK = range(3)
# Configuration (entries of cfg): the slots derived from the settings (``config_array``), then one slot
# per engine setting of the registry (``cupool.settings``: a setting's ``engine_slot``, in the registry's
# order), holding the pool's resolved value.  The engine reads them by the names below.  Numba's cache
# is keyed on each module's own source, so it does not see these numbers change: they are kept steady
# where they can be (the derived slots come first, and a setting appended to the registry, as
# ``Pool``'s new arguments are, takes the next slot), and a change that renumbers them must edit the
# engine modules that read them or clear the Numba cache (``tests/test_replay_registry.py`` pins them).
#: The slots the registry's engine settings fill, in its order (max_size and memory_fraction share the limit's).
SETTING_SLOTS = tuple(dict.fromkeys(s.engine_slot for s in settings.SETTINGS if s.engine_slot is not None))
#: Slots derived from the settings (``config_array``): the plain device's address span, a growing
#: region's size, the addresses regions are reserved from, and the bytes plain segments may take.
DERIVED_SLOTS = ("span", "vspan", "arena", "holds")
CFG_SLOTS = DERIVED_SLOTS + SETTING_SLOTS
N_CFG = len(CFG_SLOTS)
C_CAPACITY = CFG_SLOTS.index("capacity")
C_INITIAL = CFG_SLOTS.index("initial_size")
C_LIMIT = CFG_SLOTS.index("limit")
C_THRESHOLD = CFG_SLOTS.index("release_threshold")  # -1: never give back at once
C_SPLIT = CFG_SLOTS.index("release_before_split")  # Note [Release before split]
C_VMM = CFG_SLOTS.index("expandable_segments")
C_STITCH = CFG_SLOTS.index("stitch")
C_UPSTREAM = CFG_SLOTS.index("upstream")  # the position of its name in the setting's choices
C_SPAN, C_VSPAN, C_ARENA, C_HOLDS = (CFG_SLOTS.index(x) for x in DERIVED_SLOTS)
#: The sim device's address span, in capacities (``SimDevice``'s default ``headroom``, which a replay's device has).
SPAN_HEADROOM = 2


def config_array(resolved: Mapping[str, Any]) -> np.ndarray:
    """The engine's configuration from a pool's resolved settings (``Pool.config``), the one place its
    derived slots are computed.

    A value is stored as an int: None as -1, a flag as 0 or 1, a choice as its
    position among the setting's choices.  Managed memory (``upstream="managed"``)
    lets plain segments take the whole address span, as ``SimDevice.malloc_managed``
    does: the pool may then reserve more than the device's capacity.
    """
    cfg = np.zeros(N_CFG, np.int64)
    for slot in SETTING_SLOTS:
        cfg[CFG_SLOTS.index(slot)] = _as_int(slot, resolved[slot])
    cfg[C_THRESHOLD] = rules.eager_threshold(resolved["release_threshold"])  # as the pool's policy reads it
    capacity = int(cfg[C_CAPACITY])
    cfg[C_SPAN] = SPAN_HEADROOM * capacity
    limit = int(cfg[C_LIMIT])
    holds = capacity if limit < 0 else limit  # a growing region, and the pool's arena (Note [Address arena])
    cfg[C_VSPAN] = region_span(holds)  # one limit: rules.region_size makes a region REGION_LIMITS of them
    cfg[C_ARENA] = LANE_ARENAS * address_arena(holds)  # a lane of numbered arenas (Note [Address arena])
    cfg[C_HOLDS] = cfg[C_SPAN] if resolved["upstream"] == "managed" else capacity
    return cfg


def _as_int(slot: str, value: Any) -> int:
    if value is None:
        return -1
    if isinstance(value, str):
        return settings.BY_NAME[slot].choices.index(value)
    return int(value)


# The free index: per block id, a treap node (see engine_heap); per heap and stream + 1 in PS: free
# block count, seen, first-seen order (by position), then NBITS words of a bitmap of the size bands
# whose tree is not empty, then a tree root per size band (NBANDS of them).
IX_SIZE, IX_ADDR, IX_LEFT, IX_RIGHT, IX_PRI, IX_UP = range(6)
NIX = 6
#: Size bands (``engine_heap.band``): 16 of one 512-byte unit each, then 8 per doubling up to 2**63 bytes.
NBANDS = 16 + 50 * 8
NBITS = (NBANDS + 63) // 64
BITS = 3
ROOT = BITS + NBITS
NPS = ROOT + NBANDS
#: An empty entry of GR (no growing region for that size class and stream).
GR_NONE = -1

