"""A snapshot outlives its process: a new process of the same program adopts it and goes on.

Each test runs tests/adopt_program.py as a job would: a first process trains,
sleeps and is killed; a second, started fresh, tracks the same model and
optimizer and adopts the snapshot before its optimizer has stepped.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hibernate.errors import SnapshotInvalidError
from tests.conftest import NOBODY, REPO, chunks_in, flip_byte_at, is_root, wait_until


def run_program(
    mode: str, directory: Path, variant: str = "", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.adopt_program", mode, str(directory), variant],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


class Preempted:
    """The first process: trained 3 steps, asleep in ``directory``, then killed."""

    def __init__(self, directory: Path, variant: str = "") -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.adopt_program", "first", str(directory), variant],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # written once it is asleep
        if not line:
            self.process.wait(timeout=60)
            raise AssertionError(
                f"the first process ended: {self.process.stderr.read() if self.process.stderr else ''}"
            )
        self.state = json.loads(line)["state"]

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=60)
        wait_until(
            lambda: not Path(f"/proc/{self.process.pid}").exists(), 30, "the killed process to be gone"
        )

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def preempted(work_dir: Path, runtime_dir: Path) -> Iterator[Preempted]:
    first = Preempted(work_dir)
    try:
        yield first
    finally:
        first.close()


def test_a_new_process_adopts_a_killed_ones_snapshot_and_trains_on_as_if_never_stopped(
    preempted: Preempted, work_dir: Path
) -> None:
    preempted.kill()
    second = run_program("second", work_dir)
    assert second.returncode == 0, second.stderr
    answer: dict[str, Any] = json.loads(second.stdout)
    assert answer["state"] == preempted.state, "weights, buffers and optimizer state bit-identical"
    straight = run_program("straight", work_dir)
    assert straight.returncode == 0, straight.stderr
    assert answer["after"] == json.loads(straight.stdout)["after"], "3 + 3 steps equal 6 uninterrupted"
    report = answer["report"]
    assert report["snapshot"].startswith(str(work_dir)) and report["snapshot"].endswith("snap-000001")
    assert report["owner_state"].startswith("dead")
    assert report["adopted_bytes"] > 0 and report["read_bytes"] >= report["adopted_bytes"]


@pytest.mark.slow
def test_a_gpt2_and_its_adamw_killed_after_3_steps_go_on_in_a_new_process_as_if_never_stopped(
    work_dir: Path, runtime_dir: Path
) -> None:
    """transformers' GPT-2 from a config (tied embeddings, no dropout) and AdamW: the adopting
    process's weights and optimizer state are bit-identical to the killed one's at its sleep, and
    3 more steps give the weights of 6 uninterrupted ones."""
    pytest.importorskip("transformers")
    first = Preempted(work_dir, "gpt2")
    try:
        first.kill()
    finally:
        first.close()
    second = run_program("second", work_dir, "gpt2")
    assert second.returncode == 0, second.stderr
    answer = json.loads(second.stdout)
    assert answer["state"] == first.state
    straight = run_program("straight", work_dir, "gpt2")
    assert straight.returncode == 0, straight.stderr
    assert answer["after"] == json.loads(straight.stdout)["after"]
    assert not answer["report"]["warnings"] or "gradients" in answer["report"]["warnings"][0]


def test_a_snapshot_whose_process_still_runs_is_not_adopted(preempted: Preempted, work_dir: Path) -> None:
    second = run_program("second", work_dir)
    assert second.returncode != 0
    assert "still runs" in second.stderr and f"hibernate wake {preempted.process.pid}" in second.stderr


def run_refused(directory: Path, variant: str = "") -> str:
    """The adopting program's refusal, once it has shown that nothing of it changed."""
    refused = run_program("refused", directory, variant)
    assert refused.returncode == 3, refused.stderr
    digests = json.loads(refused.stdout)
    assert digests["after"] == digests["before"], "weights and optimizer state as they were before"
    return refused.stderr


@pytest.mark.parametrize(
    ("variant", "difference"),
    [
        ("extra", "in this process, not in the snapshot"),
        ("double", "dtype float32 in the snapshot, float64 here"),
        ("wider", "shape [50, 16] in the snapshot, [50, 24] here"),
        ("sgd", "AdamW in the snapshot, SGD here"),
    ],
)
def test_a_program_that_changed_is_refused_with_the_difference_named(
    preempted: Preempted, work_dir: Path, variant: str, difference: str
) -> None:
    preempted.kill()
    refusal = run_refused(work_dir, variant)
    assert difference in refusal and "nothing was adopted" in refusal, refusal


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_flipped_byte_is_refused_as_a_wake_refuses_it_and_nothing_is_written(
    preempted: Preempted, work_dir: Path, where: str
) -> None:
    """Wherever the damage lies, the weights the program had are untouched and the optimizer state
    made for the adoption is taken back: a byte of the first chunk, and of the last one, read after
    every other chunk had passed."""
    preempted.kill()
    data = max(work_dir.glob("*/snap-000001/data-*.bin"), key=lambda path: path.stat().st_size)
    flip_byte_at(data, 10 if where == "first" else _last_written_byte(data))
    refusal = run_refused(work_dir)
    assert "checksum" in refusal and "nothing was adopted" in refusal, refusal
    again = run_program("second", work_dir)  # the refusal left the snapshot as it was: still refused
    assert again.returncode != 0 and "checksum" in again.stderr


def _last_written_byte(data: Path) -> int:
    """A byte in the middle of the last chunk of a data file, by the manifest (between chunks lie
    bytes no chunk refers to, whose damage nothing reads)."""
    offset, length = max(chunks_in(data))
    return offset + length // 2


def test_nothing_to_adopt_is_said_plainly(work_dir: Path, runtime_dir: Path) -> None:
    second = run_program("second", work_dir)
    assert second.returncode != 0
    assert f"no complete snapshot in {work_dir}" in second.stderr, second.stderr
    assert not os.listdir(work_dir)


def test_an_optimizers_state_is_named_by_its_parameters_whatever_their_order() -> None:
    """torch numbers an optimizer's state by position; here it goes by the parameters' names, so a
    program that builds its optimizer's parameter list in another order still finds its state."""
    import torch

    from hibernate.pools.tensors import TensorPool

    def keys(reverse: bool) -> set[str]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        parameters = list(model.parameters())
        optimizer = torch.optim.AdamW(parameters[::-1] if reverse else parameters)
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        pool = TensorPool()
        pool.track(model, "weights", True, "model")
        pool.track(optimizer, "weights", True, "optimizer")
        return {region.key for region in pool.regions()}

    assert keys(reverse=False) == keys(reverse=True)
    assert "weights/optimizer.state.model.1.bias.exp_avg_sq" in keys(reverse=False)
    assert "weights/optimizer.state.model.0.weight.step" in keys(reverse=False)


def test_an_optimizer_that_has_not_stepped_gets_the_state_the_snapshot_holds() -> None:
    """As load_state_dict would give it: tensors of the recorded dtype and shape, for the adoption
    to fill; a parameter that has state already keeps it."""
    import torch

    from hibernate.pools import optimizers

    parameter = torch.nn.Parameter(torch.zeros(3, 2))
    optimizer = torch.optim.AdamW([parameter])
    view = {"dtype": "float32", "shape": [3, 2], "strides": [2, 1], "storage_offset": 0}
    records = [
        (
            f"optimizer.state.w.{field}",
            {
                "device": "cpu",
                "optimizer": "AdamW",
                "views": [{**view, "name": f"optimizer.state.w.{field}"}],
            },
        )
        for field in ("exp_avg", "exp_avg_sq")
    ]
    given = optimizers.GivenState()
    assert optimizers.give_state(optimizer, "optimizer.", {id(parameter): "w"}, records, given) == 2
    state = optimizer.state[parameter]
    assert sorted(state) == ["exp_avg", "exp_avg_sq"] and state["exp_avg"].shape == (3, 2)
    assert [id(tensor) for tensor in given.tensors] == [id(state["exp_avg"]), id(state["exp_avg_sq"])]
    assert optimizers.give_state(optimizer, "optimizer.", {id(parameter): "w"}, records, given) == 0
    given.take_back()  # a refused adoption: the parameter has no state again
    assert not optimizer.state.get(parameter)
    sgd = torch.optim.SGD([parameter], lr=0.1)
    with pytest.raises(SnapshotInvalidError, match="of another kind: AdamW in the snapshot, SGD here"):
        optimizers.give_state(sgd, "optimizer.", {id(parameter): "w"}, records, optimizers.GivenState())


def test_a_job_script_adopts_through_the_environment_each_object_as_it_is_tracked(
    preempted: Preempted, work_dir: Path
) -> None:
    """HIBERNATE_ADOPT, for a requeued job whose program does not call adopt: the model as it is
    tracked, then the optimizer (its state made and filled) as it is."""
    preempted.kill()
    resumed = run_program("tracked", work_dir, env={"HIBERNATE_ADOPT": str(work_dir)})
    assert resumed.returncode == 0, resumed.stderr
    answer = json.loads(resumed.stdout)
    assert answer["state"] == preempted.state
    straight = run_program("straight", work_dir)
    assert answer["after"] == json.loads(straight.stdout)["after"]
    line = r"hibernate: adopted \d+ tensor storage\(s\), (\d+) bytes \((\d+) read\)"
    adopted = re.findall(line, resumed.stderr)
    assert len(adopted) == 2, resumed.stderr
    manifest = json.loads(next(work_dir.glob("*/snap-000001/manifest.json")).read_text())
    snapshot_bytes = sum(manifest["records"]["nbytes"])
    model, optimizer = ((int(filled), int(read)) for filled, read in adopted)
    assert model[1] < snapshot_bytes and optimizer[1] < snapshot_bytes, "each reads what it tracks"
    assert model[1] + optimizer[1] <= snapshot_bytes, "the snapshot read once in all, not once a track"


def test_a_run_preempted_between_two_tracks_writes_no_snapshot_and_the_next_adopts_the_whole_one(
    preempted: Preempted, work_dir: Path
) -> None:
    """A requeued run under HIBERNATE_ADOPT has adopted its model, not yet its optimizer, when
    SIGTERM comes: a snapshot then would be newer than the complete one and lack the optimizer's
    state. None is written, the process exits as the signal would have ended it, and the next
    run adopts the complete snapshot, optimizer state and all."""
    preempted.kill()
    requeued = {
        "HIBERNATE_ADOPT": str(work_dir),
        "HIBERNATE_ON_SIGNAL": "TERM",
        "HIBERNATE_DIR": str(work_dir),
        "HIBERNATE_EXIT_AFTER_SLEEP": "1",
    }
    half = subprocess.Popen(
        [sys.executable, "-m", "tests.adopt_program", "half", str(work_dir)],
        cwd=REPO,
        env={**os.environ, **requeued},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert half.stdout is not None and half.stderr is not None
        assert json.loads(half.stdout.readline()) == {"tracked": "model"}
        half.send_signal(signal.SIGTERM)
        assert half.wait(timeout=60) == 128 + signal.SIGTERM
        stderr = half.stderr.read()
    finally:
        if half.poll() is None:
            half.kill()
            half.wait()
        for stream in (half.stdout, half.stderr):
            if stream is not None:
                stream.close()
    assert "not slept: this process has not yet tracked all it adopts" in stderr, stderr
    assert "weights/optimizer.state.model.0.weight.exp_avg" in stderr, stderr
    assert len(list(work_dir.glob("*/snap-*"))) == 1, "no snapshot but the complete one"
    resumed = run_program("tracked", work_dir, env={"HIBERNATE_ADOPT": str(work_dir)})
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["state"] == preempted.state


def test_a_job_preempted_before_its_first_sleep_ended_starts_afresh(
    work_dir: Path, runtime_dir: Path
) -> None:
    fresh = run_program("tracked", work_dir, env={"HIBERNATE_ADOPT": str(work_dir / "job-7")})
    assert fresh.returncode == 0, fresh.stderr
    assert "no complete snapshot" in fresh.stderr and "starting afresh" in fresh.stderr
    assert fresh.stderr.count("starting afresh") == 2  # the model, then the optimizer


@pytest.mark.skipif(not is_root(), reason="making a snapshot another user's takes root")
def test_another_users_snapshot_is_never_read(preempted: Preempted, work_dir: Path) -> None:
    preempted.kill()
    for path in [*work_dir.rglob("*"), *work_dir.glob("*")]:
        os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
    root = next(p for p in work_dir.iterdir() if p.is_dir())
    second = run_program("second", root)
    assert second.returncode != 0
    assert f"{root} belongs to uid {NOBODY}, not to you" in second.stderr, second.stderr


def test_a_process_directory_whose_sleep_was_cut_short_is_passed_over_for_a_complete_one(
    tmp_path: Path,
) -> None:
    """A requeued job's second run was killed before its sleep published: its directory in --to
    holds no complete snapshot, and the first run's, older but complete, is the one taken."""
    from dataclasses import replace

    from hibernate.store.adoption import locate
    from hibernate.store.layout import SpillRoot
    from hibernate.store.options import WriteOptions
    from hibernate.store.owner import Owner
    from hibernate.store.writer import write_snapshot
    from tests.test_store_roundtrip import BytesRegion

    dead = [replace(Owner.current(), pid=999_999_000 + n, start_time=1) for n in range(2)]  # past pid_max
    with SpillRoot(tmp_path / "proc-1-aaaa", create=True, owner=dead[0]) as root:
        write_snapshot(root, [BytesRegion("w/a", "w", b"x" * 4096)], producer={}, options=WriteOptions())
    with SpillRoot(tmp_path / "proc-2-bbbb", create=True, owner=dead[1]) as root:
        (root.path / ".tmp-snap-000001-cafe").mkdir()  # what a sleep killed before publishing leaves
    found = locate(tmp_path)
    assert (found.root.name, found.snapshot, found.liveness) == ("proc-1-aaaa", "snap-000001", "dead")
    assert "the one process directory" in found.picked  # the one with a complete snapshot


@pytest.mark.parametrize("damaged", [False, True])
def test_device_tensors_are_adopted_through_twins_on_their_device_and_left_as_they_were_by_a_refusal(
    cudart_path: Path, tmp_path: Path, damaged: bool
) -> None:
    """A device storage the program already had is filled through a twin on its device, copied in
    once every chunk passed; a damaged snapshot leaves it as it was. No GPU: the stand-in CUDA
    runtime over host memory, the "device" storages host storages the pool is told live on device 1."""
    from dataclasses import replace

    import torch

    from hibernate.agent.adopt import adopt_here
    from hibernate.pools.device import CudaCopies, CudaRuntime
    from hibernate.pools.tensors import TensorPool
    from hibernate.store.layout import SpillRoot
    from hibernate.store.options import WriteOptions
    from hibernate.store.owner import Owner
    from hibernate.store.writer import write_snapshot
    from tests.pooled import agent_with, bits
    from tests.standins.vllm_cumem import FakeCudaRT

    cudart = FakeCudaRT(cudart_path)
    cudart.set_counter("fake_fail_copy_at", -1)
    cudart.set_counter("fake_fail_run_at", -1)

    def device_pool(tensors: dict[str, torch.Tensor]) -> TensorPool:
        ids = {t.untyped_storage()._cdata for t in tensors.values()}
        pool = TensorPool(
            copies=lambda: CudaCopies(CudaRuntime(cudart.lib)),
            device_of=lambda storage: 1 if storage._cdata in ids else None,
            graphs=list,
        )
        pool.track(tensors, "weights", True, "net")
        return pool

    generator = torch.Generator().manual_seed(5)
    written = {
        f"t{i}": torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
        for i, size in enumerate((1 << 20, 4096, 100))
    }
    dead = replace(Owner.current(), pid=999_999_100, start_time=1)  # past pid_max: a process that is gone
    with SpillRoot(tmp_path / "proc-1-aaaa", create=True, owner=dead) as root:
        write_snapshot(root, device_pool(written).regions(), producer={}, options=WriteOptions())
    if damaged:
        data = max(tmp_path.glob("*/snap-000001/data-*.bin"), key=lambda path: path.stat().st_size)
        flip_byte_at(data, _last_written_byte(data))
    mine = {name: torch.full_like(tensor, 7) for name, tensor in written.items()}
    addresses = {name: tensor.data_ptr() for name, tensor in mine.items()}
    agent = agent_with(device_pool(mine), "adopting")
    copied_before = cudart.counter("fake_copied_bytes")
    if damaged:
        with pytest.raises(SnapshotInvalidError, match="checksum"):
            adopt_here(agent, tmp_path, args={"buffer_mb": 4})
        assert all(bool((tensor == 7).all()) for tensor in mine.values()), "nothing written"
    else:
        report = adopt_here(agent, tmp_path, args={"buffer_mb": 4})
        assert report["adopted_bytes"] == sum(t.nbytes for t in written.values())
        assert all(torch.equal(bits(mine[name]), bits(written[name])) for name in written), "bit-exact"
    assert {name: tensor.data_ptr() for name, tensor in mine.items()} == addresses, "the same storages"
    assert cudart.counter("fake_copied_bytes") - copied_before >= (1 << 20), "through the device seam"
    assert agent.state.value == "running"


def test_an_adoption_the_host_memory_cannot_take_is_refused_before_anything_is_read() -> None:
    """The shadows of the tensors the program already has need host memory beside them: where the
    machine or the job's cgroup has less, the refusal says how much each side has."""
    import torch

    from hibernate.agent.adopt import Shadows
    from hibernate.errors import UnsupportedError
    from hibernate.pools.tensors import TensorPool

    pool = TensorPool()
    pool.track(torch.empty(80 << 20, dtype=torch.uint8), "weights", True, "w")
    refusal = r"needs 80\.0 MiB .* may take 1\.0 MiB more .* nothing was adopted"
    with pytest.raises(UnsupportedError, match=refusal):
        Shadows(pool.regions(), headroom=lambda: 1 << 20)
    with Shadows(pool.regions(), headroom=lambda: None) as shadows:  # nothing known: not refused
        assert shadows.standing_for(pool.regions()[0]) is not None


def test_the_memory_headroom_is_the_tightest_of_the_machine_and_every_memory_cgroup(tmp_path: Path) -> None:
    from hibernate.procinfo import memory_headroom_bytes

    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 100000 kB\nMemAvailable: 50000 kB\n")
    (proc / "self" / "cgroup").write_text("0::/job/step\n")
    step = cgroups / "job" / "step"
    step.mkdir(parents=True)
    (step / "memory.max").write_text("max\n")
    (step / "memory.current").write_text("5\n")
    assert memory_headroom_bytes(proc, cgroups) == 50000 * 1024, "no ceiling: the machine's"
    (cgroups / "job" / "memory.max").write_text(f"{30 << 20}\n")
    (cgroups / "job" / "memory.current").write_text(f"{10 << 20}\n")
    assert memory_headroom_bytes(proc, cgroups) == 20 << 20, "the job's ceiling, above its step"
    (proc / "self" / "cgroup").write_text("4:memory:/slurm/job_7\n1:cpu:/\n")  # cgroup v1, as Slurm's
    job = cgroups / "memory" / "slurm" / "job_7"
    job.mkdir(parents=True)
    (job / "memory.limit_in_bytes").write_text(f"{8 << 20}\n")
    (job / "memory.usage_in_bytes").write_text(f"{3 << 20}\n")
    (cgroups / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "none"
    assert memory_headroom_bytes(proc, cgroups) == 5 << 20
    assert memory_headroom_bytes(tmp_path / "none", tmp_path / "none") is None
