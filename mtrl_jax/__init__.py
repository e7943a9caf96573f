"""mtrl-jax: multi-turn reinforcement learning for LLM search agents in JAX/Flax.

Importing the package changes nothing in the process: the entry points (``experiments.run``,
``experiments.evaluate``, the timing benchmarks) set the host allocator up themselves
(``mtrl_jax.host.prepare_process``).
"""

__version__ = "0.1.0"
