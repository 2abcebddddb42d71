"""Shared pytest configuration: tier markers follow the test's folder."""

from __future__ import annotations

import pathlib

import pytest

_TIERS = {"unit": "unit", "distributed": "distributed", "e2e": "e2e", "gpu": "gpu"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = pathlib.Path(str(item.fspath)).parts
        for folder, marker in _TIERS.items():
            if folder in parts:
                item.add_marker(getattr(pytest.mark, marker))
