"""The ``latency_fs`` fixture: the latency-bound FUSE filesystem (tests/standins/latencyfs.py) on a temp dir.

Registered for every test by tests/conftest.py. A test that asks for it gets a
:class:`~tests.standins.latencyfs.Server` whose ``mountpoint`` is a mounted
passthrough (over ``backing``) with 2 ms per read and write request, ``stats()``
and ``reset()``. It is unmounted and its server ended at teardown, whether the
test passed or failed; the test is skipped, saying why, where FUSE is not
available (no /dev/fuse, no libfuse3, the mount refused).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.standins.latencyfs import MountRefusedError, Server, unavailable


def mount_or_skip(backing: Path, mountpoint: Path, **options: Any) -> Server:
    """The filesystem mounted at ``mountpoint`` over ``backing`` (``options``: the Server's); the
    test is skipped, saying why, where it cannot be. The caller closes it."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"latency-bound filesystem: {reason}")
    try:
        return Server(backing, mountpoint, **options)
    except MountRefusedError as exc:
        pytest.skip(f"latency-bound filesystem: {exc}")


@pytest.fixture
def latency_fs(tmp_path: Path) -> Iterator[Server]:
    server = mount_or_skip(tmp_path / "latencyfs-backing", tmp_path / "latencyfs")
    try:
        yield server
    finally:
        server.close()
