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

#: st, fst, cfg: scalars, floats and settings; B/FB: blocks and free block ids; S/FS: segments and
#: free segment ids; IX, TG: the free index (``engine_heap``); DT: streams with frees since the last
#: settle; EXT: the plain device's free extents; R/FR: virtual-memory regions and free region ids;
#: GR: each (size class, stream)'s growing region; VA: free address ranges for regions; W: two scratch
#: rows as long as B (a list of blocks and a walk's stack), so that a settle allocates nothing.
Engine = namedtuple("Engine", "st fst cfg B FB S FS IX TG DT EXT R FR GR VA W")

# Block fields (columns of B, a row per block: the fields a visit reads share a cache line; IX likewise).
ADDR, SIZE, PREV, NEXT, SEG, FREE, TAG, ALIVE, STREAM = range(9)
NBF = 9
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
# h's index; TAGS_SEEN + h: the tags heap h's index has seen (the length of its first-seen order).
(BLOCK_IDS, FREE_BLOCK_IDS, SEGMENT_IDS, FREE_SEGMENT_IDS, FREE_EXTENTS, RES, ALLOC, PEAK_RES, PEAK_ALLOC, NSEG,
 PEAK_SEG, DEV_ALLOCS, OOMS, UNMATCHED, FREE_INDEXED, FREE_INDEXED_LARGE, DEV_USED, TAGS_SEEN, TAGS_SEEN_LARGE,
 DEV_FREES, SAMPLES, MOVING, REGION_IDS, FREE_REGION_IDS, FREE_VA_RANGES, STITCHES, PEAK_SAMPLED,
 PENDING) = range(28)
N_ST = 28  # MOVING: 1 + the block between a move_out and its move_in (0: none), kept across chunks
# PEAK_SAMPLED: whether F_PEAK has a sample taken at the present peak reserved (see engine.run).
# PENDING: what engine._malloc returned for a request it left to stitching (see engine._fast).
# Floats (entries of fst): fragmentation sum and max over samples, and after the peak-setting event.
F_SUM, F_MAX, F_PEAK = range(3)
# Configuration (entries of cfg): C_VMM expandable segments, C_STITCH stitching, C_VSPAN a growing
# region's size (twice the device), C_ARENA the addresses regions are reserved from, C_SPLIT
# release_before_split (Note [Release before split]).
C_CAPACITY, C_SPAN, C_LIMIT, C_THRESHOLD, C_VMM, C_STITCH, C_VSPAN, C_ARENA, C_SPLIT = range(9)
N_CFG = 9
# The free index: per block id, a treap node (see engine_heap); per heap and tag + 1 in TG: free
# block count, seen, first-seen order (by position), tree root.
IX_SIZE, IX_ADDR, IX_LEFT, IX_RIGHT, IX_PRI, IX_UP = range(6)
NIX = 6
ROOT = 3
#: An empty entry of GR (no growing region for that size class and stream).
GR_NONE = -1

