"""Rollout: the jitted sampler, the environment interfaces and the asynchronous collector."""
