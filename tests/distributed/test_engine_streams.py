"""The CUDA stream schedule's orchestration, on gloo ranks with a recording stand-in for
``torch.cuda``'s stream API (no GPU here; see [Note: streams] in ``ftsdp/_streams.py``).

On two ranks, for the default settings, bf16 mixed precision, CPU offload and ``no_sync``:

- training under the stream schedule is bitwise identical to the host schedule;
- every all-gather runs on the gather stream and every reduce-scatter on the reduce stream,
  each right after that stream waited for the compute stream;
- the compute stream waits for a unit's latest gather event before any of the unit's modules
  runs, forward or backward (module pre-hooks log each use), and for every reduction's event
  before ``backward()`` returns; with CPU offload the CPU synchronizes once per backward;
- the rate limiter never lets a gather start with two frees outstanding,
  and it does block (synchronize) in a 4-unit model with prefetching.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any

import pytest
import torch

import ftsdp
from ftsdp.examples.gpt import GPT, Block, GPTConfig, param_groups
from ftsdp.fsdp import _fully_sharded, _streams, _unit

WORLD = 2
CONFIG = GPTConfig(vocab_size=37, block_size=8, n_layer=3, n_head=2, n_embd=16)


class _Event:
    def __init__(self, api: FakeCuda, stream: str) -> None:
        api.events += 1
        self.id, self.stream, self.api = api.events, stream, api

    def synchronize(self) -> None:
        self.api.log.append(("sync", self.id))


class _Stream:
    def __init__(self, api: FakeCuda, name: str) -> None:
        self.api, self.name = api, name

    def wait_stream(self, other: _Stream) -> None:
        self.api.log.append(("wait_stream", self.name, other.name))

    def record_event(self) -> _Event:
        event = _Event(self.api, self.name)
        self.api.log.append(("record", self.name, event.id))
        return event

    def wait_event(self, event: _Event) -> None:
        self.api.log.append(("wait_event", self.name, event.id))

    def synchronize(self) -> None:
        self.api.log.append(("sync_stream", self.name))


class FakeCuda:
    """The parts of ``torch.cuda`` the stream schedule calls, recording every call in order."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.events = 0
        self.compute = _Stream(self, "compute")
        self._current = self.compute
        self._made = iter(["gather", "reduce"])

    def Stream(self, device: Any = None, priority: int = 0) -> _Stream:
        return _Stream(self, next(self._made))

    def current_stream(self, device: Any = None) -> _Stream:
        return self._current

    @contextmanager
    def stream(self, stream: _Stream):
        previous, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = previous


def _install(api: FakeCuda | None) -> None:
    """Make every new FSDP use the stream schedule over ``api`` (None: the host schedule),
    and log each collective with the stream current when it is issued."""
    if api is None:
        _fully_sharded.schedule_for = _streams.schedule_for
        for name in ("all_gather_flat", "reduce_scatter_flat"):
            setattr(_unit, name, getattr(_unit, f"_orig_{name}", getattr(_unit, name)))
        return

    def schedule_for(device, *, limit_all_gathers=True):
        return _streams.StreamSchedule(device, api=api, limit_all_gathers=limit_all_gathers)

    _fully_sharded.schedule_for = schedule_for
    for name, kind in (("all_gather_flat", "all_gather"), ("reduce_scatter_flat", "reduce")):
        original = getattr(_unit, f"_orig_{name}", None) or getattr(_unit, name)
        setattr(_unit, f"_orig_{name}", original)

        def logged(*args, _original=original, _kind=kind, **kwargs):
            api.log.append((_kind, kwargs.get("tag", ""), api.current_stream().name))
            return _original(*args, **kwargs)

        setattr(_unit, name, logged)


def _watch_uses(model: ftsdp.FSDP, api: FakeCuda) -> None:
    """Log ("use", unit) as each module holding a unit's parameters starts its forward or
    its backward."""
    for unit in model._units:
        for info in unit.infos:
            for module, _name in info.refs:
                module.register_forward_pre_hook(
                    lambda m, a, fqn=unit.fqn: api.log.append(("use", fqn))
                )
                module.register_full_backward_pre_hook(
                    lambda m, g, fqn=unit.fqn: api.log.append(("use", fqn))
                )


def check_log(log: list[tuple], limit: int) -> dict[str, int]:
    """Assert the orderings of [Note: streams] over one run's log; counts for the caller."""
    fresh = {"gather": False, "reduce": False}  # the side stream waited for compute since
    last_collective = {"gather": "", "reduce": ""}
    gather_event: dict[str, int] = {}  # unit -> event after its latest all-gather
    reduce_events: set[int] = set()
    waited: set[int] = set()
    outstanding_frees: list[int] = []
    counts = {"all_gather": 0, "reduce": 0, "sync": 0, "use": 0, "sync_stream": 0}
    for entry in log:
        kind = entry[0]
        if kind == "wait_stream":
            assert entry[2] == "compute", entry
            fresh[entry[1]] = True
        elif kind in ("all_gather", "reduce"):
            stream = "gather" if kind == "all_gather" else "reduce"
            assert entry[2] == stream, f"{kind} of {entry[1]!r} issued on {entry[2]}"
            assert fresh[stream], f"{kind} of {entry[1]!r} without waiting for compute"
            if kind == "reduce":
                assert gather_event.get(entry[1], 0) in waited, f"{entry[1]!r} reduced unwaited"
            fresh[stream] = False
            last_collective[stream] = entry[1]
            counts[kind] += 1
        elif kind == "record":
            if entry[1] == "gather":
                gather_event[last_collective["gather"]] = entry[2]
                assert len(outstanding_frees) < limit, "gather started past the rate limit"
            elif entry[1] == "reduce":
                reduce_events.add(entry[2])
            else:
                outstanding_frees.append(entry[2])
        elif kind == "sync":
            assert entry[1] == outstanding_frees.pop(0), "the limiter waits for the oldest free"
            counts["sync"] += 1
        elif kind == "wait_event":
            assert entry[1] == "compute", entry
            waited.add(entry[2])
        elif kind == "use":
            if entry[1] in gather_event:  # units that alias their shard never gather
                assert gather_event[entry[1]] in waited, f"{entry[1]!r} used before its gather"
            counts["use"] += 1
        elif kind == "sync_stream":
            assert entry[1] == "compute", entry
            counts["sync_stream"] += 1
        elif kind == "backward_done":
            assert reduce_events <= waited, "backward returned before a reduction was waited"
    return counts


def run(rank: int, kwargs: dict, api: FakeCuda | None, micro: int = 1) -> tuple:
    _install(api)
    torch.manual_seed(0)
    model = ftsdp.FSDP(GPT(CONFIG), auto_wrap_policy={Block}, **kwargs)
    if api is not None:
        _watch_uses(model, api)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        for m in range(micro):
            tokens = torch.randint(0, 37, (2, 9), generator=g)
            ctx = model.no_sync() if m < micro - 1 else nullcontext()
            with ctx:
                loss = model(tokens[:, :-1], tokens[:, 1:])[1]
                loss.backward()
            losses.append(loss.item())
        if api is not None:
            api.log.append(("backward_done",))
        opt.step()
        opt.zero_grad()
    _install(None)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


CASES = {
    "default": ({}, 1),
    "bf16": ({"mixed_precision": ftsdp.MixedPrecision(param_dtype=torch.bfloat16)}, 1),
    "offload": ({"cpu_offload": ftsdp.CPUOffload(offload_params=True)}, 1),
    "no_sync": ({}, 2),
    "no_limit": ({"limit_all_gathers": False}, 1),
}


def rank_main(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for name, (kwargs, micro) in CASES.items():
        host_losses, host_state = run(rank, kwargs, None, micro)
        api = FakeCuda()
        stream_losses, stream_state = run(rank, kwargs, api, micro)
        assert stream_losses == host_losses, (name, stream_losses, host_losses)
        for key, value in host_state.items():
            assert torch.equal(stream_state[key], value), (name, key)
        limit = 2 if kwargs.get("limit_all_gathers", True) else 10**9
        out[name] = check_log(api.log, limit)
    return out


@pytest.fixture(scope="module")
def results(spawns) -> list[dict[str, Any]]:
    return spawns.result(WORLD, "test_engine_streams.rank_main")  # rank_main at W=2


@pytest.mark.timeout(600)  # the first test runs the shared spawn (conftest.py)
@pytest.mark.parametrize("case", list(CASES))
def test_stream_schedule_trains_like_the_host_schedule_and_orders_its_streams(results, case):
    for rank, by_case in enumerate(results):
        counts = by_case[case]
        # 4 units (root + 3 blocks); 3 steps: every unit is gathered and reduced every step
        assert counts["all_gather"] >= 3 * 4, (rank, counts)
        assert counts["reduce"] == 3 * 4, (rank, counts)
        assert counts["use"] > 0, (rank, counts)
        # offload: one CPU synchronisation per backward, before its gradients are read
        assert counts["sync_stream"] == (3 if case == "offload" else 0), (rank, counts)
        if case == "no_limit":
            assert counts["sync"] == 0, (rank, counts)
        else:
            assert counts["sync"] > 0, (rank, counts)  # the limiter really blocked


def test_schedule_for_picks_streams_only_for_cuda():
    assert isinstance(_streams.schedule_for(torch.device("cpu")), _streams.HostSchedule)
