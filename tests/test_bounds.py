"""The interpreter's out-of-bounds checks (``bounds``) on small synthetic Triton
kernels: each access past its buffer poisons the output, each access inside it
leaves the output as the plain interpreter gives it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

import bounds

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the checks run in the interpreter")

ROWS, COLS = 8, 4


@functools.cache
def _jitted(kernel, dtype):
    """One jitted function a kernel: its caches see every call."""
    out_shape = jax.ShapeDtypeStruct((ROWS, COLS), dtype)
    return jax.jit(pl.pallas_call(kernel, out_shape=out_shape, grid=(1,), interpret=True))


def _run(kernel, dtype=jnp.float32) -> np.ndarray:
    x = jnp.arange(ROWS * COLS, dtype=jnp.float32).reshape(ROWS, COLS).astype(dtype)
    return np.asarray(_jitted(kernel, dtype)(x))


def _rows_from(start: int, live):
    """A kernel copying rows ``start + i`` (i < ROWS) of x to the same rows of the
    output, loads and stores masked by ``live(rows)``; row ids past the end are
    past the buffers."""

    def kernel(x_ref, o_ref):
        rows = jnp.arange(ROWS) + start
        cols = jnp.arange(COLS)
        mask = live(rows)[:, None]
        values = plgpu.load(x_ref.at[rows[:, None], cols[None, :]], mask=mask, other=0)
        plgpu.store(o_ref.at[rows[:, None], cols[None, :]], values, mask=mask)

    return kernel


def _first_rows(x_ref, o_ref):
    plgpu.store(o_ref.at[:, :], plgpu.load(x_ref.at[:, :]))


def _rows_past_the_end(x_ref, o_ref):
    """The whole store past the end: only the first element can show it."""
    _first_rows(x_ref, o_ref)
    rows = jnp.arange(ROWS) + ROWS
    plgpu.store(o_ref.at[rows[:, None], jnp.arange(COLS)[None, :]], jnp.ones((ROWS, COLS), o_ref.dtype))


def _slice_one_past(x_ref, o_ref):
    """A dynamic slice reaching one row past the end, unmasked."""
    start = pl.program_id(0) + 1
    plgpu.store(o_ref.at[pl.ds(0, ROWS), :], plgpu.load(x_ref.at[pl.ds(start, ROWS), :]))


def _slice_one_past_masked(x_ref, o_ref):
    """The same slice with the row past the end masked off: in bounds."""
    start = pl.program_id(0) + 1
    mask = (start + jnp.arange(ROWS) < ROWS)[:, None]
    values = plgpu.load(x_ref.at[pl.ds(start, ROWS), :], mask=mask, other=0)
    plgpu.store(o_ref.at[pl.ds(0, ROWS), :], values)


def _outer_index_past(x_ref, o_ref):
    """A row picked by an outer index past the end, then its columns."""
    row = pl.program_id(0) + ROWS
    values = plgpu.load(x_ref.at[row].at[jnp.arange(COLS)])
    plgpu.store(o_ref.at[0, jnp.arange(COLS)], values)


def _element_read_past(x_ref, o_ref):
    """An unmasked element read (``ref[i, j]``) a row past the end."""
    o_ref[0, 0] = x_ref[pl.program_id(0) + ROWS, 0]


def _element_write_past(x_ref, o_ref):
    """An unmasked element write a row past the end, after the copy."""
    _first_rows(x_ref, o_ref)
    o_ref[pl.program_id(0) + ROWS, 0] = x_ref[0, 0]


def _element_in_bounds(x_ref, o_ref):
    _first_rows(x_ref, o_ref)
    o_ref[pl.program_id(0) + ROWS - 1, 0] = x_ref[pl.program_id(0), 1]


@pytest.mark.parametrize(
    "kernel, poisoned",
    [
        (_rows_from(2, lambda rows: rows < ROWS), None),  # masked at the end: in bounds
        (_rows_from(2, lambda rows: rows >= 0), "all"),  # rows 8 and 9 let through
        (_rows_past_the_end, "first"),
        (_slice_one_past, "all"),
        (_slice_one_past_masked, None),
        (_outer_index_past, "all"),
        (_element_read_past, "all"),
        (_element_write_past, "first"),
        (_element_in_bounds, None),
    ],
    ids=[
        "masked",
        "mask_lets_rows_past",
        "store_wholly_past",
        "slice_past",
        "slice_masked",
        "outer_index_past",
        "element_read_past",
        "element_write_past",
        "element_in_bounds",
    ],
)
def test_accesses_past_the_buffer_poison_the_output(kernel, poisoned):
    plain = _run(kernel)
    with bounds.CHECKING(True):
        checked = _run(kernel)
    if poisoned is None:
        np.testing.assert_array_equal(checked, plain)
    elif poisoned == "first":
        assert np.isnan(checked[0, 0]) and not np.isnan(plain[0, 0])
        kept = ~np.isnan(checked)  # the rest as the plain interpreter left it, or poisoned where it wrote
        assert kept.sum() >= checked.size - 2
        np.testing.assert_array_equal(checked[kept], plain[kept])
    else:
        stored = ~np.isnan(plain)  # what the kernel wrote (the interpreter leaves the rest NaN)
        assert stored.any() and np.isnan(checked[stored]).all()


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bfloat16])
def test_poison_of_each_dtype(dtype):
    with bounds.CHECKING(True):
        checked = _run(_rows_past_the_end, dtype)
    expected = {jnp.int32: -(2**31), jnp.uint8: 255}.get(dtype)
    if expected is None:
        assert np.isnan(np.float32(checked[0, 0]))
    else:
        assert checked[0, 0] == expected
    assert checked.reshape(-1)[1:].tolist() == list(range(1, ROWS * COLS))


def test_the_flag_keys_the_compiled_programs():
    """A program traced with the checks is not served to a call without them, nor the reverse."""
    kernel = _rows_from(2, lambda rows: rows >= 0)
    plain = _run(kernel)
    assert _jitted(kernel, jnp.float32)._cache_size() == 1
    with bounds.CHECKING(True):
        checked = _run(kernel)
    np.testing.assert_array_equal(_run(kernel), plain)
    with bounds.CHECKING(True):
        np.testing.assert_array_equal(_run(kernel), checked)
    assert np.isnan(checked).sum() > np.isnan(plain).sum()
    assert _jitted(kernel, jnp.float32)._cache_size() == 2
