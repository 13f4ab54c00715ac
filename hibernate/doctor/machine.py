"""The checks of this machine: platform, driver, cuda-checkpoint, the checkpointer, GPUs, MIG and
MPS, permissions and the store's compiled helper.

Nothing here changes anything: the driver and the binary are only asked for
versions, help and states.
"""

from __future__ import annotations

import os
import platform

from hibernate.checkpoint.selection import VALIDATED_DRIVER_API
from hibernate.doctor.checks import FAIL, OK, WARN, Examination
from hibernate.units import human_bytes


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


class MachineChecks(Examination):
    """What this machine can do, whatever the target."""

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
