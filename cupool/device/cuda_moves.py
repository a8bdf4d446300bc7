"""Moves on a CUDA GPU: large disjoint moves on the copy path, the rest in one cached kernel launch.

``CudaMover.execute`` carries out a move list (absolute addresses, bytes) with
memmove semantics.  ``cupool.kernels.plan.plan_moves`` (compiled host code) splits
it: a move whose source and destination do not overlap and that is at least
``copy_min`` bytes goes through ``cudaMemcpyAsync`` (or the driver's batched copy,
``cuMemcpyBatchAsync``, where the bindings offer it); slides over themselves and
small moves go to the Numba kernel, thousands in one launch.  Steps run in the
plan's order on one stream of the mover's own, so a copy never reads bytes a
kernel step of an earlier phase has yet to write, and the other way round.

Per call, nothing is allocated on the device and no array view is built: the
plan goes up through one staging buffer kept from call to call (grown by
doubling), a slide over itself by a little goes through one scratch buffer kept
the same way (``SCRATCH_BYTES``, taken by ``prepare``: a ``cudaMalloc`` and a
``cudaFree`` per call cost about 90 µs on an H200 and the free waits for the whole
device, the 2026-11-28 run's one failed mover test), and the kernel is launched on
raw pointers (its arguments are typed ``CPointer``) through the compiled kernel's
own ``launch``, skipping Numba's dispatcher and its argument typing.  Nothing goes
through Numba's or CuPy's allocator either: with cupool installed as theirs, that
would re-enter the pool in the middle of a compaction; both buffers come straight
from ``cudaMalloc``, and a device too full for the scratch moves window by window
through what it has (or in chunks, without any).

The runtime, the kernel and the batched copy are passed in, so that the whole of
this runs on the CPU against fakes (``tests/test_cuda_moves.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

log = logging.getLogger(__name__)

#: The most scratch a move that slides over itself by very little gets (see ``cupool.kernels.plan``).
SCRATCH_BYTES = 16 << 20
#: Threads per block of the move kernel; blocks per SM come from the cooperative-launch limit.
MOVE_THREADS = 512
#: The shortest disjoint move for the copy path.  Below it the kernel, already launched for the
#: small moves, is cheaper than one more copy call (a few microseconds each).  Not yet measured
#: on a GPU: see docs/gpu-validation.md, Pending.
COPY_MIN_BYTES = 1 << 20
#: Fewer copies than this in one step go one ``cudaMemcpyAsync`` each, not batched.
BATCH_MIN = 4
_NON_BLOCKING = 1  # cudaStreamNonBlocking
_H2D = 1  # cudaMemcpyHostToDevice
_D2D = 3  # cudaMemcpyDeviceToDevice


class MoveKernel(Protocol):
    """Launches ``move_cuda`` on one plan step; ``prepare`` compiles and sizes it for an element size."""

    def prepare(self, ws: int) -> None: ...

    def launch(self, ws: int, buf: int, extent: int, plan: int, plan_len: int, k: int, ngroups: int,
               stream: int) -> None:
        """Run one kernel step: ``extent`` elements of ``ws`` bytes at ``buf``, ``plan_len`` int64 at ``plan``."""


class CudaMover:
    """The move machinery of one GPU: a stream, a staging buffer, the kernel and the copy path.

    ``rt`` is ``cupy.cuda.runtime`` (or a fake with the same calls); ``kernel`` a
    ``MoveKernel``; ``batch`` a batched copy ``(dsts, srcs, sizes, stream) -> bool``
    or None (False from it, or an exception, means it is unusable here: the mover
    falls back to one copy per move for good, and says so once in the log).
    """

    def __init__(self, rt: Any, kernel: MoveKernel, batch: Callable[..., bool] | None = None,
                 copy_min: int = COPY_MIN_BYTES) -> None:
        self._rt = rt
        self._kernel = kernel
        self._batch = batch
        self.copy_min = copy_min
        self._stream = 0
        self._staging = 0
        self._staging_size = 0
        self._scratch = 0
        self._scratch_size = 0

    @property
    def stream(self) -> int:
        """The mover's own non-blocking stream, made on first use."""
        if not self._stream:
            self._stream = int(self._rt.streamCreateWithFlags(_NON_BLOCKING))
        return self._stream

    def prepare(self) -> None:
        """Compile and size the kernel, then launch it for words and for bytes, on a few staging bytes.

        A launch the device refuses (a grid too large to be cooperative, as once on
        an H100) raises here, before compaction has changed the heap.  The scratch
        buffer is taken here too, so that no later call allocates.
        """
        at = self._staging_for(64 << 10)
        self._scratch_for(SCRATCH_BYTES)
        for n in (8, 1):  # far past any plan prepare's own moves upload: both signatures
            self._kernel.prepare(n)
            self.execute(np.array([at + (32 << 10)]), np.array([at + (48 << 10)]), np.array([n]))

    def execute(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        """Carry out the moves in order, with memmove semantics; returns once they are done."""
        from ..kernels.move import UNROLL, word_size  # numba is imported on first use
        from ..kernels.plan import COPY, plan_moves, scratch_needed

        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        nbytes = np.asarray(nbytes, dtype=np.int64)
        if not src.size:
            return
        ws = word_size(src, dst, nbytes)
        window = min(int(scratch_needed(src // ws, dst // ws, nbytes // ws)) * ws, SCRATCH_BYTES)
        if window:
            window = min(window, self._scratch_for(window)) // ws * ws
        scratch = self._scratch if window else 0
        stream = self.stream
        try:
            # Offsets from the lowest address any move touches, so that a move may cross segments.
            lo = int(min(src.min(), dst.min()))
            hi = int(max((src + nbytes).max(), (dst + nbytes).max()))
            if scratch:
                lo, hi = min(lo, scratch), max(hi, scratch + window)
            steps, copies, packed = plan_moves(
                (src - lo) // ws, (dst - lo) // ws, nbytes // ws, (scratch - lo) // ws if scratch else -1,
                window // ws, MOVE_THREADS * UNROLL, -(-self.copy_min // ws),
            )
            if not steps.size:
                return
            staging = 0
            if packed.size:
                staging = self._staging_for(packed.nbytes)
                self._rt.memcpyAsync(staging, packed.ctypes.data, packed.nbytes, _H2D, stream)
            copies = copies * ws + lo  # addresses and bytes from here on
            copies[2] -= lo
            for kind, a, b, c in steps.tolist():
                if kind == COPY:
                    self._copy(copies[:, a : a + b], stream)
                else:
                    self._kernel.launch(ws, lo, (hi - lo) // ws, staging + 8 * a, packed.size - a, b, c, stream)
        finally:
            self._rt.streamSynchronize(stream)

    def _copy(self, pieces: np.ndarray, stream: int) -> None:
        """One step of the copy path: pieces that do not conflict with each other (rows src, dst, bytes)."""
        if self._batch is not None and pieces.shape[1] >= BATCH_MIN:
            try:
                done = self._batch(pieces[1].tolist(), pieces[0].tolist(), pieces[2].tolist(), stream)
            except Exception as e:  # noqa: BLE001 - any failure means: copy one by one from now on
                done = False
                log.info("cupool: the driver's batched copy failed (%s); copying move by move", e)
            if done:
                return
            self._batch = None  # the copies of a step are independent, so redoing them all is safe
        for s, d, n in zip(*pieces.tolist()):
            self._rt.memcpyAsync(d, s, n, _D2D, stream)

    def _scratch_for(self, nbytes: int) -> int:
        """The bytes of the kept scratch buffer, grown to ``nbytes`` where the device has them.

        A device too full keeps the buffer it had (0 bytes if none): the moves then go
        through it window by window, or in chunks without it.
        """
        if self._scratch_size < nbytes:
            try:
                ptr = int(self._rt.malloc(nbytes))
            except self._rt.CUDARuntimeError:
                return self._scratch_size
            if self._scratch:
                self._rt.free(self._scratch)  # idle: every call ends with its stream synchronized
            self._scratch, self._scratch_size = ptr, nbytes
        return self._scratch_size

    def _staging_for(self, nbytes: int) -> int:
        """A device buffer of at least ``nbytes`` for move plans, kept and grown by doubling."""
        if self._staging_size < nbytes:
            if self._staging:
                self._rt.free(self._staging)  # a blocking free: no earlier plan is still being read
                self._staging, self._staging_size = 0, 0
            size = max(64 << 10, 1 << (nbytes - 1).bit_length())
            self._staging = int(self._rt.malloc(size))
            self._staging_size = size
        return self._staging


class NumbaMoveKernel:
    """``move_cuda`` compiled for raw pointers, launched through the compiled kernel, no dispatcher.

    The grid is as many blocks as a cooperative launch may keep resident (it
    depends on the compiled kernel's registers, so it is asked of the driver once
    per element size).  512 threads a block measured best on an H100.  A Numba
    whose launch cannot pass ``CPointer`` arguments (``numba.cuda`` inside Numba
    itself, before numba-cuda) raises ``NotImplementedError`` before launching:
    the kernel is then compiled for arrays and launched on views, as before.
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self._raw = True  # pointers; False: array views
        self._compiled: dict[int, tuple[Any, int]] = {}  # element size -> (kernel, blocks)
        self._streams: dict[int, Any] = {}  # stream handle -> Numba's stream object

    def prepare(self, ws: int) -> None:
        self._get(ws)

    def _get(self, ws: int) -> tuple[Any, int]:
        have = self._compiled.get(ws)
        if have is None:
            from numba import cuda

            from ..kernels.move import move_cuda

            elem = "uint64" if ws == 8 else "uint8"
            sig = (f"void(CPointer({elem}), CPointer(int64), int64, int64)" if self._raw
                   else f"void({elem}[::1], int64[::1], int64, int64)")
            with cuda.gpus[self.index]:
                kernel = move_cuda.compile(sig)
                blocks = max(1, int(kernel.max_cooperative_grid_blocks(MOVE_THREADS)))
            have = self._compiled[ws] = (kernel, blocks)
        return have

    def launch(self, ws: int, buf: int, extent: int, plan: int, plan_len: int, k: int, ngroups: int,
               stream: int) -> None:
        from numba import cuda

        with cuda.gpus[self.index]:
            s = self._streams.get(stream)
            if s is None:
                s = self._streams[stream] = cuda.external_stream(stream)
            if self._raw:
                kernel, blocks = self._get(ws)
                try:
                    kernel.launch((buf, plan, k, ngroups), (blocks, 1, 1), (MOVE_THREADS, 1, 1), s)
                    return
                except NotImplementedError:
                    log.info("cupool: this Numba cannot launch on raw pointers; the move kernel uses array views")
                    self._raw = False
                    self._compiled.clear()
            kernel, blocks = self._get(ws)
            args = (_view(cuda, buf, extent, "<u8" if ws == 8 else "|u1"), _view(cuda, plan, plan_len, "<i8"), k, ngroups)
            kernel.launch(args, (blocks, 1, 1), (MOVE_THREADS, 1, 1), s)


def _view(cuda: Any, ptr: int, count: int, typestr: str) -> Any:
    """A Numba view of ``count`` elements at a raw device pointer, allocating nothing."""
    return cuda.from_cuda_array_interface(
        {"data": (ptr, False), "shape": (count,), "typestr": typestr, "version": 3}, owner=None, sync=False
    )


def driver_batch_copy(index: int) -> Callable[..., bool] | None:
    """``cuMemcpyBatchAsync`` from ``cuda.bindings.driver`` for device-to-device copies, or None without it.

    The bindings are the ``vmm`` extra; the call exists from CUDA 12.8.  It refuses
    the legacy default stream, which the mover never uses.
    """
    try:
        from cuda.bindings import driver as drv
    except ImportError:
        return None
    return batch_copy_over(drv, index)


def batch_copy_over(drv: Any, index: int) -> Callable[..., bool] | None:
    """The batched copy over a driver module (a fake one in tests); None where it lacks the call."""
    call = getattr(drv, "cuMemcpyBatchAsync", None)
    if call is None or not hasattr(drv, "CUmemcpyAttributes"):
        return None
    attr = drv.CUmemcpyAttributes()
    attr.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    for hint in (attr.srcLocHint, attr.dstLocHint):
        hint.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        hint.id = index
    attrs = [attr]
    ok = drv.CUresult.CUDA_SUCCESS
    ptr = drv.CUdeviceptr

    def batch(dsts: list[int], srcs: list[int], sizes: list[int], stream: int) -> bool:
        err, *_ = call([ptr(d) for d in dsts], [ptr(s) for s in srcs], sizes, len(sizes), attrs, [0], 1, stream)
        return bool(err == ok)

    return batch
