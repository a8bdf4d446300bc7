"""The rule book: placement and growth decisions as pure integer functions, written once.

Charter: integers and booleans in, an answer out; no state, no device, no Numba.
The pool calls these functions as they are; the numba replay engine compiles the
very same functions (``njit(rule)`` in ``cupool.replay.engine``), so a rule
changed here changes in the pool and in its replay together, and
``tests/test_rules.py`` checks each one exhaustively over small integers.

| rule | question it answers | the pool asks it in | the engine asks it in |
| --- | --- | --- | --- |
| ``gives_back_before_split`` | should a large request give a wholly free plain segment back rather than split it? (Note [Release before split]) | ``Arena.place``, asking ``PoolPolicy.gives_back`` | ``engine._releases`` |
| ``release_cuts_holes`` | does the reclaim ladder's release step unmap the granules under free blocks between live ones? | ``Scheduler._release`` | ``engine._malloc``, then ``engine._last_rung`` |
"""

from __future__ import annotations


def gives_back_before_split(request_pages: int, segment_size: int, limit: int, reserved: int) -> bool:
    """Whether a large request of ``request_pages`` (its size in whole pages) gives back a wholly free plain
    segment of ``segment_size`` bytes instead of splitting it, with ``reserved`` bytes of ``limit`` reserved.

    Three conditions, all needed (Note [Release before split]):

    * the request is smaller than the segment (else it takes it whole, with nothing to pin);
    * the limit has no room for another segment that big (without pressure it splits, as PyTorch does);
    * once the segment is back, the limit has room for the request's own pages: a release that
      cannot be followed by the growth it makes room for would give the cache away and then
      fail (issue 25: ``set_limit`` below what is reserved, then a request smaller than the
      cached segment), and Note [Out of memory] promises a failed request changes nothing.
    """
    if request_pages >= segment_size:
        return False
    if limit - reserved >= segment_size:
        return False
    return limit - (reserved - segment_size) >= request_pages


def release_cuts_holes(large: bool, stitching: bool) -> bool:
    """Whether the reclaim ladder's release step also unmaps the granules under free blocks between live ones.

    Only on virtual memory (a plain segment goes back whole or not at all).  Stitching
    gathers exactly those granules into one range for a large request, keeping them
    mapped, so for a large request on a stitching pool the holes are left to the
    stitch step.  A small request (its 2 MiB segments are never stitched) and any
    request on a pool that does not stitch would otherwise fail where the program's
    own ``empty_cache()``, which cuts them, succeeds (issue 25).
    """
    return not (large and stitching)
