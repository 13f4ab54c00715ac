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

import pytest

from tests.standins.latencyfs import MountRefusedError, Server, unavailable


@pytest.fixture
def latency_fs(tmp_path: Path) -> Iterator[Server]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"latency-bound filesystem: {reason}")
    try:
        server = Server(tmp_path / "latencyfs-backing", tmp_path / "latencyfs")
    except MountRefusedError as exc:
        pytest.skip(f"latency-bound filesystem: {exc}")
    try:
        yield server
    finally:
        server.close()
