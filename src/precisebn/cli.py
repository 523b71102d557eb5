"""The ``precisebn`` command line: ``demo``, ``recalibrate``, ``inspect``, ``diff``.

A thin layer over the library: every command parses its arguments, calls
:mod:`precisebn` and prints. Any error — a wrong argument, an unreadable or
mismatched checkpoint, an empty image folder, a factory that raises — is printed as
one paragraph on stderr (what went wrong, what to do) with a non-zero exit code and
no output file left behind; ``--debug`` shows the traceback instead.

Example:
    >>> main(["--version"])  # doctest: +ELLIPSIS
    precisebn ...
    0
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._optional import require
from ._version import __version__
from .errors import PreciseBNError

__all__ = ["main"]

_PLOT_HINT = "pass --no-plot to skip the figure"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _num_samples(text: str) -> int | str:
    return "all" if text == "all" else _positive_int(text)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="precisebn",
        description="Exact population statistics for BatchNorm-style layers (precise BN).",
    )
    parser.add_argument("--version", action="version", version=f"precisebn {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="what precise statistics change, on scikit-learn's digits (CPU, ~15 s)")
    demo.add_argument("--epochs", type=_positive_int, default=12, help="training epochs (default 12)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the split, init and batch order (default 0)")
    demo.add_argument("--out", type=Path, default=Path("precisebn-demo"), help="output folder (./precisebn-demo/)")
    demo.add_argument("--no-plot", action="store_true", help="write no figure (results.json only)")
    demo.add_argument("--quick", action="store_true", help="small subset (320 training images), for tests")
    demo.set_defaults(func=_cmd_demo)

    rec = sub.add_parser("recalibrate", help="recompute a checkpoint's normalization statistics exactly")
    rec.add_argument(
        "checkpoint", type=Path, metavar="CHECKPOINT", help="state_dict file: .pt/.pth (torch.save) or .safetensors"
    )
    rec.add_argument("--model", required=True, metavar="SPEC", help="torchvision:NAME or package.module:factory")
    rec.add_argument("--model-kwargs", metavar="KW", help="factory arguments: JSON or key=value,key=value")
    rec.add_argument("--data", required=True, metavar="SPEC", help="image folder or package.module:function")
    rec.add_argument("--data-kwargs", metavar="KW", help="arguments of the data function: JSON or key=value,...")
    where = rec.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, metavar="PATH", help="output checkpoint (same format as the input)")
    where.add_argument("--in-place", action="store_true", help="replace the input checkpoint (atomically)")
    rec.add_argument("--num-samples", type=_num_samples, metavar="N", help="samples to use, or 'all' (default 8192)")
    rec.add_argument("--mode", choices=("norm", "train"), default="norm", help="other modules in eval or train mode")
    rec.add_argument(
        "--batch-size",
        type=_positive_int,
        default=64,
        metavar="B",
        help="batch size; use the training one (default 64)",
    )
    rec.add_argument(
        "--image-size", type=_positive_int, default=224, metavar="S", help="image folders: crop size (224)"
    )
    rec.add_argument("--workers", type=int, default=0, metavar="N", help="image folders: DataLoader processes (0)")
    rec.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the images' random order (default 0)")
    rec.add_argument("--device", metavar="D", help="cpu, cuda, cuda:1, mps... (default: cuda if available)")
    rec.add_argument("--report", type=Path, metavar="PATH", help="save the report as JSON, with a PNG next to it")
    rec.add_argument("--trust-checkpoint", action="store_true", help="allow full unpickling (trusted files only)")
    rec.add_argument("--no-progress", action="store_true", help="no progress bar")
    rec.set_defaults(func=_cmd_recalibrate)

    ins = sub.add_parser("inspect", help="every normalization layer's statistics in a checkpoint, with health flags")
    ins.add_argument("checkpoint", type=Path, metavar="CHECKPOINT", help=".pt/.pth or .safetensors file")
    ins.add_argument(
        "--collapse-ratio", type=float, default=1e-4, metavar="R", help="'collapsed': var < ratio × layer median"
    )
    ins.add_argument("--strict", action="store_true", help="exit with 1 when any layer is flagged")
    ins.add_argument("--trust-checkpoint", action="store_true", help="allow full unpickling (trusted files only)")
    ins.set_defaults(func=_cmd_inspect)

    diff = sub.add_parser("diff", help="per-layer comparison of two checkpoints' statistics")
    diff.add_argument("a", type=Path, metavar="A")
    diff.add_argument("b", type=Path, metavar="B")
    diff.add_argument("--plot", type=Path, metavar="PATH", help="save a PNG of the per-layer shifts")
    diff.add_argument("--trust-checkpoint", action="store_true", help="allow full unpickling (trusted files only)")
    diff.set_defaults(func=_cmd_diff)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit code (0 success, 1 error, 2 usage)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors (already printed)
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    with _warnings_as_notes():
        try:
            return int(args.func(args))
        except KeyboardInterrupt:
            print("precisebn: interrupted; no output was written.", file=sys.stderr)
            return 130
        except Exception as exc:
            if args.debug:
                raise
            print(_error_paragraph(args.command, exc), file=sys.stderr)
            return 1


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
        warnings.showwarning = show
        yield


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, format_results, run_demo
    from .files import atomic_path

    start = time.perf_counter()
    if not args.no_plot:
        require("matplotlib.figure", "plot", f"the demo's figure ({_PLOT_HINT})")
    config = DemoConfig(epochs=args.epochs, seed=args.seed, quick=args.quick)
    print(
        f"precisebn demo: a small BatchNorm CNN on scikit-learn's digits, {config.epochs} epochs, "
        f"seed {config.seed}, CPU ({config.threads} thread){', quick subset' if config.quick else ''}",
        flush=True,
    )
    results = run_demo(config, log=lambda line: print(line, file=sys.stderr, flush=True))
    print()
    print(format_results(results))
    with contextlib.ExitStack() as stack:  # both files, or neither
        stack.enter_context(atomic_path(args.out / "results.json")).write_text(json.dumps(results, indent=1) + "\n")
        if not args.no_plot:
            from .plotting import plot_demo

            plot_demo(results, stack.enter_context(atomic_path(args.out / "demo.png")))
    print(f"\nwall time {time.perf_counter() - start:.1f} s (training and measuring {results['wall_seconds']:.1f} s)")
    print(f"numbers: {(args.out / 'results.json').resolve()}")
    if not args.no_plot:
        print(f"figure:  {(args.out / 'demo.png').resolve()}")
    return 0


def _cmd_recalibrate(args: argparse.Namespace) -> int:
    import torch

    from . import recalibrate
    from .checkpoint import checkpoint_format, load_checkpoint, load_into, save_checkpoint
    from .errors import InvalidArgumentError
    from .files import atomic_path
    from .recalibrate import DEFAULT_NUM_SAMPLES
    from .specs import parse_kwargs, resolve_data, resolve_model

    out: Path = args.checkpoint if args.in_place else args.out
    if not args.in_place and args.checkpoint.exists() and out.exists() and out.samefile(args.checkpoint):
        raise InvalidArgumentError(
            f"--out {str(out)!r} is the input checkpoint; write elsewhere, or pass --in-place to replace it."
        )
    if checkpoint_format(out) != checkpoint_format(args.checkpoint):
        raise InvalidArgumentError(
            f"--out {str(out)!r} would be {checkpoint_format(out)} but the input "
            f"is {checkpoint_format(args.checkpoint)}; "
            "the output keeps the input's format, so give it the same kind of extension (.safetensors or .pt/.pth)."
        )
    png = args.report.with_suffix(".png") if args.report else None
    if args.report and png == args.report:
        raise InvalidArgumentError("--report takes the JSON file's path (e.g. report.json); the PNG goes next to it.")
    if args.report:
        require("matplotlib.figure", "plot", "--report's PNG")
    device = _device(args.device)
    model_kwargs = parse_kwargs(args.model_kwargs)
    data_kwargs = parse_kwargs(args.data_kwargs, "--data-kwargs")

    if args.trust_checkpoint:
        print("precisebn: warning: --trust-checkpoint unpickles the file; that can run any code.", file=sys.stderr)
    ckpt = load_checkpoint(args.checkpoint, trust=args.trust_checkpoint)
    model = resolve_model(args.model, model_kwargs)
    prefix = load_into(model, ckpt)
    model.to(device)
    data, available = resolve_data(
        args.data,
        batch_size=args.batch_size,
        image_size=args.image_size,
        workers=args.workers,
        seed=args.seed,
        kwargs=data_kwargs,
    )
    num_samples = args.num_samples or DEFAULT_NUM_SAMPLES
    if available is not None and num_samples != "all" and available < num_samples:
        print(f"precisebn: using all {available} images of {args.data} (fewer than --num-samples {num_samples})")
        num_samples = "all"
    progress = not args.no_progress and importlib.util.find_spec("tqdm") is not None
    report = recalibrate(
        model, data, num_samples=num_samples, mode=args.mode, device=device, progress=progress, forward=_forward
    )
    print(report)

    modules = dict(model.named_modules())
    replace = {}
    for name in report.updated:
        for buffer in ("running_mean", "running_var"):
            key = f"{name}.{buffer}" if name else buffer
            replace[prefix + key] = getattr(modules[name], buffer).to(torch.device("cpu"))
    with contextlib.ExitStack() as stack:  # every file, or none
        if args.report:
            json_tmp = stack.enter_context(atomic_path(args.report))
            json_tmp.write_text(json.dumps(report.to_dict(), indent=1) + "\n")
            from .plotting import plot_report

            plot_report(report, stack.enter_context(atomic_path(png)), title=f"precisebn: {args.checkpoint.name}")
        save_checkpoint(ckpt, replace, out)
    print(f"wrote {out}" + (f", {args.report} and {png}" if args.report else ""))
    return 0


def _forward(model: Any, batch: Any) -> Any:
    """The library's default forward, with the model's own failures explained."""
    from .data import default_forward
    from .errors import InvalidArgumentError

    try:
        return default_forward(model, batch)
    except PreciseBNError:
        raise
    except Exception as exc:
        shape = tuple(batch.shape) if hasattr(batch, "shape") else type(batch).__name__
        raise InvalidArgumentError(
            f"the model failed on a batch of {shape} ({type(exc).__name__}: {exc}); check that --data "
            "(and --image-size) give the inputs this model expects. The checkpoint was not written."
        ) from exc


def _device(text: str | None) -> Any:
    import torch

    from .errors import InvalidArgumentError

    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise InvalidArgumentError(f"--device {text!r} is not a device; use cpu, cuda, cuda:1, mps...") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(f"--device {text!r}: CUDA is not available on this machine; use --device cpu.")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidArgumentError(f"--device {text!r}: MPS is not available on this machine; use --device cpu.")
    return device


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
    return 1 if args.strict and flagged else 0


def _cmd_diff(args: argparse.Namespace) -> int:
    from .checkpoint import load_checkpoint
    from .errors import InvalidArgumentError
    from .health import diff_stats, format_diff

    if args.plot:
        require("matplotlib.figure", "plot", "--plot")
    a = load_checkpoint(args.a, trust=args.trust_checkpoint)
    b = load_checkpoint(args.b, trust=args.trust_checkpoint)
    diff = diff_stats(a.state_dict, b.state_dict)
    print(format_diff(diff, str(args.a), str(args.b)))
    if args.plot:
        if not diff.report.layers:
            raise InvalidArgumentError("no layer is in both checkpoints with the same channels, so nothing to plot.")
        from .plotting import plot_report

        plot_report(diff.report, args.plot, title=f"{args.a.name} → {args.b.name}")
        print(f"wrote {args.plot}")
    return 0
