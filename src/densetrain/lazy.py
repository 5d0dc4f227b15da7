"""Package names imported on first use (PEP 562 module ``__getattr__``).

The packages whose names pull in torch, SciPy or the trainer (``models``, ``optim``, ``data``,
``scaling``, ``train``) import them only when one is first used, so that a light submodule,
a config or the CLI's help imports without them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any]
                 ) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``exports[name]`` (a module path,
    or the name of one of the package's submodules) on first access of ``name`` and caches the
    value in the package's ``namespace`` (its ``globals()``)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        path = module if "." in module else f"{package}.{module}"
        value = getattr(importlib.import_module(path), name)
        namespace[name] = value
        return value

    return __getattr__
