"""`hibernate export` (store/export.py): a snapshot's tensors as safetensors any loader reads, verified.

Through a real sleep of tracked tensors (and of a transformers model, where transformers is
installed), the real CLI, and safetensors' own loader: what comes back is what was tracked,
named as ``state_dict()`` names it, tied weights written once and named in the metadata; a
damaged snapshot, another user's snapshot, an existing output are refused, nothing left behind.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import hibernate
from hibernate.errors import ExitCode, SnapshotInvalidError, UnsupportedError, UsageError
from hibernate.store.export import TIED_KEY, export_snapshot, plan_export
from hibernate.units import parse_size
from tests.conftest import NOBODY, REPO, flip_a_bit_in_a_chunk, is_root, source_root_for, spill_root_of
from tests.test_store_roundtrip import BytesRegion, small_options, write

SCHEMA = json.loads((REPO / "docs" / "json-schema" / "export.schema.json").read_text())


def valid(result: Any, code: int = 0) -> dict[str, Any]:
    """The --json document of an export, after checking its exit code and its schema."""
    assert result.returncode == code, result.stderr + result.stdout
    document: dict[str, Any] = json.loads(result.stdout)
    if code == 0:
        assert list(jsonschema.Draft202012Validator(SCHEMA).iter_errors(document)) == []
    return document


class Tied(torch.nn.Module):
    """Tied weights, a buffer, a strided view and a slice of one storage, a bf16 parameter."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(7)
        self.emb = torch.nn.Embedding(50, 8)
        self.head = torch.nn.Linear(8, 50, bias=False)
        self.head.weight = self.emb.weight
        self.norm = torch.nn.Parameter(torch.randn(8, generator=generator).to(torch.bfloat16))
        self.register_buffer("steps", torch.arange(6, dtype=torch.int64))
        base = torch.randn(5, 7, generator=generator)
        self.register_buffer("base", base)
        self.register_buffer("transposed", base.t())  # not contiguous: gathered through torch
        self.register_buffer("rows", base[1:3])  # contiguous, inside base's storage


def tracked(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What state_dict() would hold, by name, every tied name included."""
    named: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return {name: tensor.detach().clone() for name, tensor in named.items()}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous(), b.contiguous())


@pytest.fixture
def asleep(fresh_agent: None, work_dir: Path) -> Iterator[tuple[Path, dict[str, torch.Tensor]]]:
    """A Tied model tracked and put to sleep by this process: its spill root, and its tensors."""
    model = Tied()
    expected = tracked(model)
    hibernate.track(model)
    hibernate.sleep(work_dir)
    yield spill_root_of(work_dir, os.getpid()), expected
    hibernate.wake()
    assert all(same(tensor, expected[name]) for name, tensor in tracked(model).items())


def test_tied_weights_a_slice_and_a_transpose_come_back_by_name(
    asleep: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    root, expected = asleep
    report = export_snapshot(root, tmp_path / "m.safetensors")
    assert report["aliases"] == {"head.weight": "emb.weight"} and report["tensors"] == len(expected) - 1
    loaded = load_file(tmp_path / "m.safetensors")
    assert sorted(loaded) == sorted(set(expected) - {"head.weight"})
    assert all(same(tensor, expected[name]) for name, tensor in loaded.items())


@pytest.mark.slow
def test_a_tracked_model_exports_to_a_file_safetensors_loads_by_name(
    asleep: tuple[Path, dict[str, torch.Tensor]], cli: Any, tmp_path: Path
) -> None:
    root, expected = asleep
    out = tmp_path / "model.safetensors"
    document = valid(cli("export", str(root), "--format", "safetensors", "--out", str(out), "--json"))
    assert document["ok"] and document["newest"] and document["snapshot"] == str(root / "snap-000001")
    assert document["aliases"] == {"head.weight": "emb.weight"} and document["skipped"] == []
    assert document["files"] == [{"path": str(out), "bytes": out.stat().st_size, "tensors": 6}]
    loaded = load_file(out)
    assert sorted(loaded) == sorted(set(expected) - {"head.weight"})
    for name, tensor in loaded.items():
        assert same(tensor, expected[name]), name
    with safe_open(str(out), "pt") as opened:
        metadata = opened.metadata()
    assert metadata["format"] == "pt"
    assert json.loads(metadata[TIED_KEY]) == {"head.weight": "emb.weight"}
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask, "the user's default permissions"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"], "no temporary left"
    human = cli("export", str(root / "snap-000001"), "--out", str(tmp_path / "again.safetensors"))
    assert human.returncode == 0, human.stderr
    assert human.stdout.startswith("exported 6 tensors") and "head.weight = emb.weight" in human.stdout


@pytest.mark.slow
def test_a_tiny_max_shard_size_gives_shards_and_an_index_that_maps_every_name(
    asleep: tuple[Path, dict[str, torch.Tensor]], cli: Any, tmp_path: Path
) -> None:
    root, expected = asleep
    out = tmp_path / "sharded"
    document = valid(cli("export", str(root), "--out", str(out), "--max-shard-size", "200B", "--json"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert document["index"] == str(out / "model.safetensors.index.json")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and all(name.endswith(f"-of-{len(shards):05d}.safetensors") for name in shards)
    assert sorted(index["weight_map"]) == sorted(set(expected) - {"head.weight"})
    assert sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"] == {"total_size": document["bytes"], TIED_KEY: {"head.weight": "emb.weight"}}
    for name, shard in index["weight_map"].items():
        assert same(load_file(out / shard)[name], expected[name]), name
    assert sum(expected[name].nbytes for name in index["weight_map"]) == document["bytes"]


@pytest.mark.slow
def test_a_flipped_byte_is_refused_as_a_wake_refuses_it_and_nothing_is_written(
    asleep: tuple[Path, dict[str, torch.Tensor]], cli: Any, tmp_path: Path
) -> None:
    root, _ = asleep
    snapshot = root / "snap-000001"
    data = snapshot / "data-000.bin"
    original = data.read_bytes()
    flip_a_bit_in_a_chunk(data)
    try:
        for out in (tmp_path / "one.safetensors", tmp_path / "dir"):
            document = valid(
                cli("export", str(snapshot), "--out", str(out), "--json"), ExitCode.SNAPSHOT_INVALID
            )
            assert document["error"]["code"] == "snapshot-invalid"
            assert "checksum mismatch" in document["error"]["message"]
            assert list(tmp_path.iterdir()) == [], "no file, no temporary, no directory left"
    finally:
        data.write_bytes(original)  # so that the fixture's wake can verify it


@pytest.mark.slow
def test_an_existing_output_is_kept_unless_forced_and_a_link_is_never_followed(
    asleep: tuple[Path, dict[str, torch.Tensor]], cli: Any, tmp_path: Path
) -> None:
    root, expected = asleep
    out = tmp_path / "model.safetensors"
    out.write_text("precious")
    refused = valid(cli("export", str(root), "--out", str(out), "--json"), ExitCode.USAGE)
    assert "not overwriting" in refused["error"]["message"] and "--force" in refused["error"]["hint"]
    assert out.read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    valid(cli("export", str(root), "--out", str(out), "--force", "--json"))
    assert same(load_file(out)["base"], expected["base"])

    target = tmp_path / "elsewhere"
    target.write_text("not mine to change")
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    valid(cli("export", str(root), "--out", str(link), "--json"), ExitCode.USAGE)
    valid(cli("export", str(root), "--out", str(link), "--force", "--json"))
    assert not link.is_symlink() and target.read_text() == "not mine to change"
    assert same(load_file(link)["steps"], expected["steps"])

    linked_dir = tmp_path / "linked-dir"
    linked_dir.symlink_to(tmp_path)
    assert (
        "symbolic link"
        in valid(cli("export", str(root), "--out", str(linked_dir), "--json"), 2)["error"]["message"]
    )


@pytest.mark.slow
def test_an_earlier_export_in_a_directory_is_replaced_whole_only_with_force(
    asleep: tuple[Path, dict[str, torch.Tensor]], cli: Any, tmp_path: Path
) -> None:
    root, _ = asleep
    out = tmp_path / "export"
    valid(cli("export", str(root), "--out", str(out), "--max-shard-size", "200B", "--json"))
    before = sorted(p.name for p in out.iterdir())
    (out / "config.json").write_text("{}")  # the user's own file beside the export
    refused = valid(cli("export", str(root), "--out", str(out), "--json"), ExitCode.USAGE)
    assert "model-00001-of-" in refused["error"]["message"]
    assert sorted(p.name for p in out.iterdir()) == sorted([*before, "config.json"])
    valid(cli("export", str(root), "--out", str(out), "--force", "--json"))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.slow
@pytest.mark.skipif(not is_root(), reason="needs root: the snapshots of another user")
def test_another_user_s_snapshot_is_refused(
    asleep: tuple[Path, dict[str, torch.Tensor]], cli: Any, tmp_path: Path
) -> None:
    root, _ = asleep
    out = tmp_path / "out.safetensors"
    # Theirs, as root sees it: refused, though root could read it.
    for path in [root, *root.rglob("*")]:
        os.lchown(path, NOBODY, NOBODY)
    try:
        document = valid(cli("export", str(root), "--out", str(out), "--json"), ExitCode.PERMISSION_DENIED)
        assert f"belongs to uid {NOBODY}, not to you (uid 0)" in document["error"]["message"]
    finally:
        for path in [root, *root.rglob("*")]:
            os.lchown(path, 0, 0)
    assert not out.exists()
    # Root's, as another user sees it: refused before anything is opened.
    source_root_for(NOBODY)  # skips where that user cannot run this interpreter
    os.chmod(root.parent, 0o755)
    shared = Path(os.environ.get("TMPDIR", "/tmp"))
    document = valid(
        cli(
            "export",
            str(root),
            "--out",
            str(shared / f"hb-never-{os.getpid()}.safetensors"),
            "--json",
            uid=NOBODY,
        ),
        ExitCode.PERMISSION_DENIED,
    )
    assert "not to you" in document["error"]["message"] or "permission denied" in document["error"]["message"]


@pytest.mark.slow
def test_a_fresh_transformers_model_loaded_from_the_export_generates_the_same(
    fresh_agent: None, work_dir: Path, cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=1000, bos_token_id=0, eos_token_id=999
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr(), "tied"
    prompt = torch.tensor([[5, 17, 42, 7]])

    def generate(m: Any) -> list[int]:
        with torch.no_grad():
            out = m.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
        return [int(t) for t in out[0]]

    before = generate(model)
    hibernate.track(model)
    hibernate.sleep(work_dir)
    try:
        root = spill_root_of(work_dir, os.getpid())
        for out, flags in ((tmp_path / "one", []), (tmp_path / "sharded", ["--max-shard-size", "100KB"])):
            document = valid(cli("export", str(root), "--out", str(out), *flags, "--json"))
            assert document["aliases"] == {"lm_head.weight": "transformer.wte.weight"}
            config.save_pretrained(out)
            fresh = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
            assert fresh.lm_head.weight.data_ptr() == fresh.transformer.wte.weight.data_ptr()
            assert generate(fresh) == before, out
        assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    finally:
        hibernate.wake()
    assert generate(model) == before


# -- the store's export alone ----------------------------------------------------------------------


def view(name: str, dtype: str, shape: list[int], strides: list[int], offset: int = 0) -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": shape, "strides": strides, "storage_offset": offset}


def views(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"device": "cpu", "views": list(entries)}


def test_names_regions_without_views_and_dtypes_without_a_safetensors_name(tmp_path: Path) -> None:
    regions = [
        BytesRegion(
            "weights/w", "weights", bytes(range(16)), meta=views(view("w", "float32", [2, 2], [2, 1]))
        ),
        BytesRegion("kv_cache/pool", "kv_cache", b"\x01" * 64, meta={"kind": "bytes"}),
        BytesRegion("weights/z", "weights", b"\x02" * 32, meta=views(view("z", "complex128", [2], [1]))),
        BytesRegion("optimizer/w", "optimizer", b"\x03" * 8, meta=views(view("w", "int8", [8], [1]))),
    ]
    write(tmp_path / "root", regions, small_options())
    with pytest.raises(UsageError, match="two tensors of the snapshot are named 'w'") as refused:
        export_snapshot(tmp_path / "root", tmp_path / "a.safetensors")
    assert refused.value.hint is not None and "--tag" in refused.value.hint
    report = export_snapshot(tmp_path / "root", tmp_path / "a.safetensors", tags=["weights", "kv_cache"])
    assert report["tensors"] == 1 and [s["key"] for s in report["skipped"]] == ["kv_cache/pool", "weights/z"]
    assert load_file(tmp_path / "a.safetensors")["w"].view(torch.uint8).reshape(-1).tolist() == list(
        range(16)
    )
    report = export_snapshot(tmp_path / "root", tmp_path / "b.safetensors", tags=["optimizer"])
    assert load_file(tmp_path / "b.safetensors")["w"].tolist() == [3] * 8
    with pytest.raises(UnsupportedError, match="holds no tensor to export"):
        export_snapshot(tmp_path / "root", tmp_path / "c.safetensors", tags=["kv_cache"])
    assert not (tmp_path / "c.safetensors").exists()


def test_a_view_past_its_storage_is_refused_before_anything_is_read() -> None:
    meta = views(view("w", "float32", [4, 4], [4, 1], offset=1))
    with pytest.raises(SnapshotInvalidError, match="reaches byte 68 of a storage of 64 bytes"):
        plan_export(["weights/w"], ["weights"], [64], [meta], where="m")
    with pytest.raises(SnapshotInvalidError, match="integers >= 0"):
        plan_export(["weights/w"], ["weights"], [64], [views(view("w", "float32", [4], [-1]))], where="m")


def test_a_file_that_would_not_fit_the_shard_size_is_refused(tmp_path: Path) -> None:
    meta = views(view("w", "uint8", [100], [1]))
    write(tmp_path / "root", [BytesRegion("weights/w", "weights", b"\x05" * 100, meta=meta)], small_options())
    with pytest.raises(UsageError, match="do not fit in one file"):
        export_snapshot(tmp_path / "root", tmp_path / "w.safetensors", max_shard_bytes=99)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]


def test_strided_views_are_gathered_as_torch_lays_them_out() -> None:
    from hibernate.store.export import DTYPES, Tensor, _gather

    base = torch.arange(2 * 3 * 4 * 5, dtype=torch.int16).reshape(2, 3, 4, 5)
    cases = {
        "transpose": base[0, 0].t(),
        "permute": base.permute(3, 1, 0, 2),
        "stepped": base[:, ::2, 1:, ::3],
        "expanded": base[1, 2, 3, :1].expand(4, 5),
        "column": base[..., 2],
        "scalar": base[1, 1, 1, 1],
        "bool": (base % 3 == 0)[:, 1].transpose(0, 1),
    }
    for name, tensor in cases.items():
        storage = bytearray(bytes(tensor.untyped_storage()))
        dtype = str(tensor.dtype).removeprefix("torch.")
        spec = Tensor(
            name,
            0,
            dtype,
            list(tensor.shape),
            list(tensor.stride()),
            int(tensor.storage_offset()),
            DTYPES[dtype][1],
        )
        expected = bytes(tensor.contiguous().view(-1).view(torch.uint8))
        assert bytes(_gather(storage, spec)) == expected, name


def test_a_snapshot_exports_without_importing_torch(tmp_path: Path) -> None:
    meta = views(
        view("a", "float32", [4], [1]),
        view("b", "float32", [2], [1], offset=2),
        view("t", "int16", [2, 4], [1, 2]),  # a transpose: gathered by its strides, as bytes
    )
    regions = [BytesRegion("weights/a", "weights", bytes(range(16)), meta=meta)]
    write(tmp_path / "root", regions, small_options())
    args = ["hibernate", "export", str(tmp_path / "root"), "--out", str(tmp_path / "x"), "-q"]
    probe = (
        "import sys\n"
        "from hibernate.cli import main\n"
        f"sys.argv = {args!r}\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO)
    assert result.stdout.strip() == "False", result.stderr
    loaded = load_file(tmp_path / "x" / "model.safetensors")
    assert loaded["a"].view(torch.uint8).tolist() == list(range(16))
    assert loaded["b"].view(torch.uint8).tolist() == list(range(8, 16))
    as_torch = torch.frombuffer(bytearray(range(16)), dtype=torch.int16).as_strided((2, 4), (1, 2))
    assert torch.equal(loaded["t"], as_torch)


@pytest.mark.parametrize(
    "text, expected",
    [("5GB", 5 * 10**9), ("500MiB", 500 << 20), ("100kb", 100_000), ("4096", 4096), ("1.5 KiB", 1536)],
)
def test_sizes_are_read_as_transformers_reads_them(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "5XB", "0", "-1GB"])
def test_a_bad_size_is_a_usage_error(text: str) -> None:
    with pytest.raises(UsageError):
        parse_size(text)


def test_a_missing_snapshot_and_a_bad_size_from_the_cli(cli: Any, tmp_path: Path) -> None:
    missing = valid(cli("export", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), "--json"), 8)
    assert "does not exist" in missing["error"]["message"]
    bad = valid(
        cli("export", str(tmp_path), "--out", str(tmp_path / "o"), "--max-shard-size", "x", "--json"), 2
    )
    assert "is not a size" in bad["error"]["message"]
    assert not (tmp_path / "o").exists()


def test_the_format_document_names_the_metadata_key_and_the_files_the_code_writes() -> None:
    from hibernate.store import export

    doc = (REPO / "docs" / "format.md").read_text()
    section = doc[doc.index("## 11. Export to safetensors") :]
    assert f'`"{export.TIED_KEY}"`' in section and f'metadata["{export.TIED_KEY}"]' in section
    assert f"`{export.INDEX_FILE}`" in section and '`"format": "pt"`' in section


def test_a_root_being_written_is_busy_and_a_failure_half_way_leaves_nothing(tmp_path: Path) -> None:
    from hibernate.errors import BusyError
    from hibernate.store.layout import SpillRoot

    meta = views(view("w", "uint8", [64 * 1024], [1]))
    regions = [BytesRegion("weights/w", "weights", bytes(65536), meta=meta)]
    write(tmp_path / "root", regions, small_options())
    out = tmp_path / "out"
    with SpillRoot(tmp_path / "root") as writing:
        assert writing.lock(exclusive=True)
        with pytest.raises(BusyError):
            export_snapshot(tmp_path / "root", out)
    assert not out.exists()

    def interrupted(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export_snapshot(tmp_path / "root", out, progress=interrupted)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"], "no file, temporary or directory left"
    export_snapshot(tmp_path / "root", out)
    assert load_file(out / "model.safetensors")["w"].tolist() == [0] * 65536


def test_a_to_directory_of_one_process_stands_for_it_and_one_of_several_is_refused_with_their_names(
    tmp_path: Path,
) -> None:
    meta = views(view("w", "uint8", [100], [1]))
    write(
        tmp_path / "to" / "proc-1-aaaa",
        [BytesRegion("weights/w", "weights", b"\x05" * 100, meta=meta)],
        small_options(),
    )
    report = export_snapshot(tmp_path / "to", tmp_path / "one.safetensors")
    assert report["snapshot"].endswith("proc-1-aaaa/snap-000001") and report["newest"]
    write(
        tmp_path / "to" / "proc-2-bbbb",
        [BytesRegion("weights/w", "weights", b"\x06" * 100, meta=meta)],
        small_options(),
    )
    with pytest.raises(
        UsageError, match=r"holds the snapshots of 2 process\(es\) \(proc-1-aaaa, proc-2-bbbb\)"
    ):
        export_snapshot(tmp_path / "to", tmp_path / "two.safetensors")
    assert not (tmp_path / "two.safetensors").exists()
