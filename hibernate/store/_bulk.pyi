"""The compiled helper of hibernate/store/bulk.py (hibernate/store/_bulk.c)."""

from collections.abc import Sequence

from typing_extensions import Buffer

def bind(path: str) -> None: ...
def checksums(views: Sequence[Buffer]) -> list[str]: ...
def stage_at(
    target: Buffer, positions: list[int], paddeds: list[int], addresses: list[int], lengths: list[int]
) -> list[str]: ...
def verify_copy_at(
    source: Buffer,
    base: int,
    got: int,
    group: list[int],
    offsets: list[int],
    lengths: list[int],
    checksums: str,
    targets: list[int],
) -> tuple[int, bool]: ...
