"""Reading a pickle someone handed us, with work and memory bounded by its size.

A PyTorch memory snapshot is a pickle, and a pickle is a program: it can call
any function, and even with calls refused (``find_class``) three things in it
cost far more than its size:

* a length field (``BINBYTES8``, ``FRAME``) makes the C unpickler allocate what
  it claims before reading it, and a memo index (``LONG_BINPUT``) makes it grow
  its memo to twice the index: 64 GiB for a few bytes;
* a dict key or set element is hashed as it is stored.  A memo reference
  (``BINGET``, two bytes) names an object again, so 40 tuples each holding the
  previous one twice describe a tree of 2**40 leaves in a few hundred bytes,
  and hashing it walks every leaf, in C, where no signal ends it; and numbers
  hash to what they are, so keys made to collide turn a dict's inserts
  quadratic;
* the same sharing, or plain depth, makes ``repr``, ``str`` or ``==`` of a
  loaded value take exponential time and memory, or overflow the stack.

So ``read_pickle`` walks the opcodes before unpickling (``check_pickle``):
every length must fit in the bytes that follow, every memo index must be one a
pickler could have written, and, following the unpickler's stack, every dict
key must be a string (whose hash is randomised and cached), as every key of a
PyTorch snapshot is, and sets are refused (a snapshot holds none).  The values
loaded are then only ever described by type and size (``describe``), never
printed.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import stat
from pathlib import Path
from typing import Any

from .._units import format_bytes
from ..errors import TraceError

#: The largest snapshot read: it is read whole, and unpickled takes several times that.
MAX_SNAPSHOT_BYTES = 4 << 30


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it references the Python object {module}.{name}")


# What the walk needs of each opcode, from pickletools' table: the width of its argument (> 0: fixed
# bytes; UP_TO_NEWLINE; TAKEN_FROM_ARGUMENT*: a length field, then that many bytes; None: not an
# opcode), what it does to the stack (``_DOES``; most push one value), how many values it takes (below
# its MARK, if it takes one) and leaves, and whether a value it pushes is a string (``_PUSHES_KEY``).
# Opcodes that reach for Python objects pass the walk: the unpickler's find_class refuses them, by name.
_OPS = {ord(op.code): op for op in pickletools.opcodes}
_NAMED = {op.name: ord(op.code) for op in pickletools.opcodes}
_ARG_WIDTH: list[int | None] = [None] * 256
_TAKES, _LEAVES = [0] * 256, [0] * 256
_PUSH, _GET, _MEMO, _MARK, _TO_MARK, _KEYS_TO_MARK, _SETITEM, _SET, _STOP, _OTHER = range(10)
_DOES = [_OTHER] * 256
_PUSHES_KEY = bytearray(256)
for _code, _op in _OPS.items():
    _ARG_WIDTH[_code] = 0 if _op.arg is None else _op.arg.n
    _marked = pickletools.markobject in _op.stack_before
    _TAKES[_code] = _op.stack_before.index(pickletools.markobject) if _marked else len(_op.stack_before)
    _LEAVES[_code] = len(_op.stack_after)
    _DOES[_code] = _TO_MARK if _marked else _PUSH if not _op.stack_before and _LEAVES[_code] == 1 else _OTHER
    _PUSHES_KEY[_code] = bool(_op.stack_after) and _op.stack_after[0].name in ("str", "bytes", "bytes_or_str")
for _names, _does in (("GET BINGET LONG_BINGET", _GET), ("PUT BINPUT LONG_BINPUT MEMOIZE", _MEMO),
                      ("MARK", _MARK), ("SETITEMS DICT", _KEYS_TO_MARK), ("SETITEM", _SETITEM),
                      ("EMPTY_SET ADDITEMS FROZENSET", _SET), ("STOP", _STOP)):
    for _name in _names.split():
        _DOES[_NAMED[_name]] = _does
del _code, _op, _marked, _names, _does, _name
_TWO_LINES = {_NAMED["GLOBAL"], _NAMED["INST"]}  # a module and a name, a line each
#: Length fields: (bytes, signed) by argument kind.
_LENGTH = {pickletools.TAKEN_FROM_ARGUMENT1: (1, False), pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
           pickletools.TAKEN_FROM_ARGUMENT4U: (4, False), pickletools.TAKEN_FROM_ARGUMENT8U: (8, False)}
_FRAME, _MEMOIZE, _POP = _NAMED["FRAME"], _NAMED["MEMOIZE"], _NAMED["POP"]
#: Opcodes that push a value that is not a string, with an argument of fixed width: their size in bytes.
_PLAIN = bytearray(1 + w if _DOES[c] == _PUSH and not _PUSHES_KEY[c] and w is not None and w >= 0 else 0
                   for c, w in enumerate(_ARG_WIDTH))
#: The commonest opcodes of a snapshot, which the walk looks for first.
_FAST = ("BINGET", "SHORT_BINUNICODE", "MEMOIZE", "MARK", "SETITEMS")


def check_pickle(data: bytes) -> str | None:
    """What makes ``data`` unsafe to unpickle (None: nothing); see the module's docstring.

    The walk follows the unpickler's stack and memo, knowing of each value only
    whether it is a string (1) or not (0), which is all a dict key needs.
    """
    n, pos, at, op, value = len(data), 0, 0, 0, 0  # value: the argument of the opcode at ``at``
    stack, memo = bytearray(), bytearray()
    marks: list[int] = []
    push, mark_at, widths, does, keys, plain = stack.append, marks.append, _ARG_WIDTH, _DOES, _PUSHES_KEY, _PLAIN
    binget, short_str, memoize, mark_op, setitems = (_NAMED[name] for name in _FAST)
    try:
        while pos < n:
            at = pos
            op = data[pos]
            # The opcodes of nine in ten steps of a snapshot, first.
            if op == binget:
                push(memo[data[pos + 1]])
                pos += 2
                continue
            size = plain[op]
            if size:
                push(0)
                pos += size
                continue
            if op == short_str:
                push(1)
                pos += 2 + data[pos + 1]
                continue
            if op == memoize:
                memo.append(stack[-1])
                pos += 1
                continue
            if op == mark_op:
                mark_at(len(stack))
                pos += 1
                continue
            if op == setitems:
                mark = marks.pop()
                if 0 in stack[mark::2]:
                    return _not_a_string(op, at)
                del stack[mark:]
                pos += 1
                continue
            width = widths[op]
            does_op = does[op]
            pos += 1
            if width == 1:
                value = data[pos]
                pos += 1
            elif width:
                if width is None:
                    return f"byte {at} ({op:#04x}) is not a pickle opcode"
                if width > 0:
                    value = int.from_bytes(data[pos:pos + width], "little")
                    pos += width
                    if op == _FRAME and value > n - pos:
                        return f"a FRAME at byte {at} claims {value} bytes, but {max(n - pos, 0)} follow"
                elif width == pickletools.UP_TO_NEWLINE:
                    end = data.find(b"\n", pos)
                    if op in _TWO_LINES and end >= 0:
                        end = data.find(b"\n", end + 1)
                    if end < 0:
                        break
                    text, pos = data[pos:end], end + 1
                    if does_op == _GET or does_op == _MEMO:  # the text forms
                        if not text.isdigit() or len(text) > 19:
                            return f"a memo index at byte {at} is {text[:40]!r}, which is not an index"
                        value = int(text)
                else:
                    size, signed = _LENGTH[width]
                    length = int.from_bytes(data[pos:pos + size], "little", signed=signed)
                    pos += size
                    if not 0 <= length <= n - pos:
                        return (f"a length field of opcode {_OPS[op].name} at byte {at} claims {length} bytes, "
                                f"but {max(n - pos, 0)} follow")
                    pos += length
            if does_op == _GET:
                if value >= len(memo):
                    return f"a memo index at byte {at} is {value}, which nothing was stored at"
                stack.append(memo[value])
            elif does_op == _PUSH:
                stack.append(keys[op])
            elif does_op == _MEMO:
                index = len(memo) if op == _MEMOIZE else value
                if index > len(memo):
                    return f"a memo index at byte {at} is {index}, past the {len(memo)} entries made so far"
                if index == len(memo):
                    memo.append(stack[-1])
                else:
                    memo[index] = stack[-1]
            elif does_op == _MARK:
                marks.append(len(stack))
            elif does_op == _STOP:
                return None
            elif does_op == _SET:
                return f"it holds a set (opcode {_OPS[op].name} at byte {at}), which no PyTorch snapshot does"
            else:
                if does_op == _TO_MARK or does_op == _KEYS_TO_MARK:
                    mark = marks.pop()
                    if does_op == _KEYS_TO_MARK and 0 in stack[mark::2]:
                        return _not_a_string(op, at)
                    del stack[mark:]
                elif does_op == _SETITEM and stack[-2] != 1:
                    return _not_a_string(op, at)
                elif op == _POP and len(stack) == (marks[-1] if marks else 0):
                    marks.pop()  # POP at a MARK drops the mark
                    continue
                takes = _TAKES[op]
                if len(stack) - takes < (marks[-1] if marks else 0):
                    raise IndexError
                del stack[len(stack) - takes:]
                stack.extend(bytes(_LEAVES[op]))  # a value an opcode builds from others is not a string
    except IndexError:  # an argument past the end, a memo entry never stored, or too short a stack
        if pos + 1 >= n:
            return "the pickle ends before its STOP opcode (truncated?)"
        if op == binget:
            return f"a memo index at byte {at} is {data[at + 1]}, which nothing was stored at"
        return f"opcode {_OPS[op].name} at byte {at} finds too few values on the stack"
    return "the pickle ends before its STOP opcode (truncated?)"


def _not_a_string(op: int, at: int) -> str:
    return (f"a dict key (opcode {_OPS[op].name} at byte {at}) is not a string, as every key of a PyTorch "
            "snapshot is; hashing other keys can take time without bound")


def read_pickle(p: Path) -> Any:
    """The plain data pickled in ``p``, or a TraceError saying why it cannot be had safely."""
    try:
        with open(p, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise TraceError(p, "not a regular file")
            if st.st_size > MAX_SNAPSHOT_BYTES:
                raise TraceError(p, f"a snapshot of {format_bytes(st.st_size)} is past the "
                                    f"{format_bytes(MAX_SNAPSHOT_BYTES)} this reader takes")
            data = fh.read(st.st_size)
    except OSError as e:
        raise TraceError(p, f"cannot read the file ({e.strerror or e})") from None
    problem = check_pickle(data)
    if problem is not None:
        raise TraceError(p, f"not a readable PyTorch memory snapshot pickle: {problem}")
    try:
        # From memory, not the file: a read the walk did not foresee then asks for no more than the file holds.
        return _PlainUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, OverflowError) as e:
        raise TraceError(p, f"not a readable PyTorch memory snapshot pickle ({e or type(e).__name__})") from None


def describe(value: Any) -> str:
    """An untrusted value for an error message: its type and size, never its contents.

    ``repr`` of a value that repeats another by reference can take exponential
    time and memory, and of a deeply nested one overflows the stack; a short
    string, a number or None is shown as it is.
    """
    if value is None or isinstance(value, (bool, float)):
        return repr(value)
    if isinstance(value, int):
        return str(value) if value.bit_length() <= 256 else f"an integer of {value.bit_length():,} bits"
    if isinstance(value, str) and len(value) <= 40:
        return repr(value)
    kind = type(value).__name__
    article = "an" if kind[0] in "aeiou" else "a"
    try:
        n = len(value)
    except TypeError:
        return f"{article} {kind}"
    unit = "character" if isinstance(value, str) else "byte" if isinstance(value, (bytes, bytearray)) else "item"
    return f"{article} {kind} of {n:,} {unit}{'' if n == 1 else 's'}"
