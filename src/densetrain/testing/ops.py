"""Which ops a piece of code dispatches (eager) or traces (``torch.compile``): for tests that
check which kernel path ran."""

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


class TracedOps:
    """A ``torch.compile`` backend that keeps the target names of every op dynamo traced
    (``names``) and runs each graph as it is, so autograd goes through it as in eager."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def __call__(self, graph_module, example_inputs):
        self.names += [str(getattr(node.target, "__name__", node.target))
                       for node in graph_module.graph.nodes]
        return graph_module.forward

    def traced(self, fragment: str) -> bool:
        """Whether any traced op's name contains ``fragment``."""
        return any(fragment in name for name in self.names)
