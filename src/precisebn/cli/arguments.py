"""The ``precisebn`` command line's arguments: their types and the parser of every command."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._version import __version__
from . import commands

__all__ = ["build_parser"]

_EXIT_CODES = f"""\
exit codes:
  {commands.EXIT_OK}    done
  {commands.EXIT_FAILED}    failed (unreadable or mismatched file, model or data error); nothing was written
  {commands.EXIT_USAGE}    usage error (a wrong or conflicting argument), found before anything is loaded
  {commands.EXIT_FLAGGED}    inspect --strict: some layer is flagged
  {commands.EXIT_INTERRUPTED}  interrupted (Ctrl-C); nothing was written
"""


KEY_HELP = (
    "the key of the state_dict in the checkpoint's dict, e.g. state_dict_ema for timm's EMA weights "
    "(default: the file itself, else its 'state_dict' or 'model'); the others are left as they are"
)


def _number(text: str, convert: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Any:
    """``convert(text)`` if it parses and passes ``ok``, else the argparse error "expected ..."."""
    try:
        value = convert(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return int(_number(text, int, lambda v: v >= 1, "a positive integer"))


def _non_negative_int(text: str) -> int:
    return int(_number(text, int, lambda v: v >= 0, "0 or a positive integer"))


def _non_negative_float(text: str) -> float:
    return float(_number(text, float, lambda v: 0 <= v < float("inf"), "a number >= 0 (e.g. 16)"))


def _positive_float(text: str) -> float:
    return float(_number(text, float, lambda v: 0 < v < float("inf"), "a number > 0 (e.g. 1e-4)"))


def _seed(text: str) -> int:
    return int(_number(text, int, lambda v: 0 <= v < 2**32, "a seed from 0 to 2**32 - 1"))


def _num_samples(text: str) -> int | str:
    if text in ("all", "auto"):
        return text
    return int(_number(text, int, lambda v: v >= 1, "a positive integer, all or auto"))


def _tolerance(text: str) -> float:
    def fraction(t: str) -> float:
        return float(t.rstrip("%")) / (100 if t.endswith("%") else 1)

    return float(_number(text, fraction, lambda v: 0 < v < 1, "a number between 0 and 1 such as 0.02 (or 2%)"))


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
        help="CPU threads for torch (default: torch's, but 1 for demo, whose figures are measured so; 1 is often "
        "fastest on a busy machine)",
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


def _file_path(text: str) -> Path:
    """An output file's path; one ending with a slash, ``.`` or ``..`` names a folder (``Path`` would drop it)."""
    if text.endswith(("/", os.sep)) or os.path.basename(text.rstrip("/" + os.sep)) in (".", ".."):
        why = "it ends with a slash" if text.endswith(("/", os.sep)) else "'.' and '..' are folders"
        raise argparse.ArgumentTypeError(f"{text!r} names a folder ({why}); give a file path")
    return Path(text)


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
    demo.add_argument("--seed", type=_seed, default=0, help="seed of the split, init and batch order (default 0)")
    demo.add_argument("--out", type=Path, default=Path("precisebn-demo"), help="output folder (./precisebn-demo/)")
    demo.add_argument("--no-plot", action="store_true", help="write no figure (results.json only)")
    demo.add_argument("--quick", action="store_true", help="small subset (320 training images), for tests")
    demo.set_defaults(func=commands.run_demo, check=commands.check_demo, parser=demo)

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
    where.add_argument("--out", type=_file_path, metavar="PATH", help="output checkpoint (same format as the input)")
    where.add_argument("--in-place", action="store_true", help="replace the input checkpoint (atomically)")
    rec.add_argument(
        "--num-samples",
        type=_num_samples,
        metavar="N",
        help="samples to use, 'all', or 'auto' (until precise to --tolerance; default 8192, unless --num-batches "
        "is given alone)",
    )
    rec.add_argument(
        "--tolerance",
        type=_tolerance,
        default=None,
        metavar="T",
        help="with --num-samples auto: stop once every layer's median standard error is within T (default 0.02)",
    )
    rec.add_argument(
        "--num-batches",
        type=_positive_int,
        metavar="N",
        help="stop after N batches (with --num-samples: the first limit reached)",
    )
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
        "--batch-size", type=_positive_int, metavar="B", help="batch size; use the training one (default 64)"
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
    rec.add_argument("--seed", type=_seed, metavar="S", help="seed of the images' random order (default 0)")
    rec.add_argument("--device", metavar="D", help="cpu, cuda, cuda:1, mps... (default: cuda if available)")
    rec.add_argument("--report", type=_file_path, metavar="PATH", help="save the report as JSON, with a PNG next to it")
    rec.add_argument("--trust-checkpoint", action="store_true", help="allow full unpickling (trusted files only)")
    rec.add_argument("--key", metavar="K", help=KEY_HELP)
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
    from ..images import INTERPOLATIONS

    img.add_argument("--interpolation", choices=INTERPOLATIONS, help="the resize's interpolation")
    img.add_argument("--mean", type=_floats, metavar="M", help="normalisation mean, e.g. 0.5,0.5,0.5")
    img.add_argument("--std", type=_positive_floats, metavar="S", help="normalisation std, e.g. 0.25,0.25,0.25")
    img.add_argument(
        "--transform", metavar="SPEC", help="package.module:function taking a PIL image, returning a tensor"
    )
    img.add_argument("--skip-bad-images", action="store_true", help="leave out unreadable images (listed)")
    img.add_argument("--workers", type=_non_negative_int, metavar="N", help="DataLoader processes (default 0)")
    rec.set_defaults(func=commands.run_recalibrate, check=commands.check_recalibrate, parser=rec)

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
    where.add_argument("--out", type=_file_path, metavar="PATH", help="output checkpoint (same format as the input)")
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
    app.add_argument("--key", metavar="K", help=KEY_HELP)
    app.set_defaults(func=commands.run_apply, check=commands.check_apply, parser=app)

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
    mrg.add_argument(
        "--out", type=_file_path, required=True, metavar="PATH", help="the merged statistics (.safetensors)"
    )
    mrg.set_defaults(func=commands.run_merge, check=commands.check_merge, parser=mrg)

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
        "--collapse-ratio",
        type=_positive_float,
        default=1e-4,
        metavar="R",
        help="'collapsed': var < ratio × layer median",
    )
    ins.add_argument(
        "--strict", action="store_true", help=f"exit with {commands.EXIT_FLAGGED} when any layer is flagged"
    )
    ins.add_argument("--trust-checkpoint", action="store_true", help="allow full unpickling (trusted files only)")
    ins.add_argument("--key", metavar="K", help=KEY_HELP)
    ins.set_defaults(func=commands.run_inspect, check=None, parser=ins)

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
    diff.add_argument(
        "--plot", type=_file_path, metavar="PATH", help="save a figure of the per-layer shifts (PNG, or .pdf, .svg...)"
    )
    diff.add_argument("--trust-checkpoint", action="store_true", help="allow full unpickling (trusted files only)")
    diff.add_argument("--key", metavar="K", help=KEY_HELP + " (in both files)")
    diff.set_defaults(func=commands.run_diff, check=commands.check_diff, parser=diff)
    return parser
