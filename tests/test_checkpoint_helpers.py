"""hibernate's own helper processes are never CUDA holders of the server they serve.

A vLLM worker with HIBERNATE_SELF_CHECKPOINT=1 keeps a helper child that loads
libcuda; on a real driver its ``cuInit`` opens the NVIDIA device files and the
driver may answer for it. A `hibernate sleep` of the server finds it among the
server's descendants; it must be set aside, never locked with its worker.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hibernate import orchestrator
from hibernate.checkpoint.detect import HELPER_ENV, helper_of, survey
from hibernate.checkpoint.driver import DriverCheckpointer
from hibernate.integrations.self_checkpoint import HelperProcess
from hibernate.operation.cuda import CudaStage
from tests.standins.world import World


def test_the_self_checkpoint_helper_is_set_aside_and_never_asked_about(
    world: World, runtime_dir: Path
) -> None:
    helper = HelperProcess({**os.environ, "HIBERNATE_CHECKPOINTER": "driver"})
    try:
        assert helper.pid is not None
        world.register(helper.pid)  # the driver would answer for it, as for a CUDA process
        assert helper_of(helper.pid) == os.getpid()
        found = survey([helper.pid], DriverCheckpointer())
        assert found.holders == []
        (entry,) = found.skipped
        assert entry["pid"] == helper.pid
        assert (
            entry["reason"]
            == f"hibernate's own self-checkpoint helper of process {os.getpid()}: never a target"
        )
        stage = CudaStage(orchestrator.Options(checkpointer_kind="driver"))
        stage.require([helper.pid])
        assert stage.holders == [] and stage.skipped == [entry]
        assert [pid for _, step, pid, _ in world.calls(("state",)) if pid == helper.pid] == []
        assert world.state(helper.pid) == "running"
    finally:
        helper.close()


def test_a_process_without_the_mark_is_a_holder_as_before(world: World) -> None:
    plain = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if k != HELPER_ENV},
    )
    try:
        world.register(plain.pid)
        assert helper_of(plain.pid) is None
        assert [h.pid for h in survey([plain.pid], DriverCheckpointer()).holders] == [plain.pid]
    finally:
        plain.kill()
        plain.wait()
