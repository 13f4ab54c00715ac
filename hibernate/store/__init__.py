"""Snapshots on disk: format, atomic publish, and a writer and reader at disk speed."""

from hibernate.store.format import Manifest, Record
from hibernate.store.layout import SpillRoot
from hibernate.store.reader import ReadResult, SnapshotReader
from hibernate.store.regions import Region
from hibernate.store.writer import WriteOptions, WriteResult, write_snapshot

__all__ = [
    "Manifest",
    "ReadResult",
    "Record",
    "Region",
    "SnapshotReader",
    "SpillRoot",
    "WriteOptions",
    "WriteResult",
    "write_snapshot",
]
