"""Stand-in for the module ``vllm.device_allocator.cumem`` in a process without a GPU.

On a GPU machine that module is vLLM's: ``cumem_available``, the
``CuMemAllocator`` singleton, ``create_and_map`` / ``unmap_and_release`` (its C
extension) and ``libcudart`` (a ``CudaRTLibrary`` whose ``.lib`` is the loaded
CUDA runtime). Here it cannot even be imported, so the tests put this stand-in
in ``sys.modules`` under that name, with the same public names over host
memory:

* ``CuMemAllocator`` is :class:`~tests.standins.vllm_memory.StandInCuMemAllocator`;
* ``create_and_map`` / ``unmap_and_release`` act on host reservations;
* ``libcudart.lib`` is the fake CUDA runtime built from ``vllm_fake_cudart.c``,
  so hibernate's real CUDA seam (ctypes bindings, streams, pinning) runs.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
import types
from pathlib import Path

from tests.standins.vllm_memory import (
    HostReservations,
    StandInCuMemAllocator,
    create_and_map,
    unmap_and_release,
)

MODULE_NAME = "vllm.device_allocator.cumem"
SOURCE = Path(__file__).with_name("vllm_fake_cudart.c")


def build_fake_cudart(directory: Path) -> Path:
    """Compile the fake CUDA runtime into ``directory``; returns the shared library's path."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler to build the fake CUDA runtime")
    output = directory / "libcudart-standin.so"
    subprocess.run(
        [
            compiler,
            "-shared",
            "-fPIC",
            "-O2",
            "-Wall",
            "-Werror",
            "-o",
            str(output),
            str(SOURCE),
            "-lpthread",
        ],
        check=True,
        capture_output=True,
    )
    return output


class FakeCudaRT:
    """Stands for vLLM's ``CudaRTLibrary`` as far as hibernate uses it: ``.lib`` is the runtime."""

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))

    def counter(self, name: str) -> int:
        return int(ctypes.c_longlong.in_dll(self.lib, name).value)

    def set_counter(self, name: str, value: int) -> None:
        ctypes.c_longlong.in_dll(self.lib, name).value = value


def make_module(reservations: HostReservations, libcudart: FakeCudaRT | None) -> types.ModuleType:
    module = types.ModuleType(MODULE_NAME, "stand-in for vllm.device_allocator.cumem (tests only)")
    module.cumem_available = True  # type: ignore[attr-defined]
    module.CuMemAllocator = StandInCuMemAllocator  # type: ignore[attr-defined]
    module.libcudart = libcudart  # type: ignore[attr-defined]
    module.create_and_map = functools.partial(create_and_map, reservations)  # type: ignore[attr-defined]
    module.unmap_and_release = functools.partial(unmap_and_release, reservations)  # type: ignore[attr-defined]
    return module
