"""vLLM with more than one GPU: which vLLM a process runs, what it offers, and what a sleep is told.

vLLM 0.33 readies its communicators for a checkpoint
(``checkpoint_prepare_distributed_state``, called by the backend) and offers
``--enable-nccl-comm-suspend``; older vLLMs have neither. hibernate finds a
process's vLLM through the files it maps and reads what it offers from the
package's own sources (tests/test_vllm_backend.py has the backend's side).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import vllm

from hibernate.checkpoint.nccl import (
    COMM_SUSPEND_FLAG,
    COMM_SUSPEND_OFF,
    NCCL_SAFE,
    SYMM_MEM_ON,
    VLLM_SAFE,
    VllmFeatures,
    features_in,
    has_flag,
    multi_process_traps,
    nccl_traps,
    vllm_features_of,
    vllm_packages,
)

NEW = VllmFeatures("/venv/vllm", distributed_checkpoint=True, comm_suspend=True)
OLD = VllmFeatures("/venv/vllm", distributed_checkpoint=False, comm_suspend=False)


def test_the_vllm_packages_a_process_maps() -> None:
    mapped = [
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
        "/v/lib/python3.12/site-packages/vllm/_C.abi3.so",
        "/v/lib/python3.12/site-packages/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
        "/home/me/vllm/env/lib/site-packages/vllm/cumem_allocator.abi3.so",
        "/home/me/vllm-env/bin/python3",
    ]
    assert vllm_packages(mapped) == [
        "/v/lib/python3.12/site-packages/vllm",
        "/home/me/vllm/env/lib/site-packages/vllm",
    ]


def test_what_a_vllm_offers_is_read_from_its_sources(tmp_path: Path) -> None:
    def package(parallel_state: str, arg_utils: str) -> str:
        root = tmp_path / f"p{len(list(tmp_path.iterdir()))}" / "vllm"
        (root / "distributed").mkdir(parents=True)
        (root / "engine").mkdir()
        (root / "distributed" / "parallel_state.py").write_text(parallel_state)
        (root / "engine" / "arg_utils.py").write_text(arg_utils)
        return str(root)

    def read(path: str) -> str | None:
        return Path(path).read_text() if Path(path).is_file() else None

    older = package("def init_distributed_environment():\n", 'parser.add_argument("--enforce-eager")\n')
    assert features_in(older, read) == VllmFeatures(older, False, False)
    newer = package(
        "def checkpoint_prepare_distributed_state() -> None:\n",
        'model_group.add_argument(\n    "--enable-nccl-comm-suspend",\n)\n',
    )
    assert features_in(newer, read) == VllmFeatures(newer, True, True)
    assert features_in(str(tmp_path / "nothing" / "vllm"), read) is None


def test_the_installed_vllm_0_33_is_found_through_a_mapping_of_its_extension() -> None:
    """The probe end to end, on this process: it maps the extension as a vLLM worker does."""
    package = Path(vllm.__file__).parent
    with open(package / "cumem_allocator.abi3.so", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ):
        found = vllm_features_of(os.getpid())
    assert found == VllmFeatures(str(package), distributed_checkpoint=True, comm_suspend=True)
    assert vllm_features_of(os.getpid()) is None  # nothing of vLLM mapped any more


def test_the_comm_suspend_flag_is_named_beside_the_other_traps_where_the_vllm_has_it() -> None:
    unsafe: dict[str, str] = {}
    line = "vllm serve m --tensor-parallel-size 2"
    assert nccl_traps(unsafe, line, False, NEW)[-1] == COMM_SUSPEND_OFF
    assert COMM_SUSPEND_OFF not in nccl_traps(unsafe, line + " --enable-nccl-comm-suspend", False, NEW)
    assert COMM_SUSPEND_OFF not in nccl_traps(
        unsafe, "python worker.py", False, NEW, line + " --enable-nccl-comm-suspend"
    )
    assert COMM_SUSPEND_OFF not in nccl_traps(unsafe, line, False, OLD)
    assert COMM_SUSPEND_OFF not in nccl_traps(unsafe, line, False, None)
    # Never alone: with NCCL's peer transports and vLLM's all-reduces through IPC off, nothing is refused.
    safe = {**NCCL_SAFE, **VLLM_SAFE}
    assert nccl_traps(safe, line + " --disable-custom-all-reduce", False, NEW) == []


def test_vllms_symmetric_memory_all_reduce_is_a_trap_of_every_vllm_process_until_turned_off() -> None:
    """On by default, and independent of --disable-custom-all-reduce: a server and a spawned worker
    (which maps vLLM; its command line is not vLLM's) both carry it."""
    flags = " --disable-custom-all-reduce"
    assert nccl_traps(dict(NCCL_SAFE), "vllm serve m" + flags, False) == [SYMM_MEM_ON]
    worker = "python -c from multiprocessing.spawn import spawn_main"
    assert nccl_traps(dict(NCCL_SAFE), worker, False, OLD, "vllm serve m" + flags) == [SYMM_MEM_ON]
    assert nccl_traps({**NCCL_SAFE, **VLLM_SAFE}, worker, False, OLD, "vllm serve m" + flags) == []
    assert nccl_traps(dict(NCCL_SAFE), "python train.py", False) == []  # not vLLM's business


def test_the_refusal_reads_each_process_vllm() -> None:
    envs: dict[int, dict[str, str]] = {1: {}, 2: {}}
    lines = {1: "vllm serve m", 2: "vllm serve m"}
    vllms = {1: NEW, 2: OLD}
    parents = {1: "bash", 2: "bash"}
    traps = multi_process_traps(
        [1, 2], envs.__getitem__, lines.__getitem__, vllms.__getitem__, parents.__getitem__
    )
    assert COMM_SUSPEND_OFF in traps[1] and COMM_SUSPEND_OFF not in traps[2]
    server = {1: "vllm serve m --enable-nccl-comm-suspend", 2: "bash"}  # the flag given to their parent
    traps = multi_process_traps(
        [1, 2], envs.__getitem__, lines.__getitem__, vllms.__getitem__, server.__getitem__
    )
    assert COMM_SUSPEND_OFF not in traps[1]


def test_a_flag_is_found_spelt_either_way_and_only_as_a_whole_word() -> None:
    assert has_flag("vllm serve m --enable_nccl_comm_suspend", COMM_SUSPEND_FLAG)
    assert has_flag("vllm serve m --enable-nccl-comm-suspend=true", COMM_SUSPEND_FLAG)
    assert not has_flag("vllm serve m --enable-nccl-comm-suspend-later", COMM_SUSPEND_FLAG)
    assert not has_flag("vllm serve m --config c.yaml", COMM_SUSPEND_FLAG)  # a config file is not read
    unsafe: dict[str, str] = {}
    assert COMM_SUSPEND_OFF not in nccl_traps(unsafe, "vllm serve m --enable_nccl_comm_suspend", False, NEW)


def test_a_vllm_replaced_on_disk_under_a_running_process_is_not_read_as_its_own(tmp_path: Path) -> None:
    """A mapping "(deleted)": the package now on disk is not the one the process runs."""
    package = tmp_path / "site-packages" / "vllm"
    (package / "distributed").mkdir(parents=True)
    (package / "engine").mkdir()
    (package / "distributed" / "parallel_state.py").write_text(
        "def checkpoint_prepare_distributed_state():\n"
    )
    (package / "engine" / "arg_utils.py").write_text('"--enable-nccl-comm-suspend"\n')
    extension = package / "cumem_allocator.abi3.so"
    extension.write_bytes(b"\0" * 4096)
    with open(extension, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ):
        assert vllm_features_of(os.getpid()) == VllmFeatures(str(package), True, True)
        extension.unlink()  # the upgrade replaces the file; the mapping now reads "(deleted)"
        extension.write_bytes(b"\0" * 4096)
        assert vllm_features_of(os.getpid()) is None
