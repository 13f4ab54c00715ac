"""``hibernate gc``: reclaim the snapshots nobody needs, and touch nothing hibernate did not make.

A ``--to`` directory is shared: with the user's own files, with other
processes' spill roots, with other hosts on a shared file system. gc enters
only directories that carry hibernate's marker (see layout.py), creates
nothing, and decides per root from its owner, never from a pid alone:

| the owner                         | gc removes                                   |
|-----------------------------------|----------------------------------------------|
| has exited (same boot, same or visible pid namespace), or its machine rebooted | the whole root |
| runs, asleep or state unknown     | unfinished snapshots and all but the newest  |
| runs, awake, and ``--awake``      | also the newest (the next sleep writes anew) |
| cannot be judged (another host, a pid namespace out of sight) | unfinished snapshots only |

A root in use (a sleep, a wake, another gc holds its lock) is skipped, and
an awake owner is judged while gc holds the root's lock, so no sleep can
publish a snapshot between the judgement and the deletion.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hibernate.agent.wire import AgentState
from hibernate.errors import HibernateError, UsageError
from hibernate.fsutil import open_dir
from hibernate.store.layout import SpillRoot, is_spill_root
from hibernate.store.manifest import MANIFEST_NAME
from hibernate.store.owner import Owner, liveness

# The state a running owner's agent reports, or None if it cannot be asked.
AgentStateFn = Callable[[Owner], AgentState | None]


@dataclass
class Action:
    """One thing gc does (or, with --dry-run, would do) and why."""

    path: Path
    delete: bool
    reason: str
    nbytes: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"path": str(self.path), "delete": self.delete, "reason": self.reason, "bytes": self.nbytes}


def _is_marked(path: Path) -> bool:
    """A spill root gc may look at; one it cannot look into is passed over (another user's)."""
    try:
        return is_spill_root(path)
    except PermissionError:
        return False


def spill_roots(directory: Path) -> list[Path]:
    """``directory`` itself if it is one process's root, else the marked roots directly inside it."""
    if _is_marked(directory):
        return [directory]
    try:
        entries = sorted(directory.iterdir())
    except PermissionError as exc:
        raise UsageError(f"cannot list {directory}: permission denied") from exc
    return [p for p in entries if p.is_dir() and _is_marked(p)]


def _files(dir_fd: int, name: str) -> Iterator[os.stat_result]:
    """Every regular file of a file or tree, not following links."""
    info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISREG(info.st_mode):
        yield info
    if not stat.S_ISDIR(info.st_mode):
        return
    sub = open_dir(name, dir_fd=dir_fd)
    try:
        for entry in os.listdir(sub):
            yield from _files(sub, entry)
    finally:
        os.close(sub)


def freed_by(dir_fd: int, names: Sequence[str]) -> list[int]:
    """What deleting the trees ``names``, in this order, frees at each: a file's space goes with the
    last of its links (as the deletion counts it), so a data file two snapshots share (a re-sleep links
    the chunks it reuses) counts once, with the last of them deleted, and one that a snapshot kept
    also links to counts not at all. What ``gc --dry-run`` says, and ``gc`` then frees."""
    last: dict[tuple[int, int], int] = {}  # a file -> the deletion that unlinks its last link seen
    seen: dict[tuple[int, int], int] = {}
    files: dict[tuple[int, int], os.stat_result] = {}
    for index, name in enumerate(names):
        for info in _files(dir_fd, name):
            key = (info.st_dev, info.st_ino)
            seen[key] = seen.get(key, 0) + 1
            last[key], files[key] = index, info
    freed = [0] * len(names)
    for key, info in files.items():
        if seen[key] >= info.st_nlink:  # every link of it goes
            freed[last[key]] += info.st_blocks * 512
    return freed


def plan_root(root: SpillRoot, *, awake: bool, agent_state: AgentStateFn | None) -> tuple[bool, list[Action]]:
    """What to do with one locked root: (remove it whole?, per-snapshot actions)."""
    verdict, why = liveness(root.owner)
    who = f"its process, {root.owner.describe()},"
    actions = [
        Action(root.path / name, True, "unfinished: a sleep failed or was killed while writing it")
        for name in root.unfinished()
    ]
    published = root.published()
    if verdict == "dead":
        return True, [
            *actions,
            *(Action(root.path / n, True, f"{who} is gone: {why}") for n in published),
        ]
    if verdict == "unknown":
        return False, [*actions, *(Action(root.path / n, False, why) for n in published)]
    *older, newest = published or [""]
    if newest:
        try:
            root.read_manifest(newest)
        except HibernateError as exc:
            # It may be what a sleeping process needs once repaired: keep every snapshot.
            why_kept = (
                f"{root.path / newest / MANIFEST_NAME} cannot be read ({exc.message}); every snapshot "
                "here is kept until it is repaired or deleted"
            )
            return False, [*actions, *(Action(root.path / n, False, why_kept) for n in published)]
    actions += [Action(root.path / n, True, f"replaced by {newest}") for n in older]
    if newest:
        state = agent_state(root.owner) if agent_state is not None else None
        if state is AgentState.RUNNING and awake:
            actions.append(Action(root.path / newest, True, f"{who} is awake (--awake)"))
        elif state is AgentState.RUNNING:
            actions.append(Action(root.path / newest, False, f"{who} is awake; --awake reclaims it"))
        elif state is None:
            actions.append(Action(root.path / newest, False, f"{who} runs, its state is unknown"))
        else:
            actions.append(Action(root.path / newest, False, f"{who} is {state.value}"))
    return False, actions


def collect_garbage(
    directory: Path,
    *,
    awake: bool = False,
    dry_run: bool = False,
    agent_state: AgentStateFn | None = None,
) -> dict[str, Any]:
    """Collect every marked spill root in ``directory``; one in use is skipped."""
    directory = Path(directory).expanduser().absolute()
    if not directory.is_dir():
        raise UsageError(f"{directory} is not a directory")
    roots: list[dict[str, Any]] = []
    warnings: list[str] = []
    for path in spill_roots(directory):
        try:
            roots.append(_collect_root(path, awake=awake, dry_run=dry_run, agent_state=agent_state))
        except HibernateError as exc:
            warnings.append(f"{path}: {exc.message}; left as it is")
        except OSError as exc:
            warnings.append(f"{path}: {exc.strerror or exc}; left as it is")
    return {
        "directory": str(directory),
        "dry_run": dry_run,
        "roots": roots,
        "freed_bytes": sum(r["freed_bytes"] for r in roots),
        "warnings": warnings,
    }


def _collect_root(
    path: Path, *, awake: bool, dry_run: bool, agent_state: AgentStateFn | None
) -> dict[str, Any]:
    with SpillRoot(path, inspect=True) as root:
        # A dry run must not make a sleep BUSY: a shared lock conflicts with writers only.
        if not root.lock(exclusive=not dry_run):
            return {"path": str(path), "freed_bytes": 0, "skipped": True, "removed": False, "actions": []}
        remove, actions = plan_root(root, awake=awake, agent_state=agent_state)
        doomed = [action for action in actions if action.delete]
        for action, nbytes in zip(doomed, freed_by(root.fd, [a.path.name for a in doomed]), strict=True):
            action.nbytes = nbytes
        freed = 0
        if not dry_run:
            for action in doomed:
                action.nbytes = root.delete_snapshot(action.path.name)  # what it freed: as foreseen
                freed += action.nbytes
            if remove:
                freed += root.remove()
        return {
            "path": str(path),
            "freed_bytes": freed,
            "skipped": False,
            "removed": remove,
            "owner": root.owner.to_json(),
            "actions": [a.to_wire() for a in actions],
        }
