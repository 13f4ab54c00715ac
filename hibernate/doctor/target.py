"""The checks of one target: its agents, its CUDA holders, its torch and CUDA graphs, and what a
multi-process one (NCCL, a multi-GPU vLLM server) would meet in a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hibernate.checkpoint.nccl import NCCL_FIX, VLLM_FIX, nccl_traps
from hibernate.doctor.checks import FAIL, OK, WARN, Examination


class TargetChecks(Examination):
    """What the target (``pid``'s process tree) holds, and what a sleep of it would meet."""

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
