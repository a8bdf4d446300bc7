"""The kinds of device a device string names (``sim``, ``cuda``; ``auto`` picks one): one table, ``KINDS``.

Charter: this module knows each kind's name, what it needs and how its devices are made; it
knows nothing of pools, nor of the machine (whether a GPU is usable is ``cupool.device``'s
question, asked where a name is resolved).

Every place that names device kinds reads them here, so none keeps a list of its own:
``split_device``, ``parse_device``, ``make_device``, ``pinned_device`` and
``pinned_device_beside`` (``cupool.device``); the ``device`` setting of ``CUPOOL_CONF``
(``cupool.settings``); the Dask plugin's ``device`` and its preload's ``--cupool-device``
(``cupool._dask_arguments``); ``--device`` of ``cupool info`` and ``cupool demo``, and the
kinds ``cupool info`` lists (``cupool.cli``); ``python -m cupool.validate --device``.
Their error messages and help are written from the table too, in its order.

A device string is ``auto``, or a kind's name with an optional ``:N`` index.  ``auto`` is
not a kind: it resolves to the first kind marked ``auto`` that needs a GPU when one is
usable, else the first marked ``auto`` that needs none (``cuda``, else ``sim``).

To add a kind:

1. write its device class, a ``Device`` subclass in a module of its own beside ``sim.py``
   and ``cuda.py``, whose ``capabilities`` say what it can do (callers branch on those,
   never on a kind's name), and say which class holds its pinned host memory;
2. add one ``DeviceKind`` to ``KINDS`` below (``register`` adds one from outside the
   package): every place listed above then takes the name, lists it and names it in its
   errors, with no other edit;
3. test it: the device conformance suite (``tests/conformance/test_device_conformance.py``)
   over the class, and the name through ``Pool("<name>:0")`` and ``cupool info``
   (``tests/test_device_kinds.py`` registers a kind in a fixture to show both).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .base import Device
from .cuda import CudaDevice, CudaPinnedDevice
from .sim import SimDevice, SimPinnedDevice

__all__ = ["AUTO", "DeviceKind", "KINDS", "auto_help", "auto_kind", "forms", "kind_of", "names", "one_of", "register"]

#: The device string that names no kind but picks one (see the module's docstring).
AUTO = "auto"

#: ``(index, capacity) -> device``: the capacity given or the kind's default, None for a kind that takes none.
Maker = Callable[[int, Any], Device]


@dataclass(frozen=True)
class DeviceKind:
    """One kind of device: its name in device strings, what it needs, and how its devices are made."""

    #: The name in device strings (``"sim"``, ``"sim:1"``): lower-case letters, digits and ``_``.
    name: str
    #: What the kind is, in a few words, for ``cupool info`` and the note ``auto`` gives when it
    #: falls back to this kind.
    help: str
    #: The class ``make`` returns; a device is traced back to its kind through it (``kind_of``).
    device_class: type[Device]
    #: The device of index N (``"<name>:N"``; no index is 0).
    make: Maker
    #: Its pinned host-memory companion (``PinnedPool("<name>")``, a spill tier's staging memory).
    make_pinned: Maker
    #: Usable only where a CUDA GPU and CuPy are (``cupool.device.cuda_available``).
    needs_gpu: bool = False
    #: The default size of a device the user sizes (``capacity=``); None: the kind takes no
    #: capacity, its size is the hardware's.
    capacity: str | None = None
    #: The default size of its pinned companion, for a kind that takes a capacity.
    pinned_capacity: str | None = None
    #: ``auto`` may resolve to it.
    auto: bool = False

    @property
    def sized(self) -> bool:
        """Whether a device of this kind takes ``capacity=``."""
        return self.capacity is not None


#: Every kind, by name, in the order help and errors list them.
KINDS: dict[str, DeviceKind] = {
    "sim": DeviceKind(
        "sim", "the simulated device (host memory)", SimDevice,
        lambda index, capacity: SimDevice(capacity, index=index), lambda index, capacity: SimPinnedDevice(capacity),
        capacity="4GiB", pinned_capacity="1GiB", auto=True,
    ),
    "cuda": DeviceKind(
        "cuda", "a CUDA GPU (through CuPy)", CudaDevice,
        lambda index, capacity: CudaDevice(index), lambda index, capacity: CudaPinnedDevice(index),
        needs_gpu=True, auto=True,
    ),
}


def register(kind: DeviceKind) -> DeviceKind:
    """Add ``kind`` to ``KINDS`` (a kind made outside the package), or a ``ValueError`` for a name
    that a device string could not carry, or one taken.  ``del KINDS[name]`` removes it again."""
    name = kind.name
    if not (name.isascii() and name.replace("_", "a").isalnum() and name == name.lower()):
        raise ValueError(f"a device kind's name is lower-case letters, digits and '_', got {name!r}")
    if name in names():
        raise ValueError(f"device kind {name!r} is taken")
    KINDS[name] = kind
    return kind


def names() -> tuple[str, ...]:
    """What a device string's kind may be: ``auto``, then every kind."""
    return (AUTO, *KINDS)


def forms() -> tuple[str, ...]:
    """Every form of a device string, as help and errors list them: ``auto``, ``sim``, ``sim:N``, ..."""
    return (AUTO, *(form for name in KINDS for form in (name, f"{name}:N")))


def one_of(words: Iterable[str], quoted: bool = True) -> str:
    """``'a', 'b' or 'c'`` (``a, b or c`` unquoted): the alternatives of a "must be" message."""
    said = [f"'{w}'" if quoted else w for w in words]
    return said[0] if len(said) == 1 else f"{', '.join(said[:-1])} or {said[-1]}"


def auto_kind(gpu_usable: bool) -> DeviceKind:
    """The kind ``auto`` resolves to on a machine where a GPU is usable, or is not."""
    marked = [k for k in KINDS.values() if k.auto]
    return next((k for k in marked if k.needs_gpu and gpu_usable), None) or next(k for k in marked if not k.needs_gpu)


def auto_help() -> str:
    """What ``auto`` does, in words: ``cuda when a GPU is usable, else sim``."""
    return f"{auto_kind(True).name} when a GPU is usable, else {auto_kind(False).name}"


def kind_of(device: Device) -> DeviceKind | None:
    """The kind whose class ``device`` is of (the most derived one); None for a class no kind names."""
    by_class = {k.device_class: k for k in KINDS.values()}
    return next((by_class[c] for c in type(device).__mro__ if c in by_class), None)
