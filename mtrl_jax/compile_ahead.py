"""Compile-ahead: programs compiled before their first call, so that no call of a run waits on a compile of a
shape first met late. The sampler (``rollout.engine.Sampler.precompile``: every extend / decode shape) and the
update (``rl.updater.Updater.compile_ahead``) keep theirs in a ``Programs`` table; ``Background`` runs such compiles
in a thread while the cold start and the first evaluation leave a core idle.

A call whose program is not ready compiles its shape itself (jit), as without compile-ahead. A program that
rejects its arguments (e.g. parameters placed otherwise than those it was compiled with) raises before it
runs, so nothing is donated: it is dropped with a log line, and the jitted function runs instead.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Hashable, Optional, Sequence

log = logging.getLogger("mtrl_jax")


class Programs:
    """Compiled programs by call signature (``key``), and the threads compiling them."""

    def __init__(self, name: str):
        self.name = name
        self._programs: dict = {}
        self._compiling: dict = {}  # key -> the thread compiling it

    def __contains__(self, key: Hashable) -> bool:
        return key in self._programs

    def __iter__(self):
        return iter(list(self._programs))

    def __delitem__(self, key: Hashable) -> None:
        del self._programs[key]

    def compile(self, key: Hashable, lower: Callable) -> None:
        """Compile ``lower()`` (a ``jax.stages.Lowered``) for ``key`` in this thread, unless it is there."""
        if key not in self._programs:
            self._programs[key] = lower().compile()

    def compile_in_background(self, key: Hashable, lower: Callable, thread_name: str) -> threading.Thread:
        """``compile`` in a daemon thread; a call of ``key`` waits for it (``run``)."""

        thread = threading.Thread(target=self.compile, args=(key, lower), daemon=True, name=thread_name)
        self._compiling[key] = thread
        thread.start()
        return thread

    def run(self, key: Hashable, jitted: Callable, args: Sequence, kwargs: Optional[dict] = None, static=None):
        """The program compiled for ``key`` on ``args`` if there is one (waiting for its compile if one is under
        way), else ``jitted(*args, **kwargs, **static)``, which compiles a new shape itself."""
        kwargs, static = kwargs or {}, static or {}
        if (thread := self._compiling.pop(key, None)) is not None:
            thread.join()
        program = self._programs.get(key)
        if program is not None:
            try:
                return program(*args, **kwargs)
            except (TypeError, ValueError) as error:  # raised before it ran: nothing was donated
                self._programs.pop(key, None)
                log.warning(
                    "%s: the program compiled ahead for %s was not used (%s); the call compiles its own",
                    self.name,
                    key,
                    str(error).splitlines()[0][:200],
                )
        return jitted(*args, **kwargs, **static)

    def settle(self) -> None:
        """Wait for the compiles under way: a process must not exit while XLA compiles in a thread."""
        for thread in list(self._compiling.values()):
            thread.join()


class Background:
    """``jobs`` (each called with a ``threading.Event``: set, return after the program being compiled) run in
    turn in one daemon thread, started at once; ``stop()`` returns after the program being compiled (the rest
    is not needed)."""

    def __init__(self, jobs: Sequence[Callable[[threading.Event], None]], name: str = "compile-ahead"):
        self.event = threading.Event()
        self.thread = threading.Thread(target=lambda: [job(self.event) for job in jobs], daemon=True, name=name)
        self.thread.start()

    def stop(self) -> None:
        self.event.set()
        self.thread.join()
