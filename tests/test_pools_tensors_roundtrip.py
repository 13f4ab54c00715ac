"""Every kind of tensor a program tracks comes back exactly, through a real snapshot on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import hibernate
from hibernate.errors import UsageError

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    *[
        getattr(torch, n)
        for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
        if hasattr(torch, n)
    ],
]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bytes viewed as ``dtype``: every bit pattern, NaNs included, must survive."""
    element = torch.empty(0, dtype=dtype).element_size()
    numel = 1
    for n in shape:
        numel *= n
    raw = torch.randint(
        0, 256, (numel * element,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    return raw.view(dtype).reshape(shape).clone()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)
        )
    )


def cycle(work_dir: Path) -> None:
    report = hibernate.sleep(work_dir)
    assert hibernate.state() == "asleep"
    assert report["release"]["released_bytes"] >= 0
    hibernate.wake()
    assert hibernate.state() == "running"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_comes_back_bit_exact(fresh_agent: None, work_dir: Path, dtype: torch.dtype) -> None:
    tensor = random_tensor(dtype, (37, 129), seed=1)
    expected = tensor.clone()
    hibernate.track(tensor, name="t")
    hibernate.sleep(work_dir)
    assert tensor.untyped_storage().nbytes() == 0, "memory is released while asleep"
    hibernate.wake()
    assert same_bytes(tensor, expected)


def test_zero_sized_non_contiguous_and_shared_storages(fresh_agent: None, work_dir: Path) -> None:
    base = random_tensor(torch.float32, (64, 48), seed=2)
    transposed = base.t()  # non-contiguous view of the same storage
    strided = base[::3, 5:]  # another view, with an offset
    empty = torch.empty(0, 7)
    other = random_tensor(torch.int16, (5, 5, 5), seed=3).permute(2, 0, 1)
    expected = [t.clone() for t in (base, transposed, strided, empty, other)]
    hibernate.track({"base": base, "t": transposed, "s": strided, "empty": empty, "other": other})
    cycle(work_dir)
    for got, want in zip((base, transposed, strided, empty, other), expected, strict=True):
        assert same_bytes(got, want)
    assert transposed.data_ptr() == base.data_ptr(), "views still share one storage after wake"
    assert strided.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def test_module_with_tied_weights_buffers_and_gradients(fresh_agent: None, work_dir: Path) -> None:
    torch.manual_seed(0)
    embedding, linear = torch.nn.Embedding(100, 16), torch.nn.Linear(16, 100)
    model = torch.nn.Sequential(embedding, linear, torch.nn.BatchNorm1d(100))
    linear.weight = embedding.weight  # tied input and output embeddings, as in most LMs
    loss = model(torch.arange(10)).sum()
    loss.backward()
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    hibernate.track(model)
    cycle(work_dir)
    for name, value in model.state_dict().items():
        assert same_bytes(value, snapshot[name]), name
    for name, param in model.named_parameters():
        if name in grads:
            assert param.grad is not None and same_bytes(param.grad, grads[name]), name
    assert linear.weight.data_ptr() == embedding.weight.data_ptr()


def test_optimizer_state_comes_back(fresh_agent: None, work_dir: Path) -> None:
    model = torch.nn.Linear(32, 32)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    state = [
        {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)} for s in optimizer.state.values()
    ]
    hibernate.track(model)
    hibernate.track(optimizer, tag="optimizer")
    cycle(work_dir)
    for live, saved in zip(optimizer.state.values(), state, strict=True):
        for key, value in saved.items():
            assert same_bytes(live[key], value)


def test_dropped_tags_come_back_zero_filled(fresh_agent: None, work_dir: Path) -> None:
    weights = random_tensor(torch.bfloat16, (256, 256), seed=4)
    cache = torch.full((8, 1024), 3.0)
    expected = weights.clone()
    hibernate.track(weights, name="w")
    hibernate.track(cache, tag="kv_cache", keep=False, name="cache")
    report = hibernate.sleep(work_dir)
    assert report["spill"]["total_bytes"] == weights.nbytes
    assert report["spill"]["dropped_bytes"] == cache.nbytes
    hibernate.wake()
    assert same_bytes(weights, expected)
    assert torch.count_nonzero(cache) == 0


def test_a_storage_shared_with_a_kept_tensor_is_kept(fresh_agent: None, work_dir: Path) -> None:
    shared = torch.arange(1000, dtype=torch.int64)
    hibernate.track(shared[:10], tag="kv_cache", keep=False, name="scratch")
    hibernate.track(shared, name="weights")
    cycle(work_dir)
    assert torch.equal(shared, torch.arange(1000, dtype=torch.int64))


def test_replaced_parameters_are_hibernated_as_they_are_now(fresh_agent: None, work_dir: Path) -> None:
    model = torch.nn.Linear(8, 8)
    hibernate.track(model)
    model.weight = torch.nn.Parameter(torch.full((8, 8), 5.0))
    cycle(work_dir)
    assert torch.equal(model.weight, torch.full((8, 8), 5.0))


def test_untrack_stops_hibernating(fresh_agent: None, work_dir: Path) -> None:
    kept, dropped_from_tracking = torch.ones(100), torch.ones(100)
    hibernate.track(kept, name="kept")
    hibernate.track(dropped_from_tracking, name="gone")
    assert hibernate.untrack(dropped_from_tracking)
    hibernate.sleep(work_dir)
    assert dropped_from_tracking.untyped_storage().nbytes() == 400
    hibernate.wake()


@pytest.mark.parametrize(
    "bad, message",
    [
        (object(), "cannot track object"),
        (torch.zeros(3).to_sparse(), "only strided tensors"),
        (torch.empty(3, device="meta"), "is on meta"),
    ],
)
def test_untrackable_objects_are_refused_clearly(fresh_agent: None, bad: object, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        hibernate.track(bad)


def test_bad_tag_is_refused(fresh_agent: None) -> None:
    with pytest.raises(UsageError, match="tag"):
        hibernate.track(torch.ones(1), tag="a/b")


def test_a_tensor_pools_meta_is_plain_as_it_vouches() -> None:
    """The writer skips checking a PlainMeta: every meta the tensor pool builds must pass the full check."""
    from hibernate.pools.tensors import TensorPool
    from hibernate.store.manifest import PlainMeta
    from hibernate.store.parse import _is_plain, check_meta

    base = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    model = torch.nn.Linear(4, 3)
    model.bias.grad = torch.zeros(3)
    pool = TensorPool()
    pool.track(
        {"base": base, "slice": base[2:, 1::2], "t": base.t(), "empty": torch.empty(0)},
        tag="weights",
        keep=False,
        name="tensors",
    )
    pool.track(model, tag="model", keep=True, name="model")
    metas = [region.meta for region in pool.regions()]
    assert metas and all(type(meta) is PlainMeta for meta in metas)
    for meta in metas:
        check_meta(meta, "meta")
        assert _is_plain(dict(meta)), meta


def test_a_pools_contents_are_those_of_its_regions() -> None:
    """``contents`` (what status shows of a running process) counts what ``regions`` would build,
    without building it: storages shared, kept over dropped, nested names, device storages, a
    storage torch cannot resize (which it leaves to the regions), and names as regions give them."""
    from hibernate.pools.base import Contents
    from hibernate.pools.tensors import TensorPool

    base = torch.arange(64, dtype=torch.float32)
    on_device = torch.ones(8, dtype=torch.bfloat16)
    pool = TensorPool(device_of=lambda s: 1 if s._cdata == on_device.untyped_storage()._cdata else None)
    pool.track({"a": base, "b": [base[4:], torch.zeros(3)], "c": {"x.": on_device}}, "weights", True, "d")
    pool.track([base[:8], torch.ones(5)], "cache", False, "kv")
    model = torch.nn.Linear(4, 3)
    model.weight.grad = torch.zeros(3, 4)
    pool.track(model, "model", True, None)
    regions = pool.regions()
    assert pool.contents() == Contents.of("torch", regions)
    assert pool.contents().device_bytes == {"cuda:1": 16}
    assert [r.key for r in regions] == [
        "weights/d.a",
        "weights/d.b.1",
        "weights/d.c.x",
        "cache/kv.1",
        "model/weight",
        "model/weight.grad",
        "model/bias",
    ]
    assert [v["name"] for v in regions[0].meta["views"]] == ["d.a", "d.b.0", "kv.0"]

    shared = bytearray(4096)  # a storage torch cannot resize: placed by its mapping
    pool.track(torch.frombuffer(shared, dtype=torch.uint8), "fixed", True, "f")
    assert pool.contents() == Contents.of("torch", pool.regions())


def test_begin_answers_without_the_pools_the_hello_told(fresh_agent: None) -> None:
    """A command's begin is answered without walking every tracked tensor again: its pools and
    device bytes are absent, which every reader of a status takes as unknown."""
    from hibernate.agent import local
    from hibernate.agent.controller import Session
    from hibernate.agent.wire import AgentStatus

    hibernate.track({"w": torch.ones(4)}, tag="weights")
    agent = local.local_agent(serve=False)
    session = Session("hibernate (pid 1, uid 0)")
    agent.begin(session)
    try:
        brief = AgentStatus.from_wire(agent.status(contents=False))
        full = AgentStatus.from_wire(agent.status())
    finally:
        agent.end(session)
    assert {"pools", "device_bytes"} <= brief.absent and brief.pools == ()
    assert full.pools and full.pools[0]["count"] == 1 and not full.absent
    assert brief.state is full.state and brief.pid == full.pid


def test_a_sleep_after_a_wake_reuses_the_manifest_that_wake_read(
    fresh_agent: None, work_dir: Path, monkeypatch: pytest.MonkeyPatch, manifest_reads: list[str]
) -> None:
    """The agent keeps what reuse needs of the manifest its wake parsed: the next sleep parses nothing."""
    from hibernate.store.reader import SnapshotReader

    tensor = random_tensor(torch.float32, (256, 64), seed=4)
    expected = tensor.clone()
    hibernate.track(tensor, name="t")
    hibernate.sleep(work_dir)
    hibernate.wake()
    parsed = manifest_reads
    parsed.clear()
    report = hibernate.sleep(work_dir)
    assert parsed == [], "the newest snapshot's manifest came from the wake, not from disk"
    assert report["spill"]["written_bytes"] == 0, "and its chunks were reused all the same"
    checks: list[int] = []
    check_matches = SnapshotReader.check_matches

    def counting_checks(self: SnapshotReader, regions: Any, **options: Any) -> None:
        checks.append(len(regions))
        assert options.get("written") is not None, "against what the sleep wrote (see check_matches)"
        check_matches(self, regions, **options)

    monkeypatch.setattr(SnapshotReader, "check_matches", counting_checks)
    hibernate.wake()
    assert parsed, "the wake reads the new snapshot's manifest from disk"
    assert len(checks) == 1, "and checks it against the process once, before touching memory"
    assert same_bytes(tensor, expected)


def test_a_cpu_sleep_and_wake_never_ask_whether_cuda_is_available(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.cuda.is_available() initializes the CUDA driver, whose cuInit opens the NVIDIA device
    files: on a GPU machine a CPU-only process then looked like a CUDA process, and the next sleep
    of four of them was refused (the NCCL check for CUDA processes checkpointed together)."""
    from hibernate.pools.tensors import TensorPool, allocator_segments
    from hibernate.store.layout import SpillRoot
    from hibernate.store.reader import SnapshotReader
    from hibernate.store.writer import write_snapshot

    asked: list[str] = []

    def is_available() -> bool:
        asked.append("is_available")
        return False

    def device_count() -> int:
        asked.append("device_count")
        return 0

    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    monkeypatch.setattr(torch.cuda, "device_count", device_count)
    weights = {"w": torch.arange(4096, dtype=torch.float32)}
    reference = weights["w"].clone()
    pool = TensorPool()
    pool.track(weights, tag="weights", keep=True, name="model")
    for _ in range(2):  # a sleep and a wake, twice
        regions = list(pool.regions())
        with SpillRoot(tmp_path / "proc", create=True) as root:
            written = write_snapshot(root, regions, producer={})
        for region in regions:
            region.release()
        pool.after_release()
        for region in regions:
            region.reallocate()
        with SpillRoot(tmp_path / "proc") as root, SnapshotReader(root, written.snapshot) as reader:
            reader.read_into(regions, buffer_bytes=1 << 20)
    assert allocator_segments() == []
    assert torch.equal(weights["w"], reference)
    assert asked == []
