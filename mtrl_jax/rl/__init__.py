"""RL math: advantage estimators, policy losses, aggregation, KL, and the training objective."""

from mtrl_jax.rl import advantages, losses, objective  # noqa: F401
