"""Shared pytest setup: the `slow` marker is skipped unless --runslow or DENSETRAIN_FULL=1."""

import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run slow tests too")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or os.environ.get("DENSETRAIN_FULL") == "1":
        return
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow or DENSETRAIN_FULL=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
