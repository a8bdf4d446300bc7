"""Files the command line writes: whole or not at all, never over their own input, and into what they name.

``atomic_output`` writes a regular file through a temporary file in the
destination's folder and renames it over the destination only once everything
is written and flushed to disk, so a full disk, a kill or an exception leaves
either the old file or none, never a truncated one (the rename is atomic within
one file system, which is why the temporary file lives in the same folder).  A
destination that is a symbolic link has its target replaced, so the link keeps
working, as a plain ``open(path, "wb")`` would have done.

Anything else is written into, as it stands: a device (``/dev/null``, a tape:
the rename would put a regular file in its place, and as root ``-o /dev/full``
destroyed the machine's ``/dev/full``) or a FIFO (whose reader waits on it).
``-`` is standard output, and so is a name of one of this process's open
files (``/dev/stdout``, ``/dev/fd/1``, ``/proc/self/fd/1``): those are written
through the descriptor itself, which may be a pipe (its name under ``/proc``
is no file a temporary one can be made beside) or a file the shell opened for
appending.  Such outputs cannot be all or nothing: what was written stays.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TextIO

#: The output name that means standard output.
STDOUT = "-"
#: A name of an open file of a process (the pid, then the descriptor), once its folders are resolved.
_DESCRIPTOR_NAME = re.compile(r"/proc/(\d+)(?:/task/\d+)?/fd/(\d+)")
#: Symbolic links followed in a name before giving up, as the kernel does (ELOOP).
_MAX_LINKS = 40


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether ``a`` and ``b`` name one existing file (through another path, a symbolic link or a hard link).

    ``-`` names standard output, whatever it is open on.
    """
    try:
        return os.path.samestat(*(os.fstat(1) if os.fspath(x) == STDOUT else os.stat(x) for x in (a, b)))
    except OSError:  # either does not exist (yet): they cannot be the same file
        return False


def written_in_place(path: str | os.PathLike[str]) -> bool:
    """Whether ``atomic_output`` writes into ``path`` as it stands: standard output, a descriptor, a device, a FIFO."""
    if os.fspath(path) == STDOUT or _descriptor(path) is not None:
        return True
    try:
        mode = os.stat(path).st_mode
    except OSError:  # not there (yet): a new regular file
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def output_path(output: str, default: str, what: str) -> Path:
    """The file a command's ``-o OUTPUT`` names, one rule for every command: a folder means a file in it.

    ``OUTPUT`` is that folder when it ends in a slash or names an existing
    folder; the file in it is ``default`` (``report.png``, ``snapshot.pickle``).
    A folder that does not exist is refused, as is a file in one, before any
    work is done: ``OSError("cannot write the WHAT PATH: the folder F does not
    exist")``.  Standard output, a descriptor, a device or a FIFO is as named.
    """
    if written_in_place(output):
        return Path(output)
    out = Path(output)
    if output.endswith(("/", os.sep)) or out.is_dir():
        out = out / default
    folder = out.resolve().parent
    if not folder.is_dir():
        why = "is not a folder" if folder.exists() else "does not exist"
        raise OSError(f"cannot write the {what} {out}: the folder {folder} {why}")
    return out


def output_name(path: str | os.PathLike[str]) -> str:
    """How a command names what it wrote ("wrote NAME: ..."): ``-`` as the words "standard output"."""
    name = os.fspath(path)
    return "standard output" if name == STDOUT else name


def status_stream(path: str | os.PathLike[str]) -> TextIO:
    """Where a command says what it wrote to ``path``: standard error when the output is standard output."""
    name = os.fspath(path)
    return sys.stderr if name == STDOUT or _descriptor(name) == 1 else sys.stdout


def refuse_overwriting_input(output: str | os.PathLike[str], source: str | os.PathLike[str], what: str) -> None:
    """Raise ``ValueError`` if writing ``output`` would destroy ``source``, the file being read."""
    if same_file(output, source):
        raise ValueError(f"cannot write the {what} {output}: it is the input {source} (give another -o)")


@contextmanager
def atomic_output(path: str | os.PathLike[str], what: str, text: bool = False) -> Iterator[IO]:
    """A file to write ``path`` through: renamed over it once complete, removed if anything fails.

    ``what`` names the file in errors ("the snapshot"): an ``OSError`` raised
    while writing (a full disk, say) comes out as ``OSError("cannot write the
    snapshot PATH: No space left on device")``, with nothing left at ``PATH``
    but what was there before.  A file that may not be written is refused, as
    ``open`` would refuse it; one that is replaced gets the permissions a new file
    gets (the umask applies), not the old file's.  ``-``, a name of an open
    descriptor, a device or a FIFO is written into instead (see the module's
    docstring).
    """
    name = os.fspath(path)
    descriptor = 1 if name == STDOUT else _descriptor(name)
    if descriptor is not None:
        with _into_descriptor(descriptor, path, what, text) as into:
            yield into
        return
    special = _open_special(name, path, what)
    if special is not None:
        with _into(special, path, what, text) as into:
            yield into
        return
    target = Path(os.path.realpath(path))
    try:
        if target.exists() and not os.access(target, os.W_OK):  # a rename would ignore the file's own permissions
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        fd, tmp = _create_beside(target)
    except OSError as e:
        raise OSError(f"cannot write {what} {path}: {e.strerror or e}") from None
    try:
        fh: IO = open(fd, "w", encoding="utf-8", newline="") if text else open(fd, "wb")
        with fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise OSError(f"cannot write {what} {path}: {e.strerror or e}") from None
        raise


def _create_beside(target: Path) -> tuple[int, Path]:
    """A new, empty, hidden file in ``target``'s folder, created exclusively (never through a link)."""
    while True:
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.partial")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:  # another writer's name, however unlikely: draw again
            continue


def _descriptor(path: str | os.PathLike[str]) -> int | None:
    """The descriptor of this process that ``path`` names (``/dev/stdout``, ``/dev/fd/3``), if it names one.

    Follows the name's links one at a time (``/dev/stdout`` -> ``/proc/self/fd/1``)
    without following the last one, the descriptor's own, which points at
    whatever it is open on (``pipe:[123]``, a terminal, a file).
    """
    name = os.path.abspath(path)
    for _ in range(_MAX_LINKS):
        folder, base = os.path.split(name)
        name = os.path.join(os.path.realpath(folder), base)
        m = _DESCRIPTOR_NAME.fullmatch(name)
        if m is not None:
            return int(m[2]) if int(m[1]) == os.getpid() else None
        if not os.path.islink(name):
            return None
        name = os.path.normpath(os.path.join(os.path.dirname(name), os.readlink(name)))
    return None


@contextmanager
def _into_descriptor(fd: int, path: str | os.PathLike[str], what: str, text: bool) -> Iterator[IO]:
    """Write through descriptor ``fd``: for standard output, Python's own stream (after what it holds)."""
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        stream = sys.stdout if fd == 1 else None
        own = stream if text else getattr(stream, "buffer", None)  # a notebook's stdout has no bytes below it
        if own is not None:
            with _unclosed(own, path, what) as fh:
                yield fh
            return
        fd = os.dup(fd)
    except BrokenPipeError:
        raise
    except OSError as e:
        raise OSError(f"cannot write {what} {path}: {e.strerror or e}") from None
    with _into(fd, path, what, text) as fh:
        yield fh


def _open_special(name: str, path: str | os.PathLike[str], what: str) -> int | None:
    """A descriptor open for writing on ``name`` if it is a device, a FIFO or a socket (None: it is not)."""
    try:
        mode = os.stat(name).st_mode
    except OSError:  # not there, or not to be looked at: the atomic path says why
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    try:
        # No O_CREAT, no O_TRUNC: it is there, and a device has nothing to truncate.  A FIFO waits for its reader.
        fd = os.open(name, os.O_WRONLY | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise OSError(f"cannot write {what} {path}: {e.strerror or e}") from None
    if stat.S_ISREG(os.fstat(fd).st_mode):  # replaced by a regular file since: write that whole, as any
        os.close(fd)
        return None
    return fd


@contextmanager
def _into(fd: int, path: str | os.PathLike[str], what: str, text: bool) -> Iterator[IO]:
    """Write ``fd`` (which this closes), naming ``path`` in an error."""
    try:
        fh: IO = open(fd, "w", encoding="utf-8", newline="") if text else open(fd, "wb")
        with fh:
            yield fh
            fh.flush()
    except BrokenPipeError:  # the reader left: the command line ends quietly, as for its own output
        raise
    except OSError as e:
        raise OSError(f"cannot write {what} {path}: {e.strerror or e}") from None


@contextmanager
def _unclosed(fh: IO, path: str | os.PathLike[str], what: str) -> Iterator[IO]:
    """Write ``fh`` (standard output), flushed at the end and left open."""
    try:
        yield fh
        fh.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        raise OSError(f"cannot write {what} {path}: {e.strerror or e}") from None
