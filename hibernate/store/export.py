"""``hibernate export``: a snapshot's tensors as safetensors files, for any loader.

A snapshot keys each region by ``tag/name``; a tracked torch storage's meta
lists every tensor that views it (``{"device", "views": [{"name", "dtype",
"shape", "strides", "storage_offset"}, ...]}``, see pools/tensors.py). Each
view becomes one tensor of the file, named by its view name (what
``model.state_dict()`` calls it: no tag in front), laid out contiguously:

* views of one storage with the same dtype, shape, strides and offset are one
  tensor (tied weights): written once, under the first name, and every
  further name is recorded as an alias in the file's ``__metadata__``
  (``hibernate.tied``: the JSON text of ``{alias: name}``) and in the index;
* views that differ are each written as their own contiguous copy;
* regions without views (vLLM's pools, raw pools), views of a dtype
  safetensors has no name for, are left out and reported as skipped.

The snapshot is read with the store's own reader, under the root's shared
lock, every chunk verified against its checksum exactly as a wake verifies it
(SnapshotInvalidError, exit 8, on any mismatch), and nothing is published
until everything was read and written: each file is written under a
temporary name in its destination directory and renamed into place at the
end (a link where nothing may be replaced), so a failure or Ctrl-C leaves
no output behind.

Memory: a storage whose one exported tensor is the whole storage (almost
every parameter) is written from the staging buffers straight into its place
in the output file; only storages that hold several different tensors, or a
tensor that is a part of them, are gathered in memory first. Like the rest of
the store, it knows bytes, never torch: a strided view is gathered by its
strides (see _gather), so an export runs where torch is not installed.

The safetensors format (https://github.com/huggingface/safetensors): 8 bytes
little-endian header length, the header (UTF-8 JSON, padded with spaces to a
multiple of 8), then the tensors' bytes back to back with no gap, each at
``data_offsets`` ``[begin, end)`` from the end of the header. Tensors are laid
out largest element first, so every tensor starts at a multiple of its
element size.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import json
import operator
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hibernate.errors import (
    HibernateError,
    PermissionDeniedError,
    SnapshotInvalidError,
    StorageError,
    UnsupportedError,
    UsageError,
)
from hibernate.fsutil import open_dir
from hibernate.store.layout import MARKER_NAME, TMP_PREFIX, SpillRoot, is_spill_root
from hibernate.store.manifest import Record, WrittenRecords, snapshot_sequence
from hibernate.store.reader import Discard, SnapshotReader
from hibernate.store.regions import Region

FORMAT = "safetensors"
FORMATS = (FORMAT,)
# As transformers' save_pretrained: 5 GB (decimal) per shard by default.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
# The key of the file's __metadata__ (and of the index's metadata) naming tied tensors: {alias: name}.
TIED_KEY = "hibernate.tied"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5,}-of-\d{5,}\.safetensors")
# What safetensors readers accept of a header (its Rust reader's limit).
_MAX_HEADER_BYTES = 100_000_000
_RESERVED = "__metadata__"

# A snapshot's dtype names (str(torch.dtype) without "torch.") as safetensors names them, and
# their element sizes. Others (complex128, the sub-byte types, ...) have no safetensors name.
DTYPES: dict[str, tuple[str, int]] = {
    "bool": ("BOOL", 1),
    "uint8": ("U8", 1),
    "int8": ("I8", 1),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
    "float8_e4m3fnuz": ("F8_E4M3FNUZ", 1),
    "float8_e5m2fnuz": ("F8_E5M2FNUZ", 1),
    "float8_e8m0fnu": ("F8_E8M0", 1),
    "int16": ("I16", 2),
    "uint16": ("U16", 2),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "int32": ("I32", 4),
    "uint32": ("U32", 4),
    "float32": ("F32", 4),
    "int64": ("I64", 8),
    "uint64": ("U64", 8),
    "float64": ("F64", 8),
    "complex64": ("C64", 8),
}

ProgressFn = Callable[[int, int], None]
# The memoryview format of an unsigned integer of each element size.
_UNSIGNED: dict[int, Literal["B", "H", "I", "Q"]] = {1: "B", 2: "H", 4: "I", 8: "Q"}


# -- what the snapshot holds ------------------------------------------------------------------


@dataclass
class Tensor:
    """One tensor of the output: a view of a record's storage, and where it goes."""

    name: str
    record: int
    dtype: str
    shape: list[int]
    strides: list[int]
    offset: int  # in elements, as torch's storage_offset
    element: int  # bytes per element
    shard: int = 0
    start: int = 0  # data offset within its shard's byte buffer

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * self.element

    def contiguous(self) -> bool:
        """Row-major with no gaps (dimensions of size 1 have any stride); an empty tensor is."""
        if self.numel == 0:
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def whole(self, nbytes: int) -> bool:
        """The storage's bytes are this tensor's bytes, as they lie."""
        return self.offset == 0 and self.nbytes == nbytes and self.nbytes > 0 and self.contiguous()

    def header(self) -> dict[str, Any]:
        return {
            "dtype": DTYPES[self.dtype][0],
            "shape": self.shape,
            "data_offsets": [self.start, self.start + self.nbytes],
        }


@dataclass
class Plan:
    """What an export writes: the tensors, their aliases, and what it leaves out."""

    tensors: list[Tensor] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> the name written
    skipped: list[dict[str, str]] = field(default_factory=list)  # {"key", "name", "reason"}
    direct: dict[int, Tensor] = field(default_factory=dict)  # record -> its one tensor, the whole storage
    gathered: dict[int, list[Tensor]] = field(default_factory=dict)  # record -> its tensors, via memory
    shards: list[list[Tensor]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _int(value: object, minimum: int = 0) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= minimum else None


def _parse_view(raw: object, where: str) -> tuple[str, str, list[int], list[int], int]:
    """A view's (name, dtype, shape, strides, offset), each checked; one that would reach past its
    storage is refused: these numbers decide what is read, and the snapshot's checksum says only
    that they are what was written."""
    if not isinstance(raw, Mapping):
        raise SnapshotInvalidError(f"{where}: is not an object")
    name, dtype = raw.get("name"), raw.get("dtype")
    shape, strides, offset = raw.get("shape"), raw.get("strides"), _int(raw.get("storage_offset"))
    if not isinstance(name, str) or not name or not isinstance(dtype, str):
        raise SnapshotInvalidError(f"{where}: name and dtype must be non-empty strings")
    if (
        not isinstance(shape, list)
        or not isinstance(strides, list)
        or len(shape) != len(strides)
        or len(shape) > 64
        or offset is None
    ):
        raise SnapshotInvalidError(
            f"{where} ({name!r}): shape, strides and storage_offset do not describe a view"
        )
    sizes = [_int(n) for n in shape]
    steps = [_int(n) for n in strides]
    if None in sizes or None in steps:
        raise SnapshotInvalidError(f"{where} ({name!r}): shape and strides must hold integers >= 0")
    return name, dtype, [n for n in sizes if n is not None], [n for n in steps if n is not None], offset


def _reaches(tensor: Tensor) -> int:
    """The bytes of the storage a tensor's elements reach, from its start (0 for an empty tensor)."""
    if tensor.numel == 0:
        return 0
    last = tensor.offset + sum(
        (size - 1) * stride for size, stride in zip(tensor.shape, tensor.strides, strict=True)
    )
    return (last + 1) * tensor.element


def plan_export(
    keys: Sequence[str],
    tags: Sequence[str],
    sizes: Sequence[int],
    metas: Sequence[Mapping[str, Any]],
    *,
    where: str,
    only_tags: Sequence[str] = (),
) -> Plan:
    """The tensors of a snapshot's records (``only_tags``: of those tags alone), their aliases and
    what is skipped; no two tensors may share a name."""
    plan = Plan()
    owners: dict[str, str] = {}  # a name -> the key of the record it came from
    for index, (key, tag, nbytes, meta) in enumerate(zip(keys, tags, sizes, metas, strict=True)):
        if only_tags and tag not in only_tags:
            continue
        views = meta.get("views") if isinstance(meta, Mapping) else None
        if not isinstance(views, list) or not views:
            plan.skipped.append(
                {"key": key, "name": "", "reason": "not a torch tensor's storage (its meta names no views)"}
            )
            continue
        written: dict[tuple[str, tuple[int, ...], tuple[int, ...], int], Tensor] = {}
        mine: list[Tensor] = []
        for number, raw in enumerate(views):
            name, dtype, shape, strides, offset = _parse_view(raw, f"{where}: record {key!r} views[{number}]")
            if name in owners:
                raise UsageError(
                    f"two tensors of the snapshot are named {name!r} (in {owners[name]!r} and {key!r}); "
                    "a safetensors file holds one tensor by each name",
                    hint="export one tag at a time with --tag TAG" if len(set(tags)) > 1 else None,
                )
            owners[name] = key
            if name == _RESERVED:
                plan.skipped.append({"key": key, "name": name, "reason": "the name safetensors reserves"})
                continue
            if dtype not in DTYPES:
                plan.skipped.append(
                    {"key": key, "name": name, "reason": f"dtype {dtype} has no safetensors name"}
                )
                continue
            tensor = Tensor(name, index, dtype, shape, strides, offset, DTYPES[dtype][1])
            if _reaches(tensor) > nbytes:
                raise SnapshotInvalidError(
                    f"{where}: record {key!r} views[{number}] ({name!r}) reaches byte {_reaches(tensor)} "
                    f"of a storage of {nbytes} bytes"
                )
            layout = (dtype, tuple(shape), tuple(strides), offset)
            first = written.get(layout)
            if first is not None:
                plan.aliases[name] = first.name
                continue
            written[layout] = tensor
            mine.append(tensor)
        plan.tensors.extend(mine)
        if len(mine) == 1 and mine[0].whole(nbytes):
            plan.direct[index] = mine[0]
        elif mine:
            plan.gathered[index] = mine
    return plan


def shard(tensors: Sequence[Tensor], max_bytes: int) -> list[list[Tensor]]:
    """Tensors in order into shards of at most ``max_bytes`` each, as transformers shards them:
    a tensor that does not fit in the current shard starts the next; one larger than the limit
    is a shard of its own."""
    shards: list[list[Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def header_bytes(tensors: Sequence[Tensor], metadata: Mapping[str, str]) -> bytes:
    """A shard's header, laying its tensors out (``start``) largest element first, as safetensors
    does: each then starts at a multiple of its element size, the header being padded to 8."""
    start = 0
    for tensor in sorted(tensors, key=lambda t: -t.element):  # stable: the snapshot's order within
        tensor.start = start
        start += tensor.nbytes
    body: dict[str, Any] = {_RESERVED: dict(metadata)}
    body.update((t.name, t.header()) for t in tensors)
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    if len(text) > _MAX_HEADER_BYTES:
        raise UnsupportedError(
            f"a safetensors header of {len(text)} bytes: its readers refuse more than {_MAX_HEADER_BYTES}",
            hint="shard it: a smaller --max-shard-size puts fewer tensors in each file",
        )
    return len(text).to_bytes(8, "little") + text


# -- the snapshot ----------------------------------------------------------------------------


def _mine(path: Path, uid: int, what: str) -> None:
    """Refuse a root another user owns (PermissionDeniedError, exit 5)."""
    me = os.geteuid()
    if uid != me:
        raise PermissionDeniedError(
            f"{path} {what} uid {uid}, not to you (uid {me}); hibernate exports only your own snapshots",
            hint=f"run the export as uid {uid}",
        )


def _has_marker(path: Path) -> bool:
    """Whether ``path`` is a spill root; one the caller may not look into is refused, saying whose."""
    try:
        return is_spill_root(path)
    except PermissionError:
        with contextlib.suppress(OSError):
            _mine(path, os.lstat(path).st_uid, "belongs to")
        raise PermissionDeniedError(f"cannot look into {path}: permission denied") from None


def locate(snapshot: Path) -> tuple[Path, str | None]:
    """A SNAPSHOT argument as (spill root, snapshot name or None for the newest)."""
    path = Path(snapshot).expanduser().absolute()
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise SnapshotInvalidError(f"snapshot {path} does not exist") from None
    except PermissionError:
        raise PermissionDeniedError(
            f"cannot reach {path}: permission denied (another user's directory?)",
            hint="hibernate exports only your own snapshots",
        ) from None
    except OSError as exc:
        raise StorageError(f"cannot look at {path}: {exc.strerror}") from exc
    if stat.S_ISLNK(info.st_mode):
        raise SnapshotInvalidError(f"{path} is a symbolic link; refusing to follow it")
    if not stat.S_ISDIR(info.st_mode):
        raise SnapshotInvalidError(f"{path} is not a snapshot directory (snap-NNNNNN) nor a spill root")
    if snapshot_sequence(path.name) is not None and _has_marker(path.parent):
        return path.parent, path.name
    if path.name.startswith(TMP_PREFIX) and _has_marker(path.parent):
        raise SnapshotInvalidError(
            f"{path} is unfinished: a sleep was writing it, or failed; never published"
        )
    if _has_marker(path):
        return path, None
    from hibernate.store.maintenance import spill_roots

    inside = [p.name for p in spill_roots(path) if p != path]
    if len(inside) == 1:  # a --to directory of one process: there is no choosing to do
        return path / inside[0], None
    if inside:
        shown = ", ".join(inside[:5]) + (f" and {len(inside) - 5} more" if len(inside) > 5 else "")
        raise UsageError(
            f"{path} holds the snapshots of {len(inside)} process(es) ({shown}); name one of them",
            hint=f"hibernate export {path / inside[0]} ...",
        )
    raise SnapshotInvalidError(
        f"{path} was not made by hibernate (it has no {MARKER_NAME}, nor is it a snap-NNNNNN inside "
        "one); not touching it"
    )


@contextlib.contextmanager
def open_snapshot(snapshot: Path) -> Iterator[tuple[SnapshotReader, bool]]:
    """The snapshot SNAPSHOT names, opened by the store's reader, and whether it was chosen as its
    root's newest. The reader holds the root's lock shared, as a wake's does: a sleep of the process
    is refused as busy meanwhile, gc leaves the root alone; one running now makes this BUSY.

    Only a root of the caller's own (its directory and the marker's uid) is opened.
    """
    root_path, name = locate(snapshot)
    try:
        _mine(root_path, os.lstat(root_path).st_uid, "belongs to")
    except PermissionError:
        raise PermissionDeniedError(f"cannot reach {root_path}: permission denied") from None
    root = SpillRoot(root_path, inspect=True)
    try:
        _mine(root_path, os.fstat(root.fd).st_uid, "belongs to")  # the directory opened, not the path
        if root.owner.uid != os.geteuid():
            _mine(root_path, root.owner.uid, "holds the snapshots of a process of")
        newest = name is None
        if name is None:
            published = root.published()
            if not published:
                raise SnapshotInvalidError(f"{root_path} holds no published snapshot")
            name = published[-1]
        with SnapshotReader(root, name) as reader:
            yield reader, newest
    finally:
        root.close()


# -- regions the reader fills ----------------------------------------------------------------


def _pwrite_all(fd: int, data: bytes | bytearray | memoryview, position: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, position)
        position += written
        view = view[written:]


class _FileRegion:
    """A record read straight into its tensor's place in an output file (``pwrite``)."""

    def __init__(self, key: str, tag: str, nbytes: int, meta: Mapping[str, Any], fd: int, at: int) -> None:
        self.key, self.tag, self.nbytes, self.meta = key, tag, nbytes, meta
        self._fd, self._at = fd, at

    def copy_out(self, offset: int, dst: memoryview) -> None:
        raise AssertionError("an export never writes a snapshot")

    def copy_in(self, offset: int, src: memoryview) -> None:
        _pwrite_all(self._fd, src, self._at + offset)

    def host_view(self, offset: int, length: int) -> memoryview | None:
        return None

    def host_address(self) -> int | None:
        return None


class _MemoryRegion:
    """A record read into memory, to be cut into its tensors once verified."""

    def __init__(self, key: str, tag: str, nbytes: int, meta: Mapping[str, Any]) -> None:
        self.key, self.tag, self.nbytes, self.meta = key, tag, nbytes, meta
        self.data = bytearray(nbytes)

    def copy_out(self, offset: int, dst: memoryview) -> None:
        raise AssertionError("an export never writes a snapshot")

    def copy_in(self, offset: int, src: memoryview) -> None:
        self.data[offset : offset + len(src)] = src

    def host_view(self, offset: int, length: int) -> memoryview | None:
        return memoryview(self.data)[offset : offset + length]

    def host_address(self) -> int | None:
        # Never resized while the read runs, so its buffer stays where it is.
        return ctypes.addressof(ctypes.c_char.from_buffer(self.data)) if self.data else None


def _gather(data: bytearray, tensor: Tensor) -> bytes | bytearray | memoryview:
    """A view's bytes, contiguous, from its storage's bytes, as they lie (no value is interpreted).

    A strided view (a transpose, an expanded dimension) is gathered a row at a time: its elements
    as unsigned integers of their width, the last dimension as one stepped slice copied in C, so
    a transposed 4096 x 4096 matrix costs 4096 slices, not 16 million elements in Python.
    """
    if tensor.numel == 0:
        return b""
    if tensor.contiguous():
        start = tensor.offset * tensor.element
        return memoryview(data)[start : start + tensor.nbytes]
    size = tensor.element
    typed = memoryview(data)[: len(data) // size * size].cast(_UNSIGNED[size])
    *outer, inner = tensor.shape
    *outer_strides, step = tensor.strides
    out = bytearray(tensor.nbytes)
    row = inner * size
    for number, index in enumerate(itertools.product(*map(range, outer))):
        first = tensor.offset + sum(map(operator.mul, index, outer_strides))
        if step:
            piece = typed[first : first + (inner - 1) * step + 1 : step].tobytes()
        else:  # an expanded dimension: one element, repeated
            piece = typed[first : first + 1].tobytes() * inner
        out[number * row : (number + 1) * row] = piece
    return out


# -- the output ------------------------------------------------------------------------------


@dataclass
class _Output:
    """One file being written: its final name in ``dir_fd``, its temporary name and descriptor."""

    name: str
    temp: str
    fd: int
    size: int
    tensors: int
    data_start: int


class _Destination:
    """Where the files go: a directory opened once, every name relative to it, no link followed."""

    def __init__(self, out: Path, *, shards: int, force: bool) -> None:
        self.path = Path(out).expanduser().absolute()
        self.force = force
        self.created_dir = False
        self.single = self.path.name.endswith(".safetensors")
        if self.single:
            self.directory = self.path.parent
            self.names = [self.path.name]
        else:
            self.directory = self.path
            self.names = (
                [SINGLE_FILE]
                if shards == 1
                else [f"model-{n:05d}-of-{shards:05d}.safetensors" for n in range(1, shards + 1)]
                + [INDEX_FILE]
            )
        self.fd = self._open()
        try:
            self._check_names()
        except BaseException:
            self.close(failed=True)
            raise

    def _open(self) -> int:
        directory = self.directory
        try:
            info = os.lstat(directory)
        except FileNotFoundError:
            if self.single:
                raise UsageError(f"{directory} does not exist (the directory of --out)") from None
            try:
                os.mkdir(directory, 0o777)  # the umask decides, as for any file the user makes
            except FileNotFoundError:
                raise UsageError(f"{directory.parent} does not exist (the directory above --out)") from None
            except OSError as exc:
                raise StorageError(f"cannot create {directory}: {exc.strerror}") from exc
            self.created_dir = True
            info = os.lstat(directory)
        except OSError as exc:
            raise StorageError(f"cannot look at {directory}: {exc.strerror}") from exc
        if stat.S_ISLNK(info.st_mode) and not self.single:
            raise UsageError(f"--out {directory} is a symbolic link; refusing to follow it")
        try:
            return (
                open_dir(directory) if not self.single else os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            )
        except HibernateError:
            raise UsageError(f"--out {directory} is not a directory") from None
        except NotADirectoryError:
            raise UsageError(f"{directory} is not a directory (the directory of --out)") from None
        except OSError as exc:
            raise StorageError(f"cannot open {directory}: {exc.strerror}") from exc

    def _lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def _check_names(self) -> None:
        """Refuse a name taken by a directory; without --force, any name taken, and (a directory's
        export) any file of an earlier export beside, which a loader would mix with this one."""
        present = self.names if self.single else [*self.names, *self.stale()]
        taken = [name for name in dict.fromkeys(present) if self._lstat(name) is not None]
        for name in taken:
            info = self._lstat(name)
            if info is not None and stat.S_ISDIR(info.st_mode):
                raise UsageError(f"{self.directory / name} is a directory; an export would replace it")
        if taken and not self.force:
            shown = ", ".join(str(self.directory / n) for n in taken[:3])
            more = f" and {len(taken) - 3} more" if len(taken) > 3 else ""
            raise UsageError(
                f"{shown}{more} exist{'s' if len(taken) == 1 else ''}; not overwriting",
                hint="pass --force to replace them (and remove the other files of an earlier export there)",
            )

    def stale(self) -> list[str]:
        """Files of an earlier export in the directory that this one does not write."""
        if self.single:
            return []
        names = os.listdir(self.fd)
        earlier = [n for n in names if n in (SINGLE_FILE, INDEX_FILE) or _SHARD.fullmatch(n)]
        return sorted(set(earlier) - set(self.names))

    def create(self, name: str, size: int, tensors: int, data_start: int) -> _Output:
        for _ in range(8):
            temp = f".{name}.tmp-{secrets.token_hex(4)}"
            try:
                fd = os.open(
                    temp,
                    os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o666,
                    dir_fd=self.fd,
                )
            except FileExistsError:
                continue
            except OSError as exc:
                raise StorageError(f"cannot create a file in {self.directory}: {exc.strerror}") from exc
            return _Output(name, temp, fd, size, tensors, data_start)
        raise StorageError(f"cannot create a temporary file in {self.directory}: every name tried exists")

    def publish(self, outputs: Sequence[_Output]) -> None:
        """Each temporary file under its final name, in order (an index last); without --force a
        name taken meanwhile is refused, and what this call published so far is taken back."""
        done: list[str] = []
        try:
            for output in outputs:
                self._publish_one(output)
                done.append(output.name)
        except BaseException:
            for name in done:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self.fd)
            raise
        os.fsync(self.fd)
        if self.force:
            for name in self.stale():
                info = self._lstat(name)
                if info is not None and not stat.S_ISDIR(info.st_mode):
                    os.unlink(name, dir_fd=self.fd)
            os.fsync(self.fd)

    def _publish_one(self, output: _Output) -> None:
        fd = self.fd
        if self.force:
            os.rename(output.temp, output.name, src_dir_fd=fd, dst_dir_fd=fd)
            return
        try:
            os.link(output.temp, output.name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
        except FileExistsError:
            raise UsageError(
                f"{self.directory / output.name} appeared while the export ran; not overwriting",
                hint="pass --force to replace it",
            ) from None
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS):
                raise
            # No hard links here (some FUSE and network filesystems): the name checked, then renamed.
            if self._lstat(output.name) is not None:
                raise UsageError(f"{self.directory / output.name} exists; not overwriting") from None
            os.rename(output.temp, output.name, src_dir_fd=fd, dst_dir_fd=fd)
            return
        os.unlink(output.temp, dir_fd=fd)

    def discard(self, outputs: Sequence[_Output]) -> None:
        for output in outputs:
            with contextlib.suppress(OSError):
                os.unlink(output.temp, dir_fd=self.fd)

    def close(self, *, failed: bool = False) -> None:
        os.close(self.fd)
        if failed and self.created_dir:
            with contextlib.suppress(OSError):
                os.rmdir(self.directory)


def _check_space(destination: _Destination, needed: int) -> None:
    info = os.fstatvfs(destination.fd)
    free = info.f_bavail * info.f_frsize
    if free < needed:
        raise StorageError(
            f"not enough space in {destination.directory}: the export needs {needed} bytes, {free} are free"
        )


# -- the export ------------------------------------------------------------------------------


def _read_verified(
    reader: SnapshotReader, regions: list[Region], buffer_bytes: int, progress: ProgressFn | None
) -> int:
    """Read every record into its region, verified, on a thread of its own: Ctrl-C in this thread
    calls the read off and waits for its threads to stop before the output files are touched."""
    cancel = threading.Event()
    outcome: list[Any] = []

    def read() -> None:
        try:
            outcome.append(
                reader.read_into(
                    regions, buffer_bytes=buffer_bytes, progress=progress, cancelled=cancel.is_set
                )
            )
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=read, name="hibernate-export-read", daemon=True)
    thread.start()
    try:
        thread.join()
    except BaseException:
        cancel.set()
        while thread.is_alive():
            with contextlib.suppress(KeyboardInterrupt):
                thread.join()
        raise
    (result,) = outcome
    if isinstance(result, BaseException):
        raise result
    return int(result.total_bytes)


def export_snapshot(
    snapshot: Path,
    out: Path,
    *,
    fmt: str = FORMAT,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tags: Sequence[str] = (),
    force: bool = False,
    buffer_bytes: int = 256 << 20,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Export the tensors of SNAPSHOT (a snapshot directory, or a spill root: its newest) to OUT (a
    ``.safetensors`` file, or a directory: ``model.safetensors``, or shards and their index); the
    report ``hibernate export --json`` prints."""
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r} is not one hibernate exports; choose from {', '.join(FORMATS)}")
    started = time.monotonic()
    with open_snapshot(snapshot) as (reader, newest):
        manifest = reader.manifest
        columns = manifest.columns
        source = reader.root.path / manifest.snapshot
        where = str(source / "manifest.json")
        plan = plan_export(
            columns.keys, columns.tags, columns.sizes, columns.metas, where=where, only_tags=tags
        )
        if not plan.tensors:
            raise UnsupportedError(
                f"{source} holds no tensor to export"
                + (f" of tag {', '.join(tags)}" if tags else "")
                + (
                    f" ({len(plan.skipped)} region(s) skipped: {plan.skipped[0]['reason']})"
                    if plan.skipped
                    else ""
                ),
                hint="only tensors tracked with hibernate.track() are named in a snapshot",
            )
        plan.shards = shard(plan.tensors, max_shard_bytes)
        if plan.nbytes > max_shard_bytes and Path(out).name.endswith(".safetensors"):
            raise UsageError(
                f"the {len(plan.tensors)} tensors ({plan.nbytes} bytes) do not fit in one file of "
                f"--max-shard-size {max_shard_bytes} bytes",
                hint="give --out a directory to write shards and their index, or a larger --max-shard-size",
            )
        destination = _Destination(out, shards=len(plan.shards), force=force)
        outputs: list[_Output] = []
        try:
            files = _write(reader, plan, destination, outputs, buffer_bytes, progress)
            try:
                destination.publish(outputs)
            except OSError as exc:
                raise StorageError(
                    f"cannot put the export in place in {destination.directory}: {exc.strerror or exc}"
                ) from exc
        except BaseException:
            destination.discard(outputs)
            for output in outputs:
                with contextlib.suppress(OSError):
                    os.close(output.fd)
            destination.close(failed=True)
            raise
        for output in outputs:
            os.close(output.fd)
        destination.close()
    return {
        "operation": "export",
        "format": fmt,
        "snapshot": str(source),
        "newest": newest,
        "out": str(destination.path),
        "files": files,
        "index": str(destination.directory / INDEX_FILE) if len(plan.shards) > 1 else None,
        "tensors": len(plan.tensors),
        "bytes": plan.nbytes,
        "read_bytes": manifest.total_bytes,
        "aliases": plan.aliases,
        "skipped": plan.skipped,
        "seconds": round(time.monotonic() - started, 6),
    }


def _write(
    reader: SnapshotReader,
    plan: Plan,
    destination: _Destination,
    outputs: list[_Output],
    buffer_bytes: int,
    progress: ProgressFn | None,
) -> list[dict[str, Any]]:
    """Create the files, read the snapshot into them (verified), write what was gathered, fsync; the
    files as the report lists them. ``outputs`` is filled as files are made (the caller discards them
    on failure)."""
    columns = reader.manifest.columns
    headers: list[bytes] = []
    for index, tensors in enumerate(plan.shards):
        for tensor in tensors:
            tensor.shard = index
        names = {t.name for t in tensors}
        tied = {alias: name for alias, name in plan.aliases.items() if name in names}
        metadata = {"format": "pt", **({TIED_KEY: json.dumps(tied, sort_keys=True)} if tied else {})}
        headers.append(header_bytes(tensors, metadata))
    sizes = [len(h) + sum(t.nbytes for t in tensors) for h, tensors in zip(headers, plan.shards, strict=True)]
    index_text = b""
    if len(plan.shards) > 1:
        weight_map = {t.name: destination.names[t.shard] for t in plan.tensors}
        about: dict[str, Any] = {"total_size": plan.nbytes}
        if plan.aliases:
            about[TIED_KEY] = plan.aliases
        index_text = (
            json.dumps({"metadata": about, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n"
        ).encode()
    _check_space(destination, sum(sizes) + len(index_text) + (1 << 20))
    try:
        for name, header, size, tensors in zip(
            destination.names[: len(plan.shards)], headers, sizes, plan.shards, strict=True
        ):
            output = destination.create(name, size, len(tensors), len(header))
            outputs.append(output)
            os.pwrite(output.fd, header, 0)
            os.ftruncate(output.fd, size)
        regions: list[Region] = []
        memory: dict[int, _MemoryRegion] = {}
        for index, record in enumerate(
            zip(columns.keys, columns.tags, columns.sizes, columns.metas, strict=True)
        ):
            whole = plan.direct.get(index)
            if whole is not None:
                output = outputs[whole.shard]
                regions.append(_FileRegion(*record, output.fd, output.data_start + whole.start))
            elif index in plan.gathered:
                memory[index] = _MemoryRegion(*record)
                regions.append(memory[index])
            else:
                regions.append(Discard(Record(*record, ())))
        # The regions are the manifest's own records: nothing of a process to compare them with.
        reader.check_matches(regions, written=WrittenRecords.of(columns))
        _read_verified(reader, regions, buffer_bytes, progress)
        for index, tensors in plan.gathered.items():
            data = memory.pop(index).data
            for tensor in tensors:
                output = outputs[tensor.shard]
                _pwrite_all(output.fd, _gather(data, tensor), output.data_start + tensor.start)
        if index_text:
            output = destination.create(INDEX_FILE, len(index_text), 0, 0)
            outputs.append(output)
            os.pwrite(output.fd, index_text, 0)
        for output in outputs:
            os.fsync(output.fd)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise StorageError(f"no space left in {destination.directory} for the export") from exc
        raise StorageError(
            f"cannot write the export in {destination.directory}: {exc.strerror or exc}"
        ) from exc
    return [
        {"path": str(destination.directory / o.name), "bytes": o.size, "tensors": o.tensors} for o in outputs
    ]
