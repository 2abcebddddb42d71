"""The engine in one process without torch.distributed: bad input, state dicts, parity.

Without a process group the engine runs with a sharding factor of 1 (nothing to
communicate), which is what inference and single-process debugging use.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ftsdp
from ftsdp.examples.gpt import GPT, MLP, Block, GPTConfig, param_groups


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=31, block_size=8, n_layer=2, n_head=2, n_embd=16))


def tokens(batch: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, 31, (batch, 9), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1], t[:, 1:]


# ---------------------------------------------------------------- bad input
def test_wrapping_twice_is_refused() -> None:
    model = tiny_gpt()
    wrapped = ftsdp.FSDP(model, auto_wrap_policy={Block})
    with pytest.raises(ValueError, match="already belongs to an ftsdp.FSDP wrapper"):
        ftsdp.FSDP(model)
    with pytest.raises(ValueError, match="already an ftsdp.FSDP wrapper"):
        ftsdp.FSDP(nn.Sequential(wrapped))


def test_policy_that_matches_nothing_names_the_types_present() -> None:
    with pytest.raises(ValueError, match=r"matched no module of GPT.*Block") as err:
        ftsdp.FSDP(tiny_gpt(), auto_wrap_policy={nn.Conv2d})
    assert "auto_wrap_policy={Conv2d}" in str(err.value)


def test_policy_of_non_module_classes_is_refused() -> None:
    with pytest.raises(ValueError, match="not an nn.Module class"):
        ftsdp.FSDP(tiny_gpt(), auto_wrap_policy={int})
    with pytest.raises(ValueError, match="must be a set of nn.Module classes"):
        ftsdp.FSDP(tiny_gpt(), auto_wrap_policy=42)


def test_optimizer_created_before_wrapping_fails_at_step() -> None:
    model = tiny_gpt()
    early = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wrapped = ftsdp.FSDP(model, auto_wrap_policy={Block})
    x, y = tokens()
    wrapped(x, y)[1].backward()
    with pytest.raises(ValueError, match="retired when it wrapped the model .*created before"):
        early.step()
    late = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    late.step()  # the right order works


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sharding_strategy": "HYBRID_SHARD"}, "HYBRID_SHARD needs torch.distributed"),
        ({"sharding_strategy": "ZERO3"}, "sharding_strategy='ZERO3' is not one of"),
        ({"sharding_strategy": ftsdp.ShardingStrategy._HYBRID_SHARD_ZERO2}, "use HYBRID_SHARD"),
        ({"sharding_strategy": "_hybrid_shard_zero2"}, "use HYBRID_SHARD"),
        ({"mixed_precision": object()}, "mixed_precision must be an ftsdp.MixedPrecision"),
        ({"cpu_offload": object()}, "cpu_offload must be an ftsdp.CPUOffload"),
        ({"process_group": "world"}, "process_group must be a torch.distributed.ProcessGroup"),
        ({"device_id": "cuda:0"}, "device_id must be an int or a torch.device"),
        ({"sync_module_states": True}, "sync_module_states=True needs torch.distributed"),
    ],
)
def test_unsupported_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ftsdp.FSDP(tiny_gpt(), **kwargs)


def test_cuda_device_id_without_cuda_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a CUDA host
    with pytest.raises(ValueError, match="CUDA is not available"):
        ftsdp.FSDP(tiny_gpt(), device_id=0)


def test_mixed_dtypes_in_one_unit_are_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double())
    with pytest.raises(ValueError, match=r"mixes parameter dtypes .*float64"):
        ftsdp.FSDP(model)


def test_not_a_module_is_refused() -> None:
    with pytest.raises(ValueError, match="wraps an nn.Module"):
        ftsdp.FSDP(torch.zeros(3))


# ---------------------------------------------------------------- state dicts
def test_state_dict_round_trip_and_bad_loads_leave_the_model_untouched() -> None:
    reference = tiny_gpt(seed=3)
    wrapped = ftsdp.FSDP(tiny_gpt(seed=0), auto_wrap_policy={Block, MLP})
    expected = reference.state_dict()
    assert list(wrapped.state_dict()) == list(expected)

    before = wrapped.state_dict()
    bad_shape = dict(expected, **{"blocks.0.mlp.c_fc.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match=r"'blocks.0.mlp.c_fc.weight' has shape \(2, 2\)"):
        wrapped.load_state_dict(bad_shape)
    missing = {k: v for k, v in expected.items() if k != "ln_f.bias"}
    with pytest.raises(ValueError, match=r"missing keys \['ln_f.bias'\]"):
        wrapped.load_state_dict(missing)
    # torch's load_state_dict raises RuntimeError, which scripts catch to retry non-strict
    for bad in (missing, bad_shape):
        with pytest.raises(RuntimeError, match="load_state_dict: "):
            wrapped.load_state_dict(bad)
    for key, value in wrapped.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} changed by a failed load"

    result = wrapped.load_state_dict(dict(expected, extra=torch.zeros(1)), strict=False)
    assert result.unexpected_keys == ["extra"] and result.missing_keys == []
    for key, value in wrapped.state_dict().items():
        assert torch.equal(value, expected[key]), key
    x, y = tokens()
    torch.testing.assert_close(wrapped(x, y)[1], reference(x, y)[1], rtol=0, atol=0)


def test_tied_weight_stays_tied_and_appears_once_in_the_sharded_view() -> None:
    wrapped = ftsdp.FSDP(tiny_gpt(), auto_wrap_policy={Block})
    assert wrapped.module.lm_head.weight is wrapped.module.wte.weight
    views = wrapped.sharded_state_dict()
    assert "wte.weight" in views and "lm_head.weight" not in views
    assert views["wte.weight"].global_shape == (31, 16)
    assert "lm_head.weight" in wrapped.state_dict()


def test_eval_forward_under_no_grad_matches_and_frees() -> None:
    reference = tiny_gpt()
    wrapped = ftsdp.FSDP(copy.deepcopy(reference), auto_wrap_policy={Block})
    x, _ = tokens()
    with torch.no_grad():
        logits, _ = wrapped(x)
    torch.testing.assert_close(logits, reference(x)[0], rtol=0, atol=0)
    assert all(u["state"] == "SHARDED" for u in wrapped.units())


def test_single_process_training_matches_unwrapped() -> None:
    reference = tiny_gpt()
    wrapped = ftsdp.FSDP(copy.deepcopy(reference), auto_wrap_policy={Block})
    opt = torch.optim.AdamW(param_groups(wrapped, 0.1), lr=1e-3)
    ref_opt = torch.optim.AdamW(param_groups(reference, 0.1), lr=1e-3)
    for step in range(3):
        x, y = tokens(seed=step)
        loss = wrapped(x, y)[1]
        loss.backward()
        ref_loss = reference(x, y)[1]
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        torch.testing.assert_close(
            wrapped.clip_grad_norm_(1.0), nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        )
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(wrapped.state_dict()[key], value)


def test_attribute_access_reaches_the_wrapped_module() -> None:
    wrapped = ftsdp.FSDP(tiny_gpt(), auto_wrap_policy={Block})
    assert wrapped.config.n_layer == 2  # GPT.config through the wrapper
    with pytest.raises(AttributeError):
        _ = wrapped.no_such_attribute


def test_unknown_arguments_get_a_clear_error() -> None:
    # torch FSDP's own arguments are accepted: tests/unit/fsdp/test_wrap_policies.py
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        ftsdp.FSDP(tiny_gpt(), no_such_option=1)


def test_zero_grad_frees_the_sharded_gradient() -> None:
    wrapped = ftsdp.FSDP(tiny_gpt(), auto_wrap_policy={Block})
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    x, y = tokens()
    wrapped(x, y)[1].backward()
    assert wrapped.memory_stats()["sharded_grad_bytes"] > 0
    opt.zero_grad(set_to_none=True)
    assert wrapped.memory_stats()["sharded_grad_bytes"] == 0


def test_model_zero_grad_discards_gradients_kept_under_no_sync() -> None:
    reference = tiny_gpt()
    wrapped = ftsdp.FSDP(copy.deepcopy(reference), auto_wrap_policy={Block})
    x, y = tokens(seed=5)
    with wrapped.no_sync():
        wrapped(x, y)[1].backward()  # a micro-batch the user decides to throw away
    wrapped.zero_grad()
    wrapped(x, y)[1].backward()
    reference(x, y)[1].backward()
    for (name, p), (_, q) in zip(
        wrapped.named_parameters(), reference.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p.grad, q.grad.reshape(-1), msg=name)


def test_mixed_precision_and_offload_validate_their_fields() -> None:
    with pytest.raises(ValueError, match="param_dtype=torch.int32 must be a floating torch.dtype"):
        ftsdp.MixedPrecision(param_dtype=torch.int32)
    with pytest.raises(ValueError, match="pass either"):
        ftsdp.FSDP(tiny_gpt(), device_mesh=object(), process_group=object())
    with pytest.raises(ValueError, match="cpu_offload must be an ftsdp.CPUOffload"):
        ftsdp.FSDP(tiny_gpt(), cpu_offload=True)


def test_single_process_bf16_and_offload_train() -> None:
    """Without a process group: bf16 compute with fp32 masters, and offloaded shards."""
    reference = tiny_gpt()
    for kwargs, atol in (
        ({"mixed_precision": ftsdp.MixedPrecision(param_dtype=torch.bfloat16)}, 0.02),
        ({"cpu_offload": ftsdp.CPUOffload(offload_params=True)}, 0.0),  # the same arithmetic
    ):
        wrapped = ftsdp.FSDP(copy.deepcopy(reference), auto_wrap_policy={Block}, **kwargs)
        x, y = tokens()
        loss = wrapped(x, y)[1]
        loss.backward()
        torch.testing.assert_close(loss, reference(x, y)[1], rtol=0, atol=atol)
        assert all(
            p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in wrapped.parameters()
        )


def test_a_dropped_forward_does_not_keep_units_gathered_through_the_next_backward() -> None:
    """A forward under grad mode whose graph is dropped never gets its inputs' gradients;
    the next backward must still free each unit after its backward (see [Note: forward
    tickets]), not hold every unit gathered to the end. bf16 parameters make the full
    buffers separate allocations even on one rank."""
    cfg = GPTConfig(vocab_size=31, block_size=8, n_layer=4, n_head=2, n_embd=16)
    mp = ftsdp.MixedPrecision(param_dtype=torch.bfloat16)
    x, y = tokens()
    grads, peaks = [], []
    for dropped in (False, True):
        torch.manual_seed(0)
        model = ftsdp.FSDP(GPT(cfg), auto_wrap_policy={Block}, mixed_precision=mp)
        if dropped:
            model(x, y)  # gradients enabled, no backward: its graph is dropped
        model(x, y)[1].backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        units = model.units()
        largest = max(u["padded_numel"] for u in units[1:]) * 2  # bf16 bytes
        root = units[0]["padded_numel"] * 2
        peaks.append(model.memory_stats()["peak_unsharded_param_bytes"])
        # the root, the unit computing and the one prefetched: never all four blocks
        assert peaks[-1] <= root + 2 * largest, (dropped, peaks[-1], root, largest)
    assert peaks[0] == peaks[1]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_units_whose_inputs_need_no_gradient_still_get_theirs() -> None:
    """A unit fed a tensor that needs no gradient has no inputs' hook to say its backward is
    done: its flat gradient is reduced at the end of backward instead (and a frozen unit in
    front of it changes nothing). Gradients equal the unwrapped model's."""
    torch.manual_seed(0)
    reference = nn.Sequential(Pair(), Pair(), nn.Linear(8, 3)).double()
    for p in reference[0].parameters():
        p.requires_grad_(False)  # unit 0 frozen: unit 1's input needs no gradient either
    mp = ftsdp.MixedPrecision(param_dtype=torch.float64)  # fp32 masters: separate buffers
    wrapped = ftsdp.FSDP(copy.deepcopy(reference), auto_wrap_policy={Pair})
    wrapped_mp = ftsdp.FSDP(
        copy.deepcopy(reference).float(), auto_wrap_policy={Pair}, mixed_precision=mp
    )
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    reference(x).square().sum().backward()
    for model in (wrapped, wrapped_mp):
        model(x).square().sum().backward()
        grads = dict(model.named_parameters())
        for name, p in reference.named_parameters():
            if p.grad is None:
                assert grads[name].grad is None, name
            else:
                got = grads[name].grad.double()
                torch.testing.assert_close(got, p.grad.reshape(-1), rtol=1e-6, atol=1e-6)
        assert model.memory_stats()["unsharded_param_bytes"] == 0


def test_a_backward_that_raises_does_not_break_the_next_step() -> None:
    """A backward that raises never runs its end-of-backward callback (a caught OOM, a hook
    that raises). The next forward must start clean, with a warning, and the next backward
    must give the same gradients as the unwrapped model (before the fix: none at all)."""
    mp = ftsdp.MixedPrecision(param_dtype=torch.float64)  # separate full buffers on one rank
    reference = tiny_gpt().double()
    wrapped = ftsdp.FSDP(tiny_gpt(), auto_wrap_policy={Block}, mixed_precision=mp)
    x, y = tokens()

    def explode(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in backward")

    # raise half-way: once the last block's backward ran, at the first block's output
    def hook_output(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(explode)

    handle = wrapped.module.blocks[0].register_forward_hook(hook_output)
    _, loss = wrapped(x, y)
    handle.remove()
    with pytest.raises(RuntimeError, match="boom in backward"):
        loss.backward()
    wrapped.zero_grad()
    with pytest.warns(UserWarning, match="previous backward did not finish"):
        _, loss = wrapped(x, y)
    loss.backward()
    reference(x, y)[1].backward()
    grads = dict(wrapped.named_parameters())
    for name, p in reference.named_parameters():
        assert grads[name].grad is not None, name
        torch.testing.assert_close(grads[name].grad.double(), p.grad.reshape(-1))
    assert wrapped.memory_stats()["unsharded_param_bytes"] == 0


class Reorderable(nn.Module):
    """Six units whose order flips between iterations: the recorded backward order is wrong
    for the next backward, so its prefetches go unused and would pile up."""

    def __init__(self) -> None:
        super().__init__()
        self.units = nn.ModuleList(Pair() for _ in range(6))
        self.flip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in reversed(self.units) if self.flip else self.units:
            x = unit(x)
        return x


def test_the_rate_limiter_bounds_prefetches_the_order_no_longer_uses() -> None:
    mp = ftsdp.MixedPrecision(param_dtype=torch.float64)  # separate full buffers on one rank
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))
    outstanding = {}
    for limit in (True, False):
        torch.manual_seed(0)
        reference = Reorderable()
        wrapped = ftsdp.FSDP(
            copy.deepcopy(reference),
            auto_wrap_policy={Pair},
            mixed_precision=mp,
            limit_all_gathers=limit,
        )
        for flip in (False, True):  # the second backward runs in the other order
            wrapped.module.flip = reference.flip = flip
            wrapped(x).square().sum().backward()
            reference(x).square().sum().backward()
        outstanding[limit] = wrapped.comm_stats.max_in_flight
        grads = dict(wrapped.named_parameters())
        for name, p in reference.named_parameters():  # wasted prefetches change nothing
            torch.testing.assert_close(grads[name].grad, p.grad.reshape(-1))
        assert wrapped.memory_stats()["unsharded_param_bytes"] == 0
    assert outstanding[True] == 2, outstanding  # the limiter acted...
    assert outstanding[False] > 2, outstanding  # ...where prefetches would pile up


class _Rotary(nn.Module):
    """Buffers only, as a rotary embedding (HF's LlamaRotaryEmbedding): no parameters."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.d = d
        self.register_buffer("inv_freq", torch.empty(d))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.inv_freq.copy_(1.0 / (10000 ** (torch.arange(self.d).float() / self.d)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.inv_freq


@pytest.mark.parametrize("init", ["reset_parameters", "param_init_fn"])
def test_deferred_init_initialises_a_module_that_holds_only_buffers(init: str) -> None:
    """Built on the meta device, a module with buffers and no parameters is initialised as
    torch FSDP does (its reset_parameters, or param_init_fn on it); its buffers were left as
    the fresh memory held (zeros here), silently."""

    def net() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), _Rotary(4), nn.Linear(4, 2))

    torch.manual_seed(0)
    eager = net()

    def init_fn(m: nn.Module) -> None:
        m.to_empty(device=torch.device("cpu"), recurse=False)
        if callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()

    with torch.device("meta"):
        model = net()
    kwargs = {"param_init_fn": init_fn} if init == "param_init_fn" else {}
    wrapped = ftsdp.FSDP(model, **kwargs)
    assert torch.equal(wrapped.module[1].inv_freq, eager[1].inv_freq)


def test_the_optimizer_state_of_a_scalar_parameter_round_trips() -> None:
    """A 0-dim parameter (a learnable temperature) trains; its AdamW state saved through
    ``FSDP.optim_state_dict`` loads back through ``optim_state_dict_to_load`` and the next step
    equals the one of a model that was never saved (the state came back 0-dim, uncut, and the
    step failed on the shard's shape)."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.scale = nn.Parameter(torch.tensor(2.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale

    def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = ftsdp.FSDP(Scaled())
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.ones(4, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    model, opt = trained()
    osd = ftsdp.FSDP.optim_state_dict(model, opt)
    assert osd["state"]["scale"]["exp_avg"].shape == ()  # the parameter's own shape
    reference, ref_opt = trained()
    fresh = torch.optim.Adam(model.parameters(), lr=0.1)
    fresh.load_state_dict(ftsdp.FSDP.optim_state_dict_to_load(model, fresh, osd))
    for m, o in ((model, fresh), (reference, ref_opt)):
        m(torch.ones(4, 3)).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


def test_state_dicts_give_buffers_in_their_own_dtype_under_a_buffer_dtype() -> None:
    """``MixedPrecision(buffer_dtype=bf16)`` keeps the buffers in bf16 for the forward; the
    state dict gives them in their own dtype, as torch FSDP's does (it gave bf16, so every
    checkpoint and conversion carried the low precision), and loads back. (The sharded state
    dict, which needs a process group, takes the same path: tests/distributed.)"""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    mp = ftsdp.MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    model = ftsdp.FSDP(net, mixed_precision=mp)
    model(torch.randn(5, 4)).sum().backward()
    live = model.module[1].running_mean
    assert live.dtype == torch.bfloat16
    full = model.state_dict()
    assert full["1.running_mean"].dtype == torch.float32
    assert torch.equal(full["1.running_mean"], live.float())
    before = live.clone()
    full["1.running_mean"] = full["1.running_mean"] + 1
    model.load_state_dict(full)
    assert torch.equal(model.module[1].running_mean, (before.float() + 1).bfloat16())


@pytest.mark.parametrize("torch_config", [False, True], ids=["ftsdp", "torch's MixedPrecision"])
def test_mixed_precision_casts_forward_inputs_as_torch_fsdp_does(torch_config: bool) -> None:
    """torch FSDP's two switches: ``cast_root_forward_inputs`` (default on) casts the root's
    floating inputs to ``param_dtype``, ``cast_forward_inputs`` (default off) every unit's.
    A unit fed an fp32 tensor its parent made: cast with the second (ftsdp cast only at the
    root, and the unit's bf16 matmul failed), refused by torch's own error without it; the
    root's input left as it is with the first off (ftsdp ignored it)."""
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

    seen: dict[str, torch.dtype] = {}

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen["inner"] = x.dtype
            return self.lin(x)

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen["root"] = x.dtype
            return self.inner(x.float() * 2)  # fp32 again, whatever came in

    def wrapped(**fields: bool) -> nn.Module:
        kind = TorchMixedPrecision if torch_config else ftsdp.MixedPrecision
        mp = kind(param_dtype=torch.bfloat16, **fields)
        return ftsdp.FSDP(Root(), auto_wrap_policy={Inner}, mixed_precision=mp)

    x = torch.randn(2, 4)
    wrapped(cast_forward_inputs=True)(x)
    assert seen == {"root": torch.bfloat16, "inner": torch.bfloat16}
    with pytest.raises(RuntimeError, match="dtype"):
        wrapped()(x)  # torch's defaults: the root cast, the unit not
    assert seen["root"] == torch.bfloat16 and seen["inner"] == torch.float32
    with pytest.raises(RuntimeError, match="dtype"):
        wrapped(cast_root_forward_inputs=False)(x)
    assert seen["root"] == torch.float32


class _TiedLM(nn.Module):
    """An embedding, a layer, a head tied to the embedding (tied after construction, as
    Hugging Face and GPT-2 style models do), and a module with a weight and no
    ``reset_parameters``."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x))))


def test_deferred_init_keeps_a_tied_weight_as_an_eager_build_does() -> None:
    """Initialised module by module, the head's ``reset_parameters`` re-initialised the
    embedding it is tied to (a Linear's init instead of the embedding's N(0, 1)); an eager
    build ties after both were initialised, so the embedding's values win. Now a parameter
    keeps its first owner's values, and the RNG draws are the same as the eager build's, so
    every weight is bitwise the eager one."""
    torch.manual_seed(0)
    eager = ftsdp.FSDP(_TiedLM()).state_dict()
    with torch.device("meta"):
        model = _TiedLM()
    torch.manual_seed(0)
    wrapped = ftsdp.FSDP(model)
    assert wrapped.module.head.weight is wrapped.module.emb.weight
    deferred = wrapped.state_dict()
    assert deferred.keys() == eager.keys()
    for name, value in eager.items():
        assert torch.equal(deferred[name], value), name


def test_a_param_init_fn_skipping_a_tied_weights_first_owner_still_initialises_it() -> None:
    """A ``param_init_fn`` that initialises Linear layers only: the embedding (first owner of
    the tied weight) is skipped, the head initialises it. The head's values must stay, not
    the embedding's uninitialised memory."""
    torch.manual_seed(0)

    def linears_only(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            for p in m.parameters(recurse=False):
                nn.init.normal_(p, std=0.02)

    with torch.device("meta"):
        model = _TiedLM()
    wrapped = ftsdp.FSDP(model, param_init_fn=linears_only)
    tied = wrapped.state_dict()["emb.weight"]
    assert torch.isfinite(tied).all() and 0.01 < tied.std().item() < 0.03


def test_deferred_init_names_modules_that_nothing_initialised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A module with meta parameters or buffers, no ``reset_parameters`` and no
    ``param_init_fn`` (an RMSNorm, a rotary embedding) kept uninitialised memory (or zeros)
    silently, and a Hugging Face Llama trained on NaN. Now the wrap warns, naming them; with
    a ``param_init_fn`` it does not."""

    class Norm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(6))

    class Frequencies(nn.Module):  # computed in __init__ only
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(6) / 6))

    def net() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 6), Norm(), Frequencies(), _Rotary(6))

    with torch.device("meta"):
        model = net()
    with caplog.at_level("WARNING", logger="ftsdp.fsdp._unit"):
        ftsdp.FSDP(model)
    (record,) = [r for r in caplog.records if "no reset_parameters()" in r.message]
    assert "2 module(s)" in record.message and "1 (Norm), 2 (Frequencies)." in record.message
    caplog.clear()

    def init_fn(m: nn.Module) -> None:
        for p in m.parameters(recurse=False):
            p.fill_(1.0)

    with torch.device("meta"):
        model = net()
    with caplog.at_level("WARNING", logger="ftsdp.fsdp._unit"):
        ftsdp.FSDP(model, param_init_fn=init_fn)
    assert not [r for r in caplog.records if "no reset_parameters()" in r.message]


def test_casting_the_wrapped_model_is_refused_before_anything_changes() -> None:
    """``.bfloat16()`` after wrapping left parameters of two dtypes and failed in the next
    forward ("mat1 and mat2 must have the same dtype"); now it is refused with what to do,
    and the model still trains. A call that changes nothing (``.float()``) is fine."""
    reference = tiny_gpt()
    wrapped = ftsdp.FSDP(copy.deepcopy(reference), auto_wrap_policy={Block})
    for cast in (
        lambda m: m.bfloat16(),
        lambda m: m.double(),
        lambda m: m.to(torch.float16),
        lambda m: m.to("meta"),
    ):
        with pytest.raises(RuntimeError, match="cannot change from torch.float32 on cpu to"):
            cast(wrapped)
    assert wrapped.float() is wrapped and wrapped.to("cpu") is wrapped
    assert {p.dtype for p in wrapped.parameters()} == {torch.float32}
    x, y = tokens()
    torch.testing.assert_close(wrapped(x, y)[1], reference(x, y)[1])


def test_no_sync_sums_bf16_gradients_in_the_reduce_dtype() -> None:
    """With bf16 parameters and an fp32 reduce dtype, gradients kept under ``no_sync`` were
    summed in bf16 (worse with every micro-batch); now in fp32, as FSDP2 does, so they equal
    the gradients of the same micro-batches reduced one by one."""
    mp = ftsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    reference = tiny_gpt()
    grads = []
    for accumulate in (False, True):
        wrapped = ftsdp.FSDP(copy.deepcopy(reference), auto_wrap_policy={Block}, mixed_precision=mp)
        for k in range(16):
            x, y = tokens(seed=10 + k)
            if accumulate and k < 15:
                with wrapped.no_sync():
                    wrapped(x, y)[1].backward()
            else:
                wrapped(x, y)[1].backward()
        grads.append([p.grad.clone() for p in wrapped.parameters()])
    for one_by_one, accumulated in zip(*grads, strict=True):
        assert torch.equal(accumulated, one_by_one)


def test_the_configs_take_torch_fsdps_positional_arguments(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``MixedPrecision(torch.bfloat16, torch.float32)`` and ``CPUOffload(True)`` work as with
    torch FSDP (the same fields in the same order); ``_module_classes_to_ignore`` is accepted
    and the wrap says it is not honoured."""
    from torch.distributed import fsdp as torch_fsdp

    ours = ftsdp.MixedPrecision(torch.bfloat16, torch.float32, None, False, True, False)
    theirs = torch_fsdp.MixedPrecision(torch.bfloat16, torch.float32, None, False, True, False)
    for field in ("param_dtype", "reduce_dtype", "buffer_dtype", "keep_low_precision_grads"):
        assert getattr(ours, field) == getattr(theirs, field), field
    for field in ("cast_forward_inputs", "cast_root_forward_inputs"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ftsdp.CPUOffload(True).offload_params is torch_fsdp.CPUOffload(True).offload_params
    mp = ftsdp.MixedPrecision(torch.bfloat16, _module_classes_to_ignore=(nn.BatchNorm1d,))
    with caplog.at_level("WARNING", logger="ftsdp.fsdp._fully_sharded"):
        ftsdp.FSDP(tiny_gpt(), mixed_precision=mp)
    assert any("_module_classes_to_ignore=('BatchNorm1d',)" in r.message for r in caplog.records)


def test_the_grad_scaler_scales_on_a_machine_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ShardedGradScaler()`` took torch's ``"cuda"`` default: on a CPU machine it turned
    itself off (scale 1.0, a warning). Now it scales on the CPU when there is no CUDA."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    scaler = ftsdp.ShardedGradScaler()
    assert scaler.is_enabled() and scaler.get_scale() == 65536.0
    assert scaler.scale(torch.ones(())).item() == 65536.0
