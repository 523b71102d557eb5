"""Plain-text tables for the command line."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table", "times"]


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int] | None = None) -> str:
    """Aligns ``rows`` under ``header``; columns in ``right`` are right-aligned.

    Example:
        >>> print(format_table(["name", "n"], [["a", "1"], ["bb", "22"]], right={1}))
        name   n
        ----  --
        a      1
        bb    22
    """
    right = right or set()
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(header)]

    def fmt(row: Sequence[str]) -> str:
        cells = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        return "  ".join(cells).rstrip()

    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *(fmt(row) for row in rows)])


def times(k: int) -> str:
    """``once``, ``twice``, ``3 times``..."""
    return {1: "once", 2: "twice"}.get(k, f"{k} times")
