"""The host allocator policy (mtrl_jax/host.py): nothing on import, set by the entry points, in fresh processes."""

import os
import platform
import subprocess
import sys

import pytest

from mtrl_jax.host import huge_pages_possible

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _env(**values):
    """This process's environment for a child, without the allocator settings (``values`` set them)."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("MTRL_JAX_MALLOC", "GLIBC_TUNABLES", "MTRL_JAX_REEXECUTED")
    }
    return dict(env, PYTHONPATH=ROOT, **values)


# Whether glibc serves a 64 MiB block with a fresh mmap (its policy by default: above the largest mmap
# threshold it adapts to, 32 MiB) or from the heap (the thresholds tune_allocator sets): mallinfo2's count
# of mmapped blocks, read around one malloc.
_MMAPPED = """
import ctypes, sys
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype, libc.malloc.restype, libc.malloc.argtypes = MallInfo2, ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def mmapped():
    before = libc.mallinfo2().hblks
    block = libc.malloc(64 << 20)
    after = libc.mallinfo2().hblks
    libc.free(block)
    return after > before
import mtrl_jax, mtrl_jax.trainer  # the package and most of its modules
print("after import", mmapped())
import mtrl_jax.host
mtrl_jax.host.tune_allocator()
print("after tune_allocator", mmapped())
"""


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_importing_the_package_changes_no_allocator_setting():
    done = subprocess.run([sys.executable, "-c", _MMAPPED], env=_env(), capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    # glibc's own policy after the import; the thresholds only once an entry point asks for them
    assert done.stdout.split("\n")[:2] == ["after import True", "after tune_allocator False"], done.stdout


def test_an_unknown_policy_is_an_error_naming_the_variable():
    bad = subprocess.run(
        [sys.executable, "-c", "import mtrl_jax.host as h; h.prepare_process()"],
        env=_env(MTRL_JAX_MALLOC="fast"),
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode != 0
    assert "MTRL_JAX_MALLOC='fast'" in bad.stderr and "'tuned'" in bad.stderr


_RESTART = """
import os, sys
import mtrl_jax.host as h
print("run", os.environ.get("GLIBC_TUNABLES", ""), sys.argv[1:], flush=True)
h.prepare_process()
print("applied", sorted(h.applied))
"""


def _restart(**env_extra):
    done = subprocess.run(
        [sys.executable, "-c", _RESTART, "an-argument"],
        env=_env(**env_extra),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.skipif(not huge_pages_possible(), reason="needs glibc 2.35+ and transparent huge pages")
def test_an_entry_point_restarts_once_with_the_huge_page_tunable_and_sets_the_thresholds():
    # restarted once, same arguments, the tunable added (after any the user had), and recorded
    assert _restart() == [
        "run  ['an-argument']",
        "run glibc.malloc.hugetlb=1 ['an-argument']",
        "applied ['hugetlb', 'mmap_threshold', 'trim_threshold']",
    ]
    assert (
        _restart(GLIBC_TUNABLES="glibc.malloc.tcache_count=8")[1]
        == "run glibc.malloc.tcache_count=8:glibc.malloc.hugetlb=1 ['an-argument']"
    )
    # no restart: the user's own setting of the tunable, or glibc's policy asked for
    assert _restart(GLIBC_TUNABLES="glibc.malloc.hugetlb=0") == [
        "run glibc.malloc.hugetlb=0 ['an-argument']",
        "applied ['mmap_threshold', 'trim_threshold']",
    ]
    assert _restart(MTRL_JAX_MALLOC="default") == ["run  ['an-argument']", "applied []"]


_FAULTS = """
import mtrl_jax.host, resource, statistics, jax, jax.numpy as jnp
mtrl_jax.host.tune_allocator()
def loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) @ w.T)
step = jax.jit(jax.grad(loss))
w, x = jnp.full((256, 4096), 0.01), jnp.full((8192, 256), 0.5)
temp = step.lower(w, x).compile().memory_analysis().temp_size_in_bytes
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(step(w, x))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(temp // 4096, statistics.median(faults[1:]))
"""


def _faults(hugetlb):
    env = _env(GLIBC_TUNABLES=f"glibc.malloc.hugetlb={hugetlb}", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    pages, median = done.stdout.split()
    return int(pages), float(median)


@pytest.mark.slow
@pytest.mark.skipif(not huge_pages_possible(), reason="needs glibc 2.35+ and transparent huge pages")
def test_with_the_tunable_a_large_temporary_buffer_faults_in_by_huge_pages():
    """A jitted program whose temporaries exceed a thread arena's 64 MiB heap: XLA's thread maps them
    afresh on every call; with ``glibc.malloc.hugetlb=1`` they fault in 2 MiB at a time."""
    pages, huge = _faults(1)
    assert pages > (64 << 20) // 4096
    assert huge < 0.1 * pages, f"{huge} page faults per call with huge pages, for a {pages}-page buffer"
    _, small = _faults(0)
    if small < 0.5 * pages:
        pytest.skip(f"XLA reused this program's buffer without huge pages too ({small} faults per call)")


_BANNER_RUN = """
import os, sys
import mtrl_jax.host as h
h.prepare_process()
os.write(2, b"before\\n")
os.write(2, b"E1207 12:00:00.000000  1 slow_operation_alarm.cc:73] \\n********************************\\n"
            b"[Compiling module jit_step] Very slow compile?  If you want to file a bug, run with envvar "
            b"XLA_FLAGS=--xla_dump_to=/tmp/foo and attach the results.\\n********************************\\n")
os.write(2, b"E1207 12:02:38.000000  1 slow_operation_alarm.cc:140] The operation took 2m38.968625302s\\n")
os.write(2, b"bar 1\\rbar 2\\r")
os.write(2, b"last words\\n")
os.abort()
"""


@pytest.mark.parametrize("banner", ["", "show"])
def test_xlas_slow_compile_banner_stays_out_of_the_log_and_nothing_else_is_lost(banner):
    """Issue 71, item 18: XLA's "Very slow compile?" block (a 2-minute compile of the cold start's step on 2 cores)
    reached the user as an error block. What is written just before the process aborts still comes out."""
    done = subprocess.run(
        [sys.executable, "-c", _BANNER_RUN], env=_env(MTRL_JAX_XLA_BANNER=banner), capture_output=True, check=False
    )
    assert done.returncode != 0  # the abort
    assert b"before\n" in done.stderr and b"bar 1\rbar 2\rlast words\n" in done.stderr, done.stderr
    assert (b"Very slow compile?" in done.stderr) == (banner == "show"), done.stderr
    assert (b"The operation took" in done.stderr) == (banner == "show"), done.stderr


def test_several_cpu_devices_keep_one_collective_order(monkeypatch):
    """Issue 71, item 0: on a (2,2,2) mesh of 8 CPU devices the default's cold-start step deadlocked in XLA's
    collectives (devices in different ones). Entry points set the sequential scheduler for several CPU devices; the
    run itself is ``tests/test_trainer.py::test_the_default_sized_cold_start_runs_on_a_2_2_2_mesh``."""
    import mtrl_jax.host as h

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert h.cpu_multi_device_flags()
    assert os.environ["XLA_FLAGS"].split()[1:] == list(h.CPU_MULTI_DEVICE_FLAGS)
    assert not h.cpu_multi_device_flags()  # set once; a user's own setting is left alone
    for flags in ("", "--xla_force_host_platform_device_count=1"):
        monkeypatch.setenv("XLA_FLAGS", flags)
        assert not h.cpu_multi_device_flags() and os.environ["XLA_FLAGS"] == flags
