"""Sizes for people: one rule for writing them in every report, one for reading them from a command line."""

from __future__ import annotations

import re

from hibernate.errors import UsageError


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


def parse_size(text: str) -> int:
    """``5GB`` (10**9), ``500MiB`` (2**20), ``100kb``, ``4096``: a positive number of bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    units.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in units:
        raise UsageError(
            f"{text!r} is not a size: a number, with a unit of B, KB, MB, GB, TB (powers of 1000) or "
            "KiB, MiB, GiB, TiB (powers of 1024)"
        )
    value = int(float(match.group(1)) * units[match.group(2).upper()])
    if value < 1 or value > 1 << 60:
        raise UsageError(f"a size must be between 1 byte and 1 EiB, not {text!r}")
    return value
