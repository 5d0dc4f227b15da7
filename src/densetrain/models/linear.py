"""Linear layers whose fp32 CPU matmuls go to oneDNN instead of MKL where oneDNN is faster.

On x86 CPUs PyTorch runs every fp32 ``F.linear`` and ``@`` through MKL's sgemm. oneDNN, which
PyTorch also ships (``torch.ops.mkldnn._linear_pointwise``, the op inductor lowers CPU linears
to), is called only for low-precision or packed weights. Which library is faster depends on the
CPU (`onednn_reduction_limit`):

* On x86 CPUs with AVX-512 from other vendors than Intel (AMD Zen 4 / Zen 5), MKL's sgemm runs
  its AVX2 code while oneDNN uses AVX-512. Measured on 2 AMD EPYC Zen 5 cores, fp32: oneDNN
  0.36-0.44 TFLOP/s against MKL's 0.15-0.19 for every matmul of a GPT's training step (forward,
  input and weight gradients, output head; benchmarks/RESULTS.md). There every fp32 matmul of
  `linear` and of `matmul` goes to oneDNN.
* On Intel CPUs with AVX-512, MKL's sgemm is native and at least level with oneDNN at every
  reduction: measured on 2 cores of an AMX Xeon (2026-12-02, tuned allocator, [2048 × K] @
  [K × 1536] / [K × 384] and [1024 × K] @ [K × 50,304], K 64-2048), oneDNN/MKL speed 0.73-1.05
  in all but one of 24 cells (1.12 at K 64), 0.87-0.94 on the GPT-2-shaped step's own matmuls.
  There every fp32 matmul stays on MKL.
* Elsewhere (AVX2 CPUs; CPUs of unknown vendor) a matmul goes to oneDNN when its
  reduction is at most ``ONEDNN_AVX2_MAX_REDUCTION``. Measured on 2 AMD EPYC cores (AVX2),
  [2048 × K] @ [K × 1536], both libraries alternating: oneDNN/MKL speed 1.08 (K 128-256), 1.17
  (384), 1.30 (512), 1.20 (768), 1.03 (1024); MKL is ahead from K ≈ 1500 on (0.93 at K 50,304).

The choice depends on the CPU and the shapes only, so it is the same on every rank of a machine
and after every restart on it (resume stays bit-exact).

Only plain fp32 CPU tensors outside autocast and outside ``torch.compile`` take this path:
DTensors (tensor parallel), CUDA, bf16 / autocast (already oneDNN in PyTorch), compiled
regions (inductor picks its own kernels) and fully checkpointed blocks (`aten_matmuls`) run
``F.linear`` unchanged. Written here because
PyTorch offers no switch for it: its fp32 oneDNN matmul setting computes in bf16 or tf32, and
MKL's own instruction-set variables do not lift its AVX2 path on these CPUs.
"""

from __future__ import annotations

import contextlib
import platform
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

ONEDNN_AVX2_MAX_REDUCTION = 768
"""Largest reduction (inner) dimension sent to oneDNN on AVX2 CPUs and CPUs of unknown vendor."""


def cpuinfo_field(key: str) -> str:
    """The first ``key`` entry of ``/proc/cpuinfo`` (e.g. ``vendor_id``, ``model name``); ""
    where there is none (other operating systems)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``, ...; "" if unknown)."""
    if vendor := cpuinfo_field("vendor_id"):
        return vendor
    processor = platform.processor()  # e.g. "AMD64 Family 25 Model 17 Stepping 1, AuthenticAMD"
    return next((v for v in ("GenuineIntel", "AuthenticAMD", "HygonGenuine") if v in processor), "")


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (torch's own CPUID check; False where torch lacks it)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())


def onednn_reduction_limit(vendor: str, capability: str) -> int | None:
    """The largest reduction `linear` and `matmul` send to oneDNN on a CPU of ``vendor`` whose
    PyTorch ``capability`` (``torch.backends.cpu.get_cpu_capability()``) is given; None: every
    reduction (AVX-512 CPUs not made by Intel, where MKL runs its AVX2 code); 0: none (Intel
    CPUs with AVX-512, where MKL's own AVX-512 code is the faster one)."""
    if capability.startswith("AVX512"):
        if vendor == "GenuineIntel":
            return 0
        if vendor:
            return None
    return ONEDNN_AVX2_MAX_REDUCTION


ONEDNN_MAX_REDUCTION: int | None = onednn_reduction_limit(
    cpu_vendor(), torch.backends.cpu.get_cpu_capability()
)
"""This CPU's `onednn_reduction_limit`: the largest reduction sent to oneDNN (None: all)."""

ONEDNN_LINEAR_OP = (
    getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if torch.backends.mkldnn.is_available() else None
)
"""oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``), or None in a build without it."""

_LOCAL = threading.local()


@contextlib.contextmanager
def aten_matmuls() -> Iterator[None]:
    """Within this context (on this thread) every `linear` runs ``F.linear``.

    Full activation checkpointing enters it for the forward and the recompute of a block:
    torch's non-reentrant checkpoint stops recomputing once the last tensor that backward needs
    is rebuilt, which an aten matmul saves before it runs but a custom autograd function only
    after, so a block's last matmul would be recomputed for nothing.
    """
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    try:
        yield
    finally:
        _LOCAL.depth -= 1


def _register_flop_formula() -> None:
    """Count ``_linear_pointwise`` in ``torch.utils.flop_counter`` (torch knows only the aten
    matmuls), so FLOP counts of a model do not depend on which library ran its matmuls."""
    from torch.utils import flop_counter

    if ONEDNN_LINEAR_OP is None or ONEDNN_LINEAR_OP in flop_counter.flop_registry:
        return

    @flop_counter.register_flop_formula(ONEDNN_LINEAR_OP)
    def _linear_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
        tokens = 1
        for size in x_shape[:-1]:
            tokens *= size
        return 2 * tokens * x_shape[-1] * w_shape[0]


_register_flop_formula()


def _plain_cpu_fp32(*tensors: torch.Tensor | None) -> bool:
    return all(
        t is None or (type(t) in (torch.Tensor, nn.Parameter) and t.device.type == "cpu"
                      and t.dtype == torch.float32)
        for t in tensors
    )


def _short(reduction: int) -> bool:
    return ONEDNN_MAX_REDUCTION is None or reduction <= ONEDNN_MAX_REDUCTION


def _fp32_outside_autocast(*tensors: torch.Tensor | None) -> bool:
    return (
        ONEDNN_LINEAR_OP is not None
        and _plain_cpu_fp32(*tensors)
        and not torch.is_autocast_enabled("cpu")
    )


def _onednn_allowed(*tensors: torch.Tensor | None) -> bool:
    """Eager only: compiled regions take `compiled_uses_onednn`, full checkpointing aten."""
    return (
        _fp32_outside_autocast(*tensors)
        and not torch.compiler.is_compiling()
        and not getattr(_LOCAL, "depth", 0)
    )


def uses_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``linear(x, weight, bias)`` runs its forward matmul on oneDNN."""
    return matmul_uses_onednn(weight.shape[1], x, weight, bias)


TRANSPOSE_TILE = (512, 1024)
"""Source rows × columns per tile of `transposed_copy`. Written by hand because aten's copy of
a transposed view walks one operand across rows a page apart: measured on 2 cores of an AMD
EPYC Zen 4 (fp32, 2026-12-04), [50,304 × 384] → [384 × 50,304] 26.9 ms in one copy against
12.2 ms in tiles, the way back 24.9 against 10.3, [2,048 × 384] 0.64 against 0.37 ms (a tile's
source and target stay in the core's L2)."""


def transposed_copy(src_RC: torch.Tensor, out_CR: torch.Tensor | None = None) -> torch.Tensor:
    """A contiguous copy of ``src_RC.t()`` (into ``out_CR`` when given), a tile at a time."""
    rows, cols = src_RC.shape
    if out_CR is None:
        out_CR = src_RC.new_empty((cols, rows))
    tile_rows, tile_cols = TRANSPOSE_TILE
    for row in range(0, rows, tile_rows):
        for col in range(0, cols, tile_cols):
            out_CR[col : col + tile_cols, row : row + tile_rows].copy_(
                src_RC[row : row + tile_rows, col : col + tile_cols].t())
    return out_CR


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()``, through `transposed_copy` when ``t`` is a transposed 2-D view."""
    if t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous():
        return transposed_copy(t.t())
    return t.contiguous()


def _onednn_mm(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    # a @ b as oneDNN's x @ wᵀ: w = bᵀ in any strides (oneDNN packs the weight operand itself;
    # measured faster than a contiguous copy of it), x contiguous (oneDNN copies it otherwise).
    return ONEDNN_LINEAR_OP(_contiguous(a_MK), b_KN.t(), None, "none", [], "")


def _mm_by_rule(a_MK: torch.Tensor, b_KN: torch.Tensor, onednn_mm=_onednn_mm) -> torch.Tensor:
    """``a @ b`` through ``onednn_mm`` when the reduction K is short (`_short`), else aten's."""
    return onednn_mm(a_MK, b_KN) if _short(a_MK.shape[1]) else a_MK @ b_KN


def matmul_uses_onednn(reduction: int, *tensors: torch.Tensor | None) -> bool:
    """Whether `matmul` of ``tensors`` with this ``reduction`` (inner size) runs on oneDNN."""
    return _short(reduction) and _onednn_allowed(*tensors)


def matmul(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two 2-D tensors (not differentiable through oneDNN: for gradients that are
    computed by hand), on oneDNN under the same rule as `linear` (`matmul_uses_onednn`)."""
    return _mm_by_rule(a_MK, b_KN) if _onednn_allowed(a_MK, b_KN) else a_MK @ b_KN


def _onednn_linear(x_2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    # oneDNN reorders a non-contiguous weight on every call (slower than copying it once).
    return ONEDNN_LINEAR_OP(x_2d.contiguous(), weight.contiguous(), bias, "none", [], "")


def _weight_grad(grad_NO: torch.Tensor, x_NI: torch.Tensor) -> torch.Tensor:
    """gᵀ @ x, the [O, I] weight gradient of a linear layer, by the rule of `_mm_by_rule`.

    Its left operand must be contiguous for oneDNN, so one of the two is transposed in memory:
    gᵀ ([N × O] values), or xᵀ for (xᵀ @ g)ᵀ ([N × I] values, then the [I × O] product back).
    The second is taken when it moves fewer values: measured on 2 cores of an AMD EPYC Zen 4
    (2026-12-04), N 2,048, I 384, O 1,536: 12.9 ms against 16.5 (products alone 11.5 and 11.3).
    """
    tokens, outs = grad_NO.shape
    ins = x_NI.shape[1]
    if _short(tokens) and tokens * ins + ins * outs < tokens * outs:
        return transposed_copy(_onednn_mm(x_NI.t(), grad_NO))
    return _mm_by_rule(grad_NO.t(), x_NI)


class _OneDnnLinear(torch.autograd.Function):
    """y = x Wᵀ + b with the forward (reduction over in-features) on oneDNN, and each gradient
    on oneDNN when its reduction is short too (`_short`): the input gradient reduces over
    out-features, the weight gradient over tokens."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        x_2d = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x_2d, weight)
        ctx.x_shape = x.shape
        return _onednn_linear(x_2d, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable  # the oneDNN op has no derivative: a second backward says so
    def backward(ctx, grad_out):
        x_2d, weight = ctx.saved_tensors
        grad_2d = grad_out.reshape(-1, weight.shape[0])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _mm_by_rule(grad_2d, weight).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = _weight_grad(grad_2d, x_2d)
        if ctx.needs_input_grad[2]:  # False when there is no bias
            grad_b = grad_2d.sum(0)
        return grad_x, grad_w, grad_b


# Inside torch.compile, inductor lowers an fp32 CPU ``F.linear`` to MKL (it uses oneDNN for
# fp32 only with frozen inference weights). An opaque custom op keeps oneDNN's matmuls in the
# compiled graph, with inductor fusing the element-wise work around them; its backward is the
# same op (or aten's mm for a long reduction).
_COMPILED_MM = None
if ONEDNN_LINEAR_OP is not None:

    @torch.library.custom_op("densetrain::onednn_mm", mutates_args=())
    def _onednn_mm_op(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
        return _onednn_mm(a_MK, b_KN)

    @_onednn_mm_op.register_fake
    def _onednn_mm_fake(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
        return a_MK.new_empty((a_MK.shape[0], b_KN.shape[1]))

    def _onednn_mm_setup(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    def _onednn_mm_backward(ctx, grad_MN):
        a_MK, b_KN = ctx.saved_tensors
        grad_a = _mm_by_rule(grad_MN, b_KN.t(), _onednn_mm_op) if ctx.needs_input_grad[0] else None
        grad_b = _mm_by_rule(a_MK.t(), grad_MN, _onednn_mm_op) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b

    _onednn_mm_op.register_autograd(_onednn_mm_backward, setup_context=_onednn_mm_setup)
    _COMPILED_MM = _onednn_mm_op

    def _register_compiled_mm_flops() -> None:
        from torch.utils import flop_counter

        op = torch.ops.densetrain.onednn_mm
        if op in flop_counter.flop_registry:
            return

        @flop_counter.register_flop_formula(op)
        def _mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
            return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    _register_compiled_mm_flops()


def compiled_uses_onednn(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None) -> bool:
    """Whether ``linear(x, weight, bias)`` inside ``torch.compile`` keeps its matmuls on oneDNN
    (through the ``densetrain::onednn_mm`` custom op): the rule of `uses_onednn` for a plain fp32
    CPU linear outside autocast."""
    return (
        _COMPILED_MM is not None
        and torch.compiler.is_compiling()
        and _short(weight.shape[1])
        and _fp32_outside_autocast(x, weight, bias)
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear`` (differentiable), on oneDNN where `uses_onednn` (eager) or
    `compiled_uses_onednn` (inside ``torch.compile``) says so."""
    if uses_onednn(x, weight, bias):
        return _OneDnnLinear.apply(x, weight, bias)
    if compiled_uses_onednn(x, weight, bias):
        out = _COMPILED_MM(x.reshape(-1, x.shape[-1]), weight.t())
        out = out.view(*x.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, state-dict keys and parallel plans) whose plain fp32 CPU
    forward and backward take the faster library per matmul (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
