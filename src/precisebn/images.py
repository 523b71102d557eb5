"""Image folders for the CLI: the preprocessing that follows the model, and the batches.

The transform applied to every image comes from, in order of precedence:

1. ``--transform package.module:function`` — the function takes a PIL image and
   returns a tensor; nothing else is applied.
2. Explicit options — ``--image-size``, ``--resize``, ``--crop``, ``--interpolation``,
   ``--mean``, ``--std`` — each overriding one field of the base below.
3. The base: a ``timm:NAME`` model's own data config (input size, crop fraction,
   interpolation, mean/std); the transforms of the torchvision weights named with
   ``--weights``; otherwise the ImageNet default (resize 256, centre crop 224,
   bilinear, ImageNet mean/std), with a warning when nothing asked for it.

The resulting transform is resize (shorter side), centre crop, to-tensor, normalise.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._optional import require
from .errors import InvalidArgumentError

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "INTERPOLATIONS",
    "ImageFiles",
    "Preprocessing",
    "batch_indices",
    "image_batches",
    "link_leading_to",
    "linked_folders",
    "linked_images",
    "resolve_preprocessing",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
INTERPOLATIONS = ("nearest", "nearest-exact", "bilinear", "bicubic", "box", "hamming", "lanczos")


@dataclass(frozen=True)
class Preprocessing:
    """How an image folder's images become tensors.

    Attributes:
        source: Where the settings come from (``"timm data config of resnet18"``,
            ``"torchvision weights ResNet18_Weights.IMAGENET1K_V1"``, ``"ImageNet default"``,
            ``"--transform m:f"``), plus ``", overridden: ..."`` for explicit options.
        resize: Shorter side resized to this many pixels, or ``None`` for no resize.
        crop: Centre crop to this square size, or ``None`` for no crop.
        interpolation: The resize's interpolation (a torchvision ``InterpolationMode`` value).
        mean: Per-channel mean subtracted after scaling pixels to [0, 1].
        std: Per-channel standard deviation divided by.
        transform: ``package.module:function`` when a custom transform is used
            (the fields above are then unused).
        asked: Whether anything (the model, ``--weights``, an option) chose these
            settings; ``False`` for the ImageNet default applied by default.
    """

    source: str
    resize: int | None = 256
    crop: int | None = 224
    interpolation: str = "bilinear"
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    transform: str | None = None
    asked: bool = True

    def describe(self) -> str:
        """One line for the report.

        Example:
            >>> print(Preprocessing("ImageNet default").describe())  # doctest: +NORMALIZE_WHITESPACE
            resize 256 (bilinear), centre crop 224, mean (0.485, 0.456, 0.406),
            std (0.229, 0.224, 0.225) [ImageNet default]
        """
        if self.transform:
            return f"custom transform {self.transform}"
        parts = [
            f"resize {self.resize} ({self.interpolation})" if self.resize else "no resize",
            f"centre crop {self.crop}" if self.crop else "no crop",
            f"mean {tuple(self.mean)}",
            f"std {tuple(self.std)}",
        ]
        return ", ".join(parts) + f" [{self.source}]"

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable settings (what the CLI's report stores)."""
        d = asdict(self)
        d["mean"], d["std"] = list(self.mean), list(self.std)
        d["description"] = self.describe()
        return d

    def build(self) -> Callable[[Any], torch.Tensor]:
        """The torchvision transform (PIL image → normalised float tensor)."""
        if self.transform:
            from .specs import load_object

            fn = load_object(self.transform, "--transform")
            if not callable(fn):
                raise InvalidArgumentError(f"--transform {self.transform!r} is a {type(fn).__name__}, not a function")
            return fn  # type: ignore[no-any-return]
        t = require("torchvision.transforms", "images", "--data FOLDER")
        if self.resize and self.crop and self.crop > self.resize:
            raise InvalidArgumentError(
                f"a centre crop of {self.crop} after resizing the shorter side to {self.resize} ({self.describe()}) "
                "would pad every image with black borders; crop at most the resized size (e.g. --resize "
                f"{self.crop} or more, or --crop {self.resize} or less)."
            )
        steps: list[Any] = []
        if self.resize:
            steps.append(t.Resize(self.resize, interpolation=t.InterpolationMode(self.interpolation)))
        if self.crop:
            steps.append(_Crop(self.crop, t.CenterCrop(self.crop)))
        steps += [t.ToTensor(), t.Normalize(self.mean, self.std)]
        return t.Compose(steps)  # type: ignore[no-any-return]


class _Crop:
    """torchvision's centre crop, refusing an image smaller than the crop (which it pads with black)."""

    def __init__(self, size: int, crop: Callable[[Any], Any]) -> None:
        self.size, self.crop = size, crop

    def __call__(self, image: Any) -> Any:
        width, height = image.size
        if min(width, height) < self.size:
            raise InvalidArgumentError(
                f"an image of {width}×{height} is smaller than the centre crop of {self.size}, which would pad it "
                "with black borders (the statistics would count them); resize first (--resize), or crop less."
            )
        return self.crop(image)


def _from_timm(name: str, model: nn.Module) -> Preprocessing:
    timm_data = require("timm.data", "timm", "--model timm:NAME")
    cfg = timm_data.resolve_data_config({}, model=model)
    size = cfg["input_size"][-2:]
    if size[0] != size[1] or cfg.get("crop_mode", "center") != "center":
        raise InvalidArgumentError(
            f"timm model {name!r} wants {size[0]}x{size[1]} inputs with crop_mode {cfg.get('crop_mode')!r}, which "
            "the CLI's transform does not reproduce; pass --transform package.module:function with timm's own "
            "timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))."
        )
    crop = int(size[0])
    return Preprocessing(
        f"timm data config of {name}",
        resize=math.floor(crop / float(cfg.get("crop_pct", 1.0))),
        crop=crop,
        interpolation=str(cfg.get("interpolation", "bilinear")),
        mean=tuple(float(v) for v in cfg["mean"]),
        std=tuple(float(v) for v in cfg["std"]),
    )


def torchvision_weights(model_name: str, weights: str) -> Any:
    """The torchvision weights enum member named ``weights`` (full name, or short for ``model_name``)."""
    models = require("torchvision.models", "images", "--weights")
    try:
        if "." in weights:
            return models.get_weight(weights)
        return models.get_model_weights(model_name)[weights]
    except (KeyError, ValueError, AttributeError) as exc:
        try:
            names = [w.name for w in models.get_model_weights(model_name)] + ["DEFAULT"]
        except (KeyError, ValueError):
            names = []
        raise InvalidArgumentError(
            f"--weights {weights!r}: not a torchvision weights name for {model_name!r} ({exc}); "
            f"use one of {', '.join(names) or 'the names in torchvision.models.get_model_weights(NAME)'}."
        ) from None


def _from_weights(model_name: str, weights: str) -> Preprocessing:
    member = torchvision_weights(model_name, weights)
    t = member.transforms()  # reads the preset; downloads nothing
    return Preprocessing(
        f"torchvision weights {type(member).__name__}.{member.name}",
        resize=int(t.resize_size[0]),
        crop=int(t.crop_size[0]),
        interpolation=str(t.interpolation.value),
        mean=tuple(float(v) for v in t.mean),
        std=tuple(float(v) for v in t.std),
    )


def resolve_preprocessing(
    model_spec: str,
    model: nn.Module | None,
    *,
    weights: str | None = None,
    image_size: int | None = None,
    resize: int | str | None = "base",
    crop: int | str | None = "base",
    interpolation: str | None = None,
    mean: tuple[float, ...] | None = None,
    std: tuple[float, ...] | None = None,
    transform: str | None = None,
) -> Preprocessing:
    """The preprocessing for ``--model model_spec`` with the given overrides.

    ``resize``/``crop``: ``"base"`` keeps the base's value, ``None`` turns the step
    off, an int sets it. ``image_size`` sets the crop and scales the base's resize
    in proportion (224 → 256 becomes 32 → 37).

    Example:
        >>> p = resolve_preprocessing("my.models:make", None, image_size=32, mean=(0.5,) * 3, std=(0.25,) * 3)
        >>> (p.resize, p.crop, p.mean, p.std, p.asked)
        (37, 32, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), True)
        >>> resolve_preprocessing("my.models:make", None).asked
        False
    """
    if transform:
        return Preprocessing(f"--transform {transform}", resize=None, crop=None, transform=transform)
    source, _, name = model_spec.partition(":")
    if source == "timm" and model is not None:
        base = _from_timm(name, model)
    elif weights:
        base = _from_weights(name, weights)
    else:
        base = Preprocessing("ImageNet default", asked=False)
    changes: dict[str, Any] = {}
    if image_size is not None:
        changes["crop"] = image_size
        if base.resize and base.crop:
            changes["resize"] = round(image_size * base.resize / base.crop)
    if resize != "base":
        changes["resize"] = resize
    if crop != "base":
        changes["crop"] = crop
    for key, value in (("interpolation", interpolation), ("mean", mean), ("std", std)):
        if value is not None:
            changes[key] = value
    if not changes:
        return base
    overridden = ", ".join(f"{k}={v}" for k, v in changes.items())
    return replace(base, **changes, source=f"{base.source}, overridden: {overridden}", asked=True)


class ImageFiles(torch.utils.data.Dataset):
    """Every image under ``root`` (recursively, hidden files skipped, sorted), transformed.

    An item is ``(tensor, "")``, or ``(empty tensor, error message)`` for a file that
    cannot be read; :func:`image_batches` raises or skips (also across DataLoader workers).
    """

    def __init__(self, root: str | os.PathLike[str], transform: Callable[[Any], torch.Tensor]) -> None:
        require("PIL", "images", "--data FOLDER")
        folder = require("torchvision.datasets.folder", "images", "--data FOLDER")
        self.root = Path(root)
        allowed = folder.IMG_EXTENSIONS
        self.files = sorted(  # (a dangling link to an image is one: unreadable, named, as a damaged file — probe 34b)
            p
            for p in _walk(self.root)
            if (p.is_file() or (p.is_symlink() and not p.exists()))
            and folder.has_file_allowed_extension(p.name, allowed)
        )
        self.loader = _load_rgb
        self.transform = transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str]:
        try:
            image = self.loader(str(self.files[i]))
        except Exception as exc:
            why = "not an image file Pillow can read" if type(exc).__name__ == "UnidentifiedImageError" else exc
            return torch.empty(0, device="cpu"), f"{str(self.files[i])!r}: {why}"
        try:
            out = self.transform(image)
        except InvalidArgumentError as exc:  # (a crop larger than the image: named by its file)
            raise InvalidArgumentError(f"{str(self.files[i])!r}: {exc}") from None
        if not isinstance(out, torch.Tensor):
            raise InvalidArgumentError(
                f"the image transform returned a {type(out).__name__} for {str(self.files[i])!r}, not a tensor; "
                "end a --transform with torchvision.transforms.ToTensor() (or PILToTensor and a conversion)."
            )
        return out, ""


def _walk(root: Path) -> Iterator[Path]:
    """Every non-hidden entry under ``root``, through symlinked folders (as torchvision's
    ``ImageFolder`` does), each real folder once, reached by its first path in sorted order; a
    link to a folder that holds ``root`` is not followed (it would bring in what is beside it)."""
    for here, _, names in _folders(root):
        yield from (Path(here) / name for name in names if not name.startswith("."))


def _folders(root: str | os.PathLike[str]) -> Iterator[tuple[str, str, list[str]]]:
    """The folders :func:`_walk` reads: ``(path as reached, real path, entries)``."""
    seen: set[str] = set()
    top = os.path.realpath(root)
    for here, folders, names in os.walk(root, followlinks=True):
        real = os.path.realpath(here)
        if real in seen or (real != top and top.startswith(real.rstrip(os.sep) + os.sep)):
            folders[:] = []  # seen already, or a link up to a folder holding the root (what is beside it too)
            continue
        seen.add(real)
        folders[:] = sorted(f for f in folders if not f.startswith("."))  # (the first way to a linked folder: fixed)
        yield here, real, names


def linked_folders(root: str | os.PathLike[str]) -> dict[str, str]:
    """The folders outside ``root`` that reading it as an image folder reads, through symlinked folders:
    ``{path as reached: real path}`` (an output there would be read as data by the next run)."""
    top = Path(os.path.realpath(root))
    return {here: real for here, real, _ in _folders(root) if not Path(real).is_relative_to(top)}


def linked_images(root: str | os.PathLike[str]) -> dict[Any, str]:
    """The images that symlinked files among those reading ``root`` reads lead to, dangling links too: ``{key: the
    link as reached}``, keyed by the target's ``(st_dev, st_ino)``, or by its real path where it does not exist (an
    output there overwrote a training image, or was read as one by the next run: probe 41). One ``stat`` per link
    (a folder of a million links to a shared store: seconds); see :func:`link_leading_to`."""
    folder = require("torchvision.datasets.folder", "images", "--data FOLDER")
    found: dict[Any, str] = {}
    for here, _, _ in _folders(root):
        try:
            entries = list(os.scandir(here))
        except OSError:
            continue
        for entry in entries:
            if entry.name.startswith(".") or not entry.is_symlink():
                continue
            if not folder.has_file_allowed_extension(entry.name, folder.IMG_EXTENSIONS):
                continue
            try:
                st = os.stat(entry.path)
            except OSError:
                found.setdefault(os.path.realpath(entry.path), entry.path)
            else:
                found.setdefault((st.st_dev, st.st_ino), entry.path)
    return found


def link_leading_to(links: dict[Any, str], path: str | os.PathLike[str]) -> str | None:
    """The link of :func:`linked_images` that leads to ``path`` (the same file, or where a dangling one points)."""
    try:
        st = os.stat(path)
    except OSError:
        return links.get(os.path.realpath(path))
    return links.get((st.st_dev, st.st_ino))


def _load_rgb(path: str) -> Any:
    """The image at ``path`` as 8-bit RGB: what torchvision's ``default_loader`` gives, except
    that a 16-bit grayscale image is scaled to 8 bits (Pillow's ``convert`` clips it: mostly white)."""
    from PIL import Image

    with open(path, "rb") as f:
        image = Image.open(f)
        if image.mode.startswith("I;16") or (image.mode == "I" and image.format in ("PNG", "PPM")):  # 16-bit
            import numpy as np

            values = np.asarray(image, dtype=np.float64).clip(0, 65535) / 257.0  # 0..65535 onto 0..255
            image = Image.fromarray(np.rint(values).clip(0, 255).astype(np.uint8), mode="L")
        elif image.mode in ("I", "F"):
            raise InvalidArgumentError(
                f"{path!r} is a {'32-bit integer' if image.mode == 'I' else 'floating-point'} image (Pillow mode "
                f"{image.mode!r}), whose range precisebn cannot know; convert it to 8-bit (or 16-bit) first, or "
                "pass --transform a preprocessing that reads it."
            )
        return image.convert("RGB")


def _collate(items: list[tuple[torch.Tensor, str]]) -> tuple[torch.Tensor | None, list[str]]:
    good = [x for x, error in items if not error]
    errors = [error for _, error in items if error]
    if not good:
        return None, errors
    shapes = {tuple(x.shape) for x in good}
    if len(shapes) > 1:
        raise InvalidArgumentError(
            f"images of different shapes after preprocessing ({', '.join(map(str, sorted(shapes)[:3]))}) cannot "
            "form a batch; add a crop (--crop S or --image-size S) or a --transform that gives one size."
        )
    return torch.stack(good), errors


def batch_indices(n: int, batch_size: int, seed: int = 0) -> list[list[int]]:
    """A seeded random order of ``range(n)`` cut into batches of ``batch_size``.

    A last batch of a single sample joins the one before (a BatchNorm layer in
    training mode cannot take one value per channel).

    Example:
        >>> [len(b) for b in batch_indices(9, 4)]
        [4, 5]
    """
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    batches = [order[i : i + batch_size] for i in range(0, n, batch_size)]
    if len(batches) > 1 and len(batches[-1]) == 1:
        last = batches.pop()
        batches[-1] += last
    return batches


def _ignore_ctrl_c(worker_id: int) -> None:
    """In a loader's worker process: Ctrl-C is the main process's to handle (it stops the workers), not a
    KeyboardInterrupt traceback from every worker."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def image_batches(
    dataset: ImageFiles,
    batch_size: int,
    workers: int = 0,
    seed: int = 0,
    *,
    skipped: list[str] | None = None,
) -> Iterator[torch.Tensor]:
    """Batches of images in the order of :func:`batch_indices`.

    Args:
        skipped: ``None``: raise on the first unreadable file. A list: leave such
            files out of their batch (it gets smaller; a batch left with a single image
            joins the next one, or the one before if it was the last: BatchNorm in
            training mode cannot take one value per channel) and append their messages.
    """
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=batch_indices(len(dataset), batch_size, seed),
        num_workers=workers,
        collate_fn=_collate,
        worker_init_fn=_ignore_ctrl_c if workers else None,
    )
    if skipped is None:  # (every batch as it comes: nothing read ahead)
        for images, errors in loader:
            if errors:
                raise InvalidArgumentError(
                    f"cannot read image {errors[0].rstrip('.')}. Remove or replace the file, or pass --skip-bad-images "
                    f"({len(errors)} unreadable in this batch)."
                )
            if images is not None:
                yield images
        return
    # Skipping: a batch left with one image by a skipped file joins the next one; the batch before is held until
    # the next one is known, so that a lone image at the end can join it. Files are listed as skipped when the
    # batch they were read with is yielded (not those of batches read ahead and never used).
    held: tuple[torch.Tensor, list[str]] | None = None
    lone: torch.Tensor | None = None
    errors_since: list[str] = []
    for images, errors in loader:
        errors_since += errors
        if images is None:
            continue
        if lone is not None:
            images, lone = torch.cat([lone, images]), None
        if len(images) == 1 and errors:
            lone = images
            continue
        if held is not None:
            skipped.extend(held[1])
            yield held[0]
        held, errors_since = (images, errors_since), []
    if lone is not None:
        held = (lone, errors_since) if held is None else (torch.cat([held[0], lone]), held[1] + errors_since)
        errors_since = []
    if held is not None:
        skipped.extend(held[1] + errors_since)
        yield held[0]
    else:
        skipped.extend(errors_since)
