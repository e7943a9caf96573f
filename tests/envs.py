"""The environment of the processes tests start (``experiments.run``, scripts): JAX on CPU with the
given number of (fake) devices, one unless a test shards, as a user would run it, and XLA's backend
at optimisation level 0. The tests' programs are small and run a few times each, so most of their
time is LLVM compiling them; level 0 shortens that and changes the machine code, not what is
computed."""

import os

FAST_COMPILE = "--xla_backend_optimization_level=0"


def subprocess_env(devices: int = 1) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = [FAST_COMPILE] + ([f"--xla_force_host_platform_device_count={devices}"] if devices > 1 else [])
    env["XLA_FLAGS"] = " ".join(flags)
    return env
