"""torch FSDP1 training scripts run on ftsdp with only the import changed.

Each script below is written the way torch FSDP1's tutorials and docs write it, against a
namespace ``F`` (``torch.distributed.fsdp`` or ``ftsdp.fsdp``) and ``W`` (its ``.wrap``):
``import torch.distributed.fsdp as F`` becomes ``import ftsdp.fsdp as F`` and nothing else
changes. Two gloo ranks run the grid (a phase of the W=2 spawn this folder's modules share, see
its conftest.py); every script is compared with unwrapped training on the global batch in the
same process (losses, clip norms, weights and optimizer state within 1e-5), and where torch
FSDP1 runs on CPU, with torch FSDP1 itself running the same script (its state dicts are the
format reference).
"""

from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

from ftsdp.examples.gpt import GPT, MLP, Block, GPTConfig

pytestmark = pytest.mark.timeout(600)  # the first test may run the shared spawns (conftest.py)

CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16)
GLOBAL_BATCH = 8
TOL = dict(rtol=1e-5, atol=1e-5)
CPU = torch.device("cpu")
# torch FSDP1 without a GPU: offload_to_cpu=True in its state-dict configs kills the rank
# (SIGSEGV) and sync_module_states=True refuses CPU tensors, so its runs leave them off.
TORCH_CPU_LIMITS = {"torch"}


def batches(steps: int, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, CFG.block_size + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def mine(x: torch.Tensor) -> torch.Tensor:
    """This rank's contiguous slice of the global batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per = x.shape[0] // world
    return x[rank * per : (rank + 1) * per]


def gpt(seed: int = 0, frozen_wpe: bool = False) -> GPT:
    torch.manual_seed(seed)
    model = GPT(CFG)
    if frozen_wpe:
        model.wpe.weight.requires_grad_(False)
    return model


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6, weight_decay=0.1)


def train(model, opt, data, *, clip: float | None = None, wrapped: bool = True) -> list:
    """Steps on ``data``; the wrapped model sees this rank's slice. Per step: the global mean
    loss (and the clip norm)."""
    out = []
    for x, y in data:
        if wrapped:
            x, y = mine(x), mine(y)
        loss = model(x, y)[1]
        loss.backward()
        norm = None
        if clip is not None:
            norm = (
                model.clip_grad_norm_(clip)
                if wrapped
                else nn.utils.clip_grad_norm_(model.parameters(), clip)
            )
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        if wrapped:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        out.append((loss, norm))
    return out


def assert_close_steps(got: list, want: list, label: str) -> None:
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want, strict=True)):
        where = f"{label} step {step}"
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m, w=where: f"{w}: loss {m}")
        if ref_norm is not None:
            torch.testing.assert_close(
                norm.float(), ref_norm, **TOL, msg=lambda m, w=where: f"{w}: norm {m}"
            )


def assert_close_state(got: dict, want: dict, label: str) -> None:
    assert list(got) == list(want), f"{label}: keys {list(got)} != {list(want)}"
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, **TOL, msg=lambda m, k=key: f"{label}: {k} {m}")


def namespaces(engine: str):
    if engine == "torch":
        import torch.distributed.fsdp as F
        import torch.distributed.fsdp.wrap as W
    else:
        import ftsdp.fsdp as F
        import ftsdp.fsdp.wrap as W
    return F, W


# ---------------------------------------------------------------------- the scripts
def script_transformer(F, W, data, offload: bool = True) -> tuple[list, dict]:
    """The FSDP advanced tutorial (T5 / transformer): transformer_auto_wrap_policy, the usual
    keyword arguments, activation checkpointing, clip_grad_norm_, then a full state dict on
    rank 0 on the CPU."""
    model = gpt()
    policy = functools.partial(W.transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = F.FullyShardedDataParallel(
        model,
        auto_wrap_policy=policy,
        sharding_strategy=F.ShardingStrategy.FULL_SHARD,
        backward_prefetch=F.BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch=True,
        limit_all_gathers=True,
        use_orig_params=True,
        device_id=CPU,
    )
    apply_activation_checkpointing(  # the tutorial's non-reentrant activation checkpointing
        model,
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
        check_fn=lambda submodule: isinstance(submodule, Block),
    )
    opt = adamw(model.parameters())
    steps = train(model, opt, data, clip=0.5)
    save_policy = F.FullStateDictConfig(offload_to_cpu=offload, rank0_only=True)
    with F.FullyShardedDataParallel.state_dict_type(
        model, F.StateDictType.FULL_STATE_DICT, save_policy
    ):
        cpu_state = model.state_dict()
    return steps, cpu_state


def script_size_based(F, W, data) -> tuple[list, dict]:
    """The FSDP getting-started tutorial (MNIST): size_based_auto_wrap_policy, CPU offload,
    Adadelta and a learning-rate scheduler; the plain ``model.state_dict()`` on every rank."""
    model = gpt(seed=1)
    policy = functools.partial(W.size_based_auto_wrap_policy, min_num_params=600)
    model = F.FullyShardedDataParallel(
        model,
        auto_wrap_policy=policy,
        cpu_offload=F.CPUOffload(offload_params=True),
        device_id=CPU,
    )
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    steps = []
    for batch in data:
        steps += train(model, opt, [batch])
        scheduler.step()
    return steps, model.state_dict()


def script_module_wrap_ignored(F, W, data) -> tuple[list, dict]:
    """ModuleWrapPolicy, SHARD_GRAD_OP, and a frozen module left out with ignored_modules."""
    model = gpt(seed=2, frozen_wpe=True)
    model = F.FullyShardedDataParallel(
        model,
        auto_wrap_policy=W.ModuleWrapPolicy({Block, MLP}),
        sharding_strategy=F.ShardingStrategy.SHARD_GRAD_OP,
        ignored_modules=[model.wpe],
        device_id=CPU,
        use_orig_params=True,
    )
    whole = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in model.named_parameters()}
    assert whole["wpe.weight"].shape == (CFG.block_size, CFG.n_embd), "ignored must stay whole"
    opt = adamw([p for p in model.parameters() if p.requires_grad])
    return train(model, opt, data, clip=0.5), model.state_dict()


def script_custom_policy(F, W, data) -> tuple[list, dict]:
    """CustomPolicy returning True, False and the root's own arguments; NO_SHARD."""

    def lambda_fn(module: nn.Module):
        if isinstance(module, Block):
            return {"sharding_strategy": F.ShardingStrategy.NO_SHARD}  # the root's: fine
        return isinstance(module, nn.LayerNorm)

    model = F.FullyShardedDataParallel(
        gpt(seed=3),
        auto_wrap_policy=W.CustomPolicy(lambda_fn),
        sharding_strategy=F.ShardingStrategy.NO_SHARD,
        device_id=CPU,
        use_orig_params=True,
    )
    opt = adamw(model.parameters())
    return train(model, opt, data), model.state_dict()


def reference_run(seed: int, data, *, clip=None, frozen_wpe=False, opt_fn=adamw, sched=False):
    model = gpt(seed=seed, frozen_wpe=frozen_wpe)
    opt = opt_fn([p for p in model.parameters() if p.requires_grad])
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7) if sched else None
    steps = []
    for batch in data:
        steps += train(model, opt, [batch], clip=clip, wrapped=False)
        if scheduler is not None:
            scheduler.step()
    return model, opt, steps


def check_scripts(rank: int, engines: list[str]) -> dict:
    """The four training scripts on each engine, against unwrapped training."""
    data = batches(3)
    refs = {
        "transformer": reference_run(0, data, clip=0.5),
        "size_based": reference_run(
            1, data, opt_fn=lambda p: torch.optim.Adadelta(p, lr=1.0), sched=True
        ),
        "module_wrap_ignored": reference_run(2, data, clip=0.5, frozen_wpe=True),
        "custom_policy": reference_run(3, data),
    }
    scripts = {
        "transformer": script_transformer,
        "size_based": script_size_based,
        "module_wrap_ignored": script_module_wrap_ignored,
        "custom_policy": script_custom_policy,
    }
    ran = {}
    for engine in engines:
        F, W = namespaces(engine)
        for name, script in scripts.items():
            label = f"{engine}/{name}"
            if engine == "torch" and name == "size_based":
                continue  # torch FSDP1 refuses CPU offload without an accelerator
            if name == "transformer":
                steps, state = script(F, W, data, offload=engine not in TORCH_CPU_LIMITS)
            else:
                steps, state = script(F, W, data)
            model, _, ref_steps = refs[name]
            assert_close_steps(steps, ref_steps, label)
            if name == "transformer" and rank != 0:
                assert state == {}, f"{label}: rank0_only gave rank {rank} {list(state)}"
            else:
                assert_close_state(state, model.state_dict(), label)
                if name == "transformer":
                    assert all(v.device.type == "cpu" for v in state.values()), label
            ran[label] = len(steps)
    return ran


# ---------------------------------------------------------------------- checkpoints
def build_for_checkpoint(F, W, seed: int):
    model = F.FullyShardedDataParallel(
        gpt(seed=seed),
        auto_wrap_policy=functools.partial(
            W.transformer_auto_wrap_policy, transformer_layer_cls={Block}
        ),
        device_id=CPU,
        use_orig_params=True,
    )
    return model, adamw(model.parameters())


def check_full_checkpoint(rank: int, tmp: str, engine: str) -> dict:
    """Save model and optimizer FULL (rank 0, CPU) with torch.save, resume the documented way
    (``sync``: rank 0 loads the unwrapped model, sync_module_states=True; otherwise every rank
    loads after wrapping; the optimizer from rank 0), continue: the same as the uninterrupted
    unwrapped run. torch FSDP1 runs it without a GPU, so without CPU offload and sync."""
    sync = offload = engine not in TORCH_CPU_LIMITS
    F, W = namespaces(engine)
    FSDP = F.FullyShardedDataParallel
    data = batches(4)
    _, _, ref_steps = reference_run(10, data)
    ref_model, ref_opt_2, _ = reference_run(10, data[:2])

    model, opt = build_for_checkpoint(F, W, seed=10)
    steps = train(model, opt, data[:2])
    FSDP.set_state_dict_type(
        model,
        F.StateDictType.FULL_STATE_DICT,
        F.FullStateDictConfig(offload_to_cpu=offload, rank0_only=True),
        F.FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=True),
    )
    state = model.state_dict()
    optim_state = FSDP.optim_state_dict(model, opt)
    path = os.path.join(tmp, f"full-{engine}.pt")
    if rank == 0:
        check_full_optim_state(optim_state, ref_model, ref_opt_2, f"{engine}/full optim")
        torch.save({"model": state, "optim": optim_state}, path)
    else:
        assert state == {} and optim_state == {}, f"{engine}: rank0_only gave rank {rank} data"
    dist.barrier()

    fresh = gpt(seed=99)  # other weights: everything must come from the checkpoint
    if rank == 0 and sync:
        fresh.load_state_dict(torch.load(path)["model"])
    resumed = FSDP(
        fresh,
        auto_wrap_policy=functools.partial(
            W.transformer_auto_wrap_policy, transformer_layer_cls={Block}
        ),
        device_id=CPU,
        use_orig_params=True,
        sync_module_states=sync,
    )
    opt2 = adamw(resumed.parameters())
    FSDP.set_state_dict_type(
        resumed,
        F.StateDictType.FULL_STATE_DICT,
        F.FullStateDictConfig(rank0_only=True),
        F.FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=True),
    )
    if not sync:
        resumed.load_state_dict(torch.load(path)["model"])
    saved = torch.load(path)["optim"] if rank == 0 else {}
    opt2.load_state_dict(FSDP.optim_state_dict_to_load(resumed, opt2, saved))
    steps += train(resumed, opt2, data[2:])
    assert_close_steps(steps, ref_steps, f"{engine}/full checkpoint")
    return {"full_optim_keys": sorted(optim_state.get("state", {}))}


def check_full_optim_state(osd: dict, ref_model: nn.Module, ref_opt, label: str) -> None:
    """Keyed by parameter name, unsharded, equal to the unwrapped optimizer's state."""
    names = {id(p): n for n, p in ref_model.named_parameters()}
    assert [g["params"] for g in osd["param_groups"]] == [
        [names[id(p)] for p in g["params"]] for g in ref_opt.param_groups
    ], label
    for p, state in ref_opt.state.items():
        name = names[id(p)]
        got = osd["state"][name]
        assert sorted(got) == sorted(state), (label, sorted(got))
        for key, value in state.items():
            torch.testing.assert_close(
                got[key].float(),
                value.float(),
                **TOL,
                msg=lambda m, k=key, n=name: f"{label}: {n}.{k} {m}",
            )


def check_sharded_checkpoint(rank: int, tmp: str, engine: str, load_into: str) -> dict:
    """torch's recommended FSDP1 checkpoint: SHARDED_STATE_DICT saved with
    torch.distributed.checkpoint, loaded with load_sharded_optimizer_state_dict; saved by
    ``engine``, resumed by ``load_into``: the same as the uninterrupted run."""
    import torch.distributed.checkpoint as dcp

    F, W = namespaces(engine)
    FSDP = F.FullyShardedDataParallel
    data = batches(4, seed=11)
    _, _, ref_steps = reference_run(20, data)
    path = os.path.join(tmp, f"sharded-{engine}-{load_into}")

    model, opt = build_for_checkpoint(F, W, seed=20)
    steps = train(model, opt, data[:2])
    with FSDP.state_dict_type(model, F.StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
        layout = {k: describe(v) for k, v in state["model"].items()}
        dcp.save(state, checkpoint_id=path)

    F, W = namespaces(load_into)
    FSDP = F.FullyShardedDataParallel
    resumed, opt2 = build_for_checkpoint(F, W, seed=98)
    with FSDP.state_dict_type(resumed, F.StateDictType.SHARDED_STATE_DICT):
        checkpoint = {"model": resumed.state_dict()}
        dcp.load(checkpoint, checkpoint_id=path)
        resumed.load_state_dict(checkpoint["model"])
        optim_state = dcp.optimizer.load_sharded_optimizer_state_dict(
            checkpoint["model"], optimizer_key="optim", storage_reader=dcp.FileSystemReader(path)
        )
        opt2.load_state_dict(FSDP.optim_state_dict_to_load(resumed, opt2, optim_state["optim"]))
    steps += train(resumed, opt2, data[2:])
    assert_close_steps(steps, ref_steps, f"sharded checkpoint {engine} -> {load_into}")
    return layout


def describe(value) -> tuple:
    """(type, global shape, this rank's rows) of a sharded state-dict value."""
    if hasattr(value, "to_local"):
        return ("DTensor", tuple(value.shape), tuple(value.to_local().shape))
    if hasattr(value, "local_shards"):
        local = [tuple(s.tensor.shape) for s in value.local_shards()]
        return ("ShardedTensor", tuple(value.shape), local[0] if local else None)
    return ("Tensor", tuple(value.shape), tuple(value.shape))


# ---------------------------------------------------------------------- full parameters
def check_summon_full_params(rank: int) -> None:
    """summon_full_params: full shapes, in-place edits written back (or not), rank0_only,
    with_grads equal to the unwrapped model's gradients; FSDP.apply sees full shapes."""
    import ftsdp.fsdp as F

    FSDP = F.FullyShardedDataParallel
    data = batches(1, seed=5)
    reference = gpt(seed=4)
    model = FSDP(gpt(seed=4), auto_wrap_policy={Block}, device_id=CPU)
    x, y = data[0]
    reference(x, y)[1].backward()
    model(mine(x), mine(y))[1].backward()
    with FSDP.summon_full_params(model, with_grads=True, writeback=False):
        full = dict(model.named_parameters())
        for name, p in reference.named_parameters():
            assert full[name].shape == p.shape, name
            torch.testing.assert_close(full[name].grad, p.grad, **TOL, msg=name)
    with FSDP.summon_full_params(model), torch.no_grad():
        model.module.blocks[1].mlp.c_fc.weight.mul_(2.0)
        model.module.lm_head.weight[3].fill_(0.5)  # tied: the embedding changes too
    with FSDP.summon_full_params(model, writeback=False), torch.no_grad():
        model.module.blocks[0].attn.c_attn.weight.zero_()  # discarded
    with torch.no_grad():
        reference.blocks[1].mlp.c_fc.weight.mul_(2.0)
        reference.lm_head.weight[3].fill_(0.5)
    assert_close_state(model.state_dict(), reference.state_dict(), "summon writeback")
    with FSDP.summon_full_params(model, rank0_only=True, writeback=False):
        shape = model.module.wte.weight.shape
        assert (shape == (CFG.vocab_size, CFG.n_embd)) == (rank == 0), (rank, shape)

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            assert module.weight.dim() == 2, "apply must see full shapes"
            with torch.no_grad():
                module.weight.copy_(torch.eye(*module.weight.shape))

    model.apply(init)
    reference.apply(init)
    assert_close_state(model.state_dict(), reference.state_dict(), "FSDP.apply")


def check_meta_on_other_ranks(rank: int) -> None:
    """accelerate's low-memory loading: rank 0 holds real weights, the other ranks build on
    the meta device; param_init_fn=to_empty and sync_module_states give every rank rank 0's
    weights."""
    import ftsdp.fsdp as F

    if rank == 0:
        model = gpt(seed=6)
    else:
        with torch.device("meta"):
            model = GPT(CFG)
    wrapped = F.FullyShardedDataParallel(
        model,
        auto_wrap_policy={Block},
        device_id=CPU,
        sync_module_states=True,
        param_init_fn=lambda m: m.to_empty(device=CPU, recurse=False),
    )
    assert_close_state(wrapped.state_dict(), gpt(seed=6).state_dict(), "meta on rank 1")


# ---------------------------------------------------------------------- inside a parent module
def in_parent(rank: int, world: int) -> dict:
    """The wrapper inside a parent module (a GAN, an EMA holder), with either engine: the
    parent's state dicts (FULL, rank0_only, SHARDED), a round trip into a fresh parent, and a
    non-strict load with a key missing and one unexpected under the wrapper's prefix. A phase
    of this folder's W=2 spawn, after ``rank_main``."""
    torch.set_num_threads(1)
    out = {}
    for engine in ("torch", "ftsdp"):
        F, W = namespaces(engine)
        FSDP = F.FullyShardedDataParallel
        policy = functools.partial(W.transformer_auto_wrap_policy, transformer_layer_cls={Block})

        def parent(seed: int, F=F, policy=policy) -> nn.ModuleDict:
            net = F.FullyShardedDataParallel(
                gpt(seed), auto_wrap_policy=policy, device_id=CPU, use_orig_params=True
            )
            torch.manual_seed(seed)
            return nn.ModuleDict({"net": net, "head": nn.Linear(3, 2)})

        saved = parent(0)
        state = saved.state_dict()
        got: dict = {"state": dict(state)}
        configs = [F.FullStateDictConfig(rank0_only=True)]
        if engine not in TORCH_CPU_LIMITS:
            configs.append(F.FullStateDictConfig(rank0_only=True, offload_to_cpu=True))
        with FSDP.state_dict_type(saved, F.StateDictType.FULL_STATE_DICT, configs[0]):
            got["rank0_only"] = list(saved.state_dict())
        for config in configs[1:]:
            with FSDP.state_dict_type(saved, F.StateDictType.FULL_STATE_DICT, config):
                offloaded = saved.state_dict()
            assert list(offloaded) == got["rank0_only"], (engine, list(offloaded))
        with FSDP.state_dict_type(saved, F.StateDictType.SHARDED_STATE_DICT):
            sharded = saved.state_dict()
        got["sharded"] = {k: describe(v)[1:] for k, v in sharded.items()}
        fresh = parent(1)
        with FSDP.state_dict_type(fresh, F.StateDictType.SHARDED_STATE_DICT):
            result = fresh.load_state_dict(sharded)
        assert (result.missing_keys, result.unexpected_keys) == ([], []), (engine, result)
        assert_close_state(fresh.state_dict(), state, f"{engine}: SHARDED round trip")
        fresh = parent(2)
        result = fresh.load_state_dict(state)
        assert (result.missing_keys, result.unexpected_keys) == ([], []), (engine, result)
        assert_close_state(fresh.state_dict(), state, f"{engine}: FULL round trip")
        partial = {k: v for k, v in state.items() if k != "net.ln_f.weight"}
        partial["net.extra"] = torch.zeros(2)
        fresh = parent(3)
        result = fresh.load_state_dict(partial, strict=False)
        got["non_strict"] = (list(result.missing_keys), list(result.unexpected_keys))
        got["non_strict_state"] = fresh.state_dict()
        with pytest.raises(RuntimeError, match="Missing key"):
            fresh.load_state_dict(partial)
        out[engine] = got
    return out


# ---------------------------------------------------------------------- the grid
def grid(rank: int, world: int, tmp: str) -> dict:
    torch.set_num_threads(1)
    out = {"scripts": check_scripts(rank, ["ftsdp", "torch"])}
    out["full/ftsdp"] = check_full_checkpoint(rank, tmp, "ftsdp")
    out["full/torch"] = check_full_checkpoint(rank, tmp, "torch")
    out["layout/ftsdp"] = check_sharded_checkpoint(rank, tmp, "ftsdp", "ftsdp")
    out["layout/torch"] = check_sharded_checkpoint(rank, tmp, "torch", "ftsdp")
    check_sharded_checkpoint(rank, tmp, "ftsdp", "torch")  # and back: torch FSDP1 resumes ours
    check_summon_full_params(rank)
    check_meta_on_other_ranks(rank)
    return out


def rank_main(rank: int, world: int) -> dict:
    """``grid`` in a folder the ranks share, as a phase of this folder's W=2 spawn
    (conftest.py): rank 0 makes it, the others learn its name."""
    import tempfile

    name = [tempfile.mkdtemp(prefix="ftsdp-fsdp1-") if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    try:
        return grid(rank, world, name[0])
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(name[0], ignore_errors=True)


def test_fsdp1_scripts_run_unchanged_on_ftsdp(spawns) -> None:
    results = spawns.result(2, "test_engine_fsdp1_compat.rank_main")
    for rank, out in enumerate(results):
        assert len(out["scripts"]) == 7, out["scripts"]
        # the same state-dict format as torch FSDP1: FULL optimizer state keyed by the same
        # names, SHARDED parameters split into the same rows (DTensor here, ShardedTensor there)
        assert out["full/ftsdp"] == out["full/torch"]
        ours, theirs = out["layout/ftsdp"], out["layout/torch"]
        assert list(ours) == list(theirs)
        for key, (kind, shape, rows) in ours.items():
            assert (shape, rows) == theirs[key][1:], (rank, key, ours[key], theirs[key])
            assert kind == ("DTensor" if theirs[key][0] == "ShardedTensor" else "Tensor"), key


def test_wrapper_inside_a_parent_module(spawns) -> None:
    """parent = ModuleDict({"net": FSDP(model), ...}): parent.state_dict() and
    parent.load_state_dict() give and take what torch FSDP1's do (keys under "net.")."""
    for rank, out in enumerate(spawns.result(2, "test_engine_fsdp1_compat.in_parent")):
        ours, theirs = out["ftsdp"], out["torch"]
        assert_close_state(ours["state"], theirs["state"], f"rank {rank}: parent.state_dict()")
        # rank0_only: the other ranks keep the parent's own entries
        head = ["head.weight", "head.bias"]
        assert ours["rank0_only"] == theirs["rank0_only"], rank
        assert ours["rank0_only"] == (list(theirs["state"]) if rank == 0 else head), rank
        assert list(ours["sharded"]) == list(theirs["sharded"]), rank
        for key, (shape, rows) in ours["sharded"].items():
            assert (shape, rows) == theirs["sharded"][key], (rank, key)
        want = (["net.ln_f.weight"], ["net.extra"])  # (missing, unexpected), as torch's
        assert ours["non_strict"] == theirs["non_strict"] == want, (
            rank,
            ours["non_strict"],
            theirs["non_strict"],
        )
        assert_close_state(
            ours["non_strict_state"], theirs["non_strict_state"], f"rank {rank}: strict=False"
        )
