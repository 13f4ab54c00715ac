"""An optimizer's state, named by its parameters, so that a new process of the same program finds it.

torch keeps an optimizer's state by parameter object (``optimizer.state[param]``)
and ``state_dict`` numbers it by position. Neither survives a process: a new
one has new parameter objects, and may have built them in another order. The
names the program gave its parameters do survive (``named_parameters`` of the
modules it tracks), so each tensor of state is named
``<optimizer>.state.<parameter's name>.<field>``: the same in every process
built by the same code. A parameter no tracked module names keeps its place
instead (``param_groups.<group>.<index>``), as ``state_dict`` would number it.

An optimizer that has not stepped has no state yet (torch makes it at the
first step); to adopt a snapshot it is given the state the snapshot holds,
tensors of the recorded dtype and shape, before the adoption fills them. Each
is placed where ``load_state_dict`` would place it in this process: on its
parameter's device here, whatever device the snapshot was taken on (see
_placed_for). Its class is part of each record (``optimizer`` in the meta): the
state of an AdamW is never poured into an SGD.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hibernate.errors import SnapshotInvalidError

STATE = "state."


def parameter_names(modules: Iterable[tuple[str, torch.nn.Module]]) -> dict[int, str]:
    """id(parameter) -> its first name among the tracked modules (``prefix`` + its name in the module)."""
    names: dict[int, str] = {}
    for prefix, module in modules:
        for name, parameter in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(parameter), f"{prefix}{name}")
    return names


def _parameters(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> Iterator[tuple[str, Any]]:
    """Each parameter of the optimizer's groups with the name its state goes by, in the groups' order."""
    seen: set[int] = set()
    for group_index, group in enumerate(optimizer.param_groups):
        for index, parameter in enumerate(group["params"]):
            if id(parameter) in seen:
                continue
            seen.add(id(parameter))
            yield names.get(id(parameter)) or f"param_groups.{group_index}.{index}", parameter


def named_state(
    optimizer: torch.optim.Optimizer, prefix: str, names: Mapping[int, str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The optimizer's tensors of state, each named ``prefix + "state." + parameter name + "." + field``."""
    state = optimizer.state
    for name, parameter in _parameters(optimizer, names):
        fields = state.get(parameter)
        if not fields:
            continue
        for field_name, value in fields.items():
            if isinstance(value, torch.Tensor):
                yield f"{prefix}{STATE}{name}.{field_name}", value


def kind(optimizer: torch.optim.Optimizer) -> str:
    """What a record says the optimizer was: its class's qualified name (``AdamW``)."""
    return type(optimizer).__qualname__


@dataclass
class GivenState:
    """The state give_state made, so that an adoption refused after it can take it back.

    An adoption that fails (a checksum, a difference found late) must leave the process as it
    was, and an optimizer that had not stepped had no state: what was made is removed again.
    ``tensors`` are the new tensors, which nothing else holds yet: an adoption may fill them in
    place, where it fills the program's own tensors only once the whole snapshot is verified.
    """

    tensors: list[torch.Tensor] = field(default_factory=list)
    owners: list[tuple[torch.optim.Optimizer, Any]] = field(default_factory=list)

    def take_back(self) -> None:
        """Each parameter given state here has none again, as before the adoption."""
        for optimizer, parameter in self.owners:
            optimizer.state.pop(parameter, None)
        self.tensors.clear()
        self.owners.clear()


def give_state(
    optimizer: torch.optim.Optimizer,
    prefix: str,
    names: Mapping[int, str],
    records: Sequence[tuple[str, Mapping[str, Any]]],
    given: GivenState,
) -> int:
    """Make the state a snapshot holds for the parameters that have none yet, noted in ``given``;
    the number of tensors made.

    ``records`` are the snapshot's (name, meta) pairs under this optimizer's tag, the name without
    the tag. Each record of ``prefix + "state."`` names a parameter and a field; a parameter that
    already has state keeps it (it is compared, not replaced). Each tensor is made on the device
    torch's own ``load_state_dict`` would move it to (_placed_for), never on the snapshot's: the
    snapshot may come from a GPU of another index, or from a GPU into a model on the CPU. Refused,
    before anything is made: a record of another kind of optimizer.
    """
    wanted = kind(optimizer)
    mine = [(name, meta) for name, meta in records if name.startswith(f"{prefix}{STATE}")]
    others = sorted({str(meta.get("optimizer")) for _, meta in mine if meta.get("optimizer") != wanted})
    if others:
        raise SnapshotInvalidError(
            f"{prefix.rstrip('.') or 'the optimizer'} is of another kind: {', '.join(others)} in the "
            f"snapshot, {wanted} here; nothing was adopted",
            hint="adopt with the optimizer the snapshot was taken with",
        )
    # Parameters without state, before any is made (a parameter's fields are made one by one).
    bare = {name: p for name, p in _parameters(optimizer, names) if not optimizer.state.get(p)}
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    made = 0
    for name, meta in mine:
        parameter_name, _, field_name = name[len(prefix) + len(STATE) :].rpartition(".")
        parameter = bare.get(parameter_name)
        if parameter is None:
            continue  # a parameter this program lacks, or state it has: the pairing judges both
        view = next((v for v in meta.get("views", ()) if v.get("name") == name), None)
        if view is None:
            continue
        device = _placed_for(parameter, group_of[id(parameter)], field_name, str(meta.get("device", "cpu")))
        tensor = _empty_like_view(view, device)
        if not optimizer.state.get(parameter):
            given.owners.append((optimizer, parameter))
        optimizer.state[parameter][field_name] = tensor
        given.tensors.append(tensor)
        made += 1
    return made


def _placed_for(parameter: Any, group: Mapping[str, Any], field_name: str, saved: str) -> torch.device:
    """Where ``load_state_dict`` would put a field of the state of ``parameter`` (of param group
    ``group``; ``saved``: the device the snapshot says the field was on), by torch's rule
    (Optimizer._process_value_according_to_param_policy).

    Every field goes to the parameter's device, but ``step``, which torch keeps where the value it
    is given lies unless the parameter's group is ``capturable`` or ``fused`` (then it goes to the
    parameter's device too): Adam's step lives on the CPU, ASGD's on the parameter's device. The
    value given here is the snapshot's, read onto a device of this process as
    ``torch.load(map_location=...)`` maps a checkpoint: on the CPU if it was on the CPU, else on
    the parameter's device (the snapshot's GPU may not exist here, or have another index).
    The dtype is the record's, never cast: an adoption fills the tensor with the record's bytes.
    """
    if field_name != "step" or saved.partition(":")[0] != "cpu":
        return torch.device(parameter.device)
    if group.get("capturable") or group.get("fused"):
        return torch.device(parameter.device)
    return torch.device("cpu")


def _empty_like_view(view: Mapping[str, Any], device: torch.device) -> torch.Tensor:
    dtype = getattr(torch, str(view.get("dtype")), None)
    if not isinstance(dtype, torch.dtype):
        raise SnapshotInvalidError(f"{view.get('name')}: dtype {view.get('dtype')!r} is not one of torch's")
    return torch.empty_strided(
        tuple(view.get("shape", ())), tuple(view.get("strides", ())), dtype=dtype, device=device
    )
