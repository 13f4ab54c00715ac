"""The cgroup filesystem, read as any scheduler lays it out: who is in a cgroup, where one is.

A scheduler's job is a cgroup (Slurm's ``job_<id>``, a Kubernetes pod's
slice); what each scheduler names its cgroups is its own module's business
(:mod:`.slurm`), reading them is this one's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

from hibernate.errors import UsageError

CGROUP_ROOT_ENV = "HIBERNATE_CGROUP_ROOT"
DEFAULT_CGROUP_ROOT = Path("/sys/fs/cgroup")
# Deep enough for Slurm's cgroup v1 layout (<controller>/slurm[_<node>]/uid_<uid>/job_<id>) and
# v2 layout (system.slice/[<node>_]slurmstepd.scope/job_<id>), shallow enough to stay fast on a
# node with thousands of cgroups.
SEARCH_DEPTH = 4


def cgroup_root(environ: Mapping[str, str] | None = None) -> Path:
    """The cgroup filesystem's root: /sys/fs/cgroup, or $HIBERNATE_CGROUP_ROOT (tests, containers)."""
    env = os.environ if environ is None else environ
    return Path(env[CGROUP_ROOT_ENV]) if env.get(CGROUP_ROOT_ENV) else DEFAULT_CGROUP_ROOT


def parse_pid_list(text: str) -> list[int]:
    """The pids of a ``cgroup.procs`` or ``tasks`` file (one per line; blank lines ignored)."""
    return [int(line) for line in text.split() if line.strip().isdigit()]


def thread_group(tid: int) -> int | None:
    """The process (thread group) a thread id belongs to, from /proc/<tid>/status; None if gone."""
    try:
        with open(f"/proc/{tid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError, IndexError):
        return None
    return None


def read_text(path: Path) -> str:
    """A small kernel file's text, or "" when it is gone or unreadable (a process that just ended)."""
    try:
        return path.read_text()
    except (FileNotFoundError, PermissionError, OSError):
        return ""


def cgroup_members(directory: Path, tgid_of: Callable[[int], int | None] = thread_group) -> list[int]:
    """Every process in the cgroup at ``directory`` and in the cgroups below it, in first-seen order.

    Each cgroup lists its processes in ``cgroup.procs`` (v2, and v1 too); a v1
    hierarchy that only has ``tasks`` lists threads, which are mapped to their
    processes. Children of a process start in its cgroup, so a job's whole
    process tree is found, however deep its steps nest their cgroups.
    """
    found: dict[int, None] = {}
    for current, _dirs, files in os.walk(directory):
        here = Path(current)
        if "cgroup.procs" in files:
            pids = parse_pid_list(read_text(here / "cgroup.procs"))
        elif "tasks" in files:
            pids = [p for p in (tgid_of(t) for t in parse_pid_list(read_text(here / "tasks"))) if p]
        else:
            continue
        for pid in pids:
            found.setdefault(pid, None)
    return list(found)


def find_named_cgroups(root: Path, name: str, max_depth: int = SEARCH_DEPTH) -> list[Path]:
    """Directories called ``name`` at most ``max_depth`` levels below ``root`` (not below a match)."""
    matches: list[Path] = []
    frontier = [root]
    for _ in range(max_depth):
        below: list[Path] = []
        for directory in frontier:
            try:
                entries = sorted(os.scandir(directory), key=lambda e: e.name)
            except (FileNotFoundError, NotADirectoryError, PermissionError):
                continue
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False):
                    continue
                (matches if entry.name == name else below).append(Path(entry.path))
        frontier = below
    return matches


def unified_cgroup_path(proc_cgroup_text: str) -> str | None:
    """The cgroup v2 path of a process, from the ``0::PATH`` line of /proc/<pid>/cgroup."""
    for line in proc_cgroup_text.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def resolve_cgroup_path(path: str | Path, root: Path) -> Path:
    """``--cgroup``: a cgroup directory, or a path in the cgroup filesystem as /proc/PID/cgroup shows it."""
    given = Path(path)
    candidates = [given] if given.is_absolute() else []
    candidates.append(root / str(path).lstrip("/"))
    for candidate in candidates:
        if candidate.is_dir() and ((candidate / "cgroup.procs").exists() or (candidate / "tasks").exists()):
            return candidate
    raise UsageError(
        f"--cgroup {path}: no cgroup there (looked at {', '.join(str(c) for c in candidates)})",
        hint="pass a directory under the cgroup filesystem, or the path /proc/PID/cgroup shows "
        f"(relative to {root}; ${CGROUP_ROOT_ENV} moves the root)",
    )
