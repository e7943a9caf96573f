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


# ----------------------------------------------------------------------------- runs started ahead of their tests
# Most of the time of a test that starts ``experiments.run`` (or a tool) is that process compiling, on one
# core; the in-process tests before it use about one core too. So such runs are started when the session
# starts, one at a time in a background thread, in the order of the tests that read them, and use the other
# core (the CI machine has 2) while the tests before theirs run.

_RUNS: dict = {}  # name -> fn(workdir) -> what its tests check
_STARTED: dict = {}  # name -> Future
_PROCESSES: list = []


def background(name: str):
    """Registers ``fn(workdir)`` (starts processes, waits for them, returns what the tests check) as the run
    ``name``; a test that reads it is marked ``@pytest.mark.background(name)`` and calls ``background_result(name)``."""

    def register(fn):
        _RUNS[name] = fn
        return fn

    return register


def popen(cmd, output, **kwargs):
    """``subprocess.Popen`` of ``cmd`` writing to the file ``output`` (not a pipe: a run waiting for its reader
    would stall), killed when the test session ends."""
    import subprocess

    with open(output, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, **kwargs)
    _PROCESSES.append(proc)
    return proc


def start_background(names) -> None:
    """Starts the runs ``names``, one at a time in this order, in a daemon thread (a stopped session does not
    wait for them: their processes are killed at exit)."""
    import atexit
    import concurrent.futures
    import pathlib
    import queue
    import shutil
    import tempfile
    import threading

    if not names:
        return
    root = pathlib.Path(tempfile.mkdtemp(prefix="mtrl_jax_test_runs_"))
    todo = queue.Queue()
    for name in names:
        _STARTED[name] = concurrent.futures.Future()
        todo.put(name)

    def work():
        while not todo.empty():
            name = todo.get()
            future = _STARTED[name]
            if future.set_running_or_notify_cancel():
                try:
                    (root / name).mkdir()
                    future.set_result(_RUNS[name](root / name))
                except BaseException as e:  # noqa: BLE001 - handed to the test that reads it
                    future.set_exception(e)

    def stop():
        for proc in _PROCESSES:
            if proc.poll() is None:
                proc.kill()
        shutil.rmtree(root, ignore_errors=True)

    atexit.register(stop)
    threading.Thread(target=work, name="background runs", daemon=True).start()


def background_result(name: str, timeout: float = 1800):
    """What the run ``name`` returned: waits for it (started at once if the session did not start it)."""
    if name not in _STARTED:
        start_background([name])
    return _STARTED[name].result(timeout=timeout)
