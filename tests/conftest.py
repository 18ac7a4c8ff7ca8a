import os
import zlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.pop("HUMMING_JAX_BACKEND", None)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")


@pytest.fixture
def rng(request):
    """A NumPy generator seeded from the test's id, so a failure reproduces."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
