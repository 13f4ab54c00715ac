"""Every failure hibernate reports, each with a stable exit code.

Scripts of batch schedulers branch on the exit code, so codes are part of the
public contract (README, "Exit codes"): never renumber one, only add. Errors
also travel over the agent socket as ``{"code": "<name>", "message": ...}``
and are rebuilt on the client side with :func:`error_from_wire`, so a failure
inside the target reaches the user with its own code and words.

The whole hierarchy, with each class's exit code; those defined elsewhere say
where (they belong to one package's job, and are raised only there)::

    HibernateError                          1  base of every expected failure
    ├── UsageError                          2  bad arguments
    │   └── ServerUnreachableError             flows.vllm_api: nothing answers at the address
    ├── NoSuchProcessError                  3
    │   (StartError, serve.starter, takes this code: a backend that never became ready)
    ├── NothingToHibernateError             4  no agent in the process tree
    ├── PermissionDeniedError               5
    ├── WrongStateError                     6  already asleep, not asleep
    │   └── HibernatingError                   guard(wait=False) while the process sleeps
    ├── BusyError                           7
    ├── SnapshotInvalidError                8
    ├── StorageError                        9  I/O, no space left
    ├── HibernateTimeoutError              10
    │   ├── StillRunningError                  checkpoint.base: a driver call outlived its timeout
    │   └── _LeftInFlightError                 flows.vllm: a server request still being carried out
    ├── CudaCheckpointError                11
    │   └── CheckpointStepError                checkpoint.base: one process, one step, its CUDA result
    ├── UnsupportedError                   12
    │   ├── DriverUnavailableError             checkpoint.driver: no libcuda checkpoint API
    │   ├── BinaryUnavailableError             checkpoint.binary: no usable cuda-checkpoint
    │   └── DevEndpointsMissingError           flows.vllm_api: a vLLM server without /sleep
    ├── NeedsRecoveryError                 13  stopped half-way; keeps its journal entry
    ├── ServerFailedError                  14  the target's own server refused or failed
    │   └── ServerConnectionLostError          flows.vllm_api: closed before answering
    ├── AddressesWouldMoveError            15  captured CUDA graphs may read what would move
    ├── InterruptedByUserError            130  Ctrl-C
    ├── AbortedError                        1  the client went away; everything undone
    ├── ProtocolError                       1  a peer we do not understand
    ├── AgentConnectionLostError            1  agent.client: the agent's process exited or was killed
    ├── InjectedFaultError                  1  faults: a failure asked for by HIBERNATE_FAULT
    ├── DeviceMemoryError                   1  pools.device: a CUDA runtime call failed
    ├── StartError                          3  serve.starter (see above)
    ├── NoRoomError                         1  serve.backends: a wake that cannot fit the GPU budget
    └── NodeStepError                    the verdict's  sched.nodestep: the job's nodes agreed on abort

Every class's name ends in ``Error``. Some once did not; their former names
(``AgentConnectionLost``, ``ServerConnectionLost``, ``DriverUnavailable``,
``BinaryUnavailable``, ``InjectedFault``) stay as aliases in their modules, for
code that catches them.

Internal signals, never shown as such (each is caught in the package that
raises it and turned into one of the above, or into an answer): ``CallTimedOutError`` (threads),
``PipelineAbortedError`` and ``DirectIORefusedError`` (store.directio),
``CannotStartError`` (checkpoint.detached), ``UnknownSegmentsError``
(pools.tensors), ``ApiError`` (serve.routing: an HTTP error answered to a
client).
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Process exit codes of the ``hibernate`` command."""

    OK = 0
    FAILURE = 1  # unexpected: a bug or an unclassified error
    USAGE = 2  # bad arguments (also what typer/click use)
    NO_SUCH_PROCESS = 3
    NOTHING_TO_HIBERNATE = 4  # no agent in the process tree
    PERMISSION_DENIED = 5  # another user's process or socket
    WRONG_STATE = 6  # already asleep / not asleep
    BUSY = 7  # another operation holds the target
    SNAPSHOT_INVALID = 8  # missing, corrupt or foreign snapshot
    IO_ERROR = 9  # includes no space left
    TIMEOUT = 10
    CUDA_CHECKPOINT = 11  # cuda-checkpoint / driver API failed
    UNSUPPORTED = 12  # this machine or target cannot do what was asked
    NEEDS_RECOVERY = 13  # an operation stopped half-way and could not be undone
    SERVER_FAILED = 14  # the target's own server (vLLM) refused or failed a request
    ADDRESSES_WOULD_MOVE = 15  # a sleep would move memory that captured CUDA graphs may read
    INTERRUPTED = 130  # Ctrl-C (SIGINT): 128 + the signal's number, as a shell reports it


class HibernateError(Exception):
    """Base of all expected failures; ``code`` decides the exit status."""

    exit_code: ExitCode = ExitCode.FAILURE
    wire_name = "failure"
    # An operation that fails with this error keeps its journal entry: what it left cannot be
    # judged now, and `hibernate recover` finishes or undoes it from the journal later.
    keeps_journal: bool = False

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"

    def add_context(
        self, context: str, *, unless: str | tuple[str, ...] | None = None, hint: str | None = None
    ) -> HibernateError:
        """Put where the failure happened in front of the message, as the error travels up.

        Each layer knows a little more (which process, which step) than the one
        that raised; ``unless`` skips the prefix where an inner layer already
        named it, and ``hint`` is used only where the error has none.
        """
        if unless is None or not self.message.startswith(unless):
            self.message = f"{context}: {self.message}"
        if self.hint is None:
            self.hint = hint
        return self

    def add_consequence(self, consequence: str) -> HibernateError:
        """Say after the message what the failure led to, where a layer above did something about it."""
        self.message = f"{self.message}; {consequence}"
        return self

    def to_wire(self) -> dict[str, str | None]:
        return {"code": self.wire_name, "message": self.message, "hint": self.hint}


class UsageError(HibernateError):
    exit_code = ExitCode.USAGE
    wire_name = "usage"


class NoSuchProcessError(HibernateError):
    exit_code = ExitCode.NO_SUCH_PROCESS
    wire_name = "no-such-process"


class NothingToHibernateError(HibernateError):
    exit_code = ExitCode.NOTHING_TO_HIBERNATE
    wire_name = "nothing-to-hibernate"


class PermissionDeniedError(HibernateError):
    exit_code = ExitCode.PERMISSION_DENIED
    wire_name = "permission-denied"


class WrongStateError(HibernateError):
    exit_code = ExitCode.WRONG_STATE
    wire_name = "wrong-state"


class HibernatingError(WrongStateError):
    """``guard(wait=False)`` was entered while the process is (going) asleep."""

    wire_name = "hibernating"


class BusyError(HibernateError):
    exit_code = ExitCode.BUSY
    wire_name = "busy"


class SnapshotInvalidError(HibernateError):
    exit_code = ExitCode.SNAPSHOT_INVALID
    wire_name = "snapshot-invalid"


class StorageError(HibernateError):
    """An I/O failure while writing or reading a snapshot (ENOSPC included)."""

    exit_code = ExitCode.IO_ERROR
    wire_name = "io-error"


class HibernateTimeoutError(HibernateError):
    exit_code = ExitCode.TIMEOUT
    wire_name = "timeout"


class CudaCheckpointError(HibernateError):
    exit_code = ExitCode.CUDA_CHECKPOINT
    wire_name = "cuda-checkpoint"


class UnsupportedError(HibernateError):
    exit_code = ExitCode.UNSUPPORTED
    wire_name = "unsupported"


class NeedsRecoveryError(HibernateError):
    exit_code = ExitCode.NEEDS_RECOVERY
    wire_name = "needs-recovery"
    keeps_journal = True


class ServerFailedError(HibernateError):
    """The target's own server (a vLLM server's /sleep or /wake_up) answered with an error."""

    exit_code = ExitCode.SERVER_FAILED
    wire_name = "server-failed"


class AddressesWouldMoveError(HibernateError):
    """A sleep would bring tracked memory back at new addresses while CUDA graphs may hold the old ones.

    A graph replays against the addresses it captured: after such a wake it
    would read memory that is no longer the program's tensors and give wrong
    answers with no error. Refused before anything is touched, unless the
    caller says the program captures its graphs again after each wake.
    """

    exit_code = ExitCode.ADDRESSES_WOULD_MOVE
    wire_name = "addresses-would-move"


class AbortedError(HibernateError):
    """The operation was called off (its client went away); everything was undone."""

    exit_code = ExitCode.FAILURE
    wire_name = "aborted"


class InterruptedByUserError(HibernateError):
    """The command got SIGINT (Ctrl-C); the message says what state each target was left in."""

    exit_code = ExitCode.INTERRUPTED
    wire_name = "interrupted"


class ProtocolError(HibernateError):
    """The peer spoke a protocol we do not understand (version, framing, size)."""

    exit_code = ExitCode.FAILURE
    wire_name = "protocol"


_BY_WIRE_NAME: dict[str, type[HibernateError]] = {
    cls.wire_name: cls
    for cls in (
        HibernateError,
        UsageError,
        NoSuchProcessError,
        NothingToHibernateError,
        PermissionDeniedError,
        WrongStateError,
        HibernatingError,
        BusyError,
        SnapshotInvalidError,
        StorageError,
        HibernateTimeoutError,
        CudaCheckpointError,
        UnsupportedError,
        NeedsRecoveryError,
        ServerFailedError,
        AddressesWouldMoveError,
        AbortedError,
        InterruptedByUserError,
        ProtocolError,
    )
}


def describe_cause(error: BaseException) -> str:
    """``error`` as the cause in front of a failed undo's message: never empty (a Ctrl-C's
    KeyboardInterrupt has no words of its own), and without a hint meant for the cause alone."""
    if isinstance(error, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    if isinstance(error, HibernateError):
        return error.message
    return str(error) or type(error).__name__


def error_from_wire(payload: object) -> HibernateError:
    """Rebuild an error sent by an agent; unknown codes become a plain failure."""
    if not isinstance(payload, dict):
        return ProtocolError(f"malformed error from agent: {payload!r}")
    cls = _BY_WIRE_NAME.get(str(payload.get("code")), HibernateError)
    hint = payload.get("hint")
    return cls(str(payload.get("message", "unknown error")), hint=hint if isinstance(hint, str) else None)
