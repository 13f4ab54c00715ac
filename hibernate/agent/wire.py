"""What travels between an agent and its clients, typed: its state, its status, each request's arguments.

Both sides import this module: the agent inside the target builds its answers
with it, and the CLI side (the engine, the flows, serve, the commands) reads
them with it instead of comparing words. It loads the standard library and
:mod:`hibernate.errors` only, so a scheduler hook on a node without torch stays
light (``tests/test_agent_wire.py`` checks that).

The keys on the wire, and in every JSON document that shows an agent's status,
are a published schema (``docs/json-schema/status.schema.json``) and never
change; only the names in code may differ from them:

    wire key    field in code   why
    kind        runtime         what the program runs on ("torch", "vllm"); "kind" in the code means a
                                kind of target (hibernate.operation.registry), which an agent names
                                with ``sleep_driver``
    hibernate   version         the hibernate version the agent runs
    dir         directory       a request's snapshot directory

A target is a long-running process: it may still run the hibernate it was
started with after the command's was upgraded. :meth:`AgentStatus.from_wire`
therefore reads an older agent's status (a key it lacks gets a neutral default
and is remembered as absent) and a newer one's (a key it does not know, or a
value it cannot read, is kept verbatim in ``extra``): :meth:`AgentStatus.to_wire`
gives back exactly what was read.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, overload

from hibernate.errors import UsageError


class AgentState(str, Enum):
    """Where an agent's process is in a sleep or wake (the diagram in hibernate.agent.controller)."""

    RUNNING = "running"
    QUIESCED = "quiesced"
    SPILLED = "spilled"
    ASLEEP = "asleep"


def parse_state(word: object) -> AgentState | None:
    """The state an agent named; None where it named none, or one this hibernate does not know."""
    try:
        return AgentState(word)
    except ValueError:
        return None


# -- the status ---------------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: value is None or check(value)


def _is_str(value: object) -> bool:
    return isinstance(value, str)


def _is_dict(value: object) -> bool:
    return isinstance(value, dict)


def _is_list_of_dicts(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) for item in value)


def _is_state(value: object) -> bool:
    return parse_state(value) is not None


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class _Key:
    """One key of the status: its field in code, what a readable value is, and how it converts."""

    key: str
    name: str
    readable: Callable[[object], bool]
    read: Callable[[Any], Any] = _same
    write: Callable[[Any], Any] = _same


def _optional_tuple(value: list[Any] | None) -> tuple[Any, ...] | None:
    return tuple(value) if value is not None else None


def _optional_list(value: tuple[Any, ...] | None) -> list[Any] | None:
    return list(value) if value is not None else None


def _state_word(state: AgentState | None) -> str | None:
    return state.value if state is not None else None


# In the order the agent sends them.
_KEYS = (
    _Key("hibernate", "version", _is_str),
    _Key("pid", "pid", _is_int),
    _Key("start_time", "start_time", _is_int),
    _Key("pid_namespace", "pid_namespace", _optional(_is_int)),
    _Key("uid", "uid", _optional(_is_int)),
    _Key("name", "name", _is_str),
    _Key("kind", "runtime", _is_str),
    _Key("state", "state", _is_state, AgentState, _state_word),
    _Key("busy", "busy", _optional(_is_str)),
    _Key("guard_holders", "guard_holders", _is_int),
    _Key("leases", "leases", _optional(_is_dict)),
    _Key("pools", "pools", _is_list_of_dicts, tuple, list),
    _Key("device_bytes", "device_bytes", _is_dict),
    _Key("snapshot", "snapshot", _optional(_is_dict)),
    _Key("default_dir", "default_dir", _optional(_is_str)),
    _Key("sleep_driver", "sleep_driver", _optional(_is_str)),
    _Key("self_checkpoint", "self_checkpoint", lambda value: isinstance(value, bool)),
    _Key("transfer", "transfer", _optional(_is_dict)),
    _Key("last_operation", "last_operation", _optional(_is_dict)),
    _Key("restore_refusal", "restore_refusal", _optional(_is_str)),
    _Key("torch", "torch", _optional(_is_dict)),
    _Key("graphs", "graphs", _optional(_is_list_of_dicts), _optional_tuple, _optional_list),
)
_KNOWN = frozenset(k.key for k in _KEYS)


@dataclass(frozen=True)
class AgentStatus:
    """An agent's answer to ``status`` (and to ``hello``, ``begin``, ``end``, ``configure``), typed.

    Every field has the neutral value an agent that did not send its key
    would mean: ``None`` for what an agent of an older hibernate does not
    report (``leases``: none known, so no proxy can hold it awake; ``torch``,
    ``graphs``: not reported, so ``doctor`` leaves them out), no pools.
    """

    version: str = ""
    pid: int = 0
    start_time: int = 0
    # Two containers sharing a runtime directory can each hold a pid 1 started in the same clock
    # tick: the namespace tells their agents apart (see operation.targets.probe_agent).
    pid_namespace: int | None = None
    uid: int | None = None
    name: str = ""
    runtime: str = ""
    state: AgentState | None = None  # None: the agent named no state this hibernate knows
    busy: str | None = None  # who operates on it now
    guard_holders: int = 0
    leases: Mapping[str, Any] | None = None
    pools: tuple[Mapping[str, Any], ...] = ()
    device_bytes: Mapping[str, int] = field(default_factory=dict)
    snapshot: Mapping[str, Any] | None = None  # the newest: dir, snapshot, path
    default_dir: str | None = None
    sleep_driver: str | None = None  # the kind of target it is, if a program inside it drives its sleep
    self_checkpoint: bool = False
    transfer: Mapping[str, Any] | None = None
    last_operation: Mapping[str, Any] | None = None
    restore_refusal: str | None = None
    torch: Mapping[str, Any] | None = None
    graphs: tuple[Mapping[str, Any], ...] | None = None  # captured CUDA graphs it saw
    # What to_wire gives back beyond the fields: keys this hibernate does not know and values it
    # could not read (by key), verbatim; and the keys of fields the agent did not send.
    extra: Mapping[str, Any] = field(default_factory=dict)
    absent: frozenset[str] = frozenset()

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> AgentStatus:
        """The status an agent of any hibernate version sent; never raises (see the module docstring)."""
        values: dict[str, Any] = {}
        extra = {key: value for key, value in wire.items() if key not in _KNOWN}
        absent: set[str] = set()
        for key in _KEYS:
            if key.key not in wire:
                absent.add(key.key)
            elif key.readable(wire[key.key]):
                values[key.name] = key.read(wire[key.key])
            else:
                extra[key.key] = wire[key.key]
        return cls(**values, extra=extra, absent=frozenset(absent))

    def to_wire(self) -> dict[str, Any]:
        """The status as the agent sends it: its keys in order, then any this hibernate does not know."""
        wire = {key.key: key.write(getattr(self, key.name)) for key in _KEYS if key.key not in self.absent}
        wire.update(self.extra)
        return wire

    def names_process(self, pid: int, start_time: int, pid_namespace: int | None) -> bool:
        """Whether this is the answer of process ``pid`` started at ``start_time`` in ``pid_namespace``.

        A socket named for another process is never trusted; the same pid and start tick in another
        pid namespace is another process (two containers sharing a runtime directory). A namespace
        the agent did not send (an older hibernate) or that cannot be read here matches; one it sent
        that is no number never does.
        """
        if self.pid != pid or self.start_time != start_time or "pid_namespace" in self.extra:
            return False
        return self.pid_namespace is None or pid_namespace is None or self.pid_namespace == pid_namespace

    @property
    def snapshot_path(self) -> str | None:
        """Where the newest snapshot of the process is, if it has one."""
        path = (self.snapshot or {}).get("path")
        return path if isinstance(path, str) else None

    @property
    def state_word(self) -> str | None:
        """The state as the agent named it, for messages: a newer agent's unknown word too."""
        word = self.extra.get("state", _state_word(self.state))
        return word if isinstance(word, str) else None


def state_of(wire: Mapping[str, Any] | None) -> AgentState | None:
    """The state in a status as an agent sent it (None: no status, or no state this hibernate knows).

    For statuses kept as sent: a vLLM flow's polls, the entries ``hibernate status`` prints.
    """
    return parse_state(wire.get("state")) if wire is not None else None


# -- the requests -------------------------------------------------------------------------------
#
# Each operation's arguments as a client sends them (to_wire) and as the agent reads them
# (from_wire, which refuses what it cannot use with a UsageError naming the argument). status,
# begin, end, unlease, release and resume take none.

DEFAULT_TIMEOUT_S = 30.0


def _absolute_dir(args: Mapping[str, Any], what: str) -> str | None:
    directory = args.get("dir")
    if directory is not None and (not isinstance(directory, str) or not os.path.isabs(directory)):
        raise UsageError(f"dir must be {what}, got {directory!r}")
    return directory


@dataclass(frozen=True)
class HelloArgs:
    """``hello``: whether the answer counts the pools (``pools`` and ``device_bytes``).

    Counting them walks every tracked tensor of a running process (0.2 s at 100,000 tensors); a
    sleep, which enumerates them itself and reports what it spilled, asks without. Left out, the
    answer counts them, as an agent that knows no arguments to ``hello`` always does.
    """

    contents: bool = True

    def to_wire(self) -> dict[str, Any]:
        return {"contents": self.contents}

    @classmethod
    def from_wire(cls, args: Mapping[str, Any]) -> HelloArgs:
        contents = args.get("contents", True)
        if not isinstance(contents, bool):
            raise UsageError(f"contents must be true or false, got {contents!r}")
        return cls(contents)


@dataclass(frozen=True)
class WaitArgs:
    """``quiesce`` and ``close_leases``: how long the agent waits for its guard or its leases."""

    timeout: float = DEFAULT_TIMEOUT_S

    def to_wire(self) -> dict[str, Any]:
        return {"timeout": self.timeout}

    @classmethod
    def from_wire(cls, args: Mapping[str, Any]) -> WaitArgs:
        timeout = args.get("timeout", DEFAULT_TIMEOUT_S)
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not 0 <= timeout < 1e9:
            raise UsageError(f"timeout must be a non-negative number, got {timeout!r}")
        return cls(float(timeout))


@dataclass(frozen=True)
class LeaseArgs:
    """``lease``: what the holder calls itself (``hibernate serve``), shown in status and in a busy
    sleep's error."""

    by: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"by": self.by}

    @classmethod
    def from_wire(cls, args: Mapping[str, Any]) -> LeaseArgs:
        by = args.get("by")
        if by is not None and (not isinstance(by, str) or not by.isprintable() or not 0 < len(by) <= 64):
            raise UsageError(f"by must be a short printable string, got {by!r}")
        return cls(by)


@dataclass(frozen=True)
class ConfigureArgs:
    """``configure``: where the process's own later sleeps spill (None: nowhere until told)."""

    directory: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"dir": self.directory}

    @classmethod
    def from_wire(cls, args: Mapping[str, Any]) -> ConfigureArgs:
        return cls(_absolute_dir(args, "an absolute path or null"))


@dataclass(frozen=True)
class TransferArgs:
    """``restore``, and the transfer of a ``spill``: how the bytes move (the command's --buffer-mb, ...).

    The agent reads them into its store's options (``agent.controller.write_options``); an agent
    fills in its own default for any it is not sent.
    """

    buffer_mb: int = 256
    chunk_mb: int = 32
    io_mode: str = "auto"
    verify: bool = False  # read each snapshot back before its memory is released
    skip_reuse_check: bool = False  # reuse the previous snapshot's chunks without reading them back
    allow_moves: bool = False  # move tracked CUDA memory even while captured CUDA graphs may read it
    # Requests in flight and copy/hash threads (--io-depth, --io-workers); None: the agent chooses
    # from its machine and the snapshot's filesystem (store.tuning). Sent only when set.
    io_depth: int | None = None
    io_workers: int | None = None
    # Staging the process keeps for its next transfers, in MiB (--keep-staging-mb; 0
    # gives back what it keeps); None: the process's HIBERNATE_KEEP_STAGING_MB, else 0. Sent only
    # when set.
    keep_staging_mb: int | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "buffer_mb": self.buffer_mb,
            "chunk_mb": self.chunk_mb,
            "io_mode": self.io_mode,
            "verify": self.verify,
            "skip_reuse_check": self.skip_reuse_check,
            "allow_moves": self.allow_moves,
        }
        if self.io_depth is not None:
            wire["io_depth"] = self.io_depth
        if self.io_workers is not None:
            wire["io_workers"] = self.io_workers
        if self.keep_staging_mb is not None:
            wire["keep_staging_mb"] = self.keep_staging_mb
        return wire

    @classmethod
    def from_wire(cls, args: Mapping[str, Any]) -> TransferArgs:
        return cls(
            buffer_mb=_positive(args, "buffer_mb", cls.buffer_mb),
            chunk_mb=_positive(args, "chunk_mb", cls.chunk_mb),
            io_mode=str(args.get("io_mode", cls.io_mode)),
            verify=bool(args.get("verify", False)),
            skip_reuse_check=bool(args.get("skip_reuse_check", False)),
            allow_moves=bool(args.get("allow_moves", False)),
            io_depth=_positive(args, "io_depth", None),
            io_workers=_positive(args, "io_workers", None),
            keep_staging_mb=_not_negative(args, "keep_staging_mb"),
        )


@overload
def _positive(args: Mapping[str, Any], name: str, default: int) -> int: ...
@overload
def _positive(args: Mapping[str, Any], name: str, default: None) -> int | None: ...
def _positive(args: Mapping[str, Any], name: str, default: int | None) -> int | None:
    value = args.get(name)
    if value is None:
        return default
    if not _is_int(value) or value <= 0:
        raise UsageError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _not_negative(args: Mapping[str, Any], name: str) -> int | None:
    value = args.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < 0:
        raise UsageError(f"{name} must be an integer of 0 or more, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class SpillArgs:
    """``spill``: where the snapshot goes (None: the directory ``configure`` gave) and how."""

    directory: str | None = None
    transfer: TransferArgs = TransferArgs()

    def to_wire(self) -> dict[str, Any]:
        return {"dir": self.directory, **self.transfer.to_wire()}

    @classmethod
    def from_wire(cls, args: Mapping[str, Any]) -> SpillArgs:
        return cls(_absolute_dir(args, "an absolute path"), TransferArgs.from_wire(args))
