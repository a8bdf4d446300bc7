"""Hypothesis tools for stress-testing code that uses cupool: strategies, a state machine, fault injection.

``PoolStateMachine`` (``cupool.testing.machine``) checks cupool's invariants
after every step of a machine you extend with rules of your own;
``cupool.testing.strategies`` draws sizes by size class, allocation programs
(replayed by ``run_program``) and weight-streaming workloads;
``cupool.testing.faults`` refuses allocations, forces compactions and spills,
and shrinks a pool's limit.  It needs hypothesis: ``pip install hypothesis`` (``pip install '.[testing]'`` in cupool's checkout).
"""

try:
    import hypothesis  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "cupool.testing needs hypothesis, which is not installed: pip install hypothesis (or '.[testing]' in cupool's checkout)"
    ) from e

from . import faults, strategies
from .faults import FaultRules
from .ledger import Ledger
from .machine import PoolStateMachine
from .programs import run_program

__all__ = ["FaultRules", "Ledger", "PoolStateMachine", "faults", "run_program", "strategies"]
