"""Traces of pool events: recording them, their HDF5 file, and reading other allocators' logs.

* ``format``: ``Trace`` (parallel arrays, streams numbered densely from 0 so that
  any trace replays on the sim device), ``TraceError``, and cupool's HDF5 file;
* ``recorder``: ``EventRecorder`` (``pool.record()``), a ring buffer of a pool's
  events optionally streamed to that file;
* ``importers``: PyTorch memory snapshots and RMM logs as ``Trace``s;
* ``untrusted``: reading a snapshot's pickle with work and memory bounded by its
  size, and naming its values in errors by type and size only;
* ``rmm_log``: a trace written as an RMM log;
* ``load``: ``load_trace``, which reads any of the three.

Event kinds are ``cupool.core.events.KINDS``; nothing here keeps a list of its own.
Replaying a trace is ``cupool.replay``.
"""

from .format import Trace, TraceError, dense_streams
from .importers import load_rmm_log, load_torch_snapshot
from .load import load_trace
from .recorder import EventRecorder, active_recorder, recording_config

__all__ = [
    "EventRecorder",
    "Trace",
    "TraceError",
    "active_recorder",
    "dense_streams",
    "load_rmm_log",
    "load_torch_snapshot",
    "load_trace",
    "recording_config",
]
