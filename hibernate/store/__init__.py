"""Snapshots on disk: format, atomic publish, and a writer and reader at disk speed."""

from hibernate.store.layout import SpillRoot
from hibernate.store.manifest import Manifest, Record
from hibernate.store.options import WriteOptions
from hibernate.store.owner import Owner, spill_root_name
from hibernate.store.reader import ReadResult, SnapshotReader, verify_snapshot
from hibernate.store.regions import Region
from hibernate.store.reuse import ReuseSource
from hibernate.store.writer import WriteResult, write_snapshot

__all__ = [
    "Manifest",
    "Owner",
    "ReadResult",
    "Record",
    "Region",
    "ReuseSource",
    "SnapshotReader",
    "SpillRoot",
    "WriteOptions",
    "WriteResult",
    "spill_root_name",
    "verify_snapshot",
    "write_snapshot",
]
