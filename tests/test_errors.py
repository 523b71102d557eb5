"""The exception tree: one base, each error also the matching built-in."""

from __future__ import annotations

import inspect

import pytest

from precisebn import errors

EXPECTED = {
    "InvalidArgumentError": ValueError,
    "BatchTypeError": TypeError,
    "EmptyDataError": ValueError,
    "LayerNotFoundError": LookupError,
    "UninitializedLayerError": RuntimeError,
    "UnsupportedLayerError": TypeError,
    "ConcurrentUseError": RuntimeError,
    "NonFiniteError": FloatingPointError,
    "StatsMismatchError": ValueError,
    "MissingDependencyError": ImportError,
    "MissingFileError": FileNotFoundError,
    "DistributedError": RuntimeError,
    "NotWritableError": PermissionError,
}


@pytest.mark.parametrize(("name", "builtin"), EXPECTED.items())
def test_each_error_is_a_precisebn_error_and_a_builtin(name: str, builtin: type) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, errors.PreciseBNError)
    assert issubclass(cls, builtin)


def test_every_error_class_is_listed() -> None:
    classes = {n for n, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.PreciseBNError)}
    assert classes == set(EXPECTED) | {"PreciseBNError"}
    assert sorted(errors.__all__) == errors.__all__


def test_shortloader_error_is_an_assertion_error() -> None:
    from precisebn.compat import ShortLoaderError

    assert issubclass(ShortLoaderError, AssertionError) and issubclass(ShortLoaderError, errors.EmptyDataError)


def test_missing_dependency_hint() -> None:
    from precisebn._optional import require

    with pytest.raises(errors.MissingDependencyError, match=r"pip install 'precisebn\[plot\]'"):
        require("surely_not_installed_pkg.sub", "plot", "Report.plot()")
