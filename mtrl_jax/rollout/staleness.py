"""Bounded off-policy staleness: the published parameters, and the background rollout thread that runs
ahead of the trainer by at most ``max_staleness`` versions (the stale groups it still yields are dropped
by ``rollout.selection``)."""

from __future__ import annotations

import queue
import threading
from typing import Callable, Optional

import jax
import jax.numpy as jnp


class PublishedParams:
    """The latest published ``(params, version)``, read by the collector before each device call. With a
    ``dtype`` (``rollout.param_dtype``) the rollouts get a copy of every floating parameter in it (a bfloat16
    copy for sampling, refreshed at every publication; the master parameters stay as they are)."""

    def __init__(self, params, version: int, dtype: str = ""):
        self.dtype = dtype
        self.publish(params, version)

    def __call__(self):
        return self.value

    def publish(self, params, version: int):
        if self.dtype and params is not None:
            params = jax.tree.map(
                lambda x: x.astype(self.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params
            )
        self.value = (params, version)


class AsyncRollouts:
    """Runs ``collect(step)`` for steps ``start, start+1, ...`` in a background thread.

    Batch ``step`` starts only once the trainer has published version ``>= step - max_staleness``,
    so generation overlaps training by at most ``max_staleness`` versions, and with
    ``max_staleness = 0`` every batch is generated entirely by the parameters it is trained from.
    """

    def __init__(self, collect: Callable[[int], list], start_step: int, max_staleness: int, initial_version: int):
        self.collect, self.max_staleness = collect, max_staleness
        self.version = initial_version
        self.cond = threading.Condition()
        self.out: queue.Queue = queue.Queue(maxsize=max_staleness + 1)
        self.error: Optional[BaseException] = None
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, args=(start_step,), daemon=True, name="rollouts")
        self.thread.start()

    def _loop(self, step: int):
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self.stopped or self.version >= step - self.max_staleness)
                    if self.stopped:
                        return
                batch = self.collect(step)
                while not self.stopped:
                    try:
                        self.out.put((step, batch), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                step += 1
        except BaseException as e:  # surfaced to the trainer by get()
            self.error = e
            self.out.put((None, None))

    def publish(self, version: int):
        with self.cond:
            self.version = version
            self.cond.notify_all()

    def get(self, step: int):
        """Batch ``step``, waiting for the rollout thread to finish it."""
        got, batch = self.out.get()
        if self.error is not None:
            raise RuntimeError(f"rollout thread failed: {type(self.error).__name__}: {self.error}") from self.error
        assert got == step, (got, step)
        return batch

    def stop(self):
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.thread.join(timeout=60)
