"""Hugging Face export one tensor at a time, for checkpoints larger than memory.

``save_hf`` maps a whole state dict at once. ``iter_hf_tensors`` yields the same tensors, but
reads only the densetrain tensors that one Hugging Face tensor is made of (one for a rename or
transpose, q/k/v for a fused attention projection), converts them and lets them go before the
next. Which densetrain tensors make which Hugging Face tensor is read off the adapter itself:
its mapping is run once on meta tensors that require grad, and the autograd graph of each output
names its inputs, so no family needs a second, hand-kept description of its fused layouts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from densetrain.models.config import ModelConfig
from densetrain.models.hf.base import HFAdapter, Tensors
from densetrain.models.hf.shapes import dt_param_shapes, meta_state_dict


@dataclass(frozen=True)
class ExportGroup:
    """Densetrain tensors that are converted together and the Hugging Face tensors they make."""

    dt_names: tuple[str, ...]
    hf_names: tuple[str, ...]


def _input_names(tensor: torch.Tensor, name_of: dict[int, str]) -> set[str]:
    """Names of the leaf tensors ``tensor`` was computed from (walking its autograd graph)."""
    if tensor.grad_fn is None:
        return {name_of[id(tensor)]}
    found: set[str] = set()
    stack, seen = [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None:
            found.add(name_of[id(variable)])
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def export_groups(cfg: ModelConfig, adapter: HFAdapter) -> list[ExportGroup]:
    """The smallest sets of densetrain tensors that convert independently, in model order."""
    with torch.enable_grad():
        leaves = {
            name: torch.empty(shape, device="meta", requires_grad=True)
            for name, shape in dt_param_shapes(cfg).items()
        }
        outputs = adapter.dt_to_hf(leaves, cfg)
        name_of = {id(t): name for name, t in leaves.items()}
        inputs_of = {hf: _input_names(t, name_of) for hf, t in outputs.items()}
    parent = {name: name for name in leaves}

    def root(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for hf, inputs in inputs_of.items():
        if not inputs:
            raise AssertionError(f"adapter {adapter.model_type!r} makes {hf} from no parameter")
        first, *rest = sorted(inputs)
        for other in rest:
            parent[root(other)] = root(first)
    dt_by_root: dict[str, list[str]] = {}
    for name in leaves:
        dt_by_root.setdefault(root(name), []).append(name)
    hf_by_root: dict[str, list[str]] = {}
    for hf, inputs in inputs_of.items():
        hf_by_root.setdefault(root(next(iter(inputs))), []).append(hf)
    return [
        ExportGroup(dt_names=tuple(dt_names), hf_names=tuple(hf_by_root[key]))
        for key, dt_names in dt_by_root.items()
        if key in hf_by_root
    ]


def hf_tensor_shapes(cfg: ModelConfig, adapter: HFAdapter) -> dict[str, tuple[int, ...]]:
    """Every exported Hugging Face tensor with its shape (computed on the meta device)."""
    return {k: tuple(v.shape) for k, v in adapter.dt_to_hf(meta_state_dict(cfg), cfg).items()}


def iter_hf_tensors(
    cfg: ModelConfig,
    adapter: HFAdapter,
    read: Callable[[tuple[str, ...]], Tensors],
    *,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hugging Face name, tensor)`` of every exported tensor, one group read at a time.

    ``read(names)`` returns the densetrain tensors ``names`` (full, unsharded shapes). ``dtype``
    casts the outputs (None keeps the stored dtype). The tensors not being converted stand in as
    meta tensors, so the adapter's mapping runs unchanged and only the group's outputs are real.
    """
    meta = meta_state_dict(cfg)
    for group in export_groups(cfg, adapter):
        real = read(group.dt_names)
        with torch.no_grad():
            outputs = adapter.dt_to_hf({**meta, **real}, cfg)
        for hf_name in group.hf_names:
            tensor = outputs[hf_name]
            yield hf_name, tensor if dtype is None else tensor.to(dtype)
        del real, outputs
