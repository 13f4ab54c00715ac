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
    from hibernate.store.layout import SpillRoot
    from hibernate.store.options import WriteOptions
    from hibernate.store.owner import Owner
    from hibernate.store.writer import write_snapshot
    from tests.pooled import agent_with, bits, standin_device_pool
    from tests.standins.vllm_cumem import FakeCudaRT

    cudart = FakeCudaRT(cudart_path)
    cudart.set_counter("fake_fail_copy_at", -1)
    cudart.set_counter("fake_fail_run_at", -1)

    generator = torch.Generator().manual_seed(5)
    written = {
        f"t{i}": torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
        for i, size in enumerate((1 << 20, 4096, 100))
    }
    dead = replace(Owner.current(), pid=999_999_100, start_time=1)  # past pid_max: a process that is gone
    with SpillRoot(tmp_path / "proc-1-aaaa", create=True, owner=dead) as root:
        write_snapshot(
            root, standin_device_pool(cudart, written, 1).regions(), producer={}, options=WriteOptions()
        )
    if damaged:
        data = max(tmp_path.glob("*/snap-000001/data-*.bin"), key=lambda path: path.stat().st_size)
        flip_byte_at(data, _last_written_byte(data))
    mine = {name: torch.full_like(tensor, 7) for name, tensor in written.items()}
    addresses = {name: tensor.data_ptr() for name, tensor in mine.items()}
    agent = agent_with(standin_device_pool(cudart, mine, 1), "adopting")
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


def test_pairing_takes_a_storage_from_another_device_and_still_refuses_a_changed_dtype_or_shape() -> None:
    """A storage's bytes are the same on any device: a record of cuda:1 fills a region on cuda:0 or
    the CPU, and the pairing says how many moved which way. A dtype or shape that changed is still
    refused, in the same call that has storages on other devices, and the device is never named."""
    from hibernate.store.adoption import pair_by_name
    from hibernate.store.manifest import ChunkColumns, Columns
    from tests.test_store_roundtrip import BytesRegion

    def meta(device: str, name: str, dtype: str = "float32", shape: tuple[int, ...] = (4,)) -> dict[str, Any]:
        view = {
            "name": name,
            "dtype": dtype,
            "shape": list(shape),
            "strides": [1] * len(shape),
            "storage_offset": 0,
        }
        return {"device": device, "views": [view]}

    names = ["a", "b", "c", "d"]
    columns = Columns(
        [f"w/{name}" for name in names],
        ["w"] * 4,
        [16] * 4,
        [0] * 4,
        ChunkColumns([], [], [], ""),
        metas=[meta("cuda:1", name) for name in names],
    )

    def regions(devices: list[str], *changes: tuple[int, dict[str, Any]]) -> list[BytesRegion]:
        made = [
            BytesRegion(f"w/{n}", "w", bytes(16), meta=meta(d, n))
            for n, d in zip(names, devices, strict=True)
        ]
        for index, changed in changes:
            made[index].meta = meta(devices[index], names[index], **changed)
        return made

    moved = pair_by_name(columns, regions(["cuda:0", "cuda:0", "cpu", "cuda:1"]), every_record=True)
    assert moved.order == [0, 1, 2, 3]
    assert moved.moves() == {"cuda:1 -> cpu": 1, "cuda:1 -> cuda:0": 2}
    assert sorted(moved.moved) == [0, 1, 2], "the record on the same device is not among them"
    assert pair_by_name(columns, regions(["cuda:1"] * 4), every_record=True).moves() == {}
    changed = regions(["cuda:0", "cuda:0", "cpu", "cpu"], (1, {"dtype": "float16"}), (3, {"shape": (2, 2)}))
    with pytest.raises(SnapshotInvalidError) as refused:
        pair_by_name(columns, changed, every_record=True)
    refusal = refused.value.message
    assert "(2 differences)" in refusal, refusal
    assert "w/b: dtype float32 in the snapshot, float16 here" in refusal
    assert "w/d: shape [4] in the snapshot, [2, 2] here" in refusal
    assert "cuda" not in refusal and "w/a" not in refusal and "w/c" not in refusal


@pytest.mark.parametrize("saved", ["cpu", "cuda:1"])
@pytest.mark.parametrize("capturable", [False, True])
def test_state_an_optimizer_had_not_made_is_placed_as_torchs_load_state_dict_places_it(
    saved: str, capturable: bool
) -> None:
    """On the parameter's device in this process, whatever the snapshot's was; ``step`` on the CPU
    unless the group is capturable. torch's own load_state_dict is the reference: a CPU state dict
    loaded into an AdamW whose parameter is on the meta device (a device other than the CPU, which
    a machine without a GPU has)."""
    import torch

    from hibernate.pools import optimizers

    def stepped_on_cpu() -> dict[str, Any]:
        """The state dict of the same program's AdamW (its groups as capturable as here: torch takes
        the flag from the state dict's groups), stepped on the CPU."""
        parameter = torch.nn.Parameter(torch.zeros(3, 2))
        optimizer = torch.optim.AdamW([parameter])
        parameter.grad = torch.ones(3, 2)
        optimizer.step()  # a capturable step runs on a GPU only
        state_dict = optimizer.state_dict()
        state_dict["param_groups"][0]["capturable"] = capturable
        return state_dict

    reference = torch.nn.Parameter(torch.empty(3, 2, device="meta"))
    loaded = torch.optim.AdamW([reference], capturable=capturable)
    loaded.load_state_dict(stepped_on_cpu())
    expected = {name: value.device for name, value in loaded.state[reference].items()}
    assert expected["exp_avg"] == torch.device("meta"), "torch moves it to the parameter's device"
    assert expected["step"] == torch.device("meta" if capturable else "cpu")

    parameter = torch.nn.Parameter(torch.empty(3, 2, device="meta"))
    optimizer = torch.optim.AdamW([parameter], capturable=capturable)
    shapes = {"step": ([], []), "exp_avg": ([3, 2], [2, 1]), "exp_avg_sq": ([3, 2], [2, 1])}
    records = [
        (
            f"optimizer.state.w.{field}",
            {
                "device": "cpu" if field == "step" and not capturable else saved,
                "optimizer": "AdamW",
                "views": [
                    {
                        "name": f"optimizer.state.w.{field}",
                        "dtype": "float32",
                        "shape": shape,
                        "strides": strides,
                        "storage_offset": 0,
                    }
                ],
            },
        )
        for field, (shape, strides) in shapes.items()
    ]
    given = optimizers.GivenState()
    assert optimizers.give_state(optimizer, "optimizer.", {id(parameter): "w"}, records, given) == 3
    assert {name: value.device for name, value in optimizer.state[parameter].items()} == expected


@pytest.mark.parametrize("direction", ["device to cpu", "cpu to device"])
def test_a_snapshot_taken_on_one_device_is_adopted_into_a_process_on_another(
    cudart_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], direction: str
) -> None:
    """A requeued job on a GPU of another index, or a GPU job's state taken up on the CPU: the
    records say one device, the live storages another, and the adoption fills them bit for bit.
    The optimizer, which had not stepped, gets its state where torch would put it: on its
    parameter's device here (the CPU, as torch sees the stand-in's storages), its step on the CPU.
    No GPU: the stand-in CUDA runtime over host memory, the "device" storages (weights and
    optimizer state, not the step, which torch keeps on the CPU) ones the pool is told live on
    device 1. ``cpu to device`` adopts through HIBERNATE_ADOPT's path (a call per tracked object),
    whose line on stderr says what moved."""
    from dataclasses import replace

    import torch

    from hibernate.agent.adopt import adopt_here, adopt_on_track
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

    def built() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(3)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 8)
        )
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(16, 64, generator=generator)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # gradients set to None: not in the snapshot

    def on_device(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> set[int]:
        """The storages the stand-in device holds: the parameters and their state but the steps."""
        tensors = [*model.parameters()]
        tensors += [
            value for state in optimizer.state.values() for name, value in state.items() if name != "step"
        ]
        return {tensor.untyped_storage()._cdata for tensor in tensors}

    def pool_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: bool) -> TensorPool:
        if device:  # asked at each enumeration: state made by the adoption is on the device too
            pool = TensorPool(
                copies=lambda: CudaCopies(CudaRuntime(cudart.lib)),
                device_of=lambda storage: 1 if storage._cdata in on_device(model, optimizer) else None,
                graphs=list,
            )
        else:
            pool = TensorPool()
        pool.track(model, "weights", True, "model")
        pool.track(optimizer, "weights", True, "optimizer")
        return pool

    def everything(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, bytes]:
        tensors = dict(model.state_dict())
        for index, state in optimizer.state_dict()["state"].items():
            tensors.update({f"optimizer.{index}.{name}": value for name, value in state.items()})
        return {name: bits(value).numpy().tobytes() for name, value in tensors.items()}

    from_device = direction == "device to cpu"
    model, optimizer = built()
    for seed in range(3):
        train(model, optimizer, seed)
    dead = replace(Owner.current(), pid=999_999_200, start_time=1)  # past pid_max: a process that is gone
    written_pool = pool_of(model, optimizer, from_device)
    with SpillRoot(tmp_path / "proc-1-aaaa", create=True, owner=dead) as root:
        write_snapshot(root, written_pool.regions(), producer={}, options=WriteOptions())
    recorded = json.loads(next(tmp_path.glob("*/snap-000001/manifest.json")).read_text())
    assert "cuda:1" in json.dumps(recorded) if from_device else "cuda:1" not in json.dumps(recorded)
    at_sleep = everything(model, optimizer)

    mine, my_optimizer = built()
    pool = pool_of(mine, my_optimizer, not from_device)
    agent = agent_with(pool, "adopting")
    copied_before = cudart.counter("fake_copied_bytes")
    reports: list[dict[str, Any] | None]
    if from_device:
        reports = [adopt_here(agent, tmp_path, args={"buffer_mb": 4})]
    else:
        reports = [adopt_on_track(agent, pool, tracked, str(tmp_path)) for tracked in (mine, my_optimizer)]
    storages = len(on_device(mine, my_optimizer))  # 6 parameters, an exp_avg and an exp_avg_sq each
    way = "cuda:1 -> cpu" if from_device else "cpu -> cuda:1"
    moved: dict[str, int] = {}
    for report in reports:
        assert report is not None
        for key, count in report["moved"].items():
            moved[key] = moved.get(key, 0) + count
    assert moved == {way: storages} and storages == 18
    assert everything(mine, my_optimizer) == at_sleep, "weights and optimizer state bit-identical"
    for parameter in mine.parameters():
        state = my_optimizer.state[parameter]
        assert state["exp_avg"].device == parameter.device and state["step"].device == torch.device("cpu")
    if not from_device:
        assert cudart.counter("fake_copied_bytes") - copied_before >= sum(t.nbytes for t in mine.parameters())
        lines = [line for line in capsys.readouterr().err.splitlines() if "hibernate: adopted" in line]
        assert len(lines) == 2 and all(", 6 moved cpu -> cuda:1)" in line for line in lines[:1]), lines
        assert ", 12 moved cpu -> cuda:1)" in lines[1], lines
    train(model, optimizer, 3)  # and both go on alike: the adopted optimizer steps as the first would
    train(mine, my_optimizer, 3)
    assert everything(mine, my_optimizer) == everything(model, optimizer)
