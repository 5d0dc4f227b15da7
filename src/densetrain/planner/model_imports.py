"""Import ``densetrain.models``' pure-Python modules (config, presets, sizing) without torch.

The package's ``__init__`` exports the torch model (``Transformer``, the losses), so importing
any ``densetrain.models.<sub>`` first imports torch: seconds that a planner, which needs only
configs and counts, does not need. `defer_models_init` registers the package with its search
path but without running its ``__init__``; submodules then import on their own, and the first
access of any other package attribute (``densetrain.models.Transformer``, ``from
densetrain.models import get_preset``) runs the real ``__init__`` in place, so every other
caller sees the usual package. Python's import system has no switch for this; the deferral is a
module-level ``__getattr__`` (PEP 562) that removes itself once the package is complete.
"""

from __future__ import annotations

import importlib.util
import sys
import threading

_PACKAGE = "densetrain.models"
_lock = threading.Lock()


def defer_models_init() -> None:
    """Make ``densetrain.models.<sub>`` importable without running the package ``__init__``
    (a no-op when the package is already imported)."""
    with _lock:
        if _PACKAGE in sys.modules:
            return
        spec = importlib.util.find_spec(_PACKAGE)
        if spec is None or spec.loader is None:  # pragma: no cover - broken installation
            raise ImportError(f"cannot find {_PACKAGE}")
        module = importlib.util.module_from_spec(spec)

        def finish_init(name: str):
            with _lock:
                if module.__dict__.get("__getattr__") is finish_init:
                    del module.__dict__["__getattr__"]
                    spec.loader.exec_module(module)
            if name in module.__dict__:
                return module.__dict__[name]
            raise AttributeError(f"module {_PACKAGE!r} has no attribute {name!r}")

        module.__getattr__ = finish_init
        sys.modules[_PACKAGE] = module
        sys.modules["densetrain"].models = module
