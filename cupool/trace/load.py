"""Reading any trace: the format is told from the file's first bytes, not its name.

Kept apart from ``format`` because it dispatches to the importers as well, and
the importers build on ``format``.
"""

from __future__ import annotations

from pathlib import Path

from .format import HDF5_MAGIC, Trace, TraceError, read_hdf5
from .importers import RMM_COLUMNS, is_rmm_log, load_rmm_log, load_torch_snapshot

_PICKLE = b"\x80"  # the PROTO opcode that starts every pickle of protocol 2 or later


def load_trace(path: str | Path, device: int | None = None) -> Trace:
    """Read a trace: a cupool HDF5 trace, a PyTorch memory snapshot pickle or an RMM log CSV.

    ``device`` picks one device of a multi-device PyTorch snapshot (default: the
    busiest); the other formats hold one device and refuse it.  Raises
    ``TraceError`` (a ``ValueError``) naming the file and the problem.
    """
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            head = fh.read(512)
    except OSError as e:
        raise TraceError(p, f"cannot read the file ({e.strerror or e})") from None
    if not head:
        raise TraceError(p, "the file is empty")
    if head.startswith(_PICKLE):
        return load_torch_snapshot(p, device)
    if device is not None and (head.startswith(HDF5_MAGIC) or is_rmm_log(head)):
        raise TraceError(p, f"device {device}: only a PyTorch snapshot holds several devices; this trace is one")
    if head.startswith(HDF5_MAGIC):
        return read_hdf5(p)
    if is_rmm_log(head):
        return load_rmm_log(p)
    raise TraceError(
        p,
        "not a trace cupool can read: expected a cupool HDF5 trace, a PyTorch memory snapshot "
        f"pickle (torch.cuda.memory._snapshot()) or an RMM log CSV ({','.join(RMM_COLUMNS)})",
    )
