"""The arguments of ``cupool.dask``'s plugin and preload, checked where the user typed them.

A bad argument must fail on the client (or on ``dask worker``'s command line),
not as a log line in every worker: the checks build, and close, a pool with the
arguments on a sim device, which is what ``Pool`` itself would say in the worker.
"""

from __future__ import annotations

import inspect
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from . import settings
from ._units import parse_size
from .device import SimDevice, kinds, resolve_device, split_device
from .pool import Pool

__all__ = ["GPU_STAND_IN", "PRELOAD_HELP", "SIZE", "WORKER_FIELD", "check_pool_arguments", "pool_defaults",
           "pool_keywords", "preload_options", "spill_template"]

#: The sim device a GPU configuration is checked against on the client: larger than
#: any GPU, so that a percentage never makes an absolute size look too big there.
#: Its address space is reserved, not used (``SimDevice``), so the check is cheap
#: (``expandable_segments`` with a large ``initial_size`` maps it granule by granule:
#: about a second per 30 GB).
GPU_STAND_IN = 1 << 40

#: In a spill path, replaced by the worker's name: workers on one machine must not share a file.
WORKER_FIELD = "{worker}"


def pool_keywords() -> tuple[str, ...]:
    """``Pool``'s keyword arguments other than ``device``, read from its signature so new ones pass through."""
    params = inspect.signature(Pool).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(p.name for p in params if p.kind in kinds and p.name != "device")


def pool_defaults() -> dict[str, Any]:
    """``Pool``'s keyword arguments with their defaults."""
    params = inspect.signature(Pool).parameters
    return {name: params[name].default for name in pool_keywords()}


def spill_template(spill: Any) -> str:
    """``spill`` as text that every worker can fill in: ``"host"`` or an HDF5 path with ``{worker}``."""
    if not isinstance(spill, (str, os.PathLike)):
        raise TypeError(
            "CupoolSetup: spill must be None, 'host' or a path with {worker} in it (each worker makes its own "
            f"tier; a tier object cannot be shared between worker processes), got {spill!r}"
        )
    text = spill if isinstance(spill, str) else str(Path(spill))
    if text != "host" and WORKER_FIELD not in text:
        raise ValueError(
            f"CupoolSetup: spill path {text!r} has no {WORKER_FIELD} in it, so workers on one machine would "
            f"share one file; write it as e.g. {str(Path(text).with_name('spill-' + WORKER_FIELD + '.h5'))!r}"
        )
    return text


def check_pool_arguments(device: Any, options: dict[str, Any]) -> None:
    """Build and close a pool with these arguments on a sim device, raising its error as the plugin's."""
    if not isinstance(device, str):
        raise TypeError(
            f"CupoolSetup: device must be {kinds.one_of(kinds.forms())} (each worker makes its own device), "
            f"got {device!r}"
        )
    capacity = options.get("capacity")
    kind = None  # "auto": the worker decides
    try:
        if split_device(device)[0] != kinds.AUTO:  # a GPU needs to be in the worker, not here: present=False
            kind, _ = resolve_device(device, capacity, note_fallback=False, present=False)
    except ValueError as e:
        raise ValueError(f"CupoolSetup: {e}") from None
    probe = dict(options)
    spill = probe.get("spill")
    if isinstance(spill, str) and spill != "host":
        # The file's name is checked here, its folder in the worker (whose machine may have it when the
        # client's has not); an HDF5 tier makes its file only when it spills.
        probe["spill"] = str(Path(tempfile.gettempdir()) / Path(spill.replace(WORKER_FIELD, "probe")).name)
    if kind is not None and not kind.needs_gpu:
        target: str | SimDevice = device  # the very device each worker will make: an exact check
    elif capacity is not None:
        target = kinds.auto_kind(False).name  # "auto" given a capacity: the worker must make a sized kind
    else:
        target = SimDevice(GPU_STAND_IN, headroom=1)
    try:
        Pool(target, **probe).close()
    except TypeError as e:
        raise TypeError(f"CupoolSetup: {e}") from e
    except ValueError as e:
        raise ValueError(f"CupoolSetup: {e}") from e


class _Size(click.ParamType):
    """A size as ``Pool`` takes it ("80%", "20GiB", bytes), checked as the command line is read."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        try:
            parse_size(text, GPU_STAND_IN, "size")
        except ValueError as e:
            self.fail(str(e).removeprefix("size: "), param, ctx)  # click names the option
        return text


#: The click type of ``--cupool-*-size`` options.
SIZE = _Size()


#: The help of the preload as a command (``python -m cupool.dask --help``): ``dask worker --help``
#: cannot show a preload's options, which distributed reads only as a worker starts.
PRELOAD_HELP = """Set up a cupool pool in each Dask worker, from the worker's command line:

\b
    dask worker SCHEDULER --preload cupool.dask --cupool-max-size 80%

The options are those of cupool.dask.CupoolSetup (--cupool-NAME for its NAME).
Sizes are bytes, a unit (20GiB) or a share of the device (80%). Bad options stop
dask worker before any worker starts; a worker that cannot make its pool says why,
once, and exits with status 1. Given options without --help, this command checks
them and prints the setup they describe; it starts nothing."""

_F = TypeVar("_F", bound=Callable[..., Any])


def _setting_option(s: settings.Setting) -> Callable[[_F], _F]:
    """The ``--cupool-NAME`` option of one of ``Pool``'s settings, read as its registry entry says."""
    flag = "--cupool-" + s.name.replace("_", "-")
    text = f"{s.help[0].upper()}{s.help[1:]}"
    if s.kind == "flag":  # unset: Pool's default, which the registry's help states where it is not plain
        default = "" if s.default is None else f" (default: {'on' if s.default else 'off'})"
        return click.option(f"{flag}/--no-{flag[2:]}", default=None, help=f"{text}{default}.")
    if s.name == "device":  # the worker's GPU by name, checked where the worker can see it
        return click.option(flag, default=s.default, show_default=True, help=f"{kinds.one_of(kinds.forms())}.")
    if s.name == "spill":
        return click.option(flag, help="Spill movable buffers to 'host', or to an HDF5 path with {worker} in it.")
    types: dict[str, Any] = {
        "size": SIZE, "fraction": click.FloatRange(0, 1, min_open=True),
        "threshold": click.FloatRange(0, 1, max_open=True), "choice": click.Choice(s.choices),
    }
    return click.option(flag, type=types[s.kind], help=f"{text}.")


#: Settings a worker's pool does not take from its command line: sites are a debugging aid of one process.
_NOT_PRELOADED = ("track_sites",)


def preload_options(f: _F) -> _F:
    """The preload's ``--cupool-NAME`` options, each with its help, on ``cupool.dask.dask_setup``: one per
    setting of the registry (``cupool.settings``), then the hooks'."""
    options = [_setting_option(s) for s in settings.SETTINGS if s.name not in _NOT_PRELOADED] + [
        click.option("--cupool-cupy/--no-cupool-cupy", default=None, help="Hook CuPy (default: when it imports)."),
        click.option("--cupool-numba/--no-cupool-numba", default=True, show_default=True, help="Hook Numba."),
    ]
    for option in reversed(options):  # as stacked decorators apply them: the first listed is the first shown
        f = option(f)
    return f
