"""Turning the CLI's ``--model`` and ``--data`` specifications into a model and batches.

* ``--model torchvision:NAME`` builds a torchvision model, ``--model timm:NAME`` a timm
  model (no weights downloaded by either); ``--model package.module:factory`` calls the
  user's factory.
* ``--data FOLDER`` reads images (ImageFolder layout or a flat folder) with the
  preprocessing of :mod:`precisebn.images`; ``--data package.module:function`` calls the
  user's function, which returns an iterable of batches.

Both accept keyword arguments as JSON (``'{"num_classes": 10}'``) or
``key=value,key=value`` (values parsed as JSON when they can be).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import json
import os
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._optional import require
from .errors import EmptyDataError, InvalidArgumentError
from .images import IMAGENET_MEAN, IMAGENET_STD, ImageFiles, Preprocessing, batch_indices, image_batches

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ImageFiles",
    "SpecError",
    "batch_indices",
    "image_batches",
    "load_object",
    "parse_kwargs",
    "resolve_data",
    "resolve_model",
]


class SpecError(InvalidArgumentError):
    """A ``--model``/``--data`` specification that cannot be resolved or fails when called."""


def parse_kwargs(text: str | None, option: str = "--model-kwargs") -> dict[str, Any]:
    """Keyword arguments from JSON or ``key=value,key=value``.

    Example:
        >>> parse_kwargs('num_classes=10,name=small')
        {'num_classes': 10, 'name': 'small'}
        >>> parse_kwargs('{"num_classes": 10}')
        {'num_classes': 10}
    """
    if not text:
        return {}
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecError(f"{option} {text!r} is not valid JSON ({exc}); or write key=value,key=value.") from None
        if not isinstance(value, dict):
            raise SpecError(f"{option} must be a JSON object, got {text!r}")
        return value
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in re.split(r",\s*(?=[A-Za-z_]\w*\s*=)", text))):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise SpecError(f"{option}: {item!r} is not key=value; write e.g. num_classes=10,dropout=0.1")
        if key.strip() in out:
            raise SpecError(f"{option}: {key.strip()!r} is given twice; give each keyword once.")
        if raw.rstrip().endswith(","):
            raise SpecError(
                f"{option}: {item!r} ends with a comma; drop it (a value with commas: quote it as JSON, "
                '{"key": "a,b"}).'
            )
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


@contextlib.contextmanager
def _cwd_on_path() -> Iterator[None]:
    added = os.getcwd() not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        yield
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(os.getcwd())


def load_object(spec: str, option: str) -> Any:
    """Imports ``package.module:attribute`` (the current folder is importable).

    Raises:
        SpecError: Malformed spec, module not importable, or attribute missing.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SpecError(f"{option} {spec!r} is not of the form package.module:name")
    try:
        with _cwd_on_path():
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise SpecError(
            f"{option} {spec!r}: cannot import {module_name!r} ({exc}). Run from the folder that holds it, "
            "install its package, or add its folder to PYTHONPATH."
        ) from None
    except Exception as exc:
        raise SpecError(f"{option} {spec!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            close = difflib.get_close_matches(part, [n for n in dir(obj) if not n.startswith("_")], n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise SpecError(f"{option} {spec!r}: {module_name!r} has no attribute {attr!r}{hint}")
        obj = getattr(obj, part)
    return obj


def _call(obj: Any, kwargs: dict[str, Any], what: str) -> Any:
    try:
        return obj(**kwargs)
    except Exception as exc:
        args = f" with {kwargs}" if kwargs else ""
        raise SpecError(f"{what}{args} raised {type(exc).__name__}: {exc}") from None


def resolve_model(spec: str, kwargs: dict[str, Any] | None = None) -> nn.Module:
    """Builds the model named by ``spec`` (``torchvision:NAME``, ``timm:NAME`` or ``package.module:factory``).

    Raises:
        SpecError: Unknown name, the factory raised, or it returned no ``nn.Module``.
    """
    kwargs = kwargs or {}
    source, sep, name = spec.partition(":")
    if source == "torchvision" and sep:
        models = require("torchvision.models", "images", "--model torchvision:NAME")
        known = models.list_models()
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise SpecError(
                f"--model {spec!r}: torchvision has no model {name!r}; {hint}"
                "see torchvision.models.list_models() for the names."
            )
        model = _call(lambda **kw: models.get_model(name, weights=None, **kw), kwargs, f"torchvision model {name!r}")
    elif source == "timm" and sep:
        timm = require("timm", "timm", "--model timm:NAME")
        if not timm.is_model(name):
            known = timm.list_models()
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise SpecError(f"--model {spec!r}: timm has no model {name!r}; {hint}see timm.list_models().")
        # pretrained=False: nothing is downloaded; the weights come from the checkpoint
        model = _call(lambda **kw: timm.create_model(name, pretrained=False, **kw), kwargs, f"timm model {name!r}")
    else:
        factory = load_object(spec, "--model")
        model = factory if isinstance(factory, nn.Module) else _call(factory, kwargs, f"--model {spec!r}")
    if not isinstance(model, nn.Module):
        raise SpecError(f"--model {spec!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def resolve_data(
    spec: str,
    *,
    batch_size: int = 64,
    preprocessing: Preprocessing | None = None,
    workers: int = 0,
    seed: int = 0,
    kwargs: dict[str, Any] | None = None,
    skipped: list[str] | None = None,
) -> tuple[Iterable[Any], int | None]:
    """The batches named by ``spec``: an image folder or ``package.module:function``.

    Args:
        preprocessing: An image folder's transform (default: the ImageNet default).
        skipped: A list to collect unreadable images in, instead of failing on the first.

    Returns:
        The batches, and the number of samples when known (an image folder's images).

    Raises:
        SpecError: Not a folder nor a loadable function, or the function raised.
        EmptyDataError: The folder holds no image.
    """
    path = Path(spec)
    if path.is_dir():
        dataset = ImageFiles(path, (preprocessing or Preprocessing("ImageNet default")).build())
        if not len(dataset):
            raise EmptyDataError(
                f"--data {spec!r}: no images found in the folder (looked recursively for "
                "jpg/jpeg/png/ppm/bmp/pgm/tif/tiff/webp files). Point --data at a folder of images."
            )
        return image_batches(dataset, batch_size, workers, seed, skipped=skipped), len(dataset)
    if path.exists():
        raise SpecError(f"--data {spec!r} is a file; pass a folder of images or package.module:function")
    if ":" not in spec:
        raise SpecError(f"--data {spec!r}: no such folder. Pass a folder of images or package.module:function")
    obj = load_object(spec, "--data")
    data = _call(obj, kwargs or {}, f"--data {spec!r}") if callable(obj) else obj
    if isinstance(data, (torch.Tensor, str, bytes)) or not isinstance(data, Iterable):
        raise SpecError(f"--data {spec!r} returned a {type(data).__name__}, not an iterable of batches")
    return data, None
