"""The code base passes ruff (lint and format), configured in pyproject.toml."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff")
    cmd = [exe] if exe else [sys.executable, "-m", "ruff"]
    return subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(150)
def test_ruff_check() -> None:
    result = _ruff("check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(150)
def test_ruff_format() -> None:
    result = _ruff("format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr
