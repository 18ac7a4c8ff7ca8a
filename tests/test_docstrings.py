"""Every public function and class says what it takes and gives: ``Args:``
(a function's parameters, a class's constructor) or ``Attributes:`` (a data
class, an enum), and ``Returns:`` (a function that returns something), in
the docstring (a jitted op's is its function's)."""

import dataclasses
import importlib
import inspect

import pytest

MODULES = ("humming_jax", "humming_jax.nn", "humming_jax.checkpoints", "humming_jax.parallel")


def _public(module_name):
    module = importlib.import_module(module_name)
    for name in module.__all__:
        obj = getattr(module, name)
        obj = inspect.unwrap(obj) if callable(obj) and not inspect.isclass(obj) else obj  # jitted ops
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__.startswith("humming_jax"):
            yield f"{module_name}.{name}", obj


PUBLIC = sorted({name: obj for m in MODULES for name, obj in _public(m)}.items())


def _parameters(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]


def _problems(obj) -> list[str]:
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj):
        empty = dataclasses.is_dataclass(obj) and not dataclasses.fields(obj)  # (the Dense layout)
        found = [] if ("Args:" in doc or "Attributes:" in doc or empty) else ["no Args: or Attributes:"]
        call = obj.__dict__.get("__call__")
        if call is not None:
            found += [f"__call__: {p}" for p in _problems(call)]
        return found
    found = []
    if _parameters(obj) and "Args:" not in doc:
        found.append("no Args:")
    returns = inspect.signature(obj).return_annotation
    if returns not in (None, "None") and "Returns:" not in doc:
        found.append("no Returns:")
    return found


def test_every_public_name_is_listed():
    assert len(PUBLIC) > 60
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        assert sorted(module.__all__) == sorted(set(module.__all__)), module_name


@pytest.mark.parametrize("name,obj", PUBLIC, ids=[name for name, _ in PUBLIC])
def test_docstring_says_what_it_takes_and_gives(name, obj):
    assert not _problems(obj), f"{name}: {_problems(obj)}"
