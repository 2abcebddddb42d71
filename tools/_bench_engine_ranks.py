"""Per-rank work of ``tools/bench_engine.py``: build each engine, time it, count its bytes.

Every rank builds the same GPT from the same seed once per engine (ftsdp, torch FSDP2, torch
DDP and any ftsdp variants), feeds every engine the same batches (seeded by step and rank) and
returns plain data: per-step times, losses, bytes communicated in one step by collective kind,
and the bytes of model state it holds (see [Note: what the memory columns measure]).

[Note: how bytes communicated are counted]
All three are counted at the API with the same ring cost per rank: an all-gather or
reduce-scatter moves (W-1) * shard bytes, an all-reduce of n bytes 2 * (W-1)/W * n. ftsdp counts
its own (``model.comm_stats``). FSDP2 is counted by wrapping ``torch.distributed
.all_gather_single`` / ``reduce_scatter_single`` / ``all_reduce`` (the names it calls at run time)
for one step. DDP is counted by a comm hook that all-reduces each bucket, as the default does.

[Note: what the memory columns measure]
On CPU there is no ``max_memory_allocated``, so peaks come from the profiler's allocator events
(``profile_memory=True``): the running sum of every allocation and free on the rank's thread, in
time order, above the bytes held when the step starts. "model state at rest" is computed from the
tensors themselves (unique storages of parameters, gradients and optimizer state). "peak model
state" is at rest + the peak of a step run with a 1 x 1 token batch, so activations are a few KB
and what remains is parameters, gradients, optimizer state and communication buffers; it is
measured over forward + backward (the optimizer's own temporaries are reported apart).
Allocations made by gloo's worker threads are not seen.
"""

from __future__ import annotations

import cProfile
import inspect
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from ftsdp.examples.gpt import GPT

ENGINES = ("ftsdp", "fsdp2", "ddp")


# -- engines ----------------------------------------------------------------------------------------


class Engine:
    """One model + optimizer, a step, and its way of counting bytes communicated."""

    def __init__(self, name: str, model: torch.nn.Module, kind: str, lr: float) -> None:
        from ftsdp.examples.gpt import param_groups

        # Any: ftsdp's FSDP, DDP or an FSDP2 module; each kind's own methods are called on it
        self.name, self.kind = name, kind
        self.model: Any = model
        self.call: Any = model  # what a step calls: the model, or torch.compile of it
        self.opt = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=lr)
        self.times: list[float] = []
        self.losses: list[float] = []
        self.ddp_bytes = 0
        self.ddp_calls = 0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.fwd_bwd(x, y)
        self.opt.step()
        return self._loss

    def fwd_bwd(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        _, loss = self.call(x, y)
        loss.backward()
        self._loss = loss.detach()


def _gpt(cfg: dict[str, Any], device: torch.device) -> GPT:
    from ftsdp.examples.gpt import GPT, GPTConfig

    torch.manual_seed(cfg["seed"])
    return GPT(GPTConfig(**cfg["model"])).to(device)


def build_ftsdp(name: str, cfg: dict, device: torch.device, extra: dict) -> Engine:
    import ftsdp
    from ftsdp.examples.gpt import Block

    kwargs = {"auto_wrap_policy": {Block}, "sharding_strategy": "FULL_SHARD", **extra}
    if device.type == "cuda":
        kwargs["device_id"] = device
    return Engine(name, ftsdp.FSDP(_gpt(cfg, device), **kwargs), "ftsdp", cfg["lr"])


def build_fsdp2(name: str, cfg: dict, device: torch.device) -> Engine:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _gpt(cfg, device)
    # the ranks' own device: FSDP2's default mesh is on CUDA wherever a GPU is, CPU ranks too
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return Engine(name, model, "fsdp2", cfg["lr"])


def build_ddp(name: str, cfg: dict, device: torch.device) -> Engine:
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    model = DistributedDataParallel(_gpt(cfg, device), device_ids=ids)
    engine = Engine(name, model, "ddp", cfg["lr"])
    world = dist.get_world_size()

    # unannotated: DDP compares the annotations with its own types, and these are strings
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        # What DDP's default all-reduce does, plus counting (see [Note: how bytes ...]).
        buf = bucket.buffer()
        engine.ddp_calls += 1
        engine.ddp_bytes += 2 * (world - 1) * buf.numel() * buf.element_size() // world
        buf.div_(world)
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])

    model.register_comm_hook(None, hook)
    return engine


def variant_kwargs(variant: str, world: int) -> dict[str, Any]:
    """ftsdp.FSDP keyword arguments of a variant; raises if this ftsdp cannot express it."""
    import ftsdp

    params = inspect.signature(ftsdp.FSDP).parameters

    def need(name: str, value: Any) -> dict[str, Any]:
        if name not in params:
            raise ValueError(f"ftsdp.FSDP has no {name}= argument (yet)")
        return {name: value}

    if variant == "no_shard":
        return {"sharding_strategy": "NO_SHARD"}
    if variant == "grad_op":
        return {"sharding_strategy": "SHARD_GRAD_OP"}
    if variant in ("prefetch", "no_prefetch"):
        return need("backward_prefetch", variant == "prefetch")
    if variant == "forward_prefetch":
        return need("forward_prefetch", True)
    if variant in ("limit", "no_limit"):
        return need("limit_all_gathers", variant == "limit")
    if variant == "mp":
        bf16 = torch.bfloat16
        return need("mixed_precision", ftsdp.MixedPrecision(param_dtype=bf16, reduce_dtype=bf16))
    if variant == "offload":
        return need("cpu_offload", ftsdp.CPUOffload(offload_params=True))
    if variant == "hybrid":
        if world % 2 or world < 4:
            raise ValueError(f"hybrid needs an even world size >= 4 (W/2 x 2), got {world}")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // 2, 2))  # (replicate, shard)
        return {"sharding_strategy": "HYBRID_SHARD", **need("device_mesh", mesh)}
    raise ValueError(f"unknown variant {variant!r}")


def ftsdp_defaults() -> dict[str, Any]:
    """The performance switches ftsdp.FSDP uses when not given (the plain "ftsdp" engine)."""
    import ftsdp

    names = ("backward_prefetch", "forward_prefetch", "limit_all_gathers")
    params = inspect.signature(ftsdp.FSDP).parameters
    return {n: params[n].default for n in names if n in params}


def build_all(cfg: dict, device: torch.device) -> tuple[list[Engine], dict[str, str]]:
    """Every requested engine; variants this ftsdp cannot build are skipped with the reason."""
    world = dist.get_world_size()
    engines: list[Engine] = []
    skipped: dict[str, str] = {}
    for name in cfg["engines"]:
        if name == "ftsdp":
            engines.append(build_ftsdp(name, cfg, device, {}))
        elif name == "fsdp2":
            try:
                engines.append(build_fsdp2(name, cfg, device))
            except Exception as e:  # reported, e.g. a torch that refuses CPU / gloo
                skipped[name] = f"{type(e).__name__}: {e}"
        elif name == "ddp":
            engines.append(build_ddp(name, cfg, device))
    for engine in list(engines) if cfg.get("compile") else []:
        if engine.kind in ("ftsdp", "fsdp2"):  # the same model again, compiled whole
            build = build_fsdp2 if engine.kind == "fsdp2" else partial(build_ftsdp, extra={})
            compiled = build(f"{engine.name}-compiled", cfg, device)
            compiled.call = torch.compile(
                compiled.model, backend=cfg.get("compile_backend", "inductor")
            )
            engines.append(compiled)
    for variant in cfg["variants"]:
        name = f"ftsdp+{variant}"
        try:
            engines.append(build_ftsdp(name, cfg, device, variant_kwargs(variant, world)))
            ok = 1
        except Exception as e:
            skipped[name] = f"{type(e).__name__}: {e}".splitlines()[0]
            ok = 0
        flag = torch.tensor([ok], dtype=torch.int32, device=_comm_device(device))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank keeps the same engines
        if ok and not flag.item():
            engines.pop()
            skipped[name] = "failed on another rank"
    return engines, skipped


# -- data, timing ----------------------------------------------------------------------------------


def batch(
    cfg: dict, step: int, rank: int, device: torch.device, tiny: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids, the same for every engine: (B, T) inputs and next-token targets."""
    g = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + rank * 1009 + step)
    b, t = (1, 1) if tiny else (cfg["batch"], cfg["seq"])
    tokens = torch.randint(cfg["model"]["vocab_size"], (b, t + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(engine: Engine, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> None:
    dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    loss = engine.step(x, y)
    _sync(device)
    engine.times.append(time.perf_counter() - t0)
    engine.losses.append(float(loss))


# -- bytes communicated -----------------------------------------------------------------------------


class _TorchCollectiveCounter:
    """Wrap ``torch.distributed``'s flat collectives for the duration of a ``with`` block."""

    NAMES: ClassVar[dict[str, str]] = {
        "all_gather_single": "all_gather",
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_single": "reduce_scatter",
        "reduce_scatter_tensor": "reduce_scatter",
        "all_reduce": "all_reduce",
    }

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self._saved: dict[str, Callable] = {}

    def __enter__(self) -> _TorchCollectiveCounter:
        for name, kind in self.NAMES.items():
            orig = getattr(dist, name, None)
            if orig is not None:
                self._saved[name] = orig
                setattr(dist, name, self._wrap(orig, kind))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, orig in self._saved.items():
            setattr(dist, name, orig)

    def _wrap(self, orig: Callable, kind: str) -> Callable:
        sig = inspect.signature(orig)

        def counted(*args: Any, **kwargs: Any) -> Any:
            a = sig.bind(*args, **kwargs).arguments
            w = dist.get_world_size(a.get("group"))
            if kind == "all_gather":
                n = (w - 1) * _nbytes(a["input_tensor"])
            elif kind == "reduce_scatter":
                n = (w - 1) * _nbytes(a["output"])
            else:
                n = 2 * (w - 1) * _nbytes(a["tensor"]) // w
            self.bytes[kind] = self.bytes.get(kind, 0) + n
            self.calls[kind] = self.calls.get(kind, 0) + 1
            return orig(*args, **kwargs)

        return counted


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def comm_step(engine: Engine, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """One step with bytes counted: ``{"bytes": {kind: n}, "calls": {kind: n}}``."""
    if engine.kind == "ftsdp":
        engine.model.comm_stats.reset()
        with _TorchCollectiveCounter() as counter:  # sees only what ftsdp calls through `dist.`
            engine.step(x, y)
        stats = engine.model.comm_stats
        outside = {
            k: (counter.calls[k] - stats.calls.get(k, 0), counter.bytes[k] - stats.bytes.get(k, 0))
            for k in counter.calls
            if counter.calls[k] > stats.calls.get(k, 0)
        }
        return {"bytes": dict(stats.bytes), "calls": dict(stats.calls), "outside": outside}
    if engine.kind == "ddp":
        engine.ddp_bytes = engine.ddp_calls = 0
        engine.step(x, y)
        return {
            "bytes": {"all_reduce": engine.ddp_bytes},
            "calls": {"all_reduce": engine.ddp_calls},
        }
    with _TorchCollectiveCounter() as counter:
        engine.step(x, y)
    return {"bytes": counter.bytes, "calls": counter.calls}


# -- memory -----------------------------------------------------------------------------------------


def _storage_bytes(tensors: Sequence[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # DTensor (FSDP2): this rank's local tensor
            t = t.to_local()
        s = t.untyped_storage()
        if s.nbytes():
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def state_bytes(engine: Engine) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds now."""
    params = list(engine.model.parameters())
    out = {
        "params": _storage_bytes(params),
        "grads": _storage_bytes([p.grad for p in params]),
        "optim": _storage_bytes(
            [v for s in engine.opt.state.values() for v in s.values() if torch.is_tensor(v)]
        ),
    }
    return out


def engine_accounting(engine: Engine) -> dict[str, int]:
    """ftsdp's own ``memory_stats`` (with the optimizer), for comparison."""
    return dict(engine.model.memory_stats(engine.opt))


def _peak_delta(fn: Callable[[], Any], device: torch.device) -> tuple[int, int, list]:
    """(peak, final) bytes allocated above the start while ``fn`` runs, and what was live at
    the peak (see ``_live_at_peak``; CPU only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        return peak - start, torch.cuda.memory_allocated(device) - start, []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    running = peak = 0
    for _, n in events:
        running += n
        peak = max(peak, running)
    return peak, running, _live_at_peak(prof)


def _label(chain: tuple[str, ...]) -> tuple[str, ...]:
    """The innermost three ops of an allocation's call chain, plus the innermost engine label
    (``ftsdp::...`` / ``FSDP::...``) when it sits further out: it says which unit and which
    phase the memory belongs to."""
    label = chain[-3:]
    engine = next((n for n in reversed(chain) if n.startswith(("ftsdp::", "FSDP::"))), None)
    if engine is not None and engine not in label:
        label = (engine, *label)
    return label


def _live_at_peak(prof: Any, top: int = 16) -> list[tuple[int, int, str]]:
    """Allocations live at the peak, grouped by the ops that made them: ``[(bytes, count,
    "op < caller < caller's caller")]``, largest first. Reads the profiler's event tree (a
    private API): on any change there it returns ``[]`` and the tables go without it."""
    try:
        from torch._C._profiler import _EventType

        allocs = []
        stack: list[tuple[Any, tuple[str, ...]]] = [
            (node, ()) for node in prof.profiler.kineto_results.experimental_event_tree()
        ]
        while stack:
            node, chain = stack.pop()
            if node.tag == _EventType.Allocation:
                f = node.extra_fields
                allocs.append((node.start_time_ns, f.ptr, f.alloc_size, _label(chain)))
                continue
            stack.extend((c, (*chain, node.name)) for c in node.children)
        allocs.sort(key=lambda a: a[0])
        live: dict[int, tuple[int, tuple]] = {}
        running = peak = 0
        at_peak: dict[int, tuple[int, tuple]] = {}
        for _, ptr, size, chain in allocs:
            running += size
            if size > 0:
                live[ptr] = (size, chain)
            else:
                live.pop(ptr, None)
            if running > peak:
                peak, at_peak = running, dict(live)
        groups: dict[str, list[int]] = {}
        for size, chain in at_peak.values():
            g = groups.setdefault(" < ".join(reversed(chain)) or "(outside any op)", [0, 0])
            g[0] += size
            g[1] += 1
        rows = sorted(((b, n, k) for k, (b, n) in groups.items()), reverse=True)
        return rows[:top]
    except Exception:
        return []


def memory(engine: Engine, cfg: dict, rank: int, device: torch.device) -> dict[str, Any]:
    """Model state at rest and the peaks described in [Note: what the memory columns measure]."""
    out: dict[str, Any] = {}
    # 1 x 1 token batch: parameters, gradients, optimizer state, communication buffers.
    x, y = batch(cfg, 10_000, rank, device, tiny=True)
    engine.opt.zero_grad(set_to_none=True)
    start = sum(state_bytes(engine).values())
    peak_fb, held, live = _peak_delta(lambda: engine.fwd_bwd(x, y), device)
    peak_opt, _, _ = _peak_delta(engine.opt.step, device)
    out.update({f"rest_{k}": v for k, v in state_bytes(engine).items()})
    if engine.kind == "ftsdp":
        out["accounting"] = engine_accounting(engine)
    out["start_bytes"] = start
    out["peak_state_fwd_bwd"] = start + peak_fb
    out["live_at_peak"] = live
    out["peak_state_opt_step"] = start + held + peak_opt
    # The real batch: everything, activations included.
    x, y = batch(cfg, 10_001, rank, device)
    engine.opt.zero_grad(set_to_none=True)
    start = sum(state_bytes(engine).values())
    out["peak_step_alloc"] = start + _peak_delta(lambda: engine.step(x, y), device)[0]
    return out


# -- one rank ---------------------------------------------------------------------------------------


def rank_main(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    device = torch.device("cuda", rank) if cfg["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    engines, skipped = build_all(cfg, device)
    t_build = time.perf_counter()
    step = 0
    for _ in range(cfg["warmup"]):
        for e in engines:
            e.step(*batch(cfg, step, rank, device))
        step += 1
    comm = {e.name: comm_step(e, *batch(cfg, step, rank, device)) for e in engines}
    step += 1
    # Interleaved (default): every round runs one step of each engine, the order rotating, so
    # load from other processes falls on all engines alike. Blocked: all steps of one engine.
    for r in range(cfg["steps"]) if cfg["schedule"] == "interleaved" else []:
        k = r % len(engines)
        for e in engines[k:] + engines[:k]:
            timed_step(e, *batch(cfg, step + r, rank, device), device)
    for e in engines if cfg["schedule"] == "blocked" else []:
        for r in range(cfg["steps"]):
            timed_step(e, *batch(cfg, step + r, rank, device), device)
    step += cfg["steps"]
    mem = {e.name: memory(e, cfg, rank, device) for e in engines}
    profiles = {}
    if cfg["profile_dir"]:
        for e in engines:
            if e.kind == "ddp":
                continue
            prof = cProfile.Profile()
            prof.enable()
            for i in range(cfg["profile_steps"]):
                e.step(*batch(cfg, step + i, rank, device))
            prof.disable()
            path = os.path.join(cfg["profile_dir"], f"w{world}_rank{rank}_{e.name}.prof")
            prof.dump_stats(path)
            profiles[e.name] = path
    out: dict[str, Any] = {
        "skipped": skipped,
        "engines": [e.name for e in engines],
        "times": {e.name: e.times for e in engines},
        "losses": {e.name: e.losses for e in engines},
        "comm": comm,
        "memory": mem,
        "profiles": profiles,
        "seconds": time.perf_counter() - t_build,
        "loadavg": os.getloadavg(),
        "torch": torch.__version__,
        "ftsdp_defaults": ftsdp_defaults(),
        "max_in_flight": {
            e.name: e.model.comm_stats.max_in_flight for e in engines if e.kind == "ftsdp"
        },
        "cuda_available": torch.cuda.is_available(),
    }
    for e in engines:
        if e.kind == "ftsdp":
            out.setdefault("units", {})[e.name] = e.model.units()
    from ftsdp.examples.gpt import GPT, GPTConfig

    with torch.device("meta"):
        out["psi"] = GPT(GPTConfig(**cfg["model"])).num_parameters()
    return out


def _comm_device(device: torch.device) -> torch.device:
    return device if device.type == "cuda" else torch.device("cpu")
