"""Files the command line writes: whole or not at all, and never over their own input.

``atomic_output`` writes to a temporary file in the destination's folder and
renames it over the destination only once everything is written and flushed to
disk, so a full disk, a kill or an exception leaves either the old file or none,
never a truncated one (the rename is atomic within one file system, which is
why the temporary file lives in the same folder).  A destination that is a
symbolic link has its target replaced, so the link keeps working, as a plain
``open(path, "wb")`` would have done.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether ``a`` and ``b`` name one existing file (through another path, a symbolic link or a hard link)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # either does not exist (yet): they cannot be the same file
        return False


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
    gets (the umask applies), not the old file's.
    """
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
