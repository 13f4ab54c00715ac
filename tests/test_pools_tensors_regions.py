"""What TensorPool.regions() builds of the tracked tensors: keys, views and tensors per storage.

regions() runs at every sleep over every tracked tensor, so it is written for speed (views found
in sets once a storage has several, shapes and strides shared between views, the asleep class of
each tensor class looked up once): these tests hold it to what a plain reading of the rules gives.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

from hibernate.errors import HibernatingError
from hibernate.pools import tensors as tensor_pool
from hibernate.pools.tensors import StorageRegion, TensorPool


def view_of(name: str, tensor: torch.Tensor) -> dict[str, Any]:
    return {
        "name": name,
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "strides": list(tensor.stride()),
        "storage_offset": tensor.storage_offset(),
    }


def distinct_views(named: list[tuple[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """The rule, read plainly: every view in the order met, each equal one once."""
    views: list[dict[str, Any]] = []
    for name, tensor in named:
        view = view_of(name, tensor)
        if view not in views:
            views.append(view)
    return views


def test_keys_of_storages_whose_first_names_collide_take_the_next_free_suffix() -> None:
    """``tag/name``, then ``#2``, ``#3``...: a suffix a storage's own name already took is skipped."""
    pool = TensorPool()
    pool.track(torch.zeros(2), "w", True, "x")
    pool.track(torch.zeros(2), "w", True, "x#2")  # takes the key a generated suffix would
    pool.track(torch.zeros(2), "w", True, "x")
    pool.track(torch.zeros(2), "w", True, "x")
    pool.track(torch.zeros(2), "kv", False, "x")  # another tag: no collision
    assert [r.key for r in pool.regions()] == ["w/x", "w/x#2", "w/x#3", "w/x#4", "kv/x"]


def test_a_storage_of_many_views_lists_each_distinct_view_once_in_the_order_met() -> None:
    """Slices, transposes, a tied tensor under two names and a tensor tracked twice, on one storage."""
    base = torch.arange(4096, dtype=torch.float32)
    slices = [base[i * 16 : (i + 1) * 16] for i in range(200)]
    grid = base[:64].view(8, 8)
    tracked: dict[str, Any] = {"base": base, "grid": grid, "t": grid.t(), "tied": grid}
    tracked.update({f"s{i}": s for i, s in enumerate(slices)})
    tracked["again"] = slices[:3]  # the same tensor objects under new names: new views, no new tensors
    pool = TensorPool()
    pool.track(tracked, "w", True, "m")
    pool.track(grid, "w", True, "m.grid")  # tracked twice under one name: the same view, once
    (region,) = pool.regions()

    named = [(f"m.{k}", v) for k, v in tracked.items() if isinstance(v, torch.Tensor)]
    named += [(f"m.again.{i}", s) for i, s in enumerate(slices[:3])]
    named.append(("m.grid", grid))
    expected = distinct_views(named)
    assert region.meta["views"] == expected
    assert len(expected) == len(named) - 1  # only the second "m.grid" is a view met before
    assert json.loads(json.dumps(region.meta)) == region.meta  # shared lists encode as any others

    region.release()
    distinct = {id(t): t for _, t in named}
    assert len(distinct) == 203  # base, grid, t, 200 slices: each put to sleep once
    for tensor in distinct.values():
        assert type(tensor) is not torch.Tensor
    with pytest.raises(HibernatingError, match=re.escape("'m.grid'")):  # named by the first name met
        grid.sum()
    region.reallocate()
    assert all(type(t) is torch.Tensor for t in distinct.values())
    assert base.untyped_storage().nbytes() == 4096 * 4  # memory back (refilled by the store)


def test_views_of_equal_shapes_share_nothing_a_meta_can_be_told_apart_by() -> None:
    """Shapes and strides equal between storages are shared lists; each meta still says its own."""
    pool = TensorPool()
    pool.track({"a": torch.zeros(3, 4), "b": torch.zeros(3, 4), "c": torch.zeros(4, 3).t()}, "w", True, "m")
    metas = [region.meta for region in pool.regions()]
    assert [m["views"][0]["shape"] for m in metas] == [[3, 4], [3, 4], [3, 4]]
    assert [m["views"][0]["strides"] for m in metas] == [[4, 1], [4, 1], [1, 3]]


def test_a_tensor_already_asleep_stays_asleep_and_wakes_as_its_own_class() -> None:
    """A Parameter put to sleep takes its asleep twin once; a region built of it while asleep (tracked
    again during a sleep) leaves it so, and a wake gives it back its own class."""
    param = torch.nn.Parameter(torch.arange(4, dtype=torch.float32))
    storage = param.untyped_storage()
    first = StorageRegion("w/p", "w", True, storage, [], [(param, "p")])
    first.release()
    asleep = type(param)
    assert asleep is not torch.nn.Parameter and issubclass(asleep, torch.nn.Parameter)
    again = StorageRegion("w/p", "w", True, storage, [], [(param, "p again")])
    again.release()
    assert type(param) is asleep
    assert tensor_pool._asleep_names[id(param)] == "p"
    first.reallocate()
    assert type(param) is torch.nn.Parameter and id(param) not in tensor_pool._asleep_names
    again.reallocate()
    assert type(param) is torch.nn.Parameter
