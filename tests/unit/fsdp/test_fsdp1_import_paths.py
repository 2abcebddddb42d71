"""The module paths torch FSDP1 scripts import from (the tutorials, llama-recipes, PEFT) exist
under ``ftsdp.fsdp`` with the import changed, and name ftsdp's objects (torch's for the wrap
policies and ``OptimStateKeyType``)."""

from __future__ import annotations

import importlib

import pytest
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp.wrap as torch_wrap

import ftsdp.fsdp

PATHS = {  # torch's module -> the names scripts import from it
    "fully_sharded_data_parallel": [
        "FullyShardedDataParallel",
        "CPUOffload",
        "BackwardPrefetch",
        "MixedPrecision",
        "ShardingStrategy",
        "StateDictType",
        "FullStateDictConfig",
        "OptimStateKeyType",
    ],
    "api": list(importlib.import_module("torch.distributed.fsdp.api").__all__),
    "sharded_grad_scaler": ["ShardedGradScaler"],
}


@pytest.mark.parametrize("module", sorted(PATHS))
def test_torchs_module_paths_import_ftsdps_objects(module: str) -> None:
    ours = importlib.import_module(f"ftsdp.fsdp.{module}")
    for name in PATHS[module]:
        assert hasattr(importlib.import_module(f"torch.distributed.fsdp.{module}"), name), name
        assert getattr(ours, name) is getattr(ftsdp.fsdp, name), name


def test_every_fsdp1_name_torch_exports_is_exported() -> None:
    fsdp2 = {"CPUOffloadPolicy", "DataParallelMeshDims", "FSDPModule", "fully_shard"}
    fsdp2 |= {"MixedPrecisionPolicy", "OffloadPolicy", "register_fsdp_forward_method"}
    fsdp2 |= {"UnshardHandle", "share_comm_ctx"}
    for name in set(torch_fsdp.__all__) - fsdp2:
        assert hasattr(ftsdp.fsdp, name), name
    assert ftsdp.fsdp.OptimStateKeyType is torch_fsdp.OptimStateKeyType


def test_the_wrap_module_has_torchs_policies_and_refuses_manual_wrapping() -> None:
    from ftsdp.fsdp import wrap

    for name in ["_or_policy", "_module_wrap_policy", "transformer_auto_wrap_policy"]:
        assert getattr(wrap, name) is getattr(torch_wrap, name), name
    for manual in (wrap.enable_wrap, wrap.wrap):
        with pytest.raises(NotImplementedError, match="use|auto_wrap_policy"):
            manual()
