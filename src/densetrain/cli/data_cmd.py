"""Sub-commands of `densetrain` (see cli/main.py)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add this module's sub-commands to subparsers."""
