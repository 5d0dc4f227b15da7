"""Text of ``densetrain scaling optimal``: the allocation, the law and constants it used, and,
with an inference budget, what the training-only (Chinchilla) choice would have cost."""

from __future__ import annotations

from densetrain.errors import UserError
from densetrain.scaling.optimal import NamedLaw, compute_optimal, published_law


def law_from_fit(fit_path: str | None) -> NamedLaw:
    """The published law, or the approach 3 fit stored in ``fit_path`` (a ``fit.json``)."""
    if fit_path is None:
        return published_law()
    from densetrain.scaling.analysis import load_parametric_law

    try:
        law = load_parametric_law(fit_path)
    except (KeyError, TypeError) as err:
        raise UserError(f"{fit_path}: parametric fit is missing constant {err}") from None
    return NamedLaw(law=law, source=f"approach 3 fit in {fit_path}")


def _flops_lines(train: float, infer: float) -> list[str]:
    return [f"training FLOPs  = {train:.4g}", f"inference FLOPs = {infer:.4g}",
            f"total FLOPs     = {train + infer:.4g}"]


def _budget_report(named: NamedLaw, flops: float, inference_tokens: float) -> list[str]:
    choice = compute_optimal(flops, law=named, inference_tokens=inference_tokens)
    lines = [f"method: {choice.method}", f"C      = {choice.flops:.4g} FLOPs",
             f"N_opt  = {choice.num_params:.4g} parameters",
             f"D_opt  = {choice.num_tokens:.4g} tokens ({choice.tokens_per_param:.1f} "
             "tokens/param)",
             f"loss   = {choice.loss:.4f} (predicted by the law)"]
    if inference_tokens > 0:
        lines += [f"T      = {inference_tokens:.4g} inference tokens"]
        lines += _flops_lines(choice.training_flops, choice.inference_flops)
        lines += _chinchilla_comparison(named, choice.loss, inference_tokens,
                                        choice.training_flops + choice.inference_flops)
    return lines


def _chinchilla_comparison(named: NamedLaw, loss: float, inference_tokens: float,
                           total: float) -> list[str]:
    from densetrain.scaling.inference import min_cost_for_loss

    same = min_cost_for_loss(named.law, loss, 0.0)
    lifetime = same.training_flops + 2.0 * same.num_params * inference_tokens
    return [f"training-only optimum at the same loss: N {same.num_params:.4g}, D "
            f"{same.num_tokens:.4g}, lifetime FLOPs {lifetime:.4g} "
            f"({lifetime / total - 1:+.1%} vs this allocation)"]


def _loss_report(named: NamedLaw, target_loss: float, inference_tokens: float) -> list[str]:
    from densetrain.scaling.inference import min_cost_for_loss

    found = min_cost_for_loss(named.law, target_loss, inference_tokens)
    lines = ["method: least training + inference FLOPs at a target loss (Sardana et al. 2024), "
             "brentq",
             f"target = {target_loss:.4f} loss",
             f"N_opt  = {found.num_params:.4g} parameters",
             f"D_opt  = {found.num_tokens:.4g} tokens ({found.tokens_per_param:.1f} "
             "tokens/param)",
             f"T      = {inference_tokens:.4g} inference tokens"]
    lines += _flops_lines(found.training_flops, found.inference_flops)
    if inference_tokens > 0:
        lines += _chinchilla_comparison(named, target_loss, inference_tokens, found.total_flops)
    return lines


def optimal_report(*, flops: float | None, target_loss: float | None, inference_tokens: float,
                   fit_path: str | None) -> str:
    """The report of ``densetrain scaling optimal`` (exactly one of ``flops``/``target_loss``)."""
    if (flops is None) == (target_loss is None):
        raise UserError("give exactly one of --flops and --target-loss")
    named = law_from_fit(fit_path)
    lines = [f"law: {named.describe()}"]
    if flops is not None:
        lines += _budget_report(named, flops, inference_tokens)
    else:
        lines += _loss_report(named, target_loss, inference_tokens)
    return "\n".join(lines)
