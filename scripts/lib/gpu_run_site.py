"""scripts/gpu-run's helper, run with the GPU machine's own python3 (standard library only).

    python3 scripts/lib/gpu_run_site.py unpack VENDOR SITE   # what the image lacks, from VENDOR into SITE
    python3 scripts/lib/gpu_run_site.py check [--dry-run]    # every import the run needs, or exit 3

``unpack`` reads ``VENDOR/vendor.json`` (written by scripts/gpu-vendor) and
unpacks into ``SITE`` each carried package the image cannot import, or has
older than hibernate needs: its files common to every Python, then those of
this interpreter's Python (``cp312``, say). The command-line packages (typer,
rich and what they need) are one group, unpacked all together or not at all,
so that a carried typer never meets an older click of the image's. Any other
``VENDOR/*.whl`` is unpacked as it is. Nothing is installed into the image:
``SITE`` is put first on ``PYTHONPATH`` by gpu-run.

``check`` imports what hibernate and the run's sections need, with the
``PYTHONPATH`` the run will have, and names every one that fails (exit 3):
orjson, xxhash, psutil, typer, rich and torch with CUDA (hibernate and the
demo), numpy and torch_memory_saver (the pools sections).
``GPU_CHECK_WITHOUT_VENDOR=1`` lets the run go on without the last two, as
without the carried files. ``--dry-run`` asks torch for no CUDA.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

MANIFEST = "vendor.json"
ESSENTIAL = ("orjson", "xxhash", "psutil", "typer", "rich", "torch")
FOR_POOLS = ("numpy", "torch_memory_saver")
MISSING = 3  # scripts/gpu-run's exit status when something the run needs is not there


def python_tag(version: tuple[int, int] | None = None) -> str:
    """This interpreter's CPython tag (``cp312``): which carried files are its own."""
    major, minor = version or sys.version_info[:2]
    return f"cp{major}{minor}"


def version_key(version: str) -> tuple[int, ...]:
    """A version's leading numbers, enough to compare with a minimum (``3.10.18`` -> (3, 10, 18))."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:4])


def image_has(package: dict[str, Any]) -> bool:
    """Whether the image (what this interpreter finds) has ``package``, at its minimum version if any."""
    if importlib.util.find_spec(package["module"]) is None:
        return False
    minimum = package.get("min")
    if not minimum:
        return True
    try:
        found = importlib.metadata.version(package["dist"])
    except importlib.metadata.PackageNotFoundError:  # importable, yet no metadata: taken as it is
        return True
    return version_key(found) >= version_key(minimum)


def chosen(manifest: dict[str, Any], has: Any = image_has) -> list[dict[str, Any]]:
    """The carried packages to unpack: those the image lacks, and a whole group if any of it is lacking."""
    packages = manifest.get("packages") or []
    lacking = [p for p in packages if not has(p)]
    groups = {p["group"] for p in lacking if p.get("group")}
    return [p for p in packages if p in lacking or (p.get("group") and p["group"] in groups)]


def unpack(vendor: Path, site: Path, tag: str | None = None) -> dict[str, Any]:
    """Unpack into ``site`` what the image lacks (see the module docstring); what was done, for the log."""
    tag = tag or python_tag()
    done: dict[str, Any] = {"python": tag, "unpacked": [], "no_files_for_this_python": [], "wheels": []}
    manifest_path = vendor / MANIFEST
    listed: set[str] = set()
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        for package in manifest.get("packages") or []:
            listed.update(package.get("files") or [])
            listed.update((package.get("per_python") or {}).values())
        for package in chosen(manifest):
            per_python = package.get("per_python") or {}
            if package.get("pythons") and tag not in package["pythons"]:
                continue  # a dependency only other Pythons need (its marker says so)
            if per_python and tag not in per_python:  # compiled, and carried for other Pythons only
                done["no_files_for_this_python"].append(package["dist"])
                continue
            files = [*(package.get("files") or []), *([per_python[tag]] if tag in per_python else [])]
            for name in files:
                with zipfile.ZipFile(vendor / name) as archive:
                    archive.extractall(site)
            done["unpacked"].append(f"{package['dist']} {package.get('version', '')}".strip())
    for wheel in sorted(vendor.glob("*.whl")):  # carried by hand: unpacked as it is
        if wheel.name not in listed:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(site)
            done["wheels"].append(wheel.name)
    return done


def import_problem(module: str, dry_run: bool) -> str | None:
    """Why ``module`` cannot be used by the run (None: it can)."""
    try:
        imported = importlib.import_module(module)
    except (Exception, SystemExit) as exc:  # a broken extension, or one that exits: said, not raised
        return f"{module} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if module == "torch" and not dry_run and not imported.cuda.is_available():
        return f"torch with CUDA (torch {imported.__version__} sees no GPU)"
    return None


def check(dry_run: bool, without_vendor: bool) -> list[str]:
    """What the run needs and cannot import; the pools' packages count only with the carried files."""
    wanted = ESSENTIAL + (() if without_vendor else FOR_POOLS)
    return [problem for module in wanted if (problem := import_problem(module, dry_run)) is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    unpacking = sub.add_parser("unpack")
    unpacking.add_argument("vendor", type=Path)
    unpacking.add_argument("site", type=Path)
    checking = sub.add_parser("check")
    checking.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "unpack":
        print(json.dumps(unpack(args.vendor, args.site)))
        return 0
    problems = check(args.dry_run, os.environ.get("GPU_CHECK_WITHOUT_VENDOR") == "1")
    if problems:
        print(
            f"gpu-run: this image cannot import {'; '.join(problems)}: carry its wheels for "
            f"Python {sys.version_info[0]}.{sys.version_info[1]} in vendor/ (scripts/gpu-vendor)",
            file=sys.stderr,
        )
        return MISSING
    return 0


if __name__ == "__main__":
    sys.exit(main())
