"""The colours cupool draws memory in: one table, read by every picture.

The Jupyter map (``cupool.display``) and the report's figure
(``cupool.replay.report``) both colour blocks and curves from here, so that an
allocated block is the same colour in a notebook and in ``cupool report``, and
the report's "allocated" curve the colour of the blocks it counts.  It imports
nothing, so any layer may read it.
"""

from __future__ import annotations

#: A block's colour by its state.  "allocated" is any block in use where a picture cannot
#: tell raw from movable (the report); the Jupyter map tells them apart.
BLOCKS: dict[str, str] = {
    "allocated": "#4878d0",  # blue: in use (in the Jupyter map: a raw allocation, which never moves)
    "movable": "#6acc64",  # green: a movable buffer
    "leased": "#ee854a",  # orange: a movable buffer pinned by a live array
    "free": "#e6e6e6",  # light grey: free space in a segment
    "many": "#666666",  # dark grey: many blocks too narrow to draw one by one
}
#: Reserved memory (the segments) as a curve: dark, beside the allocated curve's blue and
#: over the free colour that fills the space between the two.
RESERVED = "#333333"
