"""THE registry of a pool's settings: each one's name, text parser, default, owner, and who knows it.

Charter: this module knows units and the names of settings, nothing of pools.
Everything that lists settings derives the list from ``SETTINGS``:

* ``Pool(...)`` takes them as keyword arguments (``tests/test_settings.py`` holds
  its signature to this table) and ``Pool.config`` reports them;
* ``CUPOOL_CONF`` (``cupool.config``) reads the ``conf`` ones, with their parsers,
  and ``cupool info`` shows them;
* the Dask plugin compares the ``size`` ones in bytes (``cupool.dask``), and its
  preload flags are ``--cupool-<name>``;
* a trace records the ``recorded`` ones, a replay's ``--config`` takes them, and
  the numba engine models the ``engine`` ones;
* a ``follows`` setting left unset takes the value of the one it follows,
  whether given or recorded (``resolve_derived``): an unset ``stitch`` follows
  ``expandable_segments``, and an unset ``expandable_segments`` the ``upstream``
  (managed and stream-ordered memory give plain segments).

| column | meaning |
| --- | --- |
| ``owner`` | who holds the value while the pool lives: ``device``, ``arena`` (the limit), ``policy`` (thresholds), ``source`` (segments), ``scheduler``, ``pool`` |
| ``kind`` | how text is read: ``size`` ("2GB", "80%"), ``fraction``, ``threshold`` (a fraction or none), ``flag``, ``device`` (a kind of ``cupool.device.kinds``, or auto), ``choice``, ``text`` |
| ``conf`` | a ``CUPOOL_CONF`` key |
| ``recorded`` | a trace records it, and "recorded" replays under it |
| ``engine`` | the numba replay engine models it (else only the pool engine does) |
| ``slot`` | the engine slot its resolved value fills: the ``Pool.config`` key it resolves to (none: its own name) |

The numba engine's configuration array has the slots derived from the settings,
then one slot per engine setting's ``slot`` in this table's order
(``cupool.replay.engine_layout``), so a new engine setting gets its slot here;
``max_size`` and ``memory_fraction`` share one, the ``limit`` they resolve to.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ._units import parse_size
from .device import kinds


@dataclass(frozen=True)
class Setting:
    """One setting of ``Pool`` (see the module's table for the columns)."""

    name: str
    kind: str
    default: Any
    owner: str
    conf: bool
    recorded: bool
    engine: bool
    help: str
    choices: tuple[str, ...] = ()
    follows: str | None = None
    slot: str | None = None

    @property
    def engine_slot(self) -> str | None:
        """The engine's configuration slot this setting's resolved value fills (None: not an engine setting)."""
        return (self.slot or self.name) if self.engine else None

    def parse(self, text: str) -> Any:
        """The value ``text`` (from ``CUPOOL_CONF``, a replay's ``--config``, a preload flag) stands for.

        A size keeps its text: a percentage needs the device's total, known once the
        pool exists; its syntax is checked here against a stand-in total.
        """
        return _PARSERS[self.kind](self, text.strip())


def _size(s: Setting, text: str) -> Any:
    if text.lower() == "none" and s.default is None:
        return None
    parse_size(text, total=100, name=s.name)
    return text


def _fraction(s: Setting, text: str) -> Any:
    if text.lower() == "none" and s.default is None:
        return None
    try:
        f = float(text)
    except ValueError:
        raise ValueError(f"{s.name}: {text!r} is not a number (try 0.8)") from None
    if not 0 < f <= 1:
        raise ValueError(f"{s.name}: must be in (0, 1], got {text}")
    return f


def _threshold(s: Setting, text: str) -> Any:
    if text.lower() == "none":
        return None
    try:
        f = float(text)
    except ValueError:
        raise ValueError(f"{s.name}: {text!r} is neither a number nor none (try 0.3)") from None
    if not 0 <= f < 1:
        raise ValueError(f"{s.name}: must be in [0, 1) or none, got {text}")
    return f


def _flag(s: Setting, text: str) -> Any:
    v = text.lower()
    if v == "none" and s.default is None:
        return None
    if v not in ("true", "false", "1", "0"):
        raise ValueError(f"{s.name}: must be true or false, got {text!r}")
    return v in ("true", "1")


def _choice(s: Setting, text: str) -> Any:
    v = text.lower()
    if v not in s.choices:
        raise ValueError(f"{s.name}: must be {', '.join(s.choices[:-1])} or {s.choices[-1]}, got {text!r}")
    return v


def _device(s: Setting, text: str) -> Any:
    """A device kind's name, or auto, as ``cupool.device.kinds`` has them now (a kind may be registered late)."""
    v = text.lower()
    if v not in kinds.names():
        raise ValueError(f"{s.name}: must be {kinds.one_of(kinds.names(), quoted=False)}, got {text!r} "
                         "(the device index follows the current device)")
    return v


def _text(s: Setting, text: str) -> Any:
    return None if text.lower() == "none" else text


_PARSERS: dict[str, Callable[[Setting, str], Any]] = {
    "size": _size, "fraction": _fraction, "threshold": _threshold, "flag": _flag,
    "device": _device, "choice": _choice, "text": _text,
}

#: Every setting of ``Pool``, in its signature's order.
SETTINGS: tuple[Setting, ...] = (
    Setting("device", "device", kinds.AUTO, "device", conf=True, recorded=False, engine=False,
            choices=kinds.names(),  # those of import time; the parser reads the table itself, late kinds too
            help=f"{kinds.one_of(kinds.names(), quoted=False)} ({kinds.AUTO}: {kinds.auto_help()}); the index "
                 "follows the current device"),
    Setting("capacity", "size", None, "device", conf=True, recorded=True, engine=True,
            help="the sim device's size (default 4 GiB); an error on a GPU"),
    Setting("initial_size", "size", None, "source", conf=True, recorded=True, engine=True,
            help="bytes to reserve now, in one segment that empty_cache keeps"),
    Setting("max_size", "size", None, "arena", conf=True, recorded=True, engine=True, slot="limit",
            help="the cap on reserved bytes (an int, 2GB, 512MiB or 50% of the device; at most the device)"),
    Setting("memory_fraction", "fraction", None, "arena", conf=True, recorded=True, engine=True, slot="limit",
            help="the cap on reserved bytes as a fraction of the device, in (0, 1]"),
    Setting("release_threshold", "size", None, "policy", conf=True, recorded=True, engine=True,
            help="give a wholly free segment back at once while more than this is reserved"),
    Setting("defrag_threshold", "threshold", 0.3, "policy", conf=True, recorded=True, engine=False,
            help="compact movable buffers before growing while fragmentation is above this (none: never)"),
    Setting("release_before_split", "flag", True, "policy", conf=True, recorded=True, engine=True,
            help="under pressure, give a wholly free plain segment back rather than let a smaller request pin it"),
    Setting("track_sites", "flag", False, "arena", conf=True, recorded=False, engine=False,
            help="remember each live allocation's line and stack, for leaks()"),
    Setting("spill", "text", None, "scheduler", conf=True, recorded=True, engine=False,
            help="where unleased movable buffers go when memory runs short: host, or an .h5 path"),
    Setting("spill_policy", "choice", "lru", "scheduler", conf=True, recorded=True, engine=False,
            choices=("lru", "fifo", "adaptive"), help="the reclaim ladder's order and its spill victims' order"),
    Setting("expandable_segments", "flag", None, "source", conf=True, recorded=True, engine=True, follows="upstream",
            help="grow one virtual segment per stream and size class, 2 MiB at a time (default: where the "
                 "device has virtual memory, with the device upstream)"),
    Setting("stitch", "flag", None, "source", conf=True, recorded=True, engine=True, follows="expandable_segments",
            help="let the ladder remap free granules of holes into one range (default: with expandable segments)"),
    Setting("upstream", "choice", "device", "source", conf=True, recorded=True, engine=True,
            choices=("device", "managed", "async"),
            help="where plain segments come from: device (cudaMalloc), managed (cudaMallocManaged: may exceed the "
                 "device) or async (cudaMallocAsync: never synchronizes)"),
)

BY_NAME: Mapping[str, Setting] = {s.name: s for s in SETTINGS}


def names(**where: Any) -> tuple[str, ...]:
    """The settings whose columns equal ``where`` (``names(conf=True)``, ``names(kind="size")``), in order."""
    return tuple(s.name for s in SETTINGS if all(getattr(s, k) == v for k, v in where.items()))


def resolve_derived(given: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``base`` (a recording's settings, say) overridden by ``given``, where a ``follows`` setting
    that ``given`` leaves out follows what it follows when ``given`` changes that.

    ``resolve_derived({"expandable_segments": False}, recorded)`` turns ``stitch`` off
    with it, where keeping the recorded ``stitch=True`` would be refused by the pool;
    restating the recorded ``expandable_segments`` keeps the recorded ``stitch``.
    Followers chain: ``upstream="managed"`` over a recording on expandable
    segments unsets ``expandable_segments``, and so ``stitch`` with it.
    """
    base = base or {}
    out = dict(base)
    out.update(given)
    # What base leaves out is its default (a trace from before a setting existed ran on it).
    changed = {k for k, v in given.items() if base.get(k, BY_NAME[k].default if k in BY_NAME else None) != v}
    while True:  # a follower unset is changed too: what follows it follows along
        unset = {s.name for s in SETTINGS
                 if s.follows in changed and s.name not in given and s.name not in changed}
        if not unset:
            break
        for name in unset:
            out[name] = None  # unset: the pool resolves it from what it follows
        changed |= unset
    return out
