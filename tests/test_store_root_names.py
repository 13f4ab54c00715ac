"""A process's spill root name, taken by someone else in one --to, costs it nothing there.

The name's random part is drawn once for the agent's life, so that every sleep
finds its previous snapshot again. Another user who saw it in one shared
``--to`` can make a directory of that name in another: the sleep there takes a
name of its own, and keeps it for later sleeps there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hibernate.errors import PermissionDeniedError
from hibernate.pools.tensors import TensorPool
from hibernate.store.layout import ROOT_NAME_TRIES, name_taken, open_spill_root_in
from hibernate.store.owner import Owner
from tests.pooled import agent_with

NOBODY = 65534
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to make directories as another user")


def shared_dir(parent: Path, name: str) -> Path:
    path = parent / name
    path.mkdir()
    path.chmod(0o1777)
    return path


def root_of(report: dict) -> Path:
    return Path(report["spill"]["path"]).parent


def squat(path: Path) -> None:
    path.mkdir()
    os.chown(path, NOBODY, NOBODY)


@needs_root
def test_a_name_squatted_in_another_to_is_replaced_there_and_kept_for_later_sleeps(tmp_path: Path) -> None:
    weights = torch.arange(1 << 16, dtype=torch.float32)
    before = weights.clone()
    pool = TensorPool()
    pool.track(weights, "weights", True, "w")
    agent = agent_with(pool, "names")
    first_to, second_to = shared_dir(tmp_path, "one"), shared_dir(tmp_path, "two")

    seen = root_of(agent.sleep_here(first_to, 5.0, {}))
    agent.wake_here({})
    squat(second_to / seen.name)  # another user saw the name in one and took it in two

    report = agent.sleep_here(second_to, 5.0, {})
    own = root_of(report)
    assert own.parent == second_to and own.name != seen.name and own.name.startswith("names-")
    assert own.stat().st_uid == os.getuid()
    assert not any((second_to / seen.name).iterdir()), "nothing was written into another's directory"
    agent.wake_here({})
    assert torch.equal(weights, before)

    again = agent.sleep_here(second_to, 5.0, {})
    assert root_of(again) == own, "a later sleep there finds its own root again"
    assert again["spill"]["reused_bytes"] == weights.nbytes, "and reuses its snapshot"
    agent.wake_here({})
    assert root_of(agent.sleep_here(first_to, 5.0, {})) == seen, "the first --to keeps the first name"
    agent.wake_here({})
    assert torch.equal(weights, before)


@needs_root
def test_what_another_user_has_there_holds_a_name_and_what_one_has_oneself_does_not(tmp_path: Path) -> None:
    for name in ("file", "link", "dir"):
        for owner in ("mine", "theirs"):
            path = tmp_path / f"{owner}-{name}"
            if name == "file":
                path.write_text("")
            elif name == "link":
                path.symlink_to(tmp_path)
            else:
                path.mkdir()
            if owner == "theirs":
                os.lchown(path, NOBODY, NOBODY)
            assert name_taken(path) is (owner == "theirs"), path.name
    assert not name_taken(tmp_path / "missing")


@needs_root
def test_when_every_name_drawn_is_taken_the_sleep_is_refused_saying_so(tmp_path: Path) -> None:
    tokens = iter(f"{n:012x}" for n in range(ROOT_NAME_TRIES + 1))
    for n in range(ROOT_NAME_TRIES + 1):
        squat(tmp_path / f"p-{n:012x}")
    with pytest.raises(PermissionDeniedError) as caught:
        open_spill_root_in(tmp_path, "p", next(tokens), Owner.current(), lambda: next(tokens))
    assert f"{ROOT_NAME_TRIES} names" in caught.value.message
    assert caught.value.hint is not None and "only you can write" in caught.value.hint
