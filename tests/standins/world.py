"""STAND-IN control for tests: build the fake driver from C and drive its world.

``build(directory)`` compiles, with gcc, into a test's temporary directory:

- ``libcuda.so.1``: the CUDA checkpoint driver API (fake_libcuda.c);
- ``old/libcuda.so.1``: the same without cuCheckpoint* (a driver older than 570);
- ``cuda-checkpoint``: the CLI, linked to the fake libcuda like the real stub is to the real one;
- ``libnvidia-ml.so.1``: the few NVML calls hibernate makes.

Nothing built is committed. A :class:`World` is one directory of state
(``HIBERNATE_STANDIN_DIR``): the GPUs, the registered CUDA processes (one
state machine per pid, shared by all three libraries) and the log of every
call. Faults are injected with ``HIBERNATE_STANDIN_FAULTS`` (see
standin_world.h).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from hibernate import procinfo
from tests.conftest import wait_until

SOURCES = Path(__file__).resolve().parent
STATES = ("running", "locked", "checkpointed", "failed", "checkpointing", "restoring")
GIB = 1 << 30
_CFLAGS = ["-O1", "-Wall", "-Wextra", "-Werror", "-Wno-unused-function"]


@dataclass(frozen=True)
class Build:
    libcuda: Path
    libcuda_old: Path
    binary: Path
    nvml: Path


def build(directory: Path) -> Build:
    """Compile the stand-ins into ``directory`` (needs gcc)."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise RuntimeError("the CUDA stand-ins need gcc")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "old").mkdir(exist_ok=True)
    out = Build(
        libcuda=directory / "libcuda.so.1",
        libcuda_old=directory / "old" / "libcuda.so.1",
        binary=directory / "cuda-checkpoint",
        nvml=directory / "libnvidia-ml.so.1",
    )
    shared = [gcc, "-shared", "-fPIC", *_CFLAGS, f"-I{SOURCES}"]
    commands = [
        [*shared, "-Wl,-soname,libcuda.so.1", "-o", str(out.libcuda), str(SOURCES / "fake_libcuda.c")],
        [
            *shared,
            "-DSTANDIN_NO_CHECKPOINT_API",
            "-Wl,-soname,libcuda.so.1",
            "-o",
            str(out.libcuda_old),
            str(SOURCES / "fake_libcuda.c"),
        ],
        [
            gcc,
            *_CFLAGS,
            f"-I{SOURCES}",
            "-o",
            str(out.binary),
            str(SOURCES / "fake_cuda_checkpoint.c"),
            str(out.libcuda),
            f"-Wl,-rpath,{directory}",
        ],
        [*shared, "-o", str(out.nvml), str(SOURCES / "fake_nvml.c")],
    ]
    for command in commands:
        subprocess.run(command, check=True, capture_output=True, text=True)
    return out


def gpu_uuid(index: int) -> str:
    return f"GPU-{index:08x}-1111-2222-3333-{0x444455556666 + index:012x}"


@dataclass
class Gpu:
    uuid: str
    total: int
    other: int = 0
    persistence: bool = True
    mig: int = -1  # -1: no MIG on this GPU (NVML_ERROR_NOT_SUPPORTED)
    name: str = "StandIn-H200"


class World:
    """The fake driver's state for one test."""

    def __init__(self, built: Build, directory: Path) -> None:
        self.built = built
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.gpus: list[Gpu] = []

    @property
    def env(self) -> dict[str, str]:
        """Environment that points hibernate (and the stand-ins) at this world."""
        return {
            "HIBERNATE_STANDIN_DIR": str(self.dir),
            "HIBERNATE_LIBCUDA": str(self.built.libcuda),
            "HIBERNATE_CUDA_CHECKPOINT": str(self.built.binary),
            "HIBERNATE_LIBNVML": str(self.built.nvml),
        }

    # -- GPUs ----------------------------------------------------------------

    def add_gpu(self, total: int = 80 * GIB, **kwargs: object) -> Gpu:
        gpu = Gpu(gpu_uuid(len(self.gpus)), total, **kwargs)  # type: ignore[arg-type]
        self.gpus.append(gpu)
        self._write_gpus()
        return gpu

    def set_other_use(self, index: int, nbytes: int) -> None:
        """Memory taken on GPU ``index`` by something else (another job)."""
        self.gpus[index].other = nbytes
        self._write_gpus()

    def _write_gpus(self) -> None:
        lines = [f"{g.uuid} {g.total} {g.other} {int(g.persistence)} {g.mig} {g.name}\n" for g in self.gpus]
        (self.dir / "gpus").write_text("".join(lines))

    # -- processes -----------------------------------------------------------

    def register(self, pid: int, gpu: int = 0, nbytes: int = GIB, state: str = "running") -> None:
        """Make ``pid`` a CUDA process of this world (holding ``nbytes`` on GPU ``gpu``)."""
        self._write(pid, STATES.index(state), gpu, nbytes, 0)

    def _write(self, pid: int, state: int, gpu: int, nbytes: int, wedged: int) -> None:
        path = self.dir / f"pid-{pid}"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{state} {gpu} {nbytes} {wedged}\n")
        tmp.rename(path)

    def _read(self, pid: int) -> list[int]:
        return [int(x) for x in (self.dir / f"pid-{pid}").read_text().split()]

    def state(self, pid: int) -> str:
        """The state the driver would answer: a call in progress (held) shows, one cut half-way is failed."""
        busy = self.dir / f"pid-{pid}.busy"
        with contextlib.suppress(FileNotFoundError):
            step, caller, started = busy.read_text().split()
            if procinfo.start_time(int(caller)) == int(started) and not _zombie(int(caller)):
                return "restoring" if step == "restore" else "checkpointing"
            return "failed"
        return STATES[self._read(pid)[0]]

    # -- calls that take as long as the test says ---------------------------------

    def hold(self, step: str, pid: int) -> None:
        """A ``step`` (checkpoint or restore) of ``pid`` that begins does not end until :meth:`release`."""
        (self.dir / f"hold-{step}-{pid}").touch()

    def release(self, step: str, pid: int) -> None:
        (self.dir / f"hold-{step}-{pid}").unlink(missing_ok=True)

    def in_progress(self, pid: int) -> tuple[str, int] | None:
        """The step of ``pid`` held in progress and the pid of the process that called it, if any."""
        with contextlib.suppress(FileNotFoundError, ValueError):
            step, caller, _ = (self.dir / f"pid-{pid}.busy").read_text().split()
            return step, int(caller)
        return None

    def set_state(self, pid: int, state: str) -> None:
        _, gpu, nbytes, wedged = self._read(pid)
        self._write(pid, STATES.index(state), gpu, nbytes, wedged)

    def gpu_of(self, pid: int) -> int:
        return self._read(pid)[1]

    def wedged(self, pid: int) -> bool:
        return bool(self._read(pid)[3])

    # -- the call log ----------------------------------------------------------

    def calls(
        self, steps: tuple[str, ...] = ("lock", "checkpoint", "restore", "unlock")
    ) -> list[tuple[str, str, int, str]]:
        """(caller, step, pid, result) of every call so far, in order, for the given steps."""
        log = self.dir / "calls.log"
        if not log.exists():
            return []
        out = []
        for line in log.read_text().splitlines():
            caller, step, pid, result = line.split()
            if step in steps:
                out.append((caller, step, int(pid), result))
        return out

    def wait_for_call(self, step: str, pid: int) -> None:
        """Wait until a ``step`` call on ``pid`` has returned and been logged.

        A call a test gave up on still runs in a thread of the test process;
        the test lets it return before it ends rather than leave it behind.
        """
        wait_until(
            lambda: (step, pid) in [(s, p) for _, s, p, _ in self.calls((step,))],
            timeout=30,
            what=f"the abandoned {step} call on {pid} to return",
        )

    def clear_calls(self) -> None:
        (self.dir / "calls.log").unlink(missing_ok=True)


def _zombie(pid: int) -> bool:
    with contextlib.suppress(OSError):
        raw = Path(f"/proc/{pid}/stat").read_text()
        return raw[raw.rindex(")") + 2] == "Z"
    return True


def spec(*items: tuple[str, int | None, str]) -> str:
    """HIBERNATE_STANDIN_FAULTS for (step, pid or None, action) items."""
    return ",".join(f"{step}{'' if pid is None else f'@{pid}'}={action}" for step, pid, action in items)


@dataclass
class Tree:
    """A running tree_target.py: a parent and its children.

    The children are held by pidfd from the start, while their parent still
    holds their pids: once it is gone, an exited child is reaped by whoever
    adopted it and its pid may name another process, which a kill by pid
    would hit.
    """

    proc: subprocess.Popen[bytes]
    children: list[int]
    handles: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for child in self.children:
            with contextlib.suppress(ProcessLookupError):
                self.handles.append(os.pidfd_open(child))

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def pids(self) -> list[int]:
        return [self.pid, *self.children]

    def stop(self) -> None:
        for handle in self.handles:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(handle, signal.SIGKILL)
            os.close(handle)
        self.handles.clear()
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=60)
