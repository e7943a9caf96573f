"""Host-process settings: the C allocator's large-block policy (glibc on Linux), and the stop signals
(``stop_signals``: SIGTERM and Ctrl-C ask a run to save and stop).

XLA's CPU runtime allocates every program's outputs and temporaries with ``malloc``. glibc serves a
block above its mmap threshold (128 KiB at first, adapting up to 32 MiB) with a fresh ``mmap`` and
returns it to the kernel on ``free``, so each such buffer of each call is page-faulted in again,
4 KiB at a time: a jitted update or decode call on the CPU spends much of its time in the kernel,
zeroing pages it had a moment ago. Two ``mallopt`` settings keep freed blocks for reuse instead:
no block is mmapped below ``MMAP_THRESHOLD`` and the heap is not trimmed below ``TRIM_THRESHOLD``.
Measured against glibc's defaults side by side, it made the tiny policy's update 1.5x faster
(``docs/decisions.md``, "Host and compiler"). The cost is memory: up to ``TRIM_THRESHOLD`` of freed heap stays with
the process.

The thresholds act on the main arena only. A thread that finds the main arena busy gets an arena of
its own, made of heaps of at most 64 MiB, and a larger block there is mmapped whatever the threshold:
XLA runs programs on its own threads, so the single temporary buffer of a jitted update (614 MiB on
the default tiny policy's B32 x T384 batch) was mapped and faulted in, 4 KiB at a time, on every call
(about 228,000 faults a call). Putting every thread on the main arena
(``MALLOC_ARENA_MAX=1``) removed the faults but made the default run slower (its threads then wait
on the one arena's lock: ``docs/decisions.md``). What works is glibc's tunable
``glibc.malloc.hugetlb=1`` (glibc 2.35 and later): glibc then asks for transparent huge pages on the
memory it maps, so such a buffer is faulted in 2 MiB at a time (under 1,000 faults a call). glibc
reads tunables when the process starts, from ``GLIBC_TUNABLES``, so the entry points
(``experiments/run.py``, ``experiments/evaluate.py``, the benchmarks that time programs) call
``reexec_with_tunables()`` first: it restarts the process once, with the tunable added. A library
user sets ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` in the environment instead.

Importing ``mtrl_jax`` changes none of this: an entry point calls ``prepare_process()`` first thing
(the restart, then the thresholds). ``MTRL_JAX_MALLOC=default`` leaves glibc's policy alone, tunable
included (for instance under an ``LD_PRELOAD`` allocator such as tcmalloc or jemalloc, which keep
freed memory for reuse themselves).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import contextlib
import logging
import platform
import signal
import sys
import threading

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from the heap, and are reused after free
TRIM_THRESHOLD = 1 << 30  # freed memory at the heap's top is kept up to 1 GiB
ENV = "MTRL_JAX_MALLOC"
HUGETLB = "glibc.malloc.hugetlb"  # the tunable; 1: madvise(MADV_HUGEPAGE) on what malloc maps
REEXEC_MARK = "MTRL_JAX_REEXECUTED"  # set in the restarted process: never restart twice

# what ``tune_allocator`` set: {"mmap_threshold": bytes, "trim_threshold": bytes}, and "hugetlb": its value when
# the process started with the tunable on (GLIBC_TUNABLES); empty when nothing was set
applied: dict = {}


def _mode() -> str:
    mode = os.environ.get(ENV, "tuned")
    if mode not in ("tuned", "default"):
        raise ValueError(f"{ENV}={mode!r}: expected 'tuned' (the default) or 'default' (glibc's own policy)")
    return mode


def _glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def hugetlb_tunable() -> str:
    """The value of ``glibc.malloc.hugetlb`` in this process's ``GLIBC_TUNABLES``, "" if absent."""
    for item in os.environ.get("GLIBC_TUNABLES", "").split(":"):
        name, _, value = item.partition("=")
        if name == HUGETLB:
            return value
    return ""


def huge_pages_possible() -> bool:
    """Whether the tunable can act here: glibc 2.35 or later, and a kernel that gives transparent huge
    pages to memory that asks for them."""
    if not _glibc():
        return False
    version = tuple(int(x) for x in platform.libc_ver()[1].split(".")[:2] if x.isdigit())
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return version >= (2, 35) and "[never]" not in f.read()
    except OSError:
        return False


def reexec_with_tunables() -> None:
    """Restart this process once, with ``glibc.malloc.hugetlb=1`` added to ``GLIBC_TUNABLES`` (see the
    module docstring), unless ``MTRL_JAX_MALLOC=default``, the C library is not glibc 2.35 or later,
    the kernel has no transparent huge pages, the tunable is already set (to any value: the user's
    choice), or this process is already the restarted one. Call it first thing in an entry point:
    the restart runs the same command line (``sys.orig_argv``) from the start."""
    if _mode() == "default" or os.environ.get(REEXEC_MARK) or hugetlb_tunable() or not huge_pages_possible():
        return
    tunables = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t] + [f"{HUGETLB}=1"]
    env = dict(os.environ, GLIBC_TUNABLES=":".join(tunables), **{REEXEC_MARK: "1"})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), env)


def tune_allocator() -> dict:
    """Set glibc's mmap and trim thresholds (above) unless ``MTRL_JAX_MALLOC=default``, the C library
    is not glibc, or ``mallopt`` refuses; returns (and records in ``applied``) what was set."""
    if _mode() == "default" or not _glibc():
        return applied
    hugetlb = hugetlb_tunable()
    if hugetlb not in ("", "0"):
        applied["hugetlb"] = hugetlb
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return applied
    if libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(MMAP_THRESHOLD)) == 1:
        applied["mmap_threshold"] = MMAP_THRESHOLD
    if libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(TRIM_THRESHOLD)) == 1:
        applied["trim_threshold"] = TRIM_THRESHOLD
    return applied


def prepare_process() -> dict:
    """What an entry point calls first, before jax is imported: restart once with the huge-page tunable
    (``reexec_with_tunables``), set the thresholds (``tune_allocator``), keep one collective order on several CPU
    devices (``cpu_multi_device_flags``) and keep XLA's slow-compile banner out of the log
    (``quiet_slow_compile_banner``); returns what the allocator got."""
    reexec_with_tunables()
    cpu_multi_device_flags()
    quiet_slow_compile_banner()
    return tune_allocator()


# Several CPU devices (--xla_force_host_platform_device_count=8): XLA:CPU's concurrency-optimized scheduler let
# the devices of one program reach its collectives in different orders (one waiting in an all-gather, its partner
# in an all-to-all), so the default's cold-start step on a (2,2,2) mesh deadlocked, and XLA aborted it after 40 s,
# every time; the sequential scheduler keeps one collective order (docs/reliability.md, item 0). The flag exists
# from jaxlib 0.10 (an older jaxlib refuses unknown flags: it is then left out).
CPU_MULTI_DEVICE_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)


def cpu_multi_device_flags() -> bool:
    """Add ``CPU_MULTI_DEVICE_FLAGS`` to ``XLA_FLAGS`` when it asks for several host-platform (CPU) devices and does
    not set the scheduler itself; returns whether it did. Call it before jax's backend starts."""
    flags = os.environ.get("XLA_FLAGS", "")
    devices = [f for f in flags.split() if f.startswith("--xla_force_host_platform_device_count=")]
    if not devices or int(devices[-1].split("=", 1)[1] or 1) < 2 or "concurrency_optimized_scheduler" in flags:
        return False
    try:
        import importlib.metadata

        major, minor = (int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return False
    if (major, minor) < (0, 10):
        return False
    os.environ["XLA_FLAGS"] = " ".join([flags, *CPU_MULTI_DEVICE_FLAGS]).strip()
    return True


# XLA logs this block when a compile passes 2 minutes (and a line when it ends); on 2 cores the cold start's step
# takes about that long, and the block reads as an error. The log says what is compiling instead (coldstart.sft).
SLOW_COMPILE_BANNER = (
    rb"[^\n]*slow_operation_alarm[^\n]*\n\*+\n[^\n]*Very slow compile\?[^\n]*\n\*+\n"  # the alarm
    rb"|[^\n]*slow_operation_alarm\.cc:\d+\] The operation took [^\n]*\n"  # and its end, once the compile is done
)
BANNER_ENV = "MTRL_JAX_XLA_BANNER"  # "show": leave XLA's slow-compile banner in the log
# the filter: a separate process, so that what the run writes just before it dies (an abort) still comes out
_FILTER = (
    "import os, re, sys\n"
    "banner = re.compile(sys.argv[1].encode('latin-1'))\n"
    "while chunk := os.read(0, 65536):\n"
    "    chunk = banner.sub(b'', chunk)\n"
    "    while chunk:\n"
    "        chunk = chunk[os.write(1, chunk):]\n"
)


def quiet_slow_compile_banner() -> bool:
    """Route this process's stderr (file descriptor 2, which XLA's C++ logging writes to) through a small child
    process that drops XLA's "Very slow compile?" block and passes every other byte on at once (progress bars
    included). Writes of under 4 KiB to a pipe are atomic, so the block arrives whole. It ends when the last
    holder of the pipe (the run, and any child that inherited its stderr) exits. Off with
    ``MTRL_JAX_XLA_BANNER=show``; returns whether it started one."""
    if os.environ.get(BANNER_ENV) == "show":
        return False
    import subprocess

    sys.stderr.flush()
    read, write = os.pipe()
    original = os.dup(2)
    subprocess.Popen(
        [sys.executable, "-c", _FILTER, SLOW_COMPILE_BANNER.decode("latin-1")],
        stdin=read,
        stdout=original,
        stderr=subprocess.DEVNULL,
        close_fds=True,
        start_new_session=True,  # a Ctrl-C to the run's group does not stop the filter before the run's last words
    )
    for fd in (read, original):
        os.close(fd)
    os.dup2(write, 2)
    os.close(write)
    return True


@contextlib.contextmanager
def stop_signals(request_stop):
    """While inside: SIGTERM and the first SIGINT (Ctrl-C) call ``request_stop(signum)`` (the run saves a checkpoint
    at the end of its step and exits); a second SIGINT raises ``KeyboardInterrupt`` at once. The previous
    handlers come back on exit. Outside the main thread (where Python cannot set handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    interrupts = []

    def on_interrupt(signum, frame):
        interrupts.append(signum)
        if len(interrupts) > 1:
            raise KeyboardInterrupt
        logging.getLogger("mtrl_jax").warning(
            "Ctrl-C: a checkpoint is written at the end of this step, then the run stops (Ctrl-C again: stop now)"
        )
        request_stop(signum)

    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, _: request_stop(signum)),
        signal.SIGINT: signal.signal(signal.SIGINT, on_interrupt),
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
