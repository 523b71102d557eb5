"""The public surface: a short, sorted, hand-written __all__, and a light import."""

from __future__ import annotations

import subprocess
import sys

import precisebn

PUBLIC = [
    "PopulationStats",
    "PreciseBNError",
    "PreciseBNScheduler",
    "Report",
    "__version__",
    "apply",
    "estimate",
    "recalibrate",
    "untie_calls",
]


def test_all_is_sorted_and_exact() -> None:
    assert precisebn.__all__ == sorted(precisebn.__all__)
    assert precisebn.__all__ == PUBLIC
    for name in PUBLIC:
        assert getattr(precisebn, name) is not None


def test_import_needs_only_torch() -> None:
    code = (
        "import sys, torch;"
        "before = {m.split('.')[0] for m in sys.modules};"
        "import precisebn, precisebn.compat, precisebn.stats;"
        "heavy = {'lightning', 'pytorch_lightning', 'matplotlib', 'sklearn', 'torchvision', 'tqdm',"
        " 'safetensors', 'PIL'};"
        "print(sorted(heavy & ({m.split('.')[0] for m in sys.modules} - before)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_py_typed_is_shipped() -> None:
    from importlib import resources

    assert resources.files("precisebn").joinpath("py.typed").is_file()
