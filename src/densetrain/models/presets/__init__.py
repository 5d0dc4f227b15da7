"""Named model presets: ``get_preset("llama2-7b")`` returns a fresh ``ModelConfig``.

Each family lives in its own small module exposing ``PRESETS``, a mapping from a lower-case,
dash-separated name to a function building the config. Every preset records its provenance in
``extra``: ``family`` (the architecture family), ``published_params`` (the size the source paper
or model card gives) and, for families that Hugging Face ``transformers`` implements,
``hf_family`` (the adapter ``densetrain.models.hf`` exports it with).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

from densetrain.errors import UserError
from densetrain.models.config import ModelConfig
from densetrain.models.presets import (
    bloom,
    gopher,
    gpt2,
    gpt3,
    llama,
    mistral,
    neox,
    opt,
    palm,
    phi,
    qwen3,
    tiny,
)

_FAMILY_MODULES = (gpt2, gpt3, llama, mistral, qwen3, neox, opt, bloom, palm, gopher, phi, tiny)


def _build_registry() -> dict[str, Callable[[], ModelConfig]]:
    registry: dict[str, Callable[[], ModelConfig]] = {}
    for module in _FAMILY_MODULES:
        for name, builder in module.PRESETS.items():
            if name in registry:
                raise RuntimeError(f"preset {name!r} is defined twice ({module.__name__})")
            registry[name] = builder
    return registry


_REGISTRY = _build_registry()


def list_presets(family: str | None = None) -> list[str]:
    """Sorted preset names; with ``family`` only those whose ``extra["family"]`` equals it."""
    names = sorted(_REGISTRY)
    if family is None:
        return names
    return [n for n in names if _REGISTRY[n]().extra.get("family") == family]


def get_preset(name: str, **overrides) -> ModelConfig:
    """Return the ``ModelConfig`` of preset ``name``, with optional field ``overrides``.

    Raises ``ValueError`` for an unknown name, listing the closest known names.
    """
    key = name.strip().lower()
    if key not in _REGISTRY:
        close = difflib.get_close_matches(key, _REGISTRY, n=5, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UserError(
            f"unknown model preset {name!r}{hint} (all {len(_REGISTRY)}: `densetrain presets`, "
            "or list_presets() in Python)"
        )
    cfg = _REGISTRY[key]()
    return cfg.replace(**overrides) if overrides else cfg


__all__ = ["get_preset", "list_presets"]
