import os
import zlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":
    # Interpreted kernels are compiled far more than they run: XLA's CPU backend
    # without LLVM's optimizations compiles them faster (the results are the same).
    flags = " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    # Eight simulated devices for the expert-parallel tests (one device is still the default).
    flags += " --xla_force_host_platform_device_count=8"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + flags).strip()
# The Mosaic GPU interpreter runs each warpgroup as a CPU computation whose blocking
# callbacks (barrier waits) take a worker thread of the CPU client, which has as many
# as the machine has cores: on 2 cores, warpgroups blocked on both could starve the one
# that would release them (the re-read rotation's 4-5 warpgroups hung 2 runs in 8).
os.environ.setdefault("PJRT_NPROC", "16")
# Compiled programs persist across the test modules (whose in-memory caches are dropped, see
# below) and the test workers of one run: most interpreted kernels recur in many tests.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# Off a GPU the library defaults to the XLA reference; the tests run the kernels
# (interpreted) wherever they leave the backend to the default.
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ["HUMMING_JAX_BACKEND"] = "interpret"
else:
    os.environ.pop("HUMMING_JAX_BACKEND", None)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

if os.environ["JAX_PLATFORMS"] == "cpu":
    # The first interpreted pallas_call imports JAX's TPU interpreter, which registers one more
    # trace-context flag: every jitted function traced before it would trace again once after.
    # Imported here, so a test's first call is not the one (tests that count compilations).
    import jax._src.pallas.mosaic.interpret.interpret_pallas_call  # noqa: E402, F401

    # Interpreted loads and stores past their buffers poison what they touch in the
    # tests marked `bounds` (see bounds): the rules wrapped, the flag registered, first.
    import bounds  # noqa: E402

    bounds.install()

    # The Mosaic GPU interpreter's host callbacks: their small arguments put on the device once.
    import host_callbacks  # noqa: E402

    host_callbacks.install()

    # Lowering a Pallas Triton kernel for the GPU asks the device for its compute capability;
    # the tests that lower kernels (and the Mosaic GEMMs' row-tile table with them) for the GPU
    # on the CPU lower them as for sm_90.
    from jax._src.pallas.triton import pallas_call_registration  # noqa: E402

    from benchmarks.lower_sm90 import gpu_info_as  # noqa: E402

    pallas_call_registration.gpu_info_lib = gpu_info_as(90)

settings.register_profile("ci", max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        help="every case of the sweeps (make test-full, the GPU step); without it the sweeps' "
        "cases marked `full` are left out",
    )


def pytest_configure(config):
    import sweep

    sweep.FULL_RUN = config.getoption("--full")


def pytest_collection_modifyitems(config, items):
    """Leave out the sweep cases marked ``full`` unless ``--full``: each
    sweep keeps a chosen case for every path it covers (see ``sweep``)."""
    if config.getoption("--full"):
        return
    kept = [item for item in items if item.get_closest_marker("full") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("full")])
        items[:] = kept


@pytest.fixture(autouse=True)
def _checked_bounds(request):
    """A test marked ``bounds`` runs with the interpreter's out-of-bounds checks on."""
    if request.node.get_closest_marker("bounds") is None or os.environ["JAX_PLATFORMS"] != "cpu":
        yield
        return
    import bounds

    with bounds.CHECKING(True):
        yield


@pytest.fixture
def rng(request):
    """A NumPy generator seeded from the test's id, so a failure reproduces."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# Memory mappings of a process past which the compiled executables are dropped (see below).
MAX_MAPPINGS = 30000


def _mappings() -> int:
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:  # no procfs: drop them after every module
        return MAX_MAPPINGS + 1


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
    """Drop JAX's compiled executables after a test module once the process
    holds many memory mappings. Every CPU executable keeps ~6 until it is
    freed; a test worker that compiles through the whole suite (interpret-mode
    kernels compile many) would reach the kernel's limit of 65530, and the
    next compilation crash with a segmentation fault. Kept until then, the
    traced and compiled programs serve the next modules (most interpreted
    kernels recur in several files)."""
    yield
    if _mappings() > MAX_MAPPINGS:
        import jax

        jax.clear_caches()


@pytest.fixture
def two_programs(monkeypatch):
    """The persistent Mosaic kernels on a grid of 2 programs, so that each loops
    over many tiles even at a test's small shapes: a tile's last pipeline slots
    meet the next tile's first loads (a hazard a grid of one tile a program —
    every compiled test's at its shapes — never reaches). Programs traced
    before and after are dropped: the grid is fixed when a kernel is traced."""
    import jax

    from pallas_kernels.gemm import mosaic

    jax.clear_caches()
    monkeypatch.setattr(mosaic, "persistent_programs", lambda interpret: 2)
    yield
    jax.clear_caches()
