"""``CUPOOL_CONF``: how the default pool is configured without touching code.

In the spirit of ``PYTORCH_CUDA_ALLOC_CONF``: comma-separated ``key=value``
pairs, e.g. ``CUPOOL_CONF="max_size=80%,initial_size=2GB,expandable_segments=true"``.  The keys are the
keyword arguments of ``Pool``, as the registry of settings (``cupool.settings``) lists and reads them.  A typo must not silently give a pool with the
defaults, so an unknown key, a repeated key or an unreadable value is an error
that names the variable, the entry and what would have been accepted.
"""

from __future__ import annotations

import os
from typing import Any

from . import settings

ENV_VAR = "CUPOOL_CONF"


#: The keys, from the one registry of settings (``cupool.settings``).
_KEYS = settings.names(conf=True)


#: ``PYTORCH_CUDA_ALLOC_CONF`` keys users bring along, and what cupool does instead (the error says so).
TORCH_KEYS = {
    "max_split_size_mb": "cupool does not pin cached segments under small blocks when memory is short "
                         "(release_before_split, on by default) and expandable segments unmap free tails",
    "garbage_collection_threshold": "release_threshold gives cached memory back while more than that is "
                                    "reserved, e.g. release_threshold=80%",
    "roundup_power2_divisions": "cupool rounds requests to 512 bytes and serves them best fit; "
                                "there is no power-of-two rounding to tune",
    "backend": "cupool is the allocator; route CuPy and Numba to it with cupool.install()",
}


def parse_conf(text: str) -> dict[str, Any]:
    """Keyword arguments for ``Pool`` from a ``CUPOOL_CONF`` string."""
    if not isinstance(text, str):
        raise TypeError(f"{ENV_VAR} must be a string, got {type(text).__name__}")
    out: dict[str, Any] = {}
    for entry in text.split(","):
        if not entry.strip():
            continue
        key, sep, value = entry.partition("=")
        key = key.strip().lower()
        torch_key = key.partition(":")[0]  # PyTorch writes key:value
        if torch_key in TORCH_KEYS:
            raise ValueError(
                f"{ENV_VAR}: {torch_key!r} is a PYTORCH_CUDA_ALLOC_CONF key, not cupool's: {TORCH_KEYS[torch_key]} "
                f"(known keys: {', '.join(sorted(_KEYS))})"
            )
        if not sep or not value.strip():
            hint = " (PYTORCH_CUDA_ALLOC_CONF writes key:value; cupool writes key=value)" if ":" in entry else ""
            raise ValueError(f"{ENV_VAR}: entry {entry.strip()!r} is not key=value{hint}")
        if key not in _KEYS:
            raise ValueError(
                f"{ENV_VAR}: unknown key {key!r} in {entry.strip()!r} (known keys: {', '.join(sorted(_KEYS))})"
            )
        if key in out:
            raise ValueError(f"{ENV_VAR}: key {key!r} is given twice")
        try:
            out[key] = settings.BY_NAME[key].parse(value)
        except ValueError as e:
            raise ValueError(f"{ENV_VAR}: {e}") from None
    return out


def env_conf() -> dict[str, Any]:
    """The parsed ``CUPOOL_CONF`` of this process (empty when unset)."""
    return parse_conf(os.environ.get(ENV_VAR, ""))
