"""The Slurm scripts come with the package: a site that pip-installs hibernate has hibernate-job.

The package is built from a copy of this checkout and installed into a fresh
virtual environment, as a site would, then asked where its scripts are.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

SLURM = REPO / "scripts" / "slurm"
ON_PATH = ("hibernate-job", "hibernate-suspend", "hibernate-resume")


def copy_of_checkout(destination: Path) -> Path:
    """The files git knows, as they are now in the working tree (nothing built, no caches)."""
    listed = (
        subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


@pytest.mark.slow
def test_a_pip_install_puts_the_slurm_scripts_on_path_and_says_where_they_are(tmp_path: Path) -> None:
    source = copy_of_checkout(tmp_path / "source")
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(source)],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("hibernate-*.whl")
    fresh = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True)
    python = fresh / "bin" / "python"
    subprocess.run(
        [*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
    )
    # hibernate's own dependencies (typer, rich...) from this interpreter, after the fresh venv's
    # own packages: hibernate and its file list are the fresh install's.
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    for name in ON_PATH:
        found = shutil.which(name, path=str(fresh / "bin"))
        assert found is not None, f"{name} is not on the fresh venv's PATH"
        assert Path(found).read_bytes() == (SLURM / name).read_bytes()

    printed = subprocess.run(
        [str(fresh / "bin" / "hibernate"), "slurm-scripts"], capture_output=True, text=True, cwd=tmp_path
    )
    assert printed.returncode == 0, printed.stderr
    directory = Path(printed.stdout.strip())
    assert directory.is_relative_to(fresh.resolve()) and directory.is_dir()
    assert sorted(p.name for p in directory.iterdir()) == sorted(p.name for p in SLURM.iterdir())
    for script in SLURM.iterdir():
        assert (directory / script.name).read_bytes() == script.read_bytes()


def test_a_source_checkout_names_its_own_scripts(cli: Callable[..., Any]) -> None:
    printed = cli("slurm-scripts")
    assert printed.returncode == 0, printed.stderr
    assert (Path(printed.stdout.strip()) / "hibernate-job").read_bytes() == (
        SLURM / "hibernate-job"
    ).read_bytes()
