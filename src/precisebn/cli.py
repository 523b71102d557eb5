"""The ``precisebn`` command line: ``demo``, ``recalibrate``, ``apply``, ``merge``, ``inspect``, ``diff``.

A thin layer over the library: every command checks all its arguments first (the
output paths included) before anything is loaded, calls :mod:`precisebn` and prints.
Any error — a wrong argument, an unreadable or mismatched checkpoint, an empty image
folder, a factory that raises — is printed as one paragraph on stderr (what went
wrong, what to do) with a non-zero exit code and no output file written; ``--debug``
shows the traceback instead.

Example:
    >>> main(["--version"])  # doctest: +ELLIPSIS
    precisebn ...
    0
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._optional import require
from ._version import __version__
from .errors import InvalidArgumentError, PreciseBNError

__all__ = ["EXIT_FAILED", "EXIT_FLAGGED", "EXIT_OK", "EXIT_USAGE", "main"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_FLAGGED = 3
EXIT_INTERRUPTED = 130

_PLOT_HINT = "pass --no-plot to skip the figure"
_EXIT_CODES = f"""\
exit codes:
  {EXIT_OK}    done
  {EXIT_FAILED}    failed (unreadable or mismatched file, model or data error); nothing was written
  {EXIT_USAGE}    usage error (a wrong or conflicting argument), found before anything is loaded
  {EXIT_FLAGGED}    inspect --strict: some layer is flagged
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C); nothing was written
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or a positive integer, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a number >= 0 (e.g. 16), got {text!r}")
    return value


def _num_samples(text: str) -> int | str:
    return text if text in ("all", "auto") else _positive_int(text)


def _tolerance(text: str) -> float:
    try:
        value = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    except ValueError:
        value = -1.0
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1 such as 0.02 (or 2%), got {text!r}")
    return value


def _size_or_none(text: str) -> int:
    """A positive size, or 0 for ``none`` (the step is skipped)."""
    return 0 if text.lower() == "none" else _positive_int(text)


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) not in (1, 3) or not all(v == v and abs(v) != float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"expected 1 or 3 comma-separated numbers (e.g. 0.5,0.5,0.5), got {text!r}")
    return values


def _positive_floats(text: str) -> tuple[float, ...]:
    values = _floats(text)
    if not all(v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _layers(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer names or patterns, got {text!r}")
    return names


def _common_options() -> argparse.ArgumentParser:
    """Options every command accepts, before or after its name."""
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("common options (before or after the command)")
    group.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the full traceback on errors"
    )
    group.add_argument(
        "--quiet", "-q", action="store_true", default=argparse.SUPPRESS, help="print only warnings and errors"
    )
    group.add_argument(
        "--threads",
        type=_positive_int,
        metavar="N",
        default=argparse.SUPPRESS,
        help="CPU threads for torch (default: torch's; 1 is often fastest on a busy machine)",
    )
    return common


def _sub(sub: Any, name: str, common: argparse.ArgumentParser, help: str, description: str, example: str) -> Any:
    return sub.add_parser(
        name,
        parents=[common],
        help=help,
        description=description,
        epilog=f"example:\n  {example}\n\n{_EXIT_CODES}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    common = _common_options()
    parser = argparse.ArgumentParser(
        prog="precisebn",
        parents=[common],
        description="Exact population statistics for BatchNorm-style layers (precise BN).",
        epilog=_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"precisebn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = _sub(
        sub,
        "demo",
        common,
        "what precise statistics change, on scikit-learn's digits (CPU, ~30 s)",
        "Trains a small BatchNorm CNN on scikit-learn's digits and shows what precise statistics change: "
        "the validation curve, weight averaging, a domain shift and few-shot adaptation. Writes results.json "
        "and demo.png.",
        "precisebn demo --out precisebn-demo",
    )
    demo.add_argument("--epochs", type=_positive_int, default=12, help="training epochs (default 12)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the split, init and batch order (default 0)")
    demo.add_argument("--out", type=Path, default=Path("precisebn-demo"), help="output folder (./precisebn-demo/)")
    demo.add_argument("--no-plot", action="store_true", help="write no figure (results.json only)")
    demo.add_argument("--quick", action="store_true", help="small subset (320 training images), for tests")
    demo.set_defaults(func=_cmd_demo, check=_check_demo, parser=demo)

    rec = _sub(
        sub,
        "recalibrate",
        common,
        "recompute a checkpoint's normalization statistics exactly",
        "Loads CHECKPOINT into the model, runs precisebn.recalibrate over the data, prints the report and "
        "writes the checkpoint with the new running_mean/running_var (every alias of a shared layer "
        "included); every other tensor is copied bit for bit, in the input's format and layout.",
        "precisebn recalibrate resnet50.pth --model torchvision:resnet50 --weights IMAGENET1K_V2 "
        "--data /data/train --out resnet50-precise.pth --report report.json",
    )
    rec.add_argument(
        "checkpoint", type=Path, metavar="CHECKPOINT", help="state_dict file: .pt/.pth (torch.save) or .safetensors"
    )
    rec.add_argument(
        "--model", required=True, metavar="SPEC", help="torchvision:NAME, timm:NAME or package.module:factory"
    )
    rec.add_argument("--model-kwargs", metavar="KW", help="factory arguments: JSON or key=value,key=value")
    rec.add_argument("--data", required=True, metavar="SPEC", help="image folder or package.module:function")
    rec.add_argument("--data-kwargs", metavar="KW", help="arguments of the data function: JSON or key=value,...")
    where = rec.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, metavar="PATH", help="output checkpoint (same format as the input)")
    where.add_argument("--in-place", action="store_true", help="replace the input checkpoint (atomically)")
    rec.add_argument(
        "--num-samples",
        type=_num_samples,
        metavar="N",
        help="samples to use, 'all', or 'auto' (until precise to --tolerance; default 8192)",
    )
    rec.add_argument(
        "--tolerance",
        type=_tolerance,
        default=None,
        metavar="T",
        help="with --num-samples auto: stop once every layer's median standard error is within T (default 0.02)",
    )
    rec.add_argument("--num-batches", type=_positive_int, metavar="N", help="stop after N batches")
    rec.add_argument(
        "--layers", type=_layers, metavar="NAMES", help="only these layers: comma-separated names or glob patterns"
    )
    rec.add_argument("--mode", choices=("norm", "train"), default="norm", help="other modules in eval or train mode")
    rec.add_argument(
        "--capture",
        choices=("auto", "float64"),
        default="auto",
        help="auto: each layer's own figures where they verify against float64 (fast); "
        "float64: reduce what every layer normalises in float64 (exact, slower)",
    )
    rec.add_argument(
        "--batch-size", type=_positive_int, default=64, metavar="B", help="batch size; use the training one (64)"
    )
    rec.add_argument(
        "--prior",
        type=_non_negative_float,
        metavar="N",
        help="count the checkpoint's current statistics as N samples, pooled exactly with the new data "
        "(adapting from few samples; default: none)",
    )
    rec.add_argument(
        "--adapt",
        choices=("both", "mean", "var"),
        default="both",
        help="which statistics to write: both (default), the mean only or the variance only",
    )
    rec.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the images' random order (default 0)")
    rec.add_argument("--device", metavar="D", help="cpu, cuda, cuda:1, mps... (default: cuda if available)")
    rec.add_argument("--report", type=Path, metavar="PATH", help="save the report as JSON, with a PNG next to it")
    rec.add_argument("--trust-checkpoint", action="store_true", help="allow full unpickling (trusted files only)")
    rec.add_argument("--no-progress", action="store_true", help="no progress bar")
    img = rec.add_argument_group(
        "image folders",
        "Default preprocessing: a timm: model's data config, the --weights' transforms, else the ImageNet "
        "default (resize 256, crop 224, bilinear, ImageNet mean/std, with a warning). Options override it.",
    )
    img.add_argument("--weights", metavar="NAME", help="torchvision weights whose transforms to use (IMAGENET1K_V1)")
    img.add_argument("--image-size", type=_positive_int, metavar="S", help="crop size S; resize in proportion")
    img.add_argument("--resize", type=_size_or_none, metavar="R", help="resize the shorter side to R, or 'none'")
    img.add_argument("--crop", type=_size_or_none, metavar="C", help="centre crop to C×C, or 'none'")
    from .images import INTERPOLATIONS

    img.add_argument("--interpolation", choices=INTERPOLATIONS, help="the resize's interpolation")
    img.add_argument("--mean", type=_floats, metavar="M", help="normalisation mean, e.g. 0.5,0.5,0.5")
    img.add_argument("--std", type=_positive_floats, metavar="S", help="normalisation std, e.g. 0.25,0.25,0.25")
    img.add_argument(
        "--transform", metavar="SPEC", help="package.module:function taking a PIL image, returning a tensor"
    )
    img.add_argument("--skip-bad-images", action="store_true", help="leave out unreadable images (listed)")
    img.add_argument("--workers", type=_non_negative_int, default=0, metavar="N", help="DataLoader processes (0)")
    rec.set_defaults(func=_cmd_recalibrate, check=_check_recalibrate, parser=rec)

    app = _sub(
        sub,
        "apply",
        common,
        "write a statistics file (PopulationStats.save) into a checkpoint, without the model",
        "Replaces the running_mean/running_var of every layer in STATS (a file written by "
        "PopulationStats.save) in CHECKPOINT, checking names and shapes; a wrapper prefix (module., "
        "model.) on the checkpoint's names is recognised. Layers never reached are left as they are.",
        "precisebn apply resnet50.pth bn-stats.safetensors --out resnet50-precise.pth",
    )
    app.add_argument("checkpoint", type=Path, metavar="CHECKPOINT", help=".pt/.pth or .safetensors file")
    app.add_argument("stats", type=Path, metavar="STATS", help="statistics file (.safetensors)")
    where = app.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, metavar="PATH", help="output checkpoint (same format as the input)")
    where.add_argument("--in-place", action="store_true", help="replace the input checkpoint (atomically)")
    app.add_argument(
        "--prior",
        type=_non_negative_float,
        metavar="N",
        help="count the checkpoint's current statistics as N samples, pooled exactly with the file's (default: none)",
    )
    app.add_argument(
        "--adapt",
        choices=("both", "mean", "var"),
        default="both",
        help="which statistics to write: both (default), the mean only or the variance only",
    )
    app.add_argument("--trust-checkpoint", action="store_true", help="allow full unpickling (trusted files only)")
    app.set_defaults(func=_cmd_apply, check=_check_apply, parser=app)

    mrg = _sub(
        sub,
        "merge",
        common,
        "combine statistics files of disjoint data exactly (shards, separate jobs)",
        "Merges statistics files written by PopulationStats.save, measured on disjoint data (shards measured "
        "by separate jobs, a job adding data), into one: per layer, counts add and the mean and variance are "
        "pooled exactly in float64, as if measured on all the data at once. A layer in only some files keeps "
        "theirs; channel counts must agree. Giving the same file twice is refused (it would count twice).",
        "precisebn merge shard0.safetensors shard1.safetensors --out all.safetensors",
    )
    mrg.add_argument("stats", type=Path, nargs="+", metavar="STATS", help="statistics files (.safetensors), 2 or more")
    mrg.add_argument("--out", type=Path, required=True, metavar="PATH", help="the merged statistics (.safetensors)")
    mrg.set_defaults(func=_cmd_merge, check=_check_merge, parser=mrg)

    ins = _sub(
        sub,
        "inspect",
        common,
        "every normalization layer's statistics in a checkpoint, with health flags",
        "Prints every normalization layer's stored statistics with health flags: non-finite, var<=0, "
        "collapsed, never updated.",
        "precisebn inspect resnet50.pth --strict",
    )
    ins.add_argument("checkpoint", type=Path, metavar="CHECKPOINT", help=".pt/.pth or .safetensors file")
    ins.add_argument(
        "--collapse-ratio", type=float, default=1e-4, metavar="R", help="'collapsed': var < ratio × layer median"
    )
    ins.add_argument("--strict", action="store_true", help=f"exit with {EXIT_FLAGGED} when any layer is flagged")
    ins.add_argument("--trust-checkpoint", action="store_true", help="allow full unpickling (trusted files only)")
    ins.set_defaults(func=_cmd_inspect, check=None, parser=ins)

    diff = _sub(
        sub,
        "diff",
        common,
        "per-layer comparison of two checkpoints' statistics",
        "Compares the normalization statistics of two checkpoints of one model, layer by layer, and counts "
        "the other tensors that are identical (same dtype, shape and values). Refuses checkpoints with no "
        "layer in common.",
        "precisebn diff resnet50.pth resnet50-precise.pth --plot diff.png",
    )
    diff.add_argument("a", type=Path, metavar="A")
    diff.add_argument("b", type=Path, metavar="B")
    diff.add_argument("--plot", type=Path, metavar="PATH", help="save a PNG of the per-layer shifts")
    diff.add_argument("--trust-checkpoint", action="store_true", help="allow full unpickling (trusted files only)")
    diff.set_defaults(func=_cmd_diff, check=_check_diff, parser=diff)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit code (0 done, 1 failed, 2 usage, 3 flagged, 130 interrupted)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors (already printed)
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_USAGE
    debug, quiet = getattr(args, "debug", False), getattr(args, "quiet", False)
    with _warnings_as_notes(), _quiet(quiet), _threads(getattr(args, "threads", None)):
        try:
            if args.check is not None:
                args.plan = args.check(args)
        except InvalidArgumentError as exc:  # found before anything was loaded: a usage error
            if debug:
                raise
            args.parser.print_usage(sys.stderr)
            print(_error_paragraph(args.command, exc), file=sys.stderr)
            return EXIT_USAGE
        except Exception as exc:
            if debug:
                raise
            print(_error_paragraph(args.command, exc), file=sys.stderr)
            return EXIT_FAILED
        try:
            return int(args.func(args))
        except KeyboardInterrupt:
            print("precisebn: interrupted; no output was written.", file=sys.stderr)
            return EXIT_INTERRUPTED
        except Exception as exc:
            if debug:
                raise
            print(_error_paragraph(args.command, exc), file=sys.stderr)
            return EXIT_FAILED


def _error_paragraph(command: str, exc: Exception) -> str:
    if isinstance(exc, PreciseBNError):
        text = str(exc)
    elif isinstance(exc, OSError):
        what = f"{exc.strerror or exc}" + (f": {exc.filename!r}" if exc.filename else "")
        text = f"{what}. Check the path and its permissions (and free disk space); nothing was written."
    else:
        text = (
            f"unexpected {type(exc).__name__}: {exc}. Nothing was written; run again with "
            "`precisebn --debug ...` for the traceback."
        )
    return f"precisebn {command}: error: " + " ".join(text.split())


@contextlib.contextmanager
def _warnings_as_notes() -> Iterator[None]:
    def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        print(f"precisebn: warning: {message}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        yield


@contextlib.contextmanager
def _quiet(on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    if n is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _say(text: str) -> None:
    print(text, flush=True)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


# --- demo --------------------------------------------------------------------------------------------------


def _check_demo(args: argparse.Namespace) -> Any:
    from .files import OutputPlan

    if not args.no_plot:
        require("matplotlib.figure", "plot", f"the demo's figure ({_PLOT_HINT})")
    plan = OutputPlan()
    plan.add("results.json", args.out / "results.json")
    if not args.no_plot:
        plan.add("demo.png", args.out / "demo.png")
    return plan


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, format_results, run_demo

    start = time.perf_counter()
    config = DemoConfig(epochs=args.epochs, seed=args.seed, quick=args.quick)
    print(
        f"precisebn demo: a small BatchNorm CNN on scikit-learn's digits, {config.epochs} epochs, "
        f"seed {config.seed}, CPU ({config.threads} thread){', quick subset' if config.quick else ''}",
        flush=True,
    )
    results = run_demo(config, log=lambda line: print(line, file=sys.stderr, flush=True))
    print()
    print(format_results(results))
    with args.plan.staged() as tmp:  # both files, or neither
        tmp["results.json"].write_text(json.dumps(results, indent=1) + "\n")
        if not args.no_plot:
            from .plotting import plot_demo

            plot_demo(results, tmp["demo.png"])
    print(f"\nwall time {time.perf_counter() - start:.1f} s (training and measuring {results['wall_seconds']:.1f} s)")
    print(f"numbers: {(args.out / 'results.json').resolve()}")
    if not args.no_plot:
        print(f"figure:  {(args.out / 'demo.png').resolve()}")
    return EXIT_OK


# --- recalibrate and apply ---------------------------------------------------------------------------------


def _plan_checkpoint_output(args: argparse.Namespace, inputs: dict[str, Path]) -> Any:
    """The output plan of a command that writes a checkpoint: ``--out`` or ``--in-place``."""
    from .checkpoint import checkpoint_format
    from .files import OutputPlan

    plan = OutputPlan(inputs)
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


def _check_recalibrate(args: argparse.Namespace) -> Any:
    from .specs import parse_kwargs

    plan = _plan_checkpoint_output(args, {"CHECKPOINT": args.checkpoint})
    if args.report is not None:
        if args.report.suffix.lower() == ".png":
            raise InvalidArgumentError(
                "--report takes the JSON file's path (e.g. report.json); the PNG goes next to it."
            )
        plan.add("--report", args.report)
        plan.add("--report's PNG", args.report.with_suffix(".png"))
        require("matplotlib.figure", "plot", "--report's PNG")
    _check_device(args.device)
    if args.tolerance is not None and args.num_samples != "auto":
        raise InvalidArgumentError("--tolerance goes with --num-samples auto; pass both.")
    args.model_kwargs_parsed = parse_kwargs(args.model_kwargs)
    args.data_kwargs_parsed = parse_kwargs(args.data_kwargs, "--data-kwargs")
    model_source = args.model.partition(":")[0]
    if args.weights and model_source != "torchvision":
        raise InvalidArgumentError(
            f"--weights names torchvision weights, for a torchvision:NAME model (not {args.model!r}); a timm: "
            "model uses its own data config, and explicit options (--resize, --crop, --mean...) set the rest."
        )
    if args.weights:  # the name is checked now, without loading anything
        from .images import torchvision_weights

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
    if is_function and (explicit or args.transform or args.weights or args.skip_bad_images):
        options = explicit + ["--transform"] * bool(args.transform) + ["--weights"] * bool(args.weights)
        options += ["--skip-bad-images"] * bool(args.skip_bad_images)
        raise InvalidArgumentError(
            f"{', '.join(options)} apply only to an image folder, but --data {args.data!r} names a data "
            "function, which prepares its own batches."
        )
    return plan


def _layer_selection(patterns: list[str] | None) -> Any:
    if not patterns:
        return None
    if not any(ch in p for p in patterns for ch in "*?["):
        return patterns  # exact names: the library suggests close matches for typos
    import fnmatch

    return lambda name, module: any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _cmd_recalibrate(args: argparse.Namespace) -> int:
    from . import recalibrate
    from .checkpoint import buffer_names, load_checkpoint, load_into
    from .images import resolve_preprocessing
    from .specs import resolve_data, resolve_model

    device = _device(args.device)
    if args.trust_checkpoint:
        print("precisebn: warning: --trust-checkpoint unpickles the file; that can run any code.", file=sys.stderr)
    ckpt = load_checkpoint(args.checkpoint, trust=args.trust_checkpoint)
    model = resolve_model(args.model, args.model_kwargs_parsed)
    prefix = load_into(model, ckpt)
    model.to(device)

    preprocessing = None
    skipped: list[str] | None = [] if args.skip_bad_images else None
    if Path(args.data).is_dir():
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
    data, available = resolve_data(
        args.data,
        batch_size=args.batch_size,
        preprocessing=preprocessing,
        workers=args.workers,
        seed=args.seed,
        kwargs=args.data_kwargs_parsed,
        skipped=skipped,
    )
    num_samples = args.num_samples
    if available is not None and isinstance(num_samples, int) and available < num_samples:
        _say(f"precisebn: using every image of {args.data} ({_plural(available, 'image')}, fewer than "
             f"--num-samples {num_samples})")  # fmt: skip
        num_samples = "all"
    progress = not args.no_progress and not getattr(args, "quiet", False)
    progress = progress and importlib.util.find_spec("tqdm") is not None
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
        layers=_layer_selection(args.layers),
        device=device,
        progress=progress,
        forward=_forward,
    )
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
    names = buffer_names(model, report.updated, ("running_mean", "running_var"), prefix)
    replace = {ckpt_name: state[name].detach().cpu() for ckpt_name, name in names.items()}
    _write_outputs(args, ckpt, replace, report=report, extra=extra)
    return EXIT_OK


def _say_adapted(args: argparse.Namespace) -> None:
    what = {"both": "mean and variance", "mean": "the mean only", "var": "the variance only"}[args.adapt]
    prior = f"pooled with the checkpoint's statistics counted as {args.prior:g} samples" if args.prior else ""
    _say(f"adapted: {what}{', ' if prior else ''}{prior}")


def _write_outputs(
    args: argparse.Namespace, ckpt: Any, replace: dict[str, Any], *, report: Any = None, extra: Any = None
) -> None:
    """Stages the checkpoint (checked by reloading it) and the report's files, then commits them together."""
    from .checkpoint import verify_written, write_checkpoint

    label = "--in-place" if args.in_place else "--out"
    with args.plan.staged() as tmp:
        write_checkpoint(ckpt, replace, tmp[label])
        verify_written(ckpt, replace, tmp[label], trust=args.trust_checkpoint)
        if getattr(args, "report", None) is not None:
            from .plotting import plot_report

            tmp["--report"].write_text(json.dumps({**report.to_dict(), **(extra or {})}, indent=1) + "\n")
            plot_report(report, tmp["--report's PNG"], title=f"precisebn: {args.checkpoint.name}")
    written = [text for text, _ in args.plan.outputs.values()]
    _say(f"wrote {', '.join(written[:-1])}{' and ' if len(written) > 1 else ''}{written[-1]}")


def _check_apply(args: argparse.Namespace) -> Any:
    return _plan_checkpoint_output(args, {"CHECKPOINT": args.checkpoint, "STATS": args.stats})


def _cmd_apply(args: argparse.Namespace) -> int:
    from .checkpoint import load_checkpoint, stats_replacement
    from .population import PopulationStats

    if args.trust_checkpoint:
        print("precisebn: warning: --trust-checkpoint unpickles the file; that can run any code.", file=sys.stderr)
    ckpt = load_checkpoint(args.checkpoint, trust=args.trust_checkpoint)
    if not args.stats.is_file():
        raise InvalidArgumentError(f"statistics file {str(args.stats)!r} does not exist; check the path.")
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


def _check_merge(args: argparse.Namespace) -> Any:
    from .files import OutputPlan, real_path

    if len(args.stats) < 2:
        raise InvalidArgumentError(f"merge needs two or more statistics files, got {len(args.stats)}.")
    seen: dict[Path, Path] = {}
    for path in args.stats:
        real = real_path(path)
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


def _cmd_merge(args: argparse.Namespace) -> int:
    from ._table import format_table
    from .population import PopulationStats

    loaded = []
    for path in args.stats:
        if not path.is_file():
            raise InvalidArgumentError(f"statistics file {str(path)!r} does not exist; check the path.")
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
    from .data import default_forward

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


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .checkpoint import CheckpointError, load_checkpoint
    from .health import format_health, norm_entries

    ckpt = load_checkpoint(args.checkpoint, trust=args.trust_checkpoint)
    entries = norm_entries(ckpt.state_dict)
    if not entries:
        raise CheckpointError(
            f"checkpoint {str(args.checkpoint)!r} holds no normalization statistics (no '*.running_mean' with "
            "'*.running_var'); is it a model with BatchNorm layers tracking running statistics?"
        )
    table, flagged = format_health(entries, args.collapse_ratio)
    print(table)
    return EXIT_FLAGGED if args.strict and flagged else EXIT_OK


def _check_diff(args: argparse.Namespace) -> Any:
    from .files import OutputPlan

    if args.plot is None:
        return None
    require("matplotlib.figure", "plot", "--plot")
    plan = OutputPlan({"A": args.a, "B": args.b})
    plan.add("--plot", args.plot)
    return plan


def _cmd_diff(args: argparse.Namespace) -> int:
    from .checkpoint import CheckpointMismatchError, load_checkpoint
    from .health import diff_stats, format_diff, norm_entries

    a = load_checkpoint(args.a, trust=args.trust_checkpoint)
    b = load_checkpoint(args.b, trust=args.trust_checkpoint)
    diff = diff_stats(a.state_dict, b.state_dict)
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
        from .plotting import plot_report

        with args.plan.staged() as tmp:
            plot_report(diff.report, tmp["--plot"], title=f"{args.a.name} → {args.b.name}")
        print(f"wrote {args.plot}")
    return EXIT_OK
