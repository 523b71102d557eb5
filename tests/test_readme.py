"""The README's "Use it in your training loop" snippets run as written.

Every ```python block between ``<!-- training-loop:start -->`` and
``<!-- training-loop:end -->`` is executed on its own, in a fresh namespace and an empty
working directory; the snippets check their own claims with ``assert``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SECTION = re.compile(r"<!-- training-loop:start -->(.*?)<!-- training-loop:end -->", re.S)
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippets() -> list[str]:
    match = SECTION.search(README.read_text(encoding="utf-8"))
    assert match, "the README lost its training-loop markers"
    return BLOCK.findall(match.group(1))


def test_the_section_covers_the_three_cases() -> None:
    section = SECTION.search(README.read_text(encoding="utf-8")).group(1)
    assert "## Use it in your training loop" in section
    code = snippets()
    assert any("PreciseBNScheduler" in c for c in code)
    assert any("integrations.lightning import PreciseBN" in c for c in code)
    assert any("AveragedModel" in c for c in code)
    assert any("PreciseWeightAveraging" in c for c in code)


@pytest.mark.parametrize("index", range(len(snippets())))
def test_snippet_runs_as_written(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # checkpoints and logs land here
    code = snippets()[index]
    exec(compile(code, f"README.md (training-loop snippet {index + 1})", "exec"), {"__name__": "readme_snippet"})
