"""torch FSDP1's wrap policies and arguments on ftsdp, in one process.

The units ftsdp makes from a torch policy are compared with the modules torch's own code
wraps: ``_recursive_wrap`` (for callables taking ``recurse`` / ``nonwrapped_numel``) run with a
recording wrapper class, and ``_run_policy`` (``ModuleWrapPolicy``, ``CustomPolicy``).
"""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch as TorchBackwardPrefetch
from torch.distributed.fsdp import CPUOffload as TorchCPUOffload
from torch.distributed.fsdp import FullStateDictConfig as TorchFullStateDictConfig
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy
from torch.distributed.fsdp import StateDictType as TorchStateDictType
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    _or_policy,
    _recursive_wrap,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

import ftsdp
from ftsdp.examples.gpt import GPT, MLP, Block, GPTConfig

CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16)


class Zoo(nn.Module):
    """Containers, a shared submodule, MultiheadAttention (a forced leaf of the size policy)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        shared = nn.Linear(12, 12)
        self.stem = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), shared)
        self.layers = nn.ModuleList(
            [nn.Sequential(nn.Linear(12, 30), nn.Linear(30, 12)) for _ in range(3)]
        )
        self.heads = nn.ModuleDict({"a": nn.Linear(12, 4), "b": shared})
        self.attn = nn.MultiheadAttention(12, 2)
        self.norm = nn.LayerNorm(12)


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def torch_wrapped(model: nn.Module, policy, ignored: set[nn.Module] = frozenset()) -> list[str]:
    """The modules torch FSDP wraps with ``policy`` (names, sorted)."""
    ignored = {m for root in ignored for m in root.modules()}
    names = {id(m): n for n, m in model.named_modules()}
    if hasattr(policy, "_run_policy"):
        chosen = policy._run_policy(model, ignored, {})
        return sorted(names[id(m)] for m in chosen if m is not model)
    wrapped: list[str] = []

    def record(module: nn.Module, **kwargs) -> nn.Module:
        wrapped.append(names[id(module)])
        return module

    ignored_params = {p for m in ignored for p in m.parameters()}
    _recursive_wrap(model, policy, record, ignored, ignored_params, only_wrap_children=True)
    return sorted(set(wrapped))  # a shared module is visited (and wrapped) once per parent


def ftsdp_units(model: nn.Module, policy, **kwargs) -> list[str]:
    wrapped = ftsdp.FSDP(model, auto_wrap_policy=policy, **kwargs)
    return sorted(u["name"] for u in wrapped.units() if u["name"])


POLICIES = {
    "transformer": functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
    "transformer2": functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={Block, MLP, nn.Sequential}
    ),
    "size100": functools.partial(size_based_auto_wrap_policy, min_num_params=100),
    "size600": functools.partial(size_based_auto_wrap_policy, min_num_params=600),
    "size2000": functools.partial(size_based_auto_wrap_policy, min_num_params=2000),
    "size_no_exclude": functools.partial(
        size_based_auto_wrap_policy, min_num_params=300, exclude_wrap_modules=set()
    ),
    "lambda": functools.partial(
        lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, (nn.Linear, nn.LayerNorm))
    ),
    "always": always_wrap_policy,
    "or": functools.partial(
        _or_policy,
        policies=[
            functools.partial(size_based_auto_wrap_policy, min_num_params=1000),
            functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.LayerNorm}),
        ],
    ),
    "own_callable": lambda module, recurse, nonwrapped_numel: recurse or nonwrapped_numel > 200,
    "module_wrap": ModuleWrapPolicy({Block, nn.Sequential, nn.LayerNorm}),
    "custom": CustomPolicy(
        lambda m: isinstance(m, MLP) or (isinstance(m, nn.Linear) and m.in_features != 6)
    ),
}


@pytest.mark.parametrize("model_fn", [gpt, Zoo], ids=["gpt", "zoo"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_torch_policies_give_the_units_torch_would_wrap(model_fn, name) -> None:
    policy = POLICIES[name]
    model = model_fn()
    expected = torch_wrapped(copy.deepcopy(model), policy)
    assert ftsdp_units(model, policy) == expected


@pytest.mark.parametrize("name", ["size100", "always", "module_wrap", "custom"])
def test_ignored_modules_are_neither_units_nor_counted(name) -> None:
    policy = POLICIES[name]
    model = Zoo()
    reference = copy.deepcopy(model)
    expected = torch_wrapped(reference, policy, ignored={reference.layers[1], reference.attn})
    assert ftsdp_units(model, policy, ignored_modules=[model.layers[1], model.attn]) == expected


def test_custom_policy_arguments_must_be_the_roots() -> None:
    def differ(module: nn.Module):
        if isinstance(module, MLP):
            return {"mixed_precision": ftsdp.MixedPrecision(param_dtype=torch.bfloat16)}
        return isinstance(module, Block)

    with pytest.raises(ValueError, match=r"'blocks.0.mlp'.*mixed_precision.*one set of arguments"):
        ftsdp.FSDP(gpt(), auto_wrap_policy=CustomPolicy(differ))
    # the root's own arguments, in torch's or ftsdp's spelling, are fine
    same = CustomPolicy(
        lambda m: (
            {"sharding_strategy": TorchShardingStrategy.SHARD_GRAD_OP, "use_orig_params": True}
            if isinstance(m, Block)
            else False
        )
    )
    units = ftsdp_units(gpt(), same, sharding_strategy=ftsdp.ShardingStrategy.SHARD_GRAD_OP)
    assert units == ["blocks.0", "blocks.1"]
    with pytest.raises(ValueError, match="not an FSDP argument"):
        ftsdp.FSDP(gpt(), auto_wrap_policy=CustomPolicy(lambda m: {"nope": 1}))


def test_a_torch_policy_selecting_nothing_is_one_unit_as_in_torch(caplog) -> None:
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=10**8)
    with caplog.at_level(logging.WARNING, logger="ftsdp.fsdp._wrap"):
        assert ftsdp_units(gpt(), policy) == []
    assert "selected no submodule" in caplog.text
    with pytest.raises(ValueError, match="matched no module"):  # ftsdp's own forms still raise
        ftsdp.FSDP(gpt(), auto_wrap_policy={nn.Conv2d})


def test_ftsdp_policies_are_unchanged() -> None:
    assert ftsdp_units(gpt(), {Block}) == ["blocks.0", "blocks.1"]
    assert ftsdp_units(gpt(), lambda m: isinstance(m, MLP)) == ["blocks.0.mlp", "blocks.1.mlp"]


# ---------------------------------------------------------------------- keyword arguments
def test_fsdp1_keyword_arguments(caplog) -> None:
    kwargs = dict(
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        device_id=torch.device("cpu"),
        sync_module_states=False,
        limit_all_gathers=True,
        forward_prefetch=True,
        backward_prefetch=TorchBackwardPrefetch.BACKWARD_PRE,
        mixed_precision=TorchMixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=True),
        cpu_offload=TorchCPUOffload(offload_params=True),
        sharding_strategy=TorchShardingStrategy.FULL_SHARD,
        use_orig_params=True,
        ignored_states=None,
    )
    with caplog.at_level(logging.WARNING, logger="ftsdp.fsdp._fully_sharded"):
        model = ftsdp.FSDP(gpt(), **kwargs)
    assert caplog.text == ""
    assert model.sharding_strategy is ftsdp.ShardingStrategy.FULL_SHARD
    assert model._units[0].param_dtype == torch.bfloat16 and model._units[0].options.offload
    for prefetch in (None, False, True, ftsdp.BackwardPrefetch.BACKWARD_PRE):
        ftsdp.FSDP(gpt(), backward_prefetch=prefetch)
    with caplog.at_level(logging.WARNING, logger="ftsdp.fsdp._fully_sharded"):
        ftsdp.FSDP(gpt(), use_orig_params=False)
    assert "always exposes the original parameters" in caplog.text


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"backward_prefetch": TorchBackwardPrefetch.BACKWARD_POST}, "BACKWARD_PRE"),
        ({"backward_prefetch": "sideways"}, "BackwardPrefetch.BACKWARD_PRE"),
        ({"mixed_precision": TorchMixedPrecision(keep_low_precision_grads=True)}, "fp32"),
        ({"sharding_strategy": TorchShardingStrategy._HYBRID_SHARD_ZERO2}, "HYBRID_SHARD"),
        ({"ignored_modules": [nn.Parameter(torch.zeros(1))]}, "ignored_states="),
        ({"no_such_option": 1}, "docs/migrating.md"),
    ],
)
def test_fsdp1_arguments_ftsdp_cannot_honour_raise_naming_the_alternative(kwargs, match) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        ftsdp.FSDP(gpt(), **kwargs)


def test_ignored_module_stays_whole_and_trains_like_the_unwrapped_model() -> None:
    reference = gpt()
    model = copy.deepcopy(reference)
    wrapped = ftsdp.FSDP(model, auto_wrap_policy={Block}, ignored_modules=[model.wpe])
    params = dict(wrapped.named_parameters())
    assert params["wpe.weight"] is model.wpe.weight and params["wpe.weight"].dim() == 2
    assert all("wpe" not in n for u in wrapped.units() for n in u["params"])
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, CFG.vocab_size, (4, CFG.block_size), generator=g)
        wrapped(x, x)[1].backward()
        reference(x, x)[1].backward()
        norm = wrapped.clip_grad_norm_(0.1)  # the ignored gradient counts, and is clipped
        torch.testing.assert_close(norm, nn.utils.clip_grad_norm_(reference.parameters(), 0.1))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    state = wrapped.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=key)
    views = wrapped.sharded_optim_state_dict(opt)  # the checkpoint view includes it, whole
    assert views["state"]["wpe.weight"]["exp_avg"].shape == model.wpe.weight.shape


# ---------------------------------------------------------------------- state-dict settings
def test_state_dict_type_settings_and_refusals() -> None:
    FSDP = ftsdp.FSDP
    model = FSDP(gpt(), auto_wrap_policy={Block})
    default = FSDP.get_state_dict_type(model)
    assert default.state_dict_type is ftsdp.fsdp.StateDictType.FULL_STATE_DICT
    assert default.optim_state_dict_config.offload_to_cpu  # torch's default
    outer = nn.Sequential(model)  # the wrapped model inside another module, as torch allows
    with FSDP.state_dict_type(
        outer, TorchStateDictType.FULL_STATE_DICT, TorchFullStateDictConfig(rank0_only=True)
    ):
        settings = FSDP.get_state_dict_type(model)
        assert isinstance(settings.state_dict_config, ftsdp.fsdp.FullStateDictConfig)
        assert settings.state_dict_config.rank0_only
        assert set(model.state_dict()) == set(gpt().state_dict())  # one process: rank 0
    assert FSDP.get_state_dict_type(model) == default
    with pytest.raises(ValueError, match="SHARDED_STATE_DICT"):
        FSDP.set_state_dict_type(model, ftsdp.fsdp.StateDictType.LOCAL_STATE_DICT)
    with pytest.raises(ValueError, match="must match the state dict type"):
        FSDP.set_state_dict_type(
            model, ftsdp.fsdp.StateDictType.SHARDED_STATE_DICT, ftsdp.fsdp.FullStateDictConfig()
        )
    with pytest.raises(ValueError, match="no ftsdp.FSDP wrapper"):
        FSDP.get_state_dict_type(gpt())
    with pytest.raises(NotImplementedError, match="FSDP.optim_state_dict"):
        FSDP.full_optim_state_dict(model, None)
    with pytest.raises(NotImplementedError, match="reduce_dtype"):
        model.register_comm_hook(None, None)


def test_the_migration_guide_changes_only_the_import() -> None:
    """docs/migrating.md's "after" imports are its "before" with ``torch.distributed.fsdp``
    replaced by ``ftsdp.fsdp``, and they run as written, without a DeprecationWarning."""
    import pathlib
    import re
    import warnings

    text = (pathlib.Path(__file__).parents[3] / "docs" / "migrating.md").read_text()
    before, after = re.search(r"# before\n(.*?)# after\n(.*?)```", text, re.S).groups()
    code = re.sub(r"\s*#.*", "", after)  # the comments differ, not the code
    assert re.sub(r"\s*#.*", "", before).replace("torch.distributed.fsdp", "ftsdp.fsdp") == code
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        names: dict = {}
        exec(compile(code, "docs/migrating.md", "exec"), names)
    assert names["FSDP"] is ftsdp.FSDP and names["StateDictType"] is ftsdp.fsdp.StateDictType


def test_exports_match_torch_fsdp1_names() -> None:
    import torch.distributed.fsdp as torch_fsdp

    import ftsdp.fsdp

    for name in (
        "BackwardPrefetch",
        "CPUOffload",
        "FullOptimStateDictConfig",
        "FullStateDictConfig",
        "FullyShardedDataParallel",
        "LocalOptimStateDictConfig",
        "LocalStateDictConfig",
        "MixedPrecision",
        "OptimStateDictConfig",
        "ShardedOptimStateDictConfig",
        "ShardedStateDictConfig",
        "ShardingStrategy",
        "StateDictConfig",
        "StateDictSettings",
        "StateDictType",
    ):
        ours, theirs = getattr(ftsdp.fsdp, name), getattr(torch_fsdp, name)
        if name in ftsdp.__all__:  # the rest only in ftsdp.fsdp (docs/migrating.md)
            assert getattr(ftsdp, name) is ours, name
        if hasattr(theirs, "__dataclass_fields__"):  # same fields and defaults
            mine = {k: f.default for k, f in ours.__dataclass_fields__.items()}
            for field, spec in theirs.__dataclass_fields__.items():
                if field.startswith("_"):
                    continue
                assert field in mine, (name, field)
                assert mine[field] == spec.default, (name, field)
        elif hasattr(theirs, "__members__"):
            public = {m for m in theirs.__members__ if not m.startswith("_")}
            assert public <= set(ours.__members__), name


def test_activation_checkpointing_after_wrapping_keeps_clean_state_dict_keys() -> None:
    """The FSDP tutorials' ``apply_activation_checkpointing`` on the wrapped model: training
    as unwrapped, and state dicts (model and optimizer) keyed without the wrapper's
    ``_checkpoint_wrapped_module.`` parts, as torch FSDP keys them."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    reference = gpt()
    wrapped = ftsdp.FSDP(copy.deepcopy(reference), auto_wrap_policy=POLICIES["transformer"])
    apply_activation_checkpointing(
        wrapped,
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
        check_fn=lambda m: isinstance(m, Block),
    )
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    x = torch.randint(0, CFG.vocab_size, (4, CFG.block_size), generator=torch.Generator())
    for _ in range(2):
        torch.testing.assert_close(wrapped(x, x)[1], reference(x, x)[1])
        wrapped(x, x)[1].backward()
        reference(x, x)[1].backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    want = reference.state_dict()
    state = wrapped.state_dict()
    assert list(state) == list(want)
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, msg=key)
    names = dict(reference.named_parameters())
    osd = ftsdp.FSDP.optim_state_dict(wrapped, opt)
    assert sorted(osd["state"]) == sorted(names)
    for name, p in names.items():
        torch.testing.assert_close(osd["state"][name]["exp_avg"], ref_opt.state[p]["exp_avg"])
    with torch.no_grad():
        for p in wrapped.parameters():
            p.zero_()
    wrapped.load_state_dict(want)  # and back, through the renamed keys
    for key, value in wrapped.state_dict().items():
        torch.testing.assert_close(value, want[key], msg=key)
