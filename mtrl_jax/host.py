"""Host-process settings: the C allocator's large-block policy (glibc on Linux).

XLA's CPU runtime allocates every program's outputs and temporaries with ``malloc``. glibc serves a
block above its mmap threshold (128 KiB at first, adapting up to 32 MiB) with a fresh ``mmap`` and
returns it to the kernel on ``free``, so each such buffer of each call is page-faulted in again,
4 KiB at a time: a jitted update or decode call on the CPU spends much of its time in the kernel,
zeroing pages it had a moment ago. Two ``mallopt`` settings keep freed blocks for reuse instead:
no block is mmapped below ``MMAP_THRESHOLD`` and the heap is not trimmed below ``TRIM_THRESHOLD``.
``scripts/bench_host.py`` measures the effect against glibc's defaults, side by side (README,
"Host allocator"). The cost is memory: up to ``TRIM_THRESHOLD`` of freed heap stays with the process.

``mtrl_jax`` applies this on import; ``MTRL_JAX_MALLOC=default`` leaves glibc's policy alone (for
instance under an ``LD_PRELOAD`` allocator such as tcmalloc or jemalloc, which keep freed memory
for reuse themselves).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from the heap, and are reused after free
TRIM_THRESHOLD = 1 << 30  # freed memory at the heap's top is kept up to 1 GiB
ENV = "MTRL_JAX_MALLOC"

applied: dict = {}  # what ``tune_allocator`` set: {"mmap_threshold": bytes, "trim_threshold": bytes}, or empty


def tune_allocator() -> dict:
    """Set glibc's mmap and trim thresholds (above) unless ``MTRL_JAX_MALLOC=default``, the C library
    is not glibc, or ``mallopt`` refuses; returns (and records in ``applied``) what was set."""
    mode = os.environ.get(ENV, "tuned")
    if mode not in ("tuned", "default"):
        raise ValueError(f"{ENV}={mode!r}: expected 'tuned' (the default) or 'default' (glibc's own policy)")
    if mode == "default" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return applied
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return applied
    if libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(MMAP_THRESHOLD)) == 1:
        applied["mmap_threshold"] = MMAP_THRESHOLD
    if libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(TRIM_THRESHOLD)) == 1:
        applied["trim_threshold"] = TRIM_THRESHOLD
    return applied
