"""Which ATen ops a piece of code dispatches: for tests that check which kernel path ran."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class OpNames(TorchDispatchMode):
    """Within this mode, ``names`` collects the overload packet of every dispatched op in order
    (e.g. ``"aten.mm"``, ``"mkldnn._linear_pointwise"``); the ops run unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))
