"""Whether a wake should ask for transparent huge pages for the host memory it refills.

A wake of a CPU target refills memory it has just allocated, and faulting that
memory in is the restore's ceiling once the disk is fast: on the 2-core VM we
measure on, fresh 4 KiB pages fault in at about 3 GB/s, below a fast disk's raw
read. A 2 MiB page faults in at 7-10 GB/s when the kernel has a free 2 MiB
block to give, so asking for them (MADV_HUGEPAGE) lifts that ceiling. Where it
has none, the kernel compacts memory to make one (THP ``defrag=madvise``, the
usual default, stalls the faulting thread for it), which is far slower than
small pages; and where a hypervisor takes free memory back (virtio-balloon
free page reporting hands it the guest's free blocks of 2 MiB and more), a
huge page costs a fresh host allocation each time: measured 0.5 GB/s against
3 GB/s for small pages, five seconds after the memory was freed. So huge pages
are asked for only where free 2 MiB blocks cover what the wake faults in and
no free page reporting is active.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

HUGE_PAGE_BYTES = 2 << 20
# Free blocks held back from the count: other processes fault too, and a count
# read a moment before the faults is not a reservation.
_MARGIN_BYTES = 256 << 20
_VIRTIO_BALLOON_DEVICE = 0x0005
_VIRTIO_BALLOON_F_REPORTING = 5  # feature bit: free page reporting


def free_huge_block_bytes(buddyinfo: str, page_bytes: int = mmap.PAGESIZE) -> int:
    """Bytes the kernel holds free in blocks of 2 MiB or more, from /proc/buddyinfo's text.

    Each line is ``Node N, zone NAME c0 c1 ... c10``: cK free blocks of
    2**K pages. A line that does not parse is skipped (counts nothing).
    """
    smallest_order = max(0, (HUGE_PAGE_BYTES // page_bytes).bit_length() - 1)
    total = 0
    for line in buddyinfo.splitlines():
        _, _, counts = line.partition("zone")
        fields = counts.split()[1:]  # the zone's name first
        if not fields or not all(field.isdigit() for field in fields):
            continue
        for order, count in enumerate(fields):
            if order >= smallest_order:
                total += int(count) << order
    return total * page_bytes


def reports_free_pages(devices: dict[int, str]) -> bool:
    """Whether a virtio-balloon device with free page reporting is present.

    ``devices`` maps each virtio device's id to its ``features`` text (one
    '0'/'1' character per feature bit, bit 0 first, as sysfs shows it).
    """
    return any(
        device == _VIRTIO_BALLOON_DEVICE
        and len(features) > _VIRTIO_BALLOON_F_REPORTING
        and features[_VIRTIO_BALLOON_F_REPORTING] == "1"
        for device, features in devices.items()
    )


def _virtio_devices(root: Path = Path("/sys/bus/virtio/devices")) -> dict[int, str]:
    devices: dict[int, str] = {}
    try:
        entries = list(root.iterdir())
    except OSError:
        return devices
    for entry in entries:
        try:
            device = int((entry / "device").read_text().strip(), 16)
            devices[device] = (entry / "features").read_text().strip()
        except (OSError, ValueError):
            continue
    return devices


def _thp_enabled() -> bool:
    """Whether MADV_HUGEPAGE can give huge pages at all (THP ``always`` or ``madvise``)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in text


def huge_pages_pay_off(nbytes: int) -> bool:
    """Whether to ask for huge pages for ``nbytes`` of host memory about to be faulted in.

    Read once per wake (a few small reads of /proc and /sys); ``HIBERNATE_HUGE_PAGES``
    set to ``0`` or ``1`` overrides the decision, for measuring either way.
    """
    forced = os.environ.get("HIBERNATE_HUGE_PAGES")
    if forced in ("0", "1"):
        return forced == "1"
    if nbytes < HUGE_PAGE_BYTES or not _thp_enabled() or reports_free_pages(_virtio_devices()):
        return False
    try:
        buddyinfo = Path("/proc/buddyinfo").read_text()
    except OSError:
        return False
    return free_huge_block_bytes(buddyinfo) >= nbytes + _MARGIN_BYTES
