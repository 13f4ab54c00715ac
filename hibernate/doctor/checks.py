"""What every check of ``hibernate doctor`` is (a name, ``ok``/``warn``/``fail``, its fix; the
package docstring says what each word means), and what the checks share while they run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "detail": self.detail,
            "fix": self.fix,
            "data": self.data,
        }


class Examination:
    """One run of the checks: what several of them need, probed once (the driver, the binary,
    NVML), what earlier checks found for later ones (the checkpointer, the target's processes,
    CUDA holders and agents), and the checks' answers in order."""

    def __init__(self, pid: int | None, directory: Path | None, kind: str, binary_path: str | None) -> None:
        from hibernate.checkpoint import binary, driver, nvml

        self.pid = pid
        self.directory = directory
        self.kind = kind
        self.binary_path = binary_path
        self.driver = driver.probe()
        self.binary = binary.probe(binary_path)
        self.gpus = nvml.read_gpus()
        self.checks: list[Check] = []
        self.checkpointer: Any = None
        self.processes: list[int] = []
        self.holders: list[Any] = []
        self.agents: list[Any] = []

    def add(self, check: str, status: str, detail: str, fix: str | None = None, **data: Any) -> None:
        self.checks.append(Check(check, status, detail, fix, data))
