"""Ctrl-C never lands in the middle of a pool operation: it is deferred to the operation's end.

Charter: this module knows signals, threads and frames; nothing of pools.  The
fast path and the arena call ``deliver()`` where an operation ends, with the
lock released; the event dispatcher calls ``defer()`` for a KeyboardInterrupt
a subscriber raised.

Note [Interrupts]
~~~~~~~~~~~~~~~~~
Python raises ``KeyboardInterrupt`` between any two bytecodes of the main
thread.  Inside a pool operation that leaves a block freed in the heap but not
in the books, a lock never released, or a buffer half moved: the pool is broken
for good.  So while Python's own SIGINT handler is in place, cupool installs one
that looks at the interrupted stack: if a frame of the mechanism (``MODULES``)
is on it, the interrupt is *deferred*: recorded, and raised by ``deliver()``
at the end of the operation, once the books are consistent and the lock is
free.  Elsewhere it raises at once, as Python's would.

Three guards keep Ctrl-C working:
- an operation that ends by raising raises the interrupt owed to it instead,
  its failure the interrupt's ``__context__`` (``unlock``, and the fast path's
  ``malloc`` and ``free``), so requests that keep failing never leave one owed;
  one deferred where no operation's end follows (a device call outside the
  lock, a pool's constructor) is re-delivered by a timer
  (``_thread.interrupt_main``) ``REDELIVER_S`` later if nothing has raised it;
- an interrupt deferred for more than ``PATIENCE_S`` (a subscriber that loops
  for ever) is raised wherever it lands: a broken pool beats a process that
  cannot be stopped;
- a handler of the user's own is never replaced, and none is installed off the
  main thread.  One that chains to the handler it replaced (``old(signum,
  frame)``, the usual way to add to Ctrl-C) asks for what that one does, so
  the deferral holds under it too.

A ``KeyboardInterrupt`` raised by a subscriber callback is deferred the same
way, on any thread.  ``PyThreadState_SetAsyncExc`` (a debugger's tool) cannot
be deferred: it is not a signal.
"""

from __future__ import annotations

import _thread
import atexit
import signal
import threading
import time
from types import FrameType
from typing import Any

#: Modules whose frames mark a pool operation in progress.
MODULES = ("cupool.core.", "cupool.pressure.", "cupool.pool", "cupool.device.")
REDELIVER_S = 0.05
PATIENCE_S = 2.0

#: Interrupts owed, by thread id: an operation's end raises its thread's (``deliver``).  The fast
#: path tests the dict itself (``if OWED:``), the cheapest test there is.
OWED: dict[int, BaseException] = {}
# When the main thread's first owed interrupt was deferred.
_since: list[float] = [0.0]
_installed: list[bool] = [False]
_exiting: list[bool] = [False]


def install() -> None:
    """Put the deferring SIGINT handler in place of Python's default one (main thread only)."""
    if _installed[0] or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
        _installed[0] = True


def _in_operation(frame: FrameType | None) -> bool:
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith(MODULES):
            return True
        frame = frame.f_back
    return False


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    me = threading.get_ident()
    now = time.monotonic()
    if not _in_operation(frame) or (me in OWED and now - _since[0] > PATIENCE_S):
        OWED.pop(me, None)
        raise KeyboardInterrupt
    if me not in OWED:
        _since[0] = now
        OWED[me] = KeyboardInterrupt()
        timer = threading.Timer(REDELIVER_S, _redeliver, (me,))  # one per owed interrupt
        timer.daemon = True
        timer.start()


def _redeliver(thread: int) -> None:
    """Deliver an interrupt still owed (the operation ended by raising something else): again
    ``REDELIVER_S`` later, so that a Ctrl-C is never lost; never once Python is shutting down."""
    if thread in OWED and not _exiting[0]:
        _thread.interrupt_main(signal.SIGINT)


def _at_exit() -> None:
    _exiting[0] = True
    OWED.clear()


atexit.register(_at_exit)


def defer(error: BaseException) -> None:
    """Owe ``error`` (a KeyboardInterrupt from a subscriber) to this thread's running operation."""
    OWED.setdefault(threading.get_ident(), error)
    if threading.current_thread() is threading.main_thread():
        _since[0] = time.monotonic()


def deliver() -> None:
    """Raise an interrupt owed to this thread; called where an operation ends, lock released."""
    error: Any = OWED.pop(threading.get_ident(), None)
    if error is not None:
        raise error
