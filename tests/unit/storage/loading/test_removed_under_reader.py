"""A step whose objects go while a reader has it open (retention deleted the step, or an object
is missing): IncompleteCheckpointError naming the step and the object, not a bare
FileNotFoundError (docs/format.md, "Integrity")."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ftsdp import storage
from ftsdp.storage._errors import IncompleteCheckpointError


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "model.a": torch.randn(30, 10, generator=g),
        "model.b": torch.randn(30, 10, generator=g),
    }


def test_step_removed_by_retention_under_an_open_reader(tmp_path: Path) -> None:
    url = str(tmp_path / "root")
    storage.save(_state(1), url, step=1)
    with storage.LazyStateDict(url) as lz:
        assert torch.equal(lz["model.a"], _state(1)["model.a"])
        storage.save(_state(2), url, step=2, options=storage.SaveOptions(keep_last=1))
        assert storage.list_steps(url) == [2]
        for read in (
            lambda: lz["model.b"],
            lambda: lz.read("model.b", 5, 10),
            lambda: lz.fill_ranges([("model.b", 5, torch.empty(10))]),
        ):
            with pytest.raises(IncompleteCheckpointError, match="step 1 was removed") as e:
                read()  # before: FileNotFoundError naming the file only
            assert f"{url}/step-1/rank" in str(e.value)


def test_object_missing_under_an_open_reader(tmp_path: Path) -> None:
    url = str(tmp_path / "root")
    storage.save(_state(1), url, step=1)
    with storage.LazyStateDict(url) as lz:
        (obj,) = [n for n in os.listdir(f"{url}/step-1") if n.startswith("rank")]
        os.remove(f"{url}/step-1/{obj}")
        with pytest.raises(
            IncompleteCheckpointError, match="step 1: .* is missing, yet its manifest"
        ) as e:
            lz["model.b"]
        assert f"{url}/step-1/{obj}" in str(e.value)
