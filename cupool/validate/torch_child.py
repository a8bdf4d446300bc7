"""The child process of the torch checks (``cupool.validate.torch_checks``): one allocator per process.

Torch's CUDA allocator can only be chosen before its first CUDA tensor, so each
allocator runs in a process of its own: ``python -m cupool.validate.torch_child
MODE ALLOCATOR [--quick]``, printing one JSON object as its last line.

* ``train cupool|own``: a small MLP trained for a few steps with a fixed seed and
  deterministic algorithms, with CuPy's workload (``cupool.validate.workload``) run
  halfway while the model's tensors are live; ``cupool`` installs cupool for CuPy and
  torch at once (one pool), ``own`` leaves each library its own allocator.  The losses
  (as exact hex floats) and digests of the final parameters and of CuPy's results come
  back, to be compared bit for bit.
* ``timing cupool|torch|rmm``: ``torch.empty`` + drop of a few sizes, medians of
  samples, on cupool, PyTorch's caching allocator, or RMM's ``rmm_torch_allocator``
  over an RMM pool.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

#: ``torch.empty`` sizes timed, in bytes.
SIZES = (4096, 1 << 20, 16 << 20)


def _choose(allocator: str, cupy_too: bool) -> dict[str, Any]:
    """Make ``allocator`` torch's (and, with ``cupy_too``, CuPy's) before any CUDA tensor exists."""
    if allocator == "cupool":
        import cupool

        pool = cupool.install(cupy=cupy_too, numba=False, torch=True)
        return {"pool": pool}
    if allocator == "rmm":
        import rmm
        from rmm.allocators.torch import rmm_torch_allocator
        from torch.cuda import memory

        rmm.reinitialize(pool_allocator=True, initial_pool_size=1 << 30)
        memory.change_current_allocator(rmm_torch_allocator)
    return {}


def _digest(arrays: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def train(allocator: str, quick: bool) -> dict[str, Any]:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what deterministic cuBLAS asks for
    chosen = _choose("cupool" if allocator == "cupool" else "own", cupy_too=True)
    import cupy as cp
    import torch
    import torch.nn.functional as F  # noqa: N812 - torch's own spelling

    from .workload import cupy_workload

    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 256, generator=gen).cuda()
    y = torch.randint(0, 10, (512,), generator=gen).cuda()
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    steps = 6 if quick else 20
    losses, cupy_out = [], []
    for step in range(steps):
        lo = (step * 64) % 512
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x[lo:lo + 64]), y[lo:lo + 64])
        loss.backward()
        opt.step()
        losses.append(float(loss.item()).hex())
        if step == steps // 2:
            cupy_out = cupy_workload(cp)  # CuPy allocates while the model's tensors and gradients are live
    torch.cuda.synchronize()
    params = [p.detach().cpu().numpy() for p in model.parameters()]
    out: dict[str, Any] = {"losses": losses, "params": _digest(params), "cupy": _digest(cupy_out)}
    if "pool" in chosen:
        import cupool.torch

        pool = chosen["pool"]
        s = pool.stats()
        out["one_pool"] = cupool.torch.serving_pool(torch.cuda.current_device()) is pool
        out["allocations"] = s["allocation.all.allocated"]
        out["peak_bytes"] = s["allocated_bytes.all.peak"]
    return out


def timing(allocator: str, quick: bool) -> dict[str, Any]:
    _choose(allocator, cupy_too=False)
    import torch

    number, repeat = (200, 5) if quick else (2000, 15)
    torch.empty(1, device="cuda")  # the context, and the allocator's first call, outside the samples
    medians = {}
    for n in SIZES:
        for _ in range(50):
            t = torch.empty(n, dtype=torch.uint8, device="cuda")
            del t
        samples = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            for _ in range(number):
                t = torch.empty(n, dtype=torch.uint8, device="cuda")
                del t
            samples.append((time.perf_counter() - t0) / number)
        medians[str(n)] = statistics.median(samples) * 1e6
    return {"us": medians, "number": number, "repeat": repeat}


def main(argv: list[str]) -> int:
    modes = {"train": (train, ("cupool", "own")), "timing": (timing, ("cupool", "torch", "rmm"))}
    args = [a for a in argv if a != "--quick"]
    if len(args) != 2 or args[0] not in modes or args[1] not in modes[args[0]][1]:
        choices = "; ".join(f"{m} {'|'.join(a)}" for m, (_, a) in modes.items())
        print(f"usage: python -m cupool.validate.torch_child MODE ALLOCATOR [--quick] ({choices})", file=sys.stderr)
        return 2
    run, _ = modes[args[0]]
    print(json.dumps(run(args[1], "--quick" in argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
