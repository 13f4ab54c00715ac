"""A training program that hibernates, as a job script runs it: the same code in every process.

    python -m tests.adopt_program MODE DIR [VARIANT]

``first``: train 3 steps, sleep into DIR, print the state's digest as it was
at the sleep, then wait to be killed. ``second``: build the same program, track it, adopt DIR before
any step, print the digest, train 3 steps more, print the weights' digest.
``tracked``: as ``second``, the adoption left to ``track`` (HIBERNATE_ADOPT).
``half``: track the model only, say so, and wait to be ended by a signal (a requeued run
preempted between its two ``track`` calls).
``refused``: as ``second``, for an adoption that must be refused: print the refusal and whether
the model and optimizer are as they were before it (digests before and after), exit 3.
``straight``: train 6 steps, printing the weights' digest after the sixth.
VARIANT changes the program as the refusal tests need (``wider``, ``double``,
``sgd``, ``extra``), or makes it transformers' GPT-2 (``gpt2``).
"""

from __future__ import annotations

import hashlib
import json
import signal
import sys
from typing import Any

import torch

import hibernate
from hibernate.errors import HibernateError


def build(variant: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    if variant == "gpt2":  # transformers' GPT-2 from a config: tied embeddings, no dropout
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=2,
            vocab_size=VOCAB,
            n_positions=32,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        gpt2 = GPT2LMHeadModel(config)
        return gpt2, torch.optim.AdamW(gpt2.parameters(), lr=0.001)
    width = 24 if variant == "wider" else 16
    embedding = torch.nn.Embedding(50, width)
    head = torch.nn.Linear(width, 50, bias=False)
    head.weight = embedding.weight  # tied, as a language model's input and output embeddings
    layers: list[torch.nn.Module] = [embedding, torch.nn.LayerNorm(width), torch.nn.BatchNorm1d(width), head]
    if variant == "extra":
        layers.insert(2, torch.nn.Linear(width, width))
    model = torch.nn.Sequential(*layers)
    if variant == "double":
        model = model.double()
    if variant == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


VOCAB = 50


def batches(variant: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    shape = (4, 16) if variant == "gpt2" else (32,)
    return [
        (
            torch.randint(0, VOCAB, shape, generator=generator),
            torch.randint(0, VOCAB, shape, generator=generator),
        )
        for _ in range(6)
    ]


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: list[Any]) -> None:
    for tokens, targets in steps:
        optimizer.zero_grad()
        if hasattr(model, "config"):  # transformers: the loss of predicting the tokens themselves
            loss = model(input_ids=tokens, labels=tokens).loss
        else:
            loss = torch.nn.functional.cross_entropy(model(tokens), targets)
        loss.backward()
        optimizer.step()


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> str:
    """The bytes of every weight and buffer, and of the optimizer's state, by name."""
    hashed = hashlib.sha256()
    tensors = dict(model.state_dict(keep_vars=False))
    if optimizer is not None:
        for index, state in optimizer.state_dict()["state"].items():
            for name, value in state.items():
                tensors[f"optimizer.{index}.{name}"] = value
    for name in sorted(tensors):
        value = tensors[name]
        hashed.update(name.encode())
        hashed.update(str(value.dtype).encode() + str(tuple(value.shape)).encode())
        hashed.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return hashed.hexdigest()


def main(mode: str, directory: str, variant: str = "") -> int:
    model, optimizer = build(variant)
    steps = batches(variant)
    if mode == "half":
        hibernate.track(model, name="model")
        print(json.dumps({"tracked": "model"}), flush=True)
        while True:  # the optimizer would be tracked next; the signal's handler ends the process
            signal.pause()
    hibernate.track(model, name="model")
    hibernate.track(optimizer, name="optimizer")
    if mode == "first":
        train(model, optimizer, steps[:3])
        state = digest(model, optimizer)
        hibernate.sleep(directory)
        print(json.dumps({"state": state}), flush=True)
        signal.pause()  # killed asleep, as a preempted job is
    elif mode == "second":
        report = hibernate.adopt(directory)
        adopted = digest(model, optimizer)
        train(model, optimizer, steps[3:])
        print(json.dumps({"state": adopted, "after": digest(model, None), "report": report}), flush=True)
    elif mode == "refused":  # a refusal leaves the process as it was: weights, and no optimizer state
        before = digest(model, optimizer)
        try:
            hibernate.adopt(directory)
        except HibernateError as exc:
            print(str(exc), file=sys.stderr, flush=True)
            print(json.dumps({"before": before, "after": digest(model, optimizer)}), flush=True)
            return 3
        return 0
    elif mode == "tracked":  # adopted by track itself, under HIBERNATE_ADOPT
        adopted = digest(model, optimizer)
        train(model, optimizer, steps[3:])
        print(json.dumps({"state": adopted, "after": digest(model, None)}), flush=True)
    elif mode == "straight":
        train(model, optimizer, steps)
        print(json.dumps({"after": digest(model, None)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
