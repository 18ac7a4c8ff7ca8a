"""Sweeps with a chosen subset for ``make test`` (2 CPU cores, kernels
interpreted: ~1-2 s of compilation a case) and every case under ``--full``
(``make test-full``, the GPU step)."""

from __future__ import annotations

import pytest


def sweep(cases, keep) -> list:
    """``cases`` as pytest params, those for which ``keep(case)`` is false
    marked ``full``. ``keep`` is a predicate or a collection of cases."""
    test = keep if callable(keep) else (lambda case, chosen=list(keep): case in chosen)
    if not callable(keep):
        missing = [case for case in keep if case not in cases]
        assert not missing, f"chosen cases not in the sweep: {missing}"
    out = []
    for case in cases:
        values = case if isinstance(case, tuple) else (case,)
        out.append(pytest.param(*values) if test(case) else pytest.param(*values, marks=pytest.mark.full))
    return out


FULL = pytest.mark.full  # for a case written as pytest.param(..., marks=FULL)


# Set by conftest.pytest_configure from ``--full`` (before the test modules are imported).
FULL_RUN = False


def examples(full: int, chosen: int) -> int:
    """Hypothesis examples of a property test over interpreted kernels: ``full``
    under ``--full``, ``chosen`` in ``make test`` (each example draws new shapes,
    so new programs to compile; fixed edge cases are tested beside it)."""
    return full if FULL_RUN else chosen
