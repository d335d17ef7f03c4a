"""A process that runs the checks keeps the memory it frees: glibc's malloc maps no large
block of its own and does not give the heap's free top back to the system.

Why: by default glibc serves a block above its mmap threshold (128 KiB, rising to at most
32 MiB) from a fresh mapping and unmaps it when it is freed, so the next block of that size
is new memory again, which the kernel faults in and zeroes page by page. The checks
allocate and free large tensors over and over (a weight 151936 x 64 wide, HQQ's optimizer
iterating over it, float64 references of it). One HQQ lm_head-width check took 9.2 s, with
4.2 million page faults and 11.3 s of system time; with freed memory kept, 4.1 s, 0.65
million faults and 2.3 s. The default run on the 2-core machine: 169-190 s wall before,
151-173 s after (docs/run-times.md). Verdicts do not depend on it: where a block comes from changes no
value. The cost: a process holds on to the most it had allocated at once, until it exits.

Left as it is: a process whose malloc its user configured (glibc's ``MALLOC_*_``
variables, ``GLIBC_TUNABLES`` naming ``glibc.malloc``, or another allocator in
``LD_PRELOAD``: setting one of these is also how to opt out), and any libc but glibc.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from typing import Any

# glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# mallopt takes an int: the heap's free top goes back to the system only above 2 GiB.
KEEP_UP_TO = 2**31 - 1
PRELOADED_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def configured_by_user(environ: Mapping[str, str]) -> str | None:
    """The setting by which the user chose the process' allocator behaviour, or None."""
    for name in sorted(environ):
        if name.startswith("MALLOC_") and name.endswith("_"):
            return name
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    preload = environ.get("LD_PRELOAD", "")
    if any(allocator in preload for allocator in PRELOADED_ALLOCATORS):
        return "LD_PRELOAD"
    return None


def _glibc() -> Any | None:
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return None
    if not version or not version.startswith("glibc"):
        return None
    return ctypes.CDLL(None)


def keep_freed_memory(environ: Mapping[str, str] = os.environ, libc: Any | None = None) -> str:
    """Make this process' malloc keep what it frees (see the module docstring); returns
    what was done, in words."""
    chosen = configured_by_user(environ)
    if chosen is not None:
        return f"left as configured by {chosen}"
    libc = libc if libc is not None else _glibc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return "left as it is: not glibc"
    if mallopt(M_MMAP_MAX, 0) != 1 or mallopt(M_TRIM_THRESHOLD, KEEP_UP_TO) != 1:
        return "left as it is: mallopt refused"
    return "freed memory kept"
