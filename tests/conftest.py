"""Shared pytest configuration: tier markers follow the test's folder; pytest-xdist's two workers
(``addopts``) take whole modules, and all of tests/distributed at once."""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

# The S3 fixtures (one SeaweedFS server per worker's session), for every test module.
pytest_plugins = ["tests.s3_fixture"]

_TIERS = {"unit": "unit", "distributed": "distributed", "e2e": "e2e", "gpu": "gpu"}


def pytest_configure(config: pytest.Config) -> None:
    """A run that measures the fault suite (``$FTSDP_FAULT_REPORT``) times each job alone: no
    workers beside it (this runs before pytest-xdist starts them)."""
    if os.environ.get("FTSDP_FAULT_REPORT") and getattr(config.option, "numprocesses", None):
        config.option.numprocesses, config.option.dist, config.option.tx = 0, "no", []


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's workers take whole scopes: a module (its fixtures are built once), and all
    of tests/distributed as one, whose modules share the rank groups of its session fixture
    ``spawns`` (one spawn per world size). A scheduler of our own, not ``xdist_group`` marks:
    ``--dist loadgroup`` no longer groups under pytest 9.2 (pytest-xdist issue 1386)."""
    from xdist.scheduler import LoadScopeScheduling

    class Scopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/distributed" if path.startswith("tests/distributed/") else path

    return Scopes(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = pathlib.Path(str(item.fspath)).parts
        for folder, marker in _TIERS.items():
            if folder in parts:
                item.add_marker(getattr(pytest.mark, marker))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # no idle core to start it early: test_mypy runs it on whichever worker gets it
    if any(item.name == "test_mypy" for item in items):
        from tests.unit import test_types

        config.stash[test_types.CHECK] = test_types.start(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    """End a background check the session did not wait for (it stopped early)."""
    from tests.unit import test_types

    check = config.stash.get(test_types.CHECK, None)
    if check is not None and check.poll() is None:
        check.kill()
        check.wait()


@pytest.fixture
def shm_path() -> Iterator[pathlib.Path]:
    """A fresh directory in host shared memory (``/dev/shm``, tmpfs), removed afterwards; the
    test fails, never skips, where there is no tmpfs there (the tmpfs code paths need one)."""
    from ftsdp.storage.io._fs import Store

    if not Store("/dev/shm", None).tmpfs:
        pytest.fail("/dev/shm is not a tmpfs mount here: this test needs one")
    path = pathlib.Path(tempfile.mkdtemp(prefix="ftsdp-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
