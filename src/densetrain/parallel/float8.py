"""float8 training of the blocks' linear layers through torchao (``training.dtype=float8``).

torchao's ``Float8Linear`` keeps the fp32 master weight and, per matmul, casts its inputs to
float8 with a dynamically computed scale: e4m3 for activations and weights, e5m2 for the
output gradient, the three matmuls of forward and backward running in ``torch._scaled_mm`` with
bf16 output. Recipes (``training.float8_recipe``):

* ``tensorwise``: one scale per tensor (amax over the whole tensor); the fastest, the recipe of
  torchtitan's float8 default and of the float8 formats paper (Micikevicius et al. 2022,
  "FP8 Formats for Deep Learning", §4: per-tensor scaling, e4m3 forward / e5m2 gradients).
* ``rowwise``: one scale per row of each operand, more robust to outliers at some speed cost
  (torchao's recommendation for large runs).

Everything else (norms, attention, the output head and its loss) runs under bf16 autocast, and
parameters, gradients and optimizer state stay fp32, so a float8 checkpoint has the same tensors
and names as a bf16 one. Layers whose widths are not multiples of 16 (``_scaled_mm``'s
constraint) stay in bf16. Conversion happens on the meta model, before compile and FSDP, as
torchao requires. torchao is an optional extra (``pip install densetrain[float8]``); the speed
gain needs a GPU with float8 tensor cores (compute capability 8.9+: H100, H200, L40S, B200);
elsewhere ``_scaled_mm`` is emulated, which is correct but slower than bf16.
"""

from __future__ import annotations

import logging

from torch import nn

from densetrain.errors import UserError
from densetrain.parallel.config import FLOAT8_RECIPES

__all__ = ["FLOAT8_RECIPES", "convert_blocks_to_float8", "float8_linear_count"]


def _import_torchao():
    # torchao logs a failure to load its Hopper CUTLASS kernels on machines without them; that
    # is expected off Hopper and not the user's concern.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise UserError(
            "training.dtype=float8 needs torchao: pip install 'densetrain[float8]' "
            f"(import failed: {exc})"
        ) from None
    return Float8LinearConfig, convert_to_float8_training


def _eligible(module: nn.Module, fqn: str) -> bool:
    """Linear layers inside the transformer blocks whose widths ``_scaled_mm`` accepts."""
    return (
        isinstance(module, nn.Linear)
        and fqn.startswith("layers.")
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def convert_blocks_to_float8(model: nn.Module, recipe: str) -> nn.Module:
    """Swap the eligible ``nn.Linear`` layers of ``model.layers`` for torchao ``Float8Linear``
    with ``recipe``'s scaling, in place (parameters keep their names); returns ``model``."""
    if recipe not in FLOAT8_RECIPES:
        raise UserError(f"training.float8_recipe must be one of {list(FLOAT8_RECIPES)}, "
                        f"got {recipe!r}")
    config_cls, convert = _import_torchao()
    convert(model, module_filter_fn=_eligible, config=config_cls.from_recipe_name(recipe))
    if float8_linear_count(model) == 0:
        raise UserError("training.dtype=float8: no linear layer of the blocks has widths that "
                        "are multiples of 16, so none can run in float8; use training.dtype=bf16")
    return model


def float8_linear_count(model: nn.Module) -> int:
    """How many of ``model``'s modules are torchao ``Float8Linear`` layers."""
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())
