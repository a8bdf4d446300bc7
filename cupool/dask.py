"""cupool on a Dask cluster: one pool per worker process, and cluster-wide stats and traces.

``CupoolSetup`` is a ``distributed.WorkerPlugin`` in the shape of dask-cuda's
``RMMSetup``: each worker builds a ``Pool`` from the plugin's arguments and
installs it (``cupool.install``) for CuPy and Numba, so every task's arrays come
from its worker's pool.  ``dask worker ... --preload cupool.dask --cupool-max-size 80%``
sets the same up from the command line (``dask_setup``).  ``stats``,
``empty_cache`` and ``record`` reach every worker through ``Client.run``.
``python -m cupool.dask --help`` lists the preload's options.  Needs
``distributed`` (``pip install distributed``, or ``pip install ".[dask]"`` in cupool's checkout); ``import cupool`` never imports
this module.

A bad argument must fail where the user typed it, not as a log line in every
worker, so ``CupoolSetup(...)`` checks its arguments on the client by building a
throwaway pool with them (see ``CupoolSetup``; the checks live in
``cupool._dask_arguments``).  Workers sharing one process
(``LocalCluster(processes=False)``) share its one installed pool.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, cast

try:
    import click
    from distributed import Client, Worker, WorkerPlugin
    from distributed.core import Status
except ImportError as e:  # pragma: no cover - exercised only where distributed is missing
    raise ImportError("cupool.dask needs distributed: pip install distributed (or '.[dask]' in cupool's checkout)") from e

from ._dask_arguments import (  # after distributed: it needs click, which comes with distributed
    PRELOAD_HELP,
    WORKER_FIELD,
    check_pool_arguments,
    pool_defaults,
    pool_keywords,
    preload_options,
    spill_template,
)
from . import settings
from ._units import parse_size
from .errors import StateError, WorkerError, add_note
from .hooks import existing_pool, install, installed, uninstall
from .pool import Pool
from .trace import EventRecorder

__all__ = [
    "ClusterRecording", "ClusterStats", "CupoolSetup", "dask_setup", "empty_cache", "record", "stats", "worker_pool",
]

logger = logging.getLogger("cupool")


def _file_name(address: str) -> str:
    """A worker's address as a file name: ``tcp://10.0.0.1:8786`` -> ``10.0.0.1-8786``."""
    return re.sub(r"[^A-Za-z0-9._]+", "-", address.rpartition("://")[2]).strip("-") or "worker"


@dataclass
class _Installed:
    """The pool ``CupoolSetup`` installed in this process, and the workers using it."""

    pool: Pool
    key: tuple[Any, ...]
    workers: set[str] = field(default_factory=set)
    #: Workers torn down whose pool closes once their event loop turns: Dask tears a plugin down
    #: just before setting up the one registered again, and an identical one keeps the pool.
    leaving: set[str] = field(default_factory=set)
    #: Tells pools apart across processes, so that workers sharing one are counted once.
    token: str = field(default_factory=lambda: uuid.uuid4().hex)


_lock = threading.Lock()  # guards _installed and _retired: setups of in-process workers may race
_installed: _Installed | None = None
#: Pools closed (replaced or torn down) while arrays still held their memory: reported by ``stats``
#: until the last of those arrays dies.  Held weakly: the arrays keep their pool alive, and nothing
#: else may (Note [Lifetimes]), or its spill file and host memory would outlive its last array.
_retired: weakref.WeakSet[Pool] = weakref.WeakSet()


class CupoolSetup(WorkerPlugin):
    """Build and install a cupool pool in each worker: ``client.register_plugin(CupoolSetup(max_size="80%"))``.

    ``device`` is ``"auto"`` (CUDA when the worker has a GPU, else sim), ``"sim"``,
    ``"cuda"`` or ``"cuda:N"``; a ``Device`` object is refused, as each worker
    needs its own.  Every other keyword goes to ``Pool`` (``initial_size``,
    ``max_size``, ``spill``, ``release_threshold``, ``defrag_threshold``, ...).
    A spill file is per worker, so a path must contain ``{worker}``, which each
    worker replaces with its address (``spill="/scratch/spill-{worker}.h5"``).
    ``cupy``: hook CuPy (None: when it imports in the worker); ``numba``: hook Numba.

    The arguments are checked here, on the client, by building (and closing) a
    pool with them on a sim device: the device itself when it is the sim one (so
    the check is exact), else a 1 TiB stand-in for the worker's GPU.  So every
    type, range, syntax and combination error is raised here, naming the
    argument; only what depends on the worker's real GPU (an ``initial_size``
    larger than its memory) fails in the worker, and ``register_plugin`` then
    raises that error on the client.

    Registering again (the plugin's ``name`` is fixed, so the last registration
    is the one new workers get):

    - an identical setup (equal ``key``: device, pool arguments, hooks), as
      re-running a notebook cell gives, changes nothing: each worker keeps its
      pool, its cached memory and its figures;
    - a different setup replaces the pool in every worker.  The old pool is
      closed: arrays still alive stay valid, and the memory they hold is reported
      by ``stats`` (``retired_*`` figures) until they die.  A worker whose new
      pool fails is left with none, and ``register_plugin`` raises the error.

    Workers sharing one process (``LocalCluster(processes=False)``) share its one
    installed pool, and a replacement replaces it for all of them.  A pool that
    ``cupool.install()`` made is never replaced (``RuntimeError``).  ``teardown``
    (``client.unregister_worker_plugin("cupool")``, or the worker closing)
    uninstalls the hooks and closes the pool.  distributed's ``idempotent=True``
    is not used: it would ignore a different setup as well as an identical one.
    """

    name = "cupool"

    def __init__(self, device: str = "auto", *, cupy: bool | None = None, numba: bool = True, **options: Any) -> None:
        if cupy is not None and not isinstance(cupy, bool):
            raise TypeError(f"CupoolSetup: cupy must be True, False or None, got {cupy!r}")
        if not isinstance(numba, bool):
            raise TypeError(f"CupoolSetup: numba must be True or False, got {numba!r}")
        known = pool_keywords()
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(
                f"CupoolSetup: unknown argument(s) {', '.join(map(repr, unknown))}; "
                f"Pool takes device, {', '.join(known)}"
            )
        spill = options.get("spill")
        if spill is not None:
            options["spill"] = spill_template(spill)
        check_pool_arguments(device, options)
        self.device = device
        self.options = options
        self.cupy = cupy
        self.numba = numba

    def __repr__(self) -> str:
        args = [repr(self.device), *(f"{k}={v!r}" for k, v in self.options.items())]
        args += [f"{k}={v!r}" for k, v in (("cupy", self.cupy), ("numba", self.numba)) if v != _HOOK_DEFAULTS[k]]
        return f"CupoolSetup({', '.join(args)})"

    @property
    def key(self) -> tuple[Any, ...]:
        """What makes two setups the same: the device, the pool's arguments (sizes in bytes, so
        ``max_size="1GiB"`` is ``max_size=1 << 30``; leaving out those given as their defaults, so
        ``expandable_segments=None`` is no change) and the hooks.  A percentage stays as written:
        only the worker's device knows what it comes to."""
        defaults = pool_defaults()
        options = []
        for k, v in self.options.items():
            if k in _SIZE_KEYS and isinstance(v, str) and not v.strip().endswith("%"):
                v = parse_size(v, name=k)
            if k not in defaults or defaults[k] != v:
                options.append((k, v))
        return (self.device, sorted(options, key=lambda kv: kv[0]), self.cupy, self.numba)

    def make_pool(self, worker_name: str) -> Pool:
        """The pool this plugin builds for the worker named ``worker_name`` (its spill path filled in)."""
        options = dict(self.options)
        spill = options.get("spill")
        if isinstance(spill, str) and spill != "host":
            options["spill"] = spill.replace(WORKER_FIELD, worker_name)
        return Pool(self.device, **options)

    def setup(self, worker: Worker) -> None:
        global _installed
        with _lock:
            current = _installed
            if current is not None:
                if current.key == self.key:
                    current.leaving.discard(worker.address)
                    current.workers.add(worker.address)
                    return
                _installed = None  # replaced: the process's other workers move to the new pool with this one
                workers = (current.workers - current.leaving) | {worker.address}
                _retire(current.pool)
            elif installed():
                raise StateError(
                    "cupool.dask: cupool is already installed in this worker process (cupool.install()); "
                    "CupoolSetup does not replace a pool it did not make"
                )
            else:
                workers = {worker.address}
            pool = self.make_pool(_file_name(worker.address))
            try:
                install(pool, cupy=self._hook_cupy(), numba=self.numba)
            except BaseException:
                pool.close()
                raise
            _installed = _Installed(pool, self.key, workers)

    def teardown(self, worker: Worker) -> None:
        with _lock:
            current = _installed
            if current is None or worker.address not in current.workers:
                return
            if worker.status in (Status.running, Status.paused):  # maybe registered again: decide after setup
                current.leaving.add(worker.address)
                worker.loop.add_callback(_leave, current, worker.address)
                return
        _leave(current, worker.address, now=True)

    def _hook_cupy(self) -> bool:
        """Whether to hook CuPy: as asked, else when the worker has it."""
        return self.cupy if self.cupy is not None else importlib.util.find_spec("cupy") is not None


_HOOK_DEFAULTS: dict[str, bool | None] = {"cupy": None, "numba": True}
#: ``Pool``'s arguments that are sizes (``cupool._units.parse_size``).
_SIZE_KEYS = settings.names(kind="size")


def _leave(entry: _Installed, address: str, now: bool = False) -> None:
    """``address`` stops using ``entry``'s pool (unless set up again meanwhile); the last one closes it."""
    global _installed
    with _lock:
        if not now and address not in entry.leaving:
            return  # set up again with the same arguments: it kept the pool
        entry.leaving.discard(address)
        entry.workers.discard(address)
        if entry.workers or _installed is not entry:
            return
        _installed = None
        _retire(entry.pool)


def _retire(pool: Pool) -> None:
    """Uninstall and close ``pool`` (under ``_lock``); keep it for ``stats`` while arrays hold its memory."""
    if installed() and existing_pool(pool.device.index) is pool:
        uninstall()
    pool.close()
    if pool.stats()["reserved_bytes.all.current"]:
        _retired.add(pool)


def _current() -> _Installed:
    current = _installed
    if current is None:
        raise StateError(
            "cupool.dask: no CupoolSetup is set up in this process; client.register_plugin(CupoolSetup(...))"
        )
    return current


def worker_pool() -> Pool:
    """The pool ``CupoolSetup`` installed in this worker process (for a task that wants it directly)."""
    return _current().pool


# --------------------------------------------------------------- cluster-wide calls
#: Figures summed across workers: bytes and counts that add up.  Peaks are left out
#: (workers peak at different times, so their sum is no peak), and so are ratios
#: and maxima (fragmentation, cache_hit_rate, largest_free_block).
_SUMMED_SUFFIXES = (".current", ".allocated", ".freed")
_SUMMED_NAMES = ("compaction_bytes_moved", "limit", "retired_allocated_bytes", "retired_reserved_bytes")


def _summed(name: str) -> bool:
    """Whether ``ClusterStats.total`` sums the figure ``name`` (see ``_SUMMED_SUFFIXES``)."""
    return name.endswith(_SUMMED_SUFFIXES) or name.startswith("num_") or name in _SUMMED_NAMES


@dataclass(frozen=True)
class ClusterStats:
    """Each worker's ``pool.stats()`` by address, and the cluster's totals.

    Each worker's figures add two of cupool.dask's own:
    ``retired_allocated_bytes`` and ``retired_reserved_bytes``, the memory still
    held by the worker's earlier pools (replaced by a different ``CupoolSetup``)
    through arrays that are still alive; they drop to 0 as those arrays die.

    ``total`` sums what adds up across workers: every ``*.current``,
    ``*.allocated`` and ``*.freed`` figure (bytes and counts), the ``num_*``
    counters, ``compaction_bytes_moved``, ``limit`` (the cluster's cap) and the
    ``retired_*`` bytes.  Peaks, ``fragmentation``, ``cache_hit_rate`` and
    ``largest_free_block`` are per worker only.  Workers that share a process
    (``processes=False``) share its pool, which the totals count once.
    """

    workers: dict[str, dict[str, int | float]]
    total: dict[str, int]


def _worker_stats() -> tuple[str, dict[str, int | float]]:
    current = _current()
    figures = cast(dict[str, int | float], current.pool.stats())  # a plain dict, given two more figures
    with _lock:
        old = [p.stats() for p in list(_retired)]
    figures["retired_allocated_bytes"] = sum(f["allocated_bytes.all.current"] for f in old)
    figures["retired_reserved_bytes"] = sum(f["reserved_bytes.all.current"] for f in old)
    return current.token, figures


def stats(client: Client) -> ClusterStats:
    """Every worker's pool statistics and their totals (see ``ClusterStats``)."""
    got: dict[str, tuple[str, dict[str, int | float]]] = client.run(_worker_stats)
    pools = dict(got.values())  # workers in one process share its pool: count it once
    names = set.intersection(*(set(s) for s in pools.values())) if pools else set()
    total = {n: int(sum(s[n] for s in pools.values())) for n in sorted(names) if _summed(n)}
    return ClusterStats({address: s for address, (_, s) in got.items()}, total)


def _worker_empty_cache() -> int:
    return worker_pool().empty_cache()


def empty_cache(client: Client) -> dict[str, int]:
    """``pool.empty_cache()`` on every worker; the bytes each gave back, by address."""
    released: dict[str, int] = client.run(_worker_empty_cache)
    return released


def _nothing() -> None:
    return None


_recordings: dict[tuple[str, str], tuple[EventRecorder, Path]] = {}  # (token, worker address) -> recorder, folder


def _start_recording(token: str, options: dict[str, Any], dask_worker: Worker) -> None:
    folder = Path(tempfile.mkdtemp(prefix="cupool-trace-", dir=dask_worker.local_directory))
    try:
        recorder = worker_pool().record(folder / "trace.h5", **options).start()
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    _recordings[token, dask_worker.address] = (recorder, folder)


def _stop_recording(token: str, dask_worker: Worker) -> bytes | None:
    """Stop this worker's recorder and hand back its trace file's bytes (None: it was not recording)."""
    entry = _recordings.pop((token, dask_worker.address), None)
    if entry is None:
        return None
    recorder, folder = entry
    try:
        recorder.stop()
        return (folder / "trace.h5").read_bytes()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class ClusterRecording:
    """Every worker records its pool's events; ``stop()`` collects the traces into ``folder``.

    ``with cupool.dask.record(client, "traces") as rec: ...`` then ``rec.paths``:
    one cupool HDF5 trace per worker, ``<folder>/<host>-<port>.h5``, which
    ``cupool.load_trace`` reads and ``cupool.replay.replay`` replays.  Each worker
    streams its trace to a file in its local directory; ``stop()`` brings the
    files over through ``Client.run``.  Workers that join after ``start()`` are
    not recorded; those that leave before ``stop()`` lose their trace.

    ``start()`` claims every worker's file name in ``folder`` (an empty file,
    created exclusively), so a second recording into the same folder, running
    or finished, is refused there with ``FileExistsError``, before anything is
    recorded.  ``stop()`` replaces each claim with its trace; a trace it cannot
    write stays in ``unsaved`` (address -> the file's bytes) and the error says so.
    """

    def __init__(self, client: Client, folder: str | Path, **options: Any) -> None:
        with Pool("sim", capacity="2MiB") as probe:  # EventRecorder's own checks, on the client
            try:
                EventRecorder(probe, None, **options)
            except TypeError as e:
                raise TypeError(f"cupool.dask.record: {e}") from None
            except ValueError as e:
                raise ValueError(f"cupool.dask.record: {e}") from None
        self.client = client
        self.folder = Path(folder)
        self.options = options
        #: The collected traces by worker address, filled in by ``stop()``.
        self.paths: dict[str, Path] = {}
        #: Traces ``stop()`` could not write, by worker address: the trace file's bytes.
        self.unsaved: dict[str, bytes] = {}
        self._token: str | None = None
        self._claimed: dict[str, Path] = {}

    def path_of(self, address: str) -> Path:
        return self.folder / f"{_file_name(address)}.h5"

    def start(self) -> ClusterRecording:
        if self._token is not None:
            raise StateError("cupool.dask.record: this recording is already started")
        self.folder.mkdir(parents=True, exist_ok=True)
        # Client.run's answer names every worker in all versions (scheduler_info() lists only some in a few).
        self._claim(sorted(self.client.run(_nothing)))
        token = uuid.uuid4().hex
        try:
            self.client.run(_start_recording, token, self.options)
        except BaseException:
            self.client.run(_stop_recording, token, on_error="ignore")  # those that did start
            self._unclaim(list(self._claimed))
            raise
        self._token = token
        return self

    def _claim(self, addresses: list[str]) -> None:
        """Create each worker's trace file empty and exclusively, or none of them (naming those taken)."""
        taken = []
        for address in addresses:
            path = self.path_of(address)
            try:
                with open(path, "xb"):
                    pass
            except FileExistsError:
                taken.append(str(path))
            else:
                self._claimed[address] = path
        if taken:
            self._unclaim(list(self._claimed))
            raise FileExistsError(
                f"cupool.dask.record: will not overwrite {', '.join(taken)} (traces of another recording into "
                f"{self.folder}, finished or still running); record into another folder"
            )

    def _unclaim(self, addresses: list[str]) -> None:
        for address in addresses:
            path = self._claimed.pop(address)
            if path.exists() and path.stat().st_size == 0:  # still our empty claim
                path.unlink()

    def stop(self) -> dict[str, Path]:
        """Stop every worker's recorder and write its trace into ``folder``; returns ``paths``.

        A worker whose recorder fails, or whose trace cannot be written, does not
        stop the others' traces from being collected; the failures are raised
        afterwards, naming the workers.
        """
        token, self._token = self._token, None
        if token is None:
            return dict(self.paths)
        results = self.client.run(_stop_recording, token, on_error="return")
        failed: dict[str, BaseException] = {}
        for address, data in sorted(results.items()):
            if isinstance(data, BaseException):
                failed[address] = data
            elif data is not None and address in self._claimed:
                try:
                    self._write(self._claimed[address], data)
                except OSError as e:
                    self.unsaved[address] = data
                    failed[address] = e
                else:
                    self.paths[address] = self._claimed.pop(address)
        self._unclaim(list(self._claimed))  # workers that left or failed: no empty file stays behind
        if failed:
            kept = f"; their traces are in .unsaved ({len(self.unsaved)})" if self.unsaved else ""
            detail = "; ".join(f"{a}: {e}" for a, e in failed.items())
            raise WorkerError(
                f"cupool.dask.record: recording failed on {len(failed)} worker(s): {detail}{kept}"
            ) from next(iter(failed.values()))
        return dict(self.paths)

    def _write(self, path: Path, data: bytes) -> None:
        """Write ``data`` over the claim at ``path`` whole or not at all (a temporary file, then a rename)."""
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def __enter__(self) -> ClusterRecording:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if ev is None:
            self.stop()
            return
        try:  # the block's error stays the one reported
            self.stop()
        except Exception as e:  # noqa: BLE001 - attached to the block's error instead
            add_note(ev, f"cupool.dask.record: also, collecting the traces failed: {e}")


def record(client: Client, folder: str | Path, **options: Any) -> ClusterRecording:
    """Record every worker's pool into ``folder``: ``with cupool.dask.record(client, "traces") as rec:``.

    ``options`` go to each worker's ``pool.record`` (``capacity``, ``stacks``,
    ``batch``, ``flush_interval``) and are checked here.  See ``ClusterRecording``.
    """
    return ClusterRecording(client, folder, **options)


# ---------------------------------------------------------- dask worker --preload cupool.dask
class _SetupCommand(click.Command):
    """``dask_setup``'s command: the options are checked together as soon as they are read.

    distributed reads a preload's options in the ``dask worker`` process before
    any worker starts (and again in the worker), so an ``initial_size`` above
    ``max_size`` stops the command with a usage error there, not as a log line.
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        rest = super().parse_args(ctx, args)
        _setup_from(ctx.params)
        return rest


def _setup_from(params: dict[str, Any]) -> CupoolSetup:
    """The ``CupoolSetup`` that ``dask_setup``'s options (``--cupool-NAME`` for its ``NAME``) describe."""
    args = {name.removeprefix("cupool_"): value for name, value in params.items() if value is not None}
    device, cupy, numba = args.pop("device"), args.pop("cupy", None), args.pop("numba")
    try:
        return CupoolSetup(device, cupy=cupy, numba=numba, **args)
    except (TypeError, ValueError) as e:
        raise click.UsageError(f"--preload cupool.dask: {e}") from e


@click.command(name="dask_setup", cls=_SetupCommand, help=PRELOAD_HELP)
@preload_options
async def dask_setup(worker: Worker, **params: Any) -> None:
    """The worker's pool from its command line, set up as a ``CupoolSetup`` under that plugin's name.

    A ``CupoolSetup`` registered later keeps it when identical, and replaces it
    otherwise.  Bad options are a usage error before any worker starts
    (``_SetupCommand``).  What only the worker can find wrong (no GPU) is said
    once and stops the worker: a process of its own (``dask worker``, or a
    nanny's child, whose nanny then fails rather than restarting it) exits with
    status 1; a worker inside another program is closed.  The pool is made
    before the plugin is registered: distributed would log a failed plugin's
    traceback, then the failed preload's (registering is then a no-op setup).
    """
    plugin = _setup_from(params)
    try:
        plugin.setup(worker)
    except Exception as e:  # noqa: BLE001 - whatever stops the pool stops the worker, told once
        reason = f"--preload cupool.dask: this worker cannot make its pool: {e}"
        logger.error("%s; closing the worker", reason)
        if getattr(worker, "nanny", None):
            # A nanny's child process: one that ends before reporting its start is a failed start to the
            # nanny, which then fails (and does not restart it).  Its start protocol is left mid-way, so no
            # interpreter shutdown: that would trip on the protocol's queue and print its traceback.
            logging.shutdown()
            sys.stderr.flush()
            os._exit(1)
        if _is_dask_worker_command():
            raise SystemExit(1) from None  # not an Exception: distributed's preloads would log it and go on
        worker.loop.add_callback(_close_once_started, worker, reason)
        return
    await worker.plugin_add(plugin=plugin, name=plugin.name, catch_errors=False)


def _is_dask_worker_command() -> bool:
    """Whether this process is the ``dask worker`` command (so a worker without a nanny is the whole process)."""
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(main, "name", None) == "distributed.cli.dask_worker" or Path(sys.argv[0]).name in (
        "dask-worker", "dask")


async def _close_once_started(worker: Worker, reason: str) -> None:
    """Close ``worker`` after its start (in progress: it runs the preloads) ends; close() skips one starting."""
    await worker.start()  # waits on the start in progress, then returns at once
    await worker.close(reason=reason)


#: The name ``python -m cupool.dask`` gives ``dask_setup`` in its usage lines.
PROG = "python -m cupool.dask"


def main(argv: list[str] | None = None) -> int:
    """``python -m cupool.dask [OPTIONS]``: the preload's options and their help (``dask worker --help`` cannot
    show a preload's); given options are checked as ``dask worker`` checks them, and nothing starts."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        with dask_setup.make_context(PROG, list(args) or ["--help"]) as ctx:
            setup = _setup_from(ctx.params)
    except click.exceptions.Exit as e:  # --help: printed
        return e.exit_code
    except click.ClickException as e:
        e.show()
        return e.exit_code
    click.echo(f"dask worker SCHEDULER --preload cupool.dask {' '.join(args)}\n  sets up {setup!r} in each worker")
    return 0


if __name__ == "__main__":
    sys.exit(main())
