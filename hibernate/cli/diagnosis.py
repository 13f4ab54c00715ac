"""``hibernate doctor [PID]``: what this machine and this target can and cannot do, each with a fix.

Every check answers ``ok``, ``warn`` (works, with a cost or a risk worth
knowing) or ``fail`` (a sleep would be refused or would fail), and says how to
fix what is not ok. Nothing here changes anything: the driver and the binary
are only asked for versions, help and states. It runs on a machine without a
GPU too, where it says what is missing.

The facts behind the checks: the checkpoint driver API needs
CUDA 12.8 / driver 570 (GPU remapping 13.0 / 580); the binary's ``--action``
needs R555; restore needs persistence mode or ``cuInit`` in the caller;
cuda-checkpoint supports neither MIG nor MPS, nor UVM or CUDA IPC memory;
multi-process NCCL jobs hang or fail to restore unless NCCL's P2P, NVLS and
SHM transports (and vLLM's custom all-reduce) are off.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hibernate.checkpoint.nccl import NCCL_FIX, VLLM_FIX, nccl_traps
from hibernate.checkpoint.selection import VALIDATED_DRIVER_API
from hibernate.fsutil import free_bytes
from hibernate.units import human_bytes

OK, WARN, FAIL = "ok", "warn", "fail"
RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "detail": self.detail,
            "fix": self.fix,
            "data": self.data,
        }


# -- pure helpers -----------------------------------------------------------


def mount_for(path: str, mounts: Sequence[tuple[str, str]]) -> tuple[str, str]:
    """(mount point, filesystem type) of the mount holding ``path``: the longest matching mount point."""
    best = ("/", "unknown")
    for point, fstype in mounts:
        inside = path == point or path.startswith(point.rstrip("/") + "/") or point == "/"
        if inside and len(point) >= len(best[0]):
            best = (point, fstype)
    return best


def ptrace_verdict(scope: int | None, root: bool) -> tuple[str, str]:
    """What Yama's ptrace_scope means for driving another process's CUDA state."""
    if scope is None:
        return OK, "no Yama ptrace restrictions on this kernel"
    if scope <= 1:
        return OK, f"kernel.yama.ptrace_scope = {scope}"
    if root:
        return OK, f"kernel.yama.ptrace_scope = {scope}; running as root"
    return WARN, (
        f"kernel.yama.ptrace_scope = {scope}: only root may attach to other processes; cuda-checkpoint "
        "reaches the target through /proc and may be refused"
    )


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


# -- the checks ---------------------------------------------------------------


class Doctor:
    """Runs every check once, sharing what several checks need (the driver probe, NVML, the target)."""

    def __init__(self, pid: int | None, directory: Path | None, kind: str, binary_path: str | None) -> None:
        from hibernate.checkpoint import binary, driver, nvml

        self.pid = pid
        self.directory = directory
        self.kind = kind
        self.binary_path = binary_path
        self.driver = driver.probe()
        self.binary = binary.probe(binary_path)
        self.gpus = nvml.snapshot()
        self.checks: list[Check] = []
        self.checkpointer: Any = None
        self.processes: list[int] = []
        self.holders: list[Any] = []
        self.agents: list[Any] = []

    def add(self, check: str, status: str, detail: str, fix: str | None = None, **data: Any) -> None:
        self.checks.append(Check(check, status, detail, fix, data))

    def run(self) -> dict[str, Any]:
        self.check_platform()
        self.check_driver()
        self.check_binary()
        self.check_checkpointer()
        self.check_gpus()
        self.check_mig_mps()
        self.check_permissions()
        self.check_store_helper()
        if self.pid is not None:
            self.check_target()
            self.check_torch()
            self.check_graphs()
            self.check_nccl()
            self.check_vllm_peers()
        self.check_directory()
        ok = all(c.status != FAIL for c in self.checks)
        return {"ok": ok, "pid": self.pid, "checks": [c.to_wire() for c in self.checks]}

    def check_platform(self) -> None:
        machine = platform.machine()
        if machine in ("x86_64", "AMD64"):
            self.add("platform", OK, f"Linux {machine}")
        else:
            self.add(
                "platform",
                WARN,
                f"{platform.system()} {machine}: cuda-checkpoint was published for x86_64 Linux",
                "check that your driver's cuda-checkpoint supports this architecture",
            )

    def check_driver(self) -> None:
        d = self.driver
        release = self.gpus.driver_version if self.gpus else None
        if not d["loaded"]:
            self.add(
                "driver",
                WARN,
                f"no NVIDIA driver here ({d['path']} cannot be loaded): only host memory can be hibernated",
                "install the NVIDIA driver, 580 or newer (570 and 575 with cuda-checkpoint), "
                "to hibernate CUDA processes",
                path=d["path"],
            )
            return
        version = f"CUDA {d['cuda_version']}" + (f" (driver {release})" if release else "")
        if not d["checkpoint_api"]:
            self.add(
                "driver",
                WARN,
                f"{version}: no checkpoint driver API (it needs CUDA 12.8, driver 570)",
                "upgrade the NVIDIA driver to 580 or newer (570 and 575 with cuda-checkpoint)",
                driver=d,
            )
            return
        remap = "yes" if d["gpu_map"] else "no (driver 580)"
        if (d["version"] or 0) < VALIDATED_DRIVER_API:
            self.add(
                "driver",
                WARN,
                f"{version}: checkpoint driver API present but not validated below CUDA 13.0 "
                "(drivers 570 and 575); --checkpointer auto uses cuda-checkpoint where it is found",
                "upgrade the NVIDIA driver to 580 or newer, or install cuda-checkpoint",
                driver=d,
            )
            return
        self.add(
            "driver",
            OK,
            f"{version}: checkpoint driver API available; restore onto other GPUs: {remap}",
            driver=d,
        )

    def check_binary(self) -> None:
        b = self.binary
        needed = (
            not self.driver.get("checkpoint_api") or (self.driver.get("version") or 0) < VALIDATED_DRIVER_API
        )
        if b["path"] is None:
            self.add(
                "cuda-checkpoint",
                WARN if needed else OK,
                "not found (not on PATH, no --cuda-checkpoint, no $HIBERNATE_CUDA_CHECKPOINT)"
                + ("" if needed else "; not needed: the driver API is used"),
                "install it from https://github.com/NVIDIA/cuda-checkpoint" if needed else None,
            )
            return
        if not b["usable"]:
            self.add(
                "cuda-checkpoint",
                WARN,  # the "checkpointer" check gives the verdict
                f"{b['path']}: {b['error']}",
                b.get("hint"),
                binary=b,
            )
            return
        caps = [
            flag for flag, on in (("--timeout", b["lock_timeout"]), ("--device-map", b["device_map"])) if on
        ]
        missing = [] if b["device_map"] else ["--device-map (driver 580)"]
        self.add(
            "cuda-checkpoint",
            OK,
            f"{b['path']} (driver {b['driver_version'] or 'unknown'}): --action"
            + "".join(f", {c}" for c in caps)
            + (f"; lacks {', '.join(missing)}" if missing else ""),
            binary=b,
        )

    def check_checkpointer(self) -> None:
        from hibernate.checkpoint.selection import choose
        from hibernate.errors import HibernateError

        try:
            self.checkpointer, passed_over = choose(self.kind, self.binary_path)
        except HibernateError as exc:
            self.add("checkpointer", FAIL, f"--checkpointer {self.kind}: {exc.message}", exc.hint)
            return
        if self.checkpointer is None:
            self.add(
                "checkpointer",
                WARN,
                "none: a process holding CUDA state cannot be hibernated here ("
                + "; ".join(passed_over)
                + ")",
                "install an NVIDIA driver >= 580 (driver API) or cuda-checkpoint",
            )
            return
        how = (
            "in-process driver API"
            if self.checkpointer.name == "driver"
            else "a cuda-checkpoint run per step"
        )
        self.add(
            "checkpointer",
            OK,
            f"{self.checkpointer.name} ({how})",
            checkpointer=self.checkpointer.describe(),
        )

    def check_gpus(self) -> None:
        if self.gpus is None:
            loaded = self.driver["loaded"]
            self.add(
                "gpus",
                WARN if loaded else OK,
                "NVML is not available: the free-memory check before a restore will be skipped"
                if loaded
                else "no NVIDIA GPU on this machine (NVML not found): nothing to check",
                "install the driver's libnvidia-ml.so.1" if loaded else None,
            )
            return
        listed = "; ".join(
            f"GPU {g.index} {g.uuid} {g.name}: {human_bytes(g.free)} free of {human_bytes(g.total)}"
            for g in self.gpus.gpus
        )
        self.add("gpus", OK, listed or "NVML sees no GPU", gpus=[g.to_wire() for g in self.gpus.gpus])
        off = [g for g in self.gpus.gpus if g.persistence is False]
        if off:
            self.add(
                "persistence",
                WARN,
                "persistence mode is off on "
                + ", ".join(f"GPU {g.index}" for g in off)
                + ": a restore then needs cuInit in the caller (hibernate does it), and the driver is "
                "torn down and reloaded whenever no process holds the GPU",
                "sudo nvidia-smi -pm 1",
            )
        else:
            self.add("persistence", OK, "persistence mode is on for every GPU")

    def check_mig_mps(self) -> None:
        mig = [g for g in (self.gpus.gpus if self.gpus else []) if g.mig]
        if mig:
            self.add(
                "mig",
                FAIL,
                "MIG is enabled on "
                + ", ".join(f"GPU {g.index}" for g in mig)
                + ": cuda-checkpoint does not support MIG",
                "disable MIG (sudo nvidia-smi -i N -mig 0) on GPUs whose processes you hibernate",
            )
        else:
            self.add("mig", OK, "no GPU in MIG mode" if self.gpus else "n/a: no GPU seen")
        from hibernate import procinfo

        daemons = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and "nvidia-cuda-mps" in procinfo.command_line(int(entry)).split(" ")[0]:
                daemons.append(int(entry))
        if daemons:
            self.add(
                "mps",
                FAIL,
                f"an MPS daemon runs (pid {', '.join(map(str, daemons))}): cuda-checkpoint cannot handle MPS",
                "run the target without MPS (echo quit | nvidia-cuda-mps-control)",
            )
        else:
            self.add("mps", OK, "no MPS daemon running")

    def check_permissions(self) -> None:
        from hibernate import procinfo

        me = os.getuid()
        try:
            with open("/proc/sys/kernel/yama/ptrace_scope") as f:
                scope: int | None = int(f.read().strip())
        except (OSError, ValueError):
            scope = None
        status, detail = ptrace_verdict(scope, me == 0)
        self.add("ptrace", status, detail, None if status == OK else "run hibernate as root", scope=scope)
        if self.pid is None:
            self.add(
                "user", OK, "running as root" if me == 0 else f"running as uid {me}: your own processes only"
            )
            return
        owner = procinfo.owner_uid(self.pid)
        if owner is None:
            self.add("user", FAIL, f"no process with pid {self.pid}")
        elif me == 0 or owner == me:
            self.add("user", OK, "running as root" if me == 0 else f"process {self.pid} is yours (uid {me})")
        else:
            self.add(
                "user",
                FAIL,
                f"process {self.pid} belongs to uid {owner}; you are uid {me}",
                "run hibernate as that user, or as root",
            )

    def check_store_helper(self) -> None:
        """Whether this installation checksums and copies chunks in C (hibernate/store/bulk.py).

        Only speed depends on it, and only with many small tensors; it is the
        CLI's installation that is looked at, and an agent loads the helper of
        the environment its target runs in.
        """
        from hibernate.store import bulk

        if bulk.NATIVE:
            self.add("store-helper", OK, "compiled: chunks are checksummed and copied in C, without the GIL")
        elif os.environ.get("HIBERNATE_NATIVE") == "0":
            self.add("store-helper", WARN, "switched off by HIBERNATE_NATIVE=0: chunks are handled in Python")
        else:
            self.add(
                "store-helper",
                WARN,
                "not built (no C compiler when hibernate was installed): chunks are handled in Python, "
                "so sleeps and wakes of many small tensors take up to a third longer",
                "install a C compiler (e.g. apt install gcc) and reinstall hibernate, in the target's "
                "environment too",
            )

    def check_target(self) -> None:
        from hibernate import procinfo
        from hibernate.checkpoint.detect import survey
        from hibernate.errors import HibernateError
        from hibernate.operation.targets import NO_AGENT_HINT, find_agent

        assert self.pid is not None
        if procinfo.identity(self.pid) is None:
            return  # "user" already failed
        self.processes = procinfo.descendants(self.pid)
        self.agents = [a for a in (find_agent(p) for p in self.processes) if a is not None]
        if self.agents:
            self.add(
                "agents",
                OK,
                ", ".join(f"process {a.pid} ({a.status.state_word})" for a in self.agents),
                pids=[a.pid for a in self.agents],
            )
        else:
            self.add(
                "agents", FAIL, f"no hibernate agent in process {self.pid} or its descendants", NO_AGENT_HINT
            )
        try:
            found = survey(self.processes, self.checkpointer)
        except HibernateError as exc:
            self.add("cuda holders", FAIL, exc.message, exc.hint)
            return
        self.holders = found.holders
        if not found.holders:
            self.add("cuda holders", OK, "no process in the tree holds CUDA state", skipped=found.skipped)
            return
        usage = {pid: self.gpus.usage_of(pid) for pid in (h.pid for h in found.holders)} if self.gpus else {}
        parts, data = [], []
        for h in found.holders:
            state = h.state.value if h.state is not None else "unknown state"
            gpus = ", ".join(usage.get(h.pid, {})) or ", ".join(h.devices) or "no GPU seen"
            parts.append(f"process {h.pid}: {state} on {gpus}")
            data.append({"pid": h.pid, "state": state, "devices": h.devices, "gpus": usage.get(h.pid, {})})
        states = {h.state.value for h in found.holders if h.state is not None}
        if self.checkpointer is None:
            status, fix = FAIL, "install an NVIDIA driver >= 570 or cuda-checkpoint: sleep would be refused"
        elif "failed" in states:
            status, fix = FAIL, "a process in the driver's failed state only recovers by a restart"
        elif states - {"running"}:
            status, fix = WARN, f"not all running: `hibernate wake {self.pid}` brings them back first"
        else:
            status, fix = OK, None
        self.add("cuda holders", status, "; ".join(parts), fix, holders=data, skipped=found.skipped)

    def check_torch(self) -> None:
        """The target's torch, as its agents report it: does an untracked view used asleep raise or crash?

        The agent in the target reads its own torch (the CLI never imports one) and
        words what a build without storage poisoning costs; an agent that reports no
        torch (an older hibernate) is left out.
        """
        reported = [(a.pid, a.status.torch) for a in self.agents if a.status.torch is not None]
        if not reported:
            return
        versions = {str(pid): torch.get("version") for pid, torch in reported}
        warned = [(pid, torch["warning"]) for pid, torch in reported if torch.get("warning")]
        if warned:
            self.add(
                "torch",
                WARN,
                "; ".join(f"process {pid}: {warning}" for pid, warning in warned),
                "upgrade torch in the target's environment, or hold hibernate.guard() around every use "
                "of a tracked tensor's views",
                versions=versions,
            )
            return
        builds = [
            f"process {pid}: torch {torch.get('version')} "
            + (f"(CUDA {torch['cuda']})" if torch.get("cuda") else "(CPU only)")
            for pid, torch in reported
        ]
        self.add("torch", OK, "; ".join(builds), versions=versions)

    def check_graphs(self) -> None:
        """The CUDA graphs each agent saw captured: what a sleep that moves tracked memory is refused for.

        An agent of an older hibernate does not report them and is left out.
        """
        reported = [(a.pid, a.status.graphs) for a in self.agents if a.status.graphs is not None]
        if not reported:
            return
        seen = [(pid, graph) for pid, graphs in reported for graph in graphs if isinstance(graph, dict)]
        if not seen:
            self.add(
                "graphs", OK, "no live CUDA graph seen captured since the first track or pool", graphs=[]
            )
            return
        outside = [(pid, g) for pid, g in seen if not g.get("hibernate_pool")]
        listed = "; ".join(
            f"process {pid}: captured at {g.get('captured_at')}"
            + (" in a hibernate pool" if g.get("hibernate_pool") else "")
            for pid, g in seen
        )
        self.add(
            "graphs",
            WARN if outside else OK,
            f"{len(seen)} live CUDA graph(s): {listed}",
            "a sleep that would move tracked CUDA memory beside these graphs is refused (exit 15): allocate "
            "what they read in hibernate.pool() and capture with hibernate.cuda_graph, or pass --allow-moves "
            "if the program captures them again after every wake"
            if outside
            else None,
            graphs=[{"pid": pid, **g} for pid, g in seen],
        )

    def check_nccl(self) -> None:
        from hibernate import procinfo

        if len(self.holders) < 2:
            self.add("nccl", OK, "fewer than two CUDA processes: no NCCL traps")
            return
        infiniband = Path("/sys/class/infiniband").is_dir() and any(Path("/sys/class/infiniband").iterdir())
        found = {}
        for h in self.holders:
            traps = nccl_traps(procinfo.environment(h.pid), procinfo.command_line(h.pid), infiniband)
            if traps:
                found[h.pid] = traps
        if not found:
            self.add("nccl", OK, f"{len(self.holders)} CUDA processes; NCCL P2P, NVLS and SHM are off")
            return
        detail = "; ".join(f"process {pid}: {', '.join(traps)}" for pid, traps in found.items())
        # The sleep refuses what it checks (all but InfiniBand, which may be unused): a fail here.
        refused = any(
            nccl_traps(procinfo.environment(pid), procinfo.command_line(pid), infiniband=False)
            for pid in found
        )
        self.add(
            "nccl",
            FAIL if refused else WARN,
            f"multi-process target: {detail} (such NCCL jobs hang or fail to restore on many drivers"
            + ("; `hibernate sleep` refuses it without --force)" if refused else ")"),
            NCCL_FIX + (" NCCL_IB_DISABLE=1" if infiniband else "") + f" ({VLLM_FIX})",
            traps={str(pid): traps for pid, traps in found.items()},
        )

    def check_vllm_peers(self) -> None:
        """What of a multi-GPU vLLM server's memory shared across GPUs a checkpoint would meet.

        vLLM 0.33 tears down FlashInfer's all-reduce and all-to-all workspaces
        (``checkpoint_prepare_distributed_state``, which the hibernate backend
        calls) and can unmap the buffers NCCL imported from peers
        (``--enable-nccl-comm-suspend``); its custom all-reduce and its
        all-reduce through torch symmetric memory stay unless turned off. The
        vLLM is read from the workers (they map its extensions), the flags from
        the command lines of the tree, the environment from the workers.
        Targets of fewer than two CUDA processes, or without vLLM, get no line.
        """
        from hibernate import procinfo
        from hibernate.checkpoint.nccl import (
            COMM_SUSPEND_FLAG,
            SYMM_MEM_ON,
            VLLM_SAFE,
            has_flag,
            runs_vllm,
            vllm_features_of,
        )

        if len(self.holders) < 2:
            return
        vllm_agents = {a.pid for a in self.agents if a.status.runtime == "vllm"}
        lines = {pid: procinfo.command_line(pid) for pid in self.processes}
        vllm_pids = [pid for pid in self.processes if pid in vllm_agents or runs_vllm(lines[pid])]
        if not vllm_pids:
            return
        safe_fix = "serve with --disable-custom-all-reduce and VLLM_ALLREDUCE_USE_SYMM_MEM=0"
        found = [f for f in (vllm_features_of(h.pid) for h in self.holders) if f is not None]
        if not found:
            self.add(
                "vllm peers",
                WARN,
                "cannot tell which vLLM the workers run (none maps a vLLM package): whether its "
                "communicators can be readied for a checkpoint is unknown",
                f"vLLM 0.33 or newer tears down FlashInfer's workspaces; {safe_fix}",
            )
            return
        features = found[0]
        tree = " ".join(lines[pid] for pid in vllm_pids)
        suspend_on = has_flag(tree, COMM_SUSPEND_FLAG)
        data: dict[str, Any] = {
            "package": features.package,
            "distributed_checkpoint": features.distributed_checkpoint,
            "comm_suspend": features.comm_suspend,
            "comm_suspend_on": suspend_on,
        }
        left = []  # what a checkpoint would still meet
        if not has_flag(tree, "--disable-custom-all-reduce"):
            left.append(
                "vLLM's custom all-reduce is on (--disable-custom-all-reduce is not on the command line)"
            )
        if any(
            procinfo.environment(h.pid).get(name) != value
            for h in self.holders
            for name, value in VLLM_SAFE.items()
        ):
            left.append(SYMM_MEM_ON)
        if not features.distributed_checkpoint:
            self.add(
                "vllm peers",
                WARN,
                f"the vLLM at {features.package} has no checkpoint_prepare_distributed_state (it came with "
                "0.33): its all-reduce workspaces in memory shared across GPUs stay during a checkpoint, "
                "which may then fail or hang",
                f"upgrade vLLM to 0.33 or newer, and {safe_fix}",
                **data,
            )
            return
        if features.comm_suspend and not suspend_on:
            left.append(
                f"{COMM_SUSPEND_FLAG} is not on the command line: NCCL keeps the buffers it imported "
                "from peers mapped"
            )
        done = (
            f"the vLLM at {features.package} tears down FlashInfer's all-reduce and all-to-all workspaces "
            "for a checkpoint (hibernate asks it to)"
        )
        if left:
            fixes = [safe_fix] if len(left) > 1 or not left[0].startswith(COMM_SUSPEND_FLAG) else []
            if features.comm_suspend and not suspend_on:
                fixes.append(f"serve with {COMM_SUSPEND_FLAG} (NCCL 2.29.7 or newer)")
            self.add(
                "vllm peers", WARN, f"{done}, and nothing else: {'; '.join(left)}", "; ".join(fixes), **data
            )
            return
        self.add(
            "vllm peers",
            OK,
            f"{done}; its custom and symmetric-memory all-reduces are off"
            + (f"; {COMM_SUSPEND_FLAG} is on" if suspend_on else ""),
            **data,
        )

    def check_directory(self) -> None:
        from hibernate.store.directio import direct_io_supported

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
        if fstype in RAM_FILESYSTEMS:
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


def run(
    pid: int | None, directory: Path | None, kind: str = "auto", binary_path: str | None = None
) -> dict[str, Any]:
    """Every check for this machine (and ``pid``'s process tree when given)."""
    from hibernate import procinfo
    from hibernate.checkpoint.selection import KINDS
    from hibernate.errors import NoSuchProcessError, UsageError

    if kind not in KINDS:
        raise UsageError(f"--checkpointer must be one of {', '.join(KINDS)}, not {kind!r}")
    if pid is not None and procinfo.identity(pid) is None:
        raise NoSuchProcessError(f"no process with pid {pid}")
    return Doctor(pid, directory, kind, binary_path).run()
