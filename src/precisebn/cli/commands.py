"""The ``precisebn`` commands: for each, a check of its arguments and its run.

``check_NAME(args)`` runs before anything is loaded: it rejects wrong or conflicting
arguments (an :class:`~precisebn.errors.InvalidArgumentError`, exit code 2) and returns
the command's output plan, so that every output path is checked up front.
``run_NAME(args)`` does the work and returns the exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from .._optional import require
from ..errors import EmptyDataError, InvalidArgumentError, PreciseBNError

__all__ = [
    "EXIT_FAILED",
    "EXIT_FLAGGED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "check_apply",
    "check_demo",
    "check_diff",
    "check_merge",
    "check_recalibrate",
    "run_apply",
    "run_demo",
    "run_diff",
    "run_inspect",
    "run_merge",
    "run_recalibrate",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_FLAGGED = 3
EXIT_INTERRUPTED = 130

_PLOT_HINT = "pass --no-plot to skip the figure"


def _say(text: str) -> None:
    print(text, flush=True)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


# --- demo --------------------------------------------------------------------------------------------------


def check_demo(args: argparse.Namespace) -> Any:
    from ..files import OutputPlan

    if not args.no_plot:
        require("matplotlib.figure", "plot", f"the demo's figure ({_PLOT_HINT})")
    plan = OutputPlan()
    plan.add("results.json", args.out / "results.json")
    if not args.no_plot:
        plan.add("demo.png", args.out / "demo.png")
    return plan


def run_demo(args: argparse.Namespace) -> int:
    from ..demo import DemoConfig, format_results
    from ..demo import run_demo as train_and_measure

    start = time.perf_counter()
    config = DemoConfig(epochs=args.epochs, seed=args.seed, quick=args.quick, threads=getattr(args, "threads", 1))
    print(
        f"precisebn demo: a small BatchNorm CNN on scikit-learn's digits, {config.epochs} epochs, "
        f"seed {config.seed}, CPU ({config.threads} thread{'s' if config.threads > 1 else ''})"
        f"{', quick subset' if config.quick else ''}",
        flush=True,
    )
    quiet = getattr(args, "quiet", False)  # (progress lines: on stderr, not silenced with stdout)
    results = train_and_measure(config, log=None if quiet else lambda line: print(line, file=sys.stderr, flush=True))
    print()
    print(format_results(results))
    with args.plan.staged() as tmp:  # both files, or neither
        tmp["results.json"].write_text(json.dumps(results, indent=1) + "\n")
        if not args.no_plot:
            from ..plotting import plot_demo

            plot_demo(results, tmp["demo.png"])
    print(f"\nwall time {time.perf_counter() - start:.1f} s (training and measuring {results['wall_seconds']:.1f} s)")
    print(f"numbers: {(args.out / 'results.json').resolve()}")
    if not args.no_plot:
        print(f"figure:  {(args.out / 'demo.png').resolve()}")
    return EXIT_OK


# --- recalibrate and apply ---------------------------------------------------------------------------------


def _plan_checkpoint_output(
    args: argparse.Namespace, inputs: dict[str, Path], folders: dict[str, Path] | None = None
) -> Any:
    """The output plan of a command that writes a checkpoint: ``--out`` or ``--in-place``."""
    from ..checkpoint import checkpoint_format
    from ..files import OutputPlan

    plan = OutputPlan(inputs, folders)
    if args.in_place:
        plan.add("--in-place", args.checkpoint, replaces="CHECKPOINT")
    else:
        plan.add("--out", args.out)
        out_format, in_format = checkpoint_format(args.out), checkpoint_format(args.checkpoint)
        if out_format != in_format:
            raise InvalidArgumentError(
                f"--out {str(args.out)!r} would be {out_format} but the input is {in_format}; the output keeps "
                "the input's format, so give it the same kind of extension (.safetensors or .pt/.pth)."
            )
    return plan


def _check_device(text: str | None) -> None:
    if text is None:
        return
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise InvalidArgumentError(f"--device {text!r} is not a device; use cpu, cuda, cuda:1, mps...") from None
    if device.type not in ("cpu", "cuda", "mps", "xpu"):
        raise InvalidArgumentError(
            f"--device {text!r}: a {device.type} device cannot hold the images and statistics; use cpu, cuda, "
            "cuda:1, mps..."
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError(f"--device {text!r}: CUDA is not available on this machine; use --device cpu.")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise InvalidArgumentError(
                f"--device {text!r}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0."
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidArgumentError(f"--device {text!r}: MPS is not available on this machine; use --device cpu.")
    if device.type == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise InvalidArgumentError(f"--device {text!r}: XPU is not available on this machine; use --device cpu.")


@contextlib.contextmanager
def _back_in(folder: str, option: str) -> Any:
    """Runs user code (``option``'s) and returns to ``folder``, the working folder the command started in, if it
    changed it: a --model factory that changed it made a relative --data folder, and a --data module, be read from
    another folder — other images, unwarned (a probe)."""
    try:
        yield
    finally:
        moved = os.getcwd()
        if moved != folder:
            os.chdir(folder)
            warnings.warn(
                f"{option}'s code changed the working folder to {moved!r}; precisebn went back to {folder!r}, where "
                "the command's relative paths are read.",
                stacklevel=1,
            )


def check_recalibrate(args: argparse.Namespace) -> Any:
    from ..specs import parse_kwargs

    args.folder = os.getcwd()  # (where relative paths are read, whatever user code does: see _back_in)
    folders = {"--data": Path(args.data)} if Path(args.data).is_dir() else {}
    if folders:  # (and the folders its symlinked folders lead to: a probe's --report went into one, read next time)
        from ..images import linked_folders

        folders.update({f"--data (through {here!r})": Path(real) for here, real in linked_folders(args.data).items()})
    plan = _plan_checkpoint_output(args, {"CHECKPOINT": args.checkpoint, **_sources(args)}, folders)
    if args.report is not None:
        if args.report.suffix.lower() == ".png":
            raise InvalidArgumentError(
                "--report takes the JSON file's path (e.g. report.json); the PNG goes next to it."
            )
        plan.add("--report", args.report)
        plan.add("--report's PNG", args.report.with_suffix(".png"))
        require("matplotlib.figure", "plot", "--report's PNG")
    _refuse_import_shadows(args, plan)
    if folders:  # (and the images its symlinked files lead to, dangling ones too, probe 41: one was overwritten)
        from ..images import link_leading_to, linked_images

        links = linked_images(args.data)
        for label, (text, real) in plan.outputs.items() if links else ():
            if (link := link_leading_to(links, real)) is not None:
                raise InvalidArgumentError(
                    f"{label} {text!r} is the image that {link!r} of --data links to ({real}); writing it would "
                    "destroy (or add) a training image. Choose another path."
                )
    _check_device(args.device)
    if args.tolerance is not None and args.num_samples != "auto":
        raise InvalidArgumentError("--tolerance goes with --num-samples auto; pass both.")
    args.model_kwargs_parsed = parse_kwargs(args.model_kwargs)
    args.data_kwargs_parsed = parse_kwargs(args.data_kwargs, "--data-kwargs")
    if ":" not in args.model or args.model.startswith(":") or args.model.endswith(":"):  # (probe 34b: exit 1, late)
        raise InvalidArgumentError(
            f"--model {args.model!r} is not of the form torchvision:NAME, timm:NAME or package.module:function"
        )
    model_source = args.model.partition(":")[0]
    if args.weights and model_source != "torchvision":
        raise InvalidArgumentError(
            f"--weights names torchvision weights, for a torchvision:NAME model (not {args.model!r}); a timm: "
            "model uses its own data config, and explicit options (--resize, --crop, --mean...) set the rest."
        )
    if args.weights:  # the name is checked now, without loading anything
        from ..images import torchvision_weights

        torchvision_weights(args.model.partition(":")[2], args.weights)
    explicit = [
        f"--{name.replace('_', '-')}"
        for name in ("image_size", "resize", "crop", "interpolation", "mean", "std")
        if getattr(args, name) is not None
    ]
    if args.transform:
        if ":" not in args.transform or args.transform.startswith(":") or args.transform.endswith(":"):
            raise InvalidArgumentError(f"--transform {args.transform!r} is not of the form package.module:function")
        ignored = explicit + ["--weights"] * bool(args.weights)
        if ignored:
            raise InvalidArgumentError(
                f"--transform replaces the whole preprocessing, so {', '.join(ignored)} would be ignored; put "
                "those steps in the transform, or drop --transform."
            )
    if args.image_size is not None and args.crop is not None:
        raise InvalidArgumentError("--image-size S is the crop size; pass either it or --crop, not both.")
    is_function = ":" in args.data and not Path(args.data).exists()  # a missing folder is reported when read
    loading = [f"--{n.replace('_', '-')}" for n in ("batch_size", "seed", "workers") if getattr(args, n) is not None]
    if is_function and (explicit or args.transform or args.weights or args.skip_bad_images or loading):
        options = explicit + ["--transform"] * bool(args.transform) + ["--weights"] * bool(args.weights)
        options += ["--skip-bad-images"] * bool(args.skip_bad_images) + loading
        raise InvalidArgumentError(
            f"{', '.join(options)} {'apply' if len(options) > 1 else 'applies'} only to an image folder, but --data "
            f"{args.data!r} names a data "
            "function, which prepares its own batches."
        )
    return plan


def _not_a_file(path: Path) -> str:
    if path.is_dir():
        return f"statistics file {str(path)!r} is a folder; pass the .safetensors file precisebn estimate wrote."
    return f"statistics file {str(path)!r} does not exist; check the path."


class _Patterns:
    """``--layers`` with wildcards: a predicate on qualified names (shown as the patterns in messages)."""

    def __init__(self, patterns: list[str]) -> None:
        self.patterns = patterns

    def __call__(self, name: str, module: Any) -> bool:
        import fnmatch

        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def __repr__(self) -> str:
        return "--layers " + " ".join(repr(p) for p in self.patterns)


def _layer_selection(patterns: list[str] | None, prefix: str = "", names: set[str] | None = None) -> Any:
    """``--layers`` for the library: names (or patterns) of the model's modules — written with the checkpoint's
    prefix too (``model.bn1`` of a Lightning checkpoint, as ``inspect`` shows them), which is taken off where
    the name (or pattern) as given names none of the model's modules (``names``): a model's own ``model.bn``
    stays itself, whatever the checkpoint's prefix."""
    if not patterns:
        return None
    if prefix:
        import fnmatch

        known = names or set()
        patterns = [
            p[len(prefix) :] if p.startswith(prefix) and not any(fnmatch.fnmatchcase(n, p) for n in known) else p
            for p in patterns
        ]
    if not any(ch in p for p in patterns for ch in "*?["):
        return patterns  # exact names: the library suggests close matches for typos
    return _Patterns(patterns)


class _Saved:
    """A ``--layers`` selection without the layers whose running statistics the checkpoint cannot hold (by
    identity: a layer has as many names as parents)."""

    def __init__(self, selection: Any, unsaved: set[int]) -> None:
        self.selection, self.unsaved = selection, unsaved

    def __call__(self, name: str, module: Any) -> bool:
        if id(module) in self.unsaved:
            return False
        return self.selection is None or self.selection(name, module)

    def __repr__(self) -> str:
        return repr(self.selection) if self.selection is not None else "every layer saved in checkpoints"


def _saved_layers(model: Any, selection: Any) -> Any:
    """``selection`` less the normalization layers whose running buffers are not in ``model.state_dict()``
    (registered ``persistent=False``): their new statistics could not be written, and a probe's run failed with
    a KeyError after all the passes. Named in ``--layers`` (by any of its names), or all that is selected:
    refused up front; otherwise left out, with a warning."""
    from ..layers import find_norm_layers, has_running_stats

    saved = set(model.state_dict())
    unsaved = {
        id(m)
        for name, m in model.named_modules()
        if has_running_stats(m)
        and not all((f"{name}.{b}" if name else b) in saved for b in ("running_mean", "running_var"))
    }
    if not unsaved:
        return selection
    chosen = find_norm_layers(model, selection, require=False)
    left_out = [layer.name for layer in chosen if id(layer.module) in unsaved]
    if not left_out:
        return selection
    shown = ", ".join(map(repr, left_out[:5])) + (f" and {len(left_out) - 5} more" if len(left_out) > 5 else "")
    why = "keep their running statistics out of the model's state_dict (buffers registered persistent=False)"
    if isinstance(selection, list) or len(left_out) == len(chosen):
        asked = f"--layers {', '.join(map(repr, selection))}" if isinstance(selection, list) else "the layers selected"
        raise InvalidArgumentError(
            f"{asked}: layer(s) {shown} {why}, so a checkpoint cannot hold their new statistics"
            + ("" if isinstance(selection, list) else ", and no other layer is selected")
            + ". Leave them out of --layers, or recalibrate them with the library (precisebn.recalibrate)."
        )
    print(f"precisebn: warning: layer(s) {shown} {why}; a checkpoint cannot hold them: left out.", file=sys.stderr)
    return _Saved(selection, unsaved)


def _say_dtypes(model: Any, ckpt: Any, prefix: str) -> None:
    """Warns where the checkpoint's floating-point tensors have another dtype than the modules ``--model``
    built: loading converted them, and the passes run the model as built (a probe: a float64 checkpoint got the
    statistics of its float32 copy, 2.6e-7 from its own, written into its float64 buffers without a word)."""
    import torch

    differ: dict[tuple[Any, Any], list[str]] = {}
    for name, t in model.state_dict().items():
        held = ckpt.state_dict.get(prefix + name)
        floating = isinstance(t, torch.Tensor) and isinstance(held, torch.Tensor) and t.is_floating_point()
        if floating and held.is_floating_point() and held.dtype != t.dtype:
            differ.setdefault((held.dtype, t.dtype), []).append(prefix + name)
    for (saved, built), names in differ.items():
        saved_name, built_name = (str(d).removeprefix("torch.") for d in (saved, built))
        are = "is" if len(names) == 1 else "are"
        print(
            f"precisebn: warning: {_plural(len(names), 'tensor')} of the checkpoint (e.g. {names[0]!r}) {are} "
            f"{saved_name}, but the model --model builds holds {'it' if len(names) == 1 else 'them'} as "
            f"{built_name}: converted on loading, so the passes measure the {built_name} model (its statistics, "
            f"written back as {saved_name}). For the {saved_name} model's, build it in {saved_name} (e.g. a "
            f"factory ending in .to(torch.{saved_name}), its forward converting the inputs).",
            file=sys.stderr,
        )


def _say_others(ckpt: Any) -> None:
    """Names the checkpoint's other state_dicts (e.g. timm's EMA weights), which are left as they are."""
    if ckpt.others:
        names = ", ".join(map(repr, ckpt.others))
        print(
            f"precisebn: warning: the checkpoint also holds the state_dict{'s' if len(ckpt.others) > 1 else ''} "
            f"{names}, left as {'they are' if len(ckpt.others) > 1 else 'it is'} (only {ckpt.key!r} is used); "
            f"run again with --key {ckpt.others[0]} for {'those' if len(ckpt.others) > 1 else 'it'}"
            + (
                " (averaged weights need statistics of their own)."
                if any("ema" in k.lower() for k in ckpt.others)
                else "."
            ),
            file=sys.stderr,
        )


def run_recalibrate(args: argparse.Namespace) -> int:
    from .. import recalibrate
    from ..checkpoint import buffer_names, load_checkpoint, load_into
    from ..images import resolve_preprocessing
    from ..recalibrate import DEFAULT_NUM_SAMPLES
    from ..specs import SpecError, resolve_data, resolve_model

    device = _device(args.device)
    if args.trust_checkpoint:
        print("precisebn: warning: --trust-checkpoint unpickles the file; that can run any code.", file=sys.stderr)
    ckpt = load_checkpoint(args.checkpoint, trust=args.trust_checkpoint, key=args.key)
    _say_others(ckpt)
    with _back_in(args.folder, "--model"):
        model = resolve_model(args.model, args.model_kwargs_parsed)
    prefix = load_into(model, ckpt)
    _say_dtypes(model, ckpt, prefix)
    layers = _saved_layers(model, _layer_selection(args.layers, prefix, {name for name, _ in model.named_modules()}))
    model.to(device)

    preprocessing = None
    skipped: list[str] | None = [] if args.skip_bad_images else None
    if Path(args.data).is_dir():
        with _back_in(args.folder, "--transform"):
            preprocessing = resolve_preprocessing(
                args.model,
                model,
                weights=args.weights,
                image_size=args.image_size,
                resize="base" if args.resize is None else (None if args.resize == 0 else args.resize),
                crop="base" if args.crop is None else (None if args.crop == 0 else args.crop),
                interpolation=args.interpolation,
                mean=args.mean,
                std=args.std,
                transform=args.transform,
            )
        if not preprocessing.asked:
            warnings.warn(
                f"--data {args.data!r} is preprocessed with the ImageNet default ({preprocessing.describe()}), "
                "which nothing asked for: the model is not timm: and no --weights or preprocessing option was "
                "given. If the model was trained on other image sizes or normalisation, pass --image-size/--resize/"
                "--crop/--mean/--std or --transform, or the statistics will be those of the wrong inputs.",
                stacklevel=1,
            )
    loading = {k: v for k in ("batch_size", "workers", "seed") if (v := getattr(args, k)) is not None}
    with _back_in(args.folder, "--data"):
        data, available = resolve_data(  # (resolve_data's defaults where not given)
            args.data, preprocessing=preprocessing, kwargs=args.data_kwargs_parsed, skipped=skipped, **loading
        )
    num_samples = args.num_samples
    limit = DEFAULT_NUM_SAMPLES if num_samples is None else num_samples  # (the library's default)
    if available is not None and isinstance(limit, int) and available < limit and not args.num_batches:
        if num_samples is not None:
            files = "" if skipped is None else " file"  # (probe 41: unreadable ones, skipped, were counted as images)
            _say(f"precisebn: using every image of {args.data} ({_plural(available, 'image' + files)}, fewer than "
                 f"--num-samples {num_samples}{'; unreadable ones are skipped' if files else ''})")  # fmt: skip
        # all of them: counted, so that a progress bar counts to the folder's size (unless images may be skipped)
        num_samples = "all" if skipped is not None else available
    progress = not args.no_progress and not getattr(args, "quiet", False)
    progress = progress and importlib.util.find_spec("tqdm") is not None
    try:
        report = recalibrate(
            model,
            data,
            num_samples=num_samples,
            num_batches=args.num_batches,
            tolerance=args.tolerance,
            mode=args.mode,
            capture=args.capture,
            prior=args.prior,
            adapt=args.adapt,
            layers=layers,
            device=device,
            progress=progress,
            forward=_forward,
        )
    except EmptyDataError:
        if not skipped:
            raise
        raise EmptyDataError(
            f"--data {args.data!r}: every image was unreadable and skipped ({_plural(len(skipped), 'image')}, "
            f"e.g. {skipped[0]}), so there is nothing to measure. Check the files. Nothing was written."
        ) from None
    except InvalidArgumentError as exc:  # a batch of one: the library's advice is for a DataLoader (drop_last)
        if preprocessing is None or _ONE_VALUE not in str(exc):  # (a --data function makes its own batches)
            raise
        raise InvalidArgumentError(_one_sample(args, str(exc), available, skipped)) from None
    except Exception as exc:  # raised in the code of --data or --model, as the passes ran it: say whose (probe 37)
        if isinstance(exc, (PreciseBNError, OSError)):
            raise
        whose = _raised_in(exc, args)
        if whose is None:
            raise
        raise SpecError(
            f"the code of {whose} raised {type(exc).__name__} while precisebn ran it: {exc}. Nothing was written; "
            "run again with `precisebn --debug ...` for the traceback."
        ) from exc
    print(report)
    extra: dict[str, Any] = {}
    if args.prior or args.adapt != "both":
        _say_adapted(args)
        extra["adaptation"] = {"prior_samples": args.prior or 0, "adapt": args.adapt}
    if preprocessing is not None:
        _say(f"preprocessing: {preprocessing.describe()}")
        extra["preprocessing"] = preprocessing.to_dict()
    if skipped is not None:
        extra["skipped_images"] = list(skipped)
        if skipped:
            more = f" and {len(skipped) - 10} more" if len(skipped) > 10 else ""
            print(
                f"precisebn: warning: skipped {_plural(len(skipped), 'unreadable image')}: "
                f"{'; '.join(skipped[:10])}{more}",
                file=sys.stderr,
            )

    state = model.state_dict()
    kept = {"both": ("running_mean", "running_var"), "mean": ("running_mean",), "var": ("running_var",)}[args.adapt]
    names = buffer_names(model, report.updated, kept, prefix)  # (--adapt: the other buffer stays bit for bit)
    replace = {ckpt_name: state[name].detach().cpu() for ckpt_name, name in names.items()}
    _write_outputs(args, ckpt, replace, report=report, extra=extra)
    return EXIT_OK


_ONE_VALUE = "received one value per channel"  # (capture's message for a BatchNorm layer given one sample)


def _one_sample(args: argparse.Namespace, message: str, available: int | None, skipped: list[str] | None) -> str:
    """The library's message for a BatchNorm layer given a batch of one, with what to do about it on the command
    line: the library suggests ``DataLoader(drop_last=True)``, which an image folder's user cannot pass (probe
    45). Only --batch-size 1 or a folder of one readable image make a batch of one (a last image alone joins the
    batch before); otherwise the model gave the layer one sample of its batch."""
    what = message.partition(" Use batches of two or more samples")[0]  # (the layer, its input's shape, why)
    readable = (available or 0) - len(skipped or ())
    if args.batch_size == 1:
        hint = "--batch-size 1 makes batches of a single image: pass --batch-size 2 or more (the training one is best)."
    elif readable <= 1:
        hint = (
            f"--data {args.data!r} holds a single {'readable ' if skipped else ''}image, a batch of one whatever "
            "--batch-size is: give it two or more images."
        )
    else:
        hint = (
            f"The batches of --data {args.data!r} hold two or more images (--batch-size {args.batch_size or 64}; "
            "a last image alone joins the batch before), so the model itself gave this layer one sample at a time, "
            "which cannot be measured in training mode: select the other layers with --layers."
        )
    return f"{what} {hint} Nothing was written."


def _say_adapted(args: argparse.Namespace) -> None:
    what = {"both": "mean and variance", "mean": "the mean only", "var": "the variance only"}[args.adapt]
    prior = f"pooled with the checkpoint's statistics counted as {args.prior:g} samples" if args.prior else ""
    _say(f"adapted: {what}{', ' if prior else ''}{prior}")


def _write_outputs(
    args: argparse.Namespace, ckpt: Any, replace: dict[str, Any], *, report: Any = None, extra: Any = None
) -> None:
    """Stages the checkpoint (checked by reloading it) and the report's files, then commits them together."""
    from ..checkpoint import verify_written, write_checkpoint

    label = "--in-place" if args.in_place else "--out"
    with args.plan.staged() as tmp:
        write_checkpoint(ckpt, replace, tmp[label])
        verify_written(ckpt, replace, tmp[label], trust=args.trust_checkpoint)
        if getattr(args, "report", None) is not None:
            from ..plotting import plot_report

            tmp["--report"].write_text(json.dumps({**report.to_dict(), **(extra or {})}, indent=1) + "\n")
            plot_report(report, tmp["--report's PNG"], title=f"precisebn: {args.checkpoint.name}", format="png")
    written = [text for text, _ in args.plan.outputs.values()]
    _say(f"wrote {', '.join(written[:-1])}{' and ' if len(written) > 1 else ''}{written[-1]}")


def _raised_in(exc: BaseException, args: argparse.Namespace) -> str | None:
    """``"--data 'SPEC'"`` or ``"--model 'SPEC'"`` if ``exc`` was raised in that module's code (its traceback's
    innermost frame of either), else ``None``."""
    import traceback

    files = {}
    for option, spec in (("--model", args.model), ("--data", args.data)):
        module = sys.modules.get(spec.partition(":")[0]) if ":" in spec else None
        file = getattr(module, "__file__", None)
        if isinstance(file, str):
            files[os.path.realpath(file)] = f"{option} {spec!r}"
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        whose = files.get(os.path.realpath(frame.filename))
        if whose is not None:
            return whose
    return None


def _sources(args: argparse.Namespace) -> dict[str, Path]:
    """The source files of --model/--data given as package.module:name (looked up as the import will, from
    the current folder and sys.path, without importing anything): read by a recalibration, so no output
    may replace them."""
    inputs: dict[str, Path] = {}
    for option, spec in (("--model", args.model), ("--data", args.data)):
        module, sep, _ = spec.partition(":")
        if not sep or module in ("torchvision", "timm") or Path(spec).exists():
            continue
        parts = module.split(".")
        base = Path(*parts)
        for root in ("", *sys.path):
            candidates = (Path(root) / base.with_suffix(".py"), Path(root) / base / "__init__.py")
            found = [p for p in candidates if p.is_file()]
            if found:
                inputs[f"--{option[2:]}'s module"] = found[0]
                for k in range(1, len(parts)):  # (its packages' __init__.py are imported too)
                    package = Path(root, *parts[:k], "__init__.py")
                    if package.is_file():
                        inputs[f"--{option[2:]}'s package {'.'.join(parts[:k])}"] = package
                break
    return inputs


def _import_shadows(args: argparse.Namespace) -> dict[Path, tuple[str, str, str]]:
    """The files that Python would import as a module the --model, --data or --transform spec names (its
    packages too), instead of that module's code: the module's name with each import suffix (``.py``, ``.pyc``,
    an extension module's ``.so``...) in each folder of the import path (the working folder first, as the import
    of a spec has it) up to the one that holds it (every one, where none does, or where it is a namespace
    package), and within its package's folder for the names under it. By path: (option and spec, module, the
    folder as the message names it). Found without importing anything, as :func:`_sources` finds the inputs."""
    import importlib.machinery

    suffixes = importlib.machinery.all_suffixes()
    here = os.getcwd()
    roots = list(dict.fromkeys(os.path.realpath(p or here) for p in (here, *sys.path) if isinstance(p, str)))
    shadows: dict[Path, tuple[str, str, str]] = {}
    for option in ("model", "data", "transform"):
        spec = getattr(args, option, None)
        if not spec or ":" not in spec or Path(spec).exists():  # (an image folder)
            continue
        parts = spec.partition(":")[0].split(".")
        folders = roots
        for k, part in enumerate(parts):
            inside: list[str] = []  # where the next part is looked for: the package's folder(s)
            for folder in folders:
                package = os.path.join(folder, part)
                if any(os.path.isfile(os.path.join(package, "__init__" + s)) for s in suffixes):
                    inside = [os.path.realpath(package)]  # (a package's folder comes before a module file beside it)
                    break
                if k:
                    where = f"its package's folder {folder!r}"
                elif folder == roots[0]:
                    where = f"the working folder {folder!r}"
                else:
                    where = f"{folder!r} (on the import path)"
                found = (f"--{option} {spec!r}", ".".join(parts[: k + 1]), where)
                for suffix in suffixes:
                    shadows.setdefault(Path(folder, part + suffix), found)
                if any(os.path.isfile(os.path.join(folder, part + s)) for s in suffixes):
                    break  # (found: the folders after this one are not searched)
                if os.path.isdir(package):  # a namespace package's portion: a module in a later folder still wins
                    inside.append(os.path.realpath(package))
            folders = inside
    return shadows


def _refuse_import_shadows(args: argparse.Namespace, plan: Any) -> None:
    """Refuses an output that would be imported as the module of --model/--data/--transform the next time (a
    probe: ``--model pmodels:fn --out pmodels.so`` wrote a file that the next run imported instead of
    ``pmodels.py``; ``--out pmodels.py`` in the working folder did the same to a ``pmodels.py`` found further down
    the import path). The checks of the inputs compare files, and this one is not the module's file yet."""
    shadows = _import_shadows(args)
    for label, (text, real) in plan.outputs.items():
        given = Path(os.path.realpath(Path(text).parent), Path(text).name)
        found = shadows.get(given) or shadows.get(real)
        if found is not None:
            whose, module, where = found
            raise InvalidArgumentError(
                f"{label} {text!r} would be imported as the module {module!r} of {whose}: Python looks for "
                f"{module!r} in {where} before it reaches that code, so the next run would load this file "
                "instead. Give the output another name or folder."
            )


def check_apply(args: argparse.Namespace) -> Any:
    return _plan_checkpoint_output(args, {"CHECKPOINT": args.checkpoint, "STATS": args.stats})


def run_apply(args: argparse.Namespace) -> int:
    from ..checkpoint import CheckpointError, load_checkpoint, stats_replacement
    from ..population import PopulationStats

    if args.trust_checkpoint:
        print("precisebn: warning: --trust-checkpoint unpickles the file; that can run any code.", file=sys.stderr)
    ckpt = load_checkpoint(args.checkpoint, trust=args.trust_checkpoint, key=args.key)
    if ckpt.metadata.get("format", "").startswith("precisebn."):
        raise CheckpointError(
            f"CHECKPOINT {str(args.checkpoint)!r} is a precisebn statistics file (PopulationStats.save), not a "
            f"checkpoint: the arguments go checkpoint first, then statistics — precisebn apply {args.stats} "
            f"{args.checkpoint} --out OUT (swapped?)."
        )
    _say_others(ckpt)
    if not args.stats.is_file():
        raise InvalidArgumentError(_not_a_file(args.stats))
    stats = PopulationStats.load(args.stats)
    replace, prefix = stats_replacement(ckpt, stats, prior=args.prior, adapt=args.adapt)
    unreached = [name for name, s in stats.items() if not s.reached]
    layers = sum(s.reached for s in stats.values())
    note = f"; {_plural(len(unreached), 'layer')} never reached, left as they are" if unreached else ""
    _say(f"applying {_plural(layers, 'layer')} of {args.stats} ({stats.samples} samples){note}"
         + (f" (checkpoint prefix {prefix!r})" if prefix else ""))  # fmt: skip
    if args.prior or args.adapt != "both":
        _say_adapted(args)
    _write_outputs(args, ckpt, replace)
    return EXIT_OK


def check_merge(args: argparse.Namespace) -> Any:
    from ..files import OutputPlan, real_path

    if len(args.stats) < 2:
        raise InvalidArgumentError(f"merge needs two or more statistics files, got {len(args.stats)}.")
    seen: dict[Any, Path] = {}
    for path in args.stats:
        real: Any = real_path(path)
        with contextlib.suppress(OSError):
            identity = os.stat(real)
            real = (identity.st_dev, identity.st_ino)  # the same file under two names (a hard link) too
        if real in seen:
            raise InvalidArgumentError(
                f"{str(path)!r} is given twice (as {str(seen[real])!r} too); its data would count twice. Give each "
                "file once."
            )
        seen[real] = path
    if not args.out.name.lower().endswith(".safetensors"):
        raise InvalidArgumentError(
            f"--out {str(args.out)!r}: statistics are written as safetensors; name the file *.safetensors."
        )
    plan = OutputPlan({f"STATS {i}": p for i, p in enumerate(args.stats, start=1)})
    plan.add("--out", args.out)
    return plan


def run_merge(args: argparse.Namespace) -> int:
    from .._table import format_table
    from ..population import PopulationStats

    loaded = []
    for path in args.stats:
        if not path.is_file():
            raise InvalidArgumentError(_not_a_file(path))
        loaded.append(PopulationStats.load(path))
    merged = loaded[0].merge(*loaded[1:])
    rows = [
        [
            name,
            s.layer_type,
            str(s.channels),
            " + ".join(str(p[name].count) if name in p else "–" for p in loaded),
            str(s.count),
        ]
        for name, s in merged.items()
    ]
    print(format_table(["layer", "type", "ch", "values/ch per file", "merged"], rows, right={2, 4}))
    _say(
        f"merged {_plural(len(loaded), 'file')}: {merged.samples} samples, {merged.batches} batches, "
        f"{_plural(len(merged), 'layer')}"
    )
    with args.plan.staged() as tmp:
        merged.save(tmp["--out"], format="safetensors")
    _say(f"wrote {args.out}")
    return EXIT_OK


def _forward(model: Any, batch: Any) -> Any:
    """The library's default forward, with the model's own failures explained."""
    from ..data import default_forward

    try:
        return default_forward(model, batch)
    except PreciseBNError:
        raise
    except Exception as exc:
        shape = tuple(batch.shape) if hasattr(batch, "shape") else type(batch).__name__
        raise InvalidArgumentError(
            f"the model failed on a batch of {shape} ({type(exc).__name__}: {exc}); check that --data "
            "(and the preprocessing: --image-size, --resize, --crop, --transform) give the inputs this model "
            "expects. The checkpoint was not written."
        ) from exc


def _device(text: str | None) -> Any:
    import torch

    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(text)


# --- inspect and diff --------------------------------------------------------------------------------------


def run_inspect(args: argparse.Namespace) -> int:
    from ..checkpoint import CheckpointError, load_checkpoint
    from ..health import format_health, norm_entries

    ckpt = load_checkpoint(args.checkpoint, trust=args.trust_checkpoint, key=args.key)
    _say_others(ckpt)
    entries = norm_entries(ckpt.state_dict)
    if not entries and ckpt.metadata.get("format", "").startswith("precisebn."):
        raise CheckpointError(
            f"{str(args.checkpoint)!r} is a precisebn statistics file (PopulationStats.save), not a checkpoint; "
            "inspect reads checkpoints. Read it with precisebn.PopulationStats.load(path), or write it into a "
            "checkpoint with: precisebn apply CHECKPOINT " + str(args.checkpoint) + " --out OUT"
        )
    if not entries:
        raise CheckpointError(
            f"checkpoint {str(args.checkpoint)!r} holds no normalization statistics (no '*.running_mean' with "
            "'*.running_var'); is it a model with BatchNorm layers tracking running statistics?"
        )
    table, flagged = format_health(entries, args.collapse_ratio)
    print(table)
    return EXIT_FLAGGED if args.strict and flagged else EXIT_OK


def check_diff(args: argparse.Namespace) -> Any:
    from ..files import OutputPlan

    if args.plot is None:
        return None
    require("matplotlib.figure", "plot", "--plot")
    plan = OutputPlan({"A": args.a, "B": args.b})
    plan.add("--plot", args.plot)
    return plan


def run_diff(args: argparse.Namespace) -> int:
    from ..checkpoint import CheckpointMismatchError, best_prefix, load_checkpoint
    from ..health import diff_stats, format_diff, norm_entries

    a = load_checkpoint(args.a, trust=args.trust_checkpoint, key=args.key)
    b = load_checkpoint(args.b, trust=args.trust_checkpoint, key=args.key)
    _say_others(a)
    if b.path.resolve() != a.path.resolve():
        _say_others(b)
    diff = diff_stats(a.state_dict, b.state_dict)
    if not diff.report.layers:  # a wrapper's prefix on one side (module., model.: probe 37), as apply recognises it
        for one, other, label in ((a, b, "A"), (b, a, "B")):
            prefix = best_prefix(list(one.state_dict), set(other.state_dict))
            if not prefix:
                continue
            bare = {k[len(prefix) :]: v for k, v in one.state_dict.items() if k.startswith(prefix)}
            tried = diff_stats(bare, b.state_dict) if label == "A" else diff_stats(a.state_dict, bare)
            if tried.report.layers:
                diff = tried
                _say(f"{label}'s names compared without their prefix {prefix!r}")
                break
    if not diff.report.layers:
        na, nb = len(norm_entries(a.state_dict)), len(norm_entries(b.state_dict))
        why = f" ({_plural(len(diff.mismatched), 'layer')} share a name but not their channels)"
        raise CheckpointMismatchError(
            f"{str(args.a)!r} ({_plural(na, 'normalization layer')}) and {str(args.b)!r} "
            f"({_plural(nb, 'normalization layer')}) have no layer in common"
            f"{why if diff.mismatched else ''}; diff compares two checkpoints of one model. Check the paths "
            "(a wrapper prefix such as module. makes the names differ: strip it first)."
        )
    print(format_diff(diff, str(args.a), str(args.b)))
    if args.plot:
        from ..plotting import plot_report

        with args.plan.staged() as tmp:
            title = f"{args.a.name} → {args.b.name}"
            # (the format its own extension names: the temporary file's is .tmp)
            plot_report(diff.report, tmp["--plot"], title=title, format=args.plot.suffix[1:] or "png")
        print(f"wrote {args.plot}")
    return EXIT_OK
