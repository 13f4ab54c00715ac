"""Sizes for people: one formatting rule for every report (CLI, doctor, scripts)."""

from __future__ import annotations


def human_bytes(n: int | float | None) -> str:
    """``1536`` -> ``1.5 KiB``; ``None`` -> ``-``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
