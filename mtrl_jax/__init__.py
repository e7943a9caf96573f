"""mtrl-jax: multi-turn reinforcement learning for LLM search agents in JAX/Flax."""

__version__ = "0.1.0"
