"""The check of where snapshots would go: its filesystem (RAM, disk or network), its free space
against what the target keeps, whether it takes direct I/O, and how a transfer there would run."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hibernate.doctor.checks import FAIL, OK, WARN, Examination
from hibernate.fsutil import free_bytes
from hibernate.units import human_bytes

if TYPE_CHECKING:
    from hibernate.store.tuning import Tuning


def mount_for(path: str, mounts: Sequence[tuple[str, str]]) -> tuple[str, str]:
    """(mount point, filesystem type) of the mount holding ``path``: the longest matching mount point."""
    best = ("/", "unknown")
    for point, fstype in mounts:
        inside = path == point or path.startswith(point.rstrip("/") + "/") or point == "/"
        if inside and len(point) >= len(best[0]):
            best = (point, fstype)
    return best


def _mounts() -> list[tuple[str, str]]:
    try:
        with open("/proc/self/mounts") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 3:
            out.append((parts[1].replace("\\040", " "), parts[2]))
    return out


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


class DiskChecks(Examination):
    """Where the snapshots would go (``--to``, else the agent's default directory)."""

    def check_directory(self) -> None:
        from hibernate.store.directio import direct_io_supported
        from hibernate.store.tuning import MEMORY

        directory = self.directory
        if directory is None:
            defaults = [a.status.default_dir for a in self.agents if a.status.default_dir]
            directory = Path(defaults[0]) if defaults else None
        if directory is None:
            self.add("snapshot dir", OK, "n/a: pass --to DIR to check where snapshots would go")
            return
        directory = Path(directory).expanduser().absolute()
        probe = _existing(directory)
        point, fstype = mount_for(str(probe.resolve()), _mounts())
        # What the store itself will see there (statfs), not the mount table's name for it.
        tuning = _tuning_at(probe)
        if tuning is not None and tuning.kind == MEMORY:
            self.add(
                "snapshot dir",
                WARN,
                f"{directory} is on {fstype} ({point}): it is RAM, a sleep there moves memory, frees none",
                "choose a directory on a disk (NVMe best)",
                fstype=fstype,
                mount=point,
            )
        else:
            self.add("snapshot dir", OK, f"{directory} is on {fstype} ({point})", fstype=fstype, mount=point)
        free = free_bytes(probe)
        needed = sum(p["bytes"] for a in self.agents for p in a.status.pools if p.get("keep"))
        if needed and free < needed:
            self.add(
                "free space",
                FAIL,
                f"{human_bytes(free)} free at {probe}; the target keeps {human_bytes(needed)}",
                "free space or choose another --to",
                free_bytes=free,
                needed_bytes=needed,
            )
        else:
            what = f"; the target keeps {human_bytes(needed)}" if needed else ""
            self.add(
                "free space",
                OK,
                f"{human_bytes(free)} free at {probe}{what}",
                free_bytes=free,
                needed_bytes=needed,
            )
        if not os.access(probe, os.W_OK | os.X_OK):
            self.add(
                "direct I/O", WARN, f"cannot probe: {probe} is not writable by you", "choose another --to"
            )
        elif direct_io_supported(probe):
            self.add("direct I/O", OK, f"{fstype} accepts O_DIRECT: snapshots bypass the page cache")
        else:
            self.add(
                "direct I/O",
                WARN,
                f"{fstype} refuses O_DIRECT: buffered I/O (slower, and it passes through the page cache)",
                "a local disk filesystem (ext4, xfs) takes direct I/O",
            )
        if tuning is not None:
            self.add(
                "transfer",
                OK,
                f"{_KIND_WORDS[tuning.kind].format(name=tuning.filesystem)}: a sleep or wake there keeps "
                f"{tuning.io_depth} request{'s' if tuning.io_depth != 1 else ''} in flight, with "
                f"{tuning.workers} copying and hashing thread{'s' if tuning.workers != 1 else ''} for the "
                "cores this command may use (--io-depth and --io-workers set others)",
                **tuning.to_wire(),
            )


_KIND_WORDS = {
    "local": "{name} is a local filesystem",
    "network": "{name} is a network filesystem, each request a round trip",
    "memory": "{name} is memory",
}


def _tuning_at(directory: Path) -> Tuning | None:
    """The tuning a transfer into ``directory`` would get (tuning.choose); None where it cannot be opened."""
    from hibernate.store.tuning import choose  # here: doctor loads no store code at import

    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return choose(fd)
    finally:
        os.close(fd)
