"""Writes README.md's Performance section (between its performance markers) from the
latest results in benchmarks/results/.

    python -m benchmarks.readme     # after python -m benchmarks.run / benchmarks.quality

``python -m benchmarks.run`` calls it at the end of a full run. Only the text between
``<!-- performance:start -->`` and ``<!-- performance:end -->`` is replaced; the file is
re-read just before writing, so edits to other sections are kept.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from . import common

START, END = "<!-- performance:start -->", "<!-- performance:end -->"
README = common.ROOT / "README.md"
SHOW = ("precisebn norm", "precisebn train", "fvcore", "torch update_bn")
QUALITY_SAMPLES = (256, 1024, 4096, 16384)


def _load(name: str) -> dict[str, Any] | None:
    path = common.RESULTS / name
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _cost_table(res: dict[str, Any]) -> list[str]:
    cases = res["cases"]
    tools = [t for t in SHOW if cases and t in cases[0]["tools"]]
    aa = [c["tools"]["floor (A/A)"]["ratio_median"] for c in cases if "floor (A/A)" in c["tools"]]
    from .run import PROJECT_BATCHES, targets

    lines = [
        "| model | input (N×…) × batches | floor ms/batch | "
        + " | ".join(tools)
        + f" | precisebn norm, projected to {PROJECT_BATCHES} batches |",
        "|---|---|---:|" + "---:|" * (len(tools) + 1),
    ]
    for c in cases:
        cells = [f"{c['tools'][t]['ratio_median']:.3f}" for t in tools]
        proj = c["tools"].get("precisebn norm", {}).get("projected_ratio_200")
        lines.append(
            f"| {c['model']} | {c['input']} × {c['num_batches']} | {c['floor']['ms_per_batch']:.1f} | "
            + " | ".join(cells)
            + f" | {'–' if proj is None else f'{proj:.3f}'} |"
        )
    lines += [
        "",
        f"Time ÷ floor, medians of {res['rounds']} rounds"
        + (f"; A/A (floor ÷ floor) medians {min(aa):.3f}–{max(aa):.3f}" if aa else "")
        + f". {common.describe_machine(res['machine'])}. Spread, samples/s, peak memory, statistics errors and"
        " the fixed/per-batch split: [`benchmarks/results/"
        + ("results.md" if res["device"] == "cpu" else "results-cuda.md")
        + "`](benchmarks/results/"
        + ("results.md" if res["device"] == "cpu" else "results-cuda.md")
        + ").",
        "",
        *targets(res),
    ]
    return lines


def _quality_table(q: dict[str, Any]) -> list[str]:
    def _pct(x: float) -> str:
        from .quality import _pct as pct

        return "<0.001%" if x < 1e-5 else pct(x)

    rows = [r for r in q["rows"] if r["samples"] in QUALITY_SAMPLES or r["samples"] == q["data_size"]]
    lines = [
        "| batch | samples | first layer: precisebn | first layer: mean of batch variances "
        "| all layers: precisebn | all layers: mean of batch variances |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        a, b = r["precisebn"], r["mean of batch variances"]
        lines.append(
            f"| {r['batch_size']} | {r['samples']} | {_pct(a['bn1_median'])} | {_pct(b['bn1_median'])} | "
            f"{_pct(a['all_median'])} | {_pct(b['all_median'])} |"
        )
    return lines


def render() -> str:
    cpu = _load("results.json")
    cuda = _load("results-cuda.json")
    quality = _load("quality.json")
    out = [
        "## Performance",
        "",
        "Recalibration is forward passes plus bookkeeping. The forward passes are the floor no tool can go under,",
        "so the measure of precisebn's cost is its time divided by the time of the same forward passes without it",
        "(under `no_grad`, BatchNorm layers in training mode, nothing kept), measured side by side in one process",
        "on the same batches: every run sits between two floor runs, tools alternate, rounds repeat, medians are",
        "reported; an A/A run (the floor timed as if it were a tool) shows the harness's own noise.",
        "",
    ]
    for res, title in ((cpu, "CPU, one thread"), (cuda, "CUDA")):
        if res is None:
            continue
        out += [f"### Cost ({title})", "", *_cost_table(res), ""]
    if cpu is None and cuda is None:
        out += [
            "### Cost",
            "",
            "Not measured yet on a quiet machine: run `make bench` (see below); it writes the table here.",
            "",
        ]
    if quality is not None:
        out += [
            "### How many samples for statistics you can trust",
            "",
            "Median relative error of the running variance against float64 statistics of the whole data set, by",
            f"samples spent — {q_desc(quality)}. fvcore's `update_bn_stats` uses the same pooled estimator as",
            "precisebn (in float32, so it tracks precisebn except where |mean|/std is large); torch's",
            "`swa_utils.update_bn` averages per-batch variances, which leaves out the spread of the batch means: at",
            "batch size 2 it stays far off however many samples it is given.",
            "",
            *_quality_table(quality),
            "",
            "The first layer's inputs do not depend on how the data fall into batches, so at the full data the pooled",
            "estimator lands on the float64 value; deeper layers receive activations normalised with each batch's own",
            "statistics, so their full-data statistics shift a little with the grouping (the ~0.5 % left at 16k",
            "samples for the pooled estimators).",
            "",
            "Full table, method and plot: [`benchmarks/results/quality.md`](benchmarks/results/quality.md).",
            "",
            "![running-variance error vs samples spent](benchmarks/results/quality.png)",
            "",
        ]
    out += [
        "### Reproduce",
        "",
        "```bash",
        "make bench                        # ~13 min on 2 cores: CPU (CUDA when available), all models;",
        "                                  # writes benchmarks/results/ and this section",
        "python -m benchmarks.run --help   # options: --models, --rounds, --device, --threads, --autocast, ...",
        "python -m benchmarks.run --quick  # a ~5-minute smoke test (benchmarks/results/quick/, not published)",
        "python -m benchmarks.quality      # the estimation-quality study: 10-15 min on 2 cores (errors, not time)",
        "make gpu-check                    # CUDA only: host syncs in the loop, exactness (fp32, bf16), SyncBN",
        "```",
        "",
        "fvcore is installed for the benchmarks only (`pip install -e '.[bench]'`); it is never a runtime",
        "dependency. CPU numbers use one torch thread (`--threads`); other processes on the machine show up as",
        "A/A medians away from 1.000 — rerun on a quiet machine when they do.",
    ]
    return "\n".join(out)


def q_desc(q: dict[str, Any]) -> str:
    return (
        f"torchvision resnet18 (random initialisation), {q['data_size']:,} natural-image patches (32×32),\n"
        f"batch sizes {', '.join(map(str, q['batch_sizes']))}"
    )


def update(readme: Path = README) -> None:
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{readme}: markers {START} / {END} not found; not touching it")
    body = render()
    text = readme.read_text()  # re-read: others edit other sections
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{START}\n{body}\n{END}{tail}"
    tmp = readme.with_suffix(".md.tmp")
    tmp.write_text(new)
    os.replace(tmp, readme)


def main() -> int:
    update()
    print(f"{README}: Performance section updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
