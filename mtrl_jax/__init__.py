"""mtrl-jax: multi-turn reinforcement learning for LLM search agents in JAX/Flax."""

from mtrl_jax.host import tune_allocator

__version__ = "0.1.0"

tune_allocator()  # before any XLA buffer: freed blocks are reused, not page-faulted in again (mtrl_jax/host.py)
