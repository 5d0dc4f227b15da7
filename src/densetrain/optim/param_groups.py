"""Decay / no-decay parameter groups, decided by module type and parameter name.

Each parameter is classified by the module that owns it (``named_modules``), not by its rank:

- ``bias``: any parameter whose own name ends in ``bias`` (linear, norm and head biases);
- ``norm``: parameters of normalisation modules (``nn.LayerNorm``, ``nn.RMSNorm``,
  ``nn.GroupNorm``, batch/instance norms, and any module class whose name ends in ``Norm``);
- ``embedding``: weights of ``nn.Embedding`` modules (token and learned position tables; a tied
  output matrix is the token table itself, so it follows the embedding rule);
- ``weight``: weights of ``nn.Linear`` and convolution modules;
- ``other``: parameters of any other module. Only here is rank used, as the last resort: matrices
  (ndim ≥ 2) decay, vectors and scalars do not.

Norms and biases never decay (GPT-3 App. B decays weights only; LLaMA follows it); embeddings
decay only with ``decay_embeddings=True`` (OLMo and many reproductions exclude them).
Rank alone would mis-class e.g. a 2-D learned scale or a 1-D weight of a custom layer; module
types keep the rule readable and stable under FSDP2/compile wrappers, which preserve module
classes (``isinstance`` still holds for ``FSDPLinear`` etc.).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

_NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm)
_MATRIX_TYPES = (nn.Linear, nn.Bilinear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
# When one parameter has several owners (tied weights), the first matching kind wins.
_PRIORITY = ("bias", "norm", "embedding", "weight", "other")
KINDS = _PRIORITY


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or isinstance(
        module, nn.modules.batchnorm._NormBase
    ) or type(module).__name__.endswith("Norm")


def _kind(module: nn.Module, local_name: str) -> str:
    if local_name.endswith("bias"):
        return "bias"
    if _is_norm(module):
        return "norm"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, _MATRIX_TYPES):
        return "weight"
    return "other"


def _owned_parameters(model: nn.Module) -> Iterator[tuple[str, str, nn.Parameter]]:
    """``(full name, kind, parameter)`` for every owner of every trainable parameter."""
    for module_name, module in model.named_modules(remove_duplicate=False):
        for local_name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            if param.requires_grad:
                full_name = f"{module_name}.{local_name}" if module_name else local_name
                yield full_name, _kind(module, local_name), param


def classify_parameters(model: nn.Module) -> dict[str, str]:
    """Parameter name → kind (``bias``, ``norm``, ``embedding``, ``weight``, ``other``).

    A tied parameter appears once, under its first name, with the highest-priority kind of its
    owners.
    """
    first_name: dict[int, str] = {}
    kinds: dict[int, str] = {}
    for full_name, kind, param in _owned_parameters(model):
        key = id(param)
        first_name.setdefault(key, full_name)
        previous = kinds.get(key)
        if previous is None or _PRIORITY.index(kind) < _PRIORITY.index(previous):
            kinds[key] = kind
    return {first_name[key]: kinds[key] for key in first_name}


def should_decay(kind: str, param: nn.Parameter, *, decay_embeddings: bool) -> bool:
    """Whether a parameter of ``kind`` receives weight decay (see the module docstring)."""
    if kind in ("bias", "norm"):
        return False
    if kind == "embedding":
        return decay_embeddings
    if kind == "weight":
        return True
    return param.ndim >= 2


def param_groups(
    model: nn.Module, *, weight_decay: float, decay_embeddings: bool = False
) -> list[dict]:
    """Optimizer param groups ``decay`` (with ``weight_decay``) and ``no_decay`` (0).

    Each group carries a ``name`` and the ``param_names`` it holds (for logs and tests); empty
    groups are left out. Parameter order follows ``model.named_parameters()``.
    """
    kinds = classify_parameters(model)
    params = dict(model.named_parameters())
    decay_names, no_decay_names = [], []
    for name, kind in kinds.items():
        if should_decay(kind, params[name], decay_embeddings=decay_embeddings):
            decay_names.append(name)
        else:
            no_decay_names.append(name)
    groups = [
        {"name": "decay", "params": [params[n] for n in decay_names],
         "param_names": decay_names, "weight_decay": weight_decay},
        {"name": "no_decay", "params": [params[n] for n in no_decay_names],
         "param_names": no_decay_names, "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]
