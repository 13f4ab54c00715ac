"""Many nodes, one outcome: the file-based barrier through which a job's nodes agree on one verdict.

A job that spans nodes is hibernated by running hibernate once per node with
the scheduler's own launcher (``scripts/slurm/hibernate-job`` runs
``srun --overlap --ntasks-per-node=1 hibernate node-step sleep ...``). Each
run acts on its own node only, so the runs must agree, or half a job would
sleep while the other half waits for it in a collective. They agree through a
directory every node can see (the *barrier*):

    1. each node sleeps its processes (lock all, checkpoint all, undo all on failure),
    2. posts ``node<i>.ok`` or ``node<i>.failed`` there,
    3. waits until one verdict stands: the first node to see every result ok writes
       ``decision`` = commit; the first to see a failure, or to pass the timeout with
       a node still silent (a dead node, a hung node), writes ``decision`` = abort,
    4. follows the verdict: commit, exit 0 asleep; abort, a node that slept wakes its
       processes again and every node exits non-zero with the verdict's exit code.

``decision`` is published with ``link()``, which creates a name only if it is
free, atomically on local file systems and on NFS, so exactly one verdict
stands even when two nodes decide at once, and a late node (its sleep finished
after the timeout) finds it and wakes: every node ends asleep, or every node
ends awake. A wake uses the same barrier so that all nodes report one verdict;
there is nothing to undo after a failed wake (a process that stayed asleep is
woken by running the wake again; nodes already awake agree).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hibernate.errors import (
    ExitCode,
    UsageError,
)

DECISION = "decision"
COMMIT = "commit"
ABORT = "abort"
_RESULT_RE = re.compile(r"^node(\d+)\.(ok|failed)$")
_LIMIT = 1 << 20
ONE_TASK_PER_NODE = "run exactly one task per node (srun --ntasks-per-node=1), each with its own SLURM_NODEID"


@dataclass(frozen=True)
class NodeResult:
    """What one node's local sleep or wake came to."""

    index: int
    node: str
    ok: bool
    exit_code: int = 0
    message: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> NodeResult:
        return cls(
            index=int(data["index"]),
            node=str(data["node"]),
            ok=bool(data["ok"]),
            exit_code=int(data.get("exit_code", 0)),
            message=data.get("message"),
            detail=dict(data.get("detail") or {}),
        )


@dataclass(frozen=True)
class Decision:
    """The one verdict of a barrier: commit or abort, who wrote it, why, and the exit code all use."""

    verdict: str
    reason: str
    exit_code: int
    by: str = ""

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Decision:
        verdict = str(data["verdict"])
        if verdict not in (COMMIT, ABORT):
            raise ValueError(f"unknown verdict {verdict!r}")
        return cls(
            verdict, str(data.get("reason", "")), int(data.get("exit_code", 0)), str(data.get("by", ""))
        )


def _describe(results: list[NodeResult]) -> str:
    return ", ".join(f"node {r.index} ({r.node})" for r in results)


def decide(
    results: Mapping[int, NodeResult], expected: int, timed_out: bool, timeout: float = 0.0
) -> Decision | None:
    """The verdict these results call for, or None while it is still open.

    Any failure aborts at once (no point waiting for the rest); every node ok
    commits; a node still silent when time is up aborts with TIMEOUT. The exit
    code of a failure verdict is that of the lowest-numbered failed node.
    """
    failed = sorted((r for r in results.values() if not r.ok), key=lambda r: r.index)
    if failed:
        first = failed[0]
        return Decision(
            ABORT,
            f"{_describe(failed)} failed: {first.message or 'no message'}",
            first.exit_code or int(ExitCode.FAILURE),
        )
    if all(i in results for i in range(expected)):
        return Decision(COMMIT, f"all {expected} node(s) succeeded", int(ExitCode.OK))
    if timed_out:
        missing = [i for i in range(expected) if i not in results]
        return Decision(
            ABORT,
            f"node(s) {', '.join(map(str, missing))} of {expected} did not report within {timeout:g}s",
            int(ExitCode.TIMEOUT),
        )
    return None


def _write_new(directory: Path, name: str, document: Mapping[str, Any]) -> bool:
    """Publish ``name`` with ``document`` only if the name is free; False if it was taken.

    The content is written and synced under a private temporary name first, then
    linked: a reader never sees a half-written file, and of two writers racing
    for the same name exactly one wins.
    """
    tmp = directory / f".{name}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(document, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, directory / name)
        except FileExistsError:
            return False
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, OSError):
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(_LIMIT)
    try:
        document = json.loads(raw)
    except ValueError:
        return None
    return document if isinstance(document, dict) else None


class Barrier:
    """A shared directory where the nodes of one operation post results and settle one verdict."""

    def __init__(
        self,
        directory: Path,
        expected: int,
        index: int,
        node: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        pause: Callable[[float], None] = time.sleep,
        poll: float = 0.2,
        appear_timeout: float = 0.0,
    ) -> None:
        self.directory = Path(directory)
        self.expected = expected
        self.index = index
        self.node = node
        self.clock = clock
        self.pause = pause
        self.poll = poll
        self.appear_timeout = appear_timeout
        # A result file is complete when it appears (linked) and never changes: parse each once,
        # not on every poll of wait() (a file system every node shares is slow to read).
        self._parsed: dict[str, NodeResult] = {}

    def check(self) -> None:
        """Refuse what cannot work before anything is touched: a missing, used or foreign barrier."""
        if self.expected < 1:
            raise UsageError(f"--nodes must be at least 1, not {self.expected}")
        if not 0 <= self.index < self.expected:
            raise UsageError(
                f"node index {self.index} is outside 0..{self.expected - 1}",
                hint="run one task per node (srun --ntasks-per-node=1) with --nodes equal to the node count",
            )
        appear_by = self.clock() + self.appear_timeout
        while not self.directory.is_dir() and self.clock() < appear_by:
            self.pause(self.poll)  # made on another node a moment ago: a network file system may lag
        if not self.directory.is_dir():
            raise UsageError(
                f"--barrier {self.directory} is not a directory",
                hint="create a fresh directory on a file system every node shares "
                "(scripts/slurm/hibernate-job does this) and pass the same path to every node",
            )
        standing = self.decision()
        reused = standing.verdict == COMMIT if standing is not None else (self.directory / DECISION).exists()
        if reused:
            raise UsageError(
                f"--barrier {self.directory} was already used (it holds a decision)",
                hint="use a fresh directory for every operation",
            )
        if any((self.directory / f"node{self.index}.{kind}").exists() for kind in ("ok", "failed")):
            raise UsageError(
                f"node index {self.index} already reported in {self.directory}",
                hint=ONE_TASK_PER_NODE,
            )

    def post(self, result: NodeResult) -> None:
        name = f"node{result.index}.{'ok' if result.ok else 'failed'}"
        other = f"node{result.index}.{'failed' if result.ok else 'ok'}"
        if (self.directory / other).exists() or not _write_new(self.directory, name, result.to_wire()):
            raise UsageError(
                f"node index {result.index} already reported in {self.directory}",
                hint=ONE_TASK_PER_NODE,
            )

    def results(self) -> dict[int, NodeResult]:
        found: dict[int, NodeResult] = {}
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return found
        for name in names:
            result = self._parsed.get(name) or self._parse_result(name)
            if result is not None:
                self._parsed[name] = result
                found[result.index] = result
        return found

    def _parse_result(self, name: str) -> NodeResult | None:
        match = _RESULT_RE.match(name)
        if not match:
            return None
        document = _read_json(self.directory / name)
        if document is None:
            return None
        try:
            result = NodeResult.from_wire(document)
        except (KeyError, TypeError, ValueError):
            return None
        if result.index == int(match.group(1)) and result.ok == (match.group(2) == "ok"):
            return result
        return None

    def decision(self) -> Decision | None:
        document = _read_json(self.directory / DECISION)
        if document is None:
            return None
        try:
            return Decision.from_wire(document)
        except (KeyError, TypeError, ValueError):
            return None

    def settle(self, proposal: Decision) -> Decision:
        """Publish ``proposal`` unless a verdict already stands; return the verdict that stands."""
        signed = Decision(proposal.verdict, proposal.reason, proposal.exit_code, proposal.by or self.node)
        if _write_new(self.directory, DECISION, signed.to_wire()):
            return signed
        for _ in range(50):  # another node linked it a moment ago: it is complete, read it
            standing = self.decision()
            if standing is not None:
                return standing
            self.pause(0.05)
        raise UsageError(f"{self.directory / DECISION} exists but cannot be read as a decision")

    def wait(self, deadline: float, timeout: float) -> Decision:
        """Wait until a verdict stands (settling one when the results call for it)."""
        while True:
            standing = self.decision()
            if standing is not None:
                return standing
            proposal = decide(self.results(), self.expected, self.clock() >= deadline, timeout)
            if proposal is not None:
                return self.settle(proposal)
            self.pause(self.poll)
