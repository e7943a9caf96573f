"""Host-process settings: the C allocator's large-block policy (glibc on Linux).

XLA's CPU runtime allocates every program's outputs and temporaries with ``malloc``. glibc serves a
block above its mmap threshold (128 KiB at first, adapting up to 32 MiB) with a fresh ``mmap`` and
returns it to the kernel on ``free``, so each such buffer of each call is page-faulted in again,
4 KiB at a time: a jitted update or decode call on the CPU spends much of its time in the kernel,
zeroing pages it had a moment ago. Two ``mallopt`` settings keep freed blocks for reuse instead:
no block is mmapped below ``MMAP_THRESHOLD``, and the heap is never trimmed (``TRIM_THRESHOLD`` -1).
A program's next call can allocate before its last call's buffers are freed, so the heap holds a
few copies of the largest before it settles; with a trim threshold (1 GiB until the arena limit
below) two freed copies of a large buffer at the heap's top were returned to the kernel, and the
next calls faulted them in again.

Those thresholds only act on the main arena. A thread that finds the main arena's lock taken gets an
arena of its own, made of heaps of at most 64 MiB: a block larger than that (the single temporary
buffer of a jitted update, 614 MiB on the default tiny policy's B32 x T384 batch) is mmapped whatever
the threshold, and unmapped on ``free``. XLA runs programs on its own threads, so the update was
page-faulted in anew on every call (160,000 faults, about 0.3 s of a 0.5 s step). ``ARENA_MAX`` = 1
keeps every thread on the main arena. glibc fixes a thread's arena at the thread's first ``malloc``,
so this has to happen before XLA's threads start: on import of ``mtrl_jax``, before the first
computation (a warning says so when JAX's backend is already running; ``MALLOC_ARENA_MAX=1`` in the
environment then does the same from the process's start). ``tune_allocator`` also puts
``MALLOC_ARENA_MAX=1`` in ``os.environ``, so child processes start with it.

``scripts/bench_host.py`` measures the policy against the thresholds alone and against glibc's
defaults, side by side (README, "Host allocator"). The costs: the process keeps its peak heap (a
few copies of its largest program's temporaries: 1.8 GB resident for a 264 MiB one in
``tests/test_host.py``), and threads that allocate at once wait for the one arena's lock.

``mtrl_jax`` applies this on import. ``MTRL_JAX_MALLOC``: ``tuned`` (the default, all of the above),
``thresholds`` (the two thresholds only, every thread keeping its own arena, for comparison), ``default`` (glibc's policy left alone; for instance under an
``LD_PRELOAD`` allocator such as tcmalloc or jemalloc, which keep freed memory for reuse themselves).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
import warnings

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from the heap, and are reused after free
TRIM_THRESHOLD = -1  # never trim (glibc: -1 turns trimming off); the heap keeps its peak
ARENA_MAX = 1  # every thread allocates from the main arena, the only one the thresholds act on
ENV = "MTRL_JAX_MALLOC"
MODES = ("tuned", "thresholds", "default")

# what ``tune_allocator`` set: {"mmap_threshold": bytes, "trim_threshold": bytes, "arena_max": n}; arena_max
# also when MALLOC_ARENA_MAX came with the environment (glibc applied it at the process's start)
applied: dict = {}


def tune_allocator() -> dict:
    """Set glibc's mmap and trim thresholds and its arena limit (above), as ``MTRL_JAX_MALLOC`` says,
    unless the C library is not glibc or ``mallopt`` refuses; returns (and records in ``applied``)
    what was set."""
    mode = os.environ.get(ENV, "tuned")
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: expected 'tuned' (the default), 'thresholds' (the mmap and trim "
                         f"thresholds without the arena limit) or 'default' (glibc's own policy)")
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
    if mode != "tuned":
        return applied
    inherited = os.environ.get("MALLOC_ARENA_MAX")
    if inherited is not None:  # glibc read it at the process's start (a parent's tune_allocator, or the user)
        if inherited.strip().isdigit():
            applied["arena_max"] = int(inherited)
    elif libc.mallopt(M_ARENA_MAX, ctypes.c_int(ARENA_MAX)) == 1:
        applied["arena_max"] = ARENA_MAX
        os.environ["MALLOC_ARENA_MAX"] = str(ARENA_MAX)  # child processes: from their start
        if _backend_running():
            warnings.warn(f"mtrl_jax was imported after JAX's backend started: XLA's threads may keep arenas of "
                          f"their own, whose blocks above 64 MiB (a jitted update's temporaries) are page-faulted "
                          f"in on every call. Import mtrl_jax before the first JAX computation, or set "
                          f"MALLOC_ARENA_MAX={ARENA_MAX} in the environment (mtrl_jax/host.py)",
                          RuntimeWarning, stacklevel=2)
    return applied


def _backend_running() -> bool:
    """Whether JAX has started a backend in this process (its thread pools may then exist)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # a JAX without this private helper: assume not
        return False
