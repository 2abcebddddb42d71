"""The CUDA paths on one GPU: the stream schedule, CPU offload's pinned host shards and real
host <-> device copies, bf16 on the device. Skipped where there is no GPU: on a machine with
one, ``bash tools/gpu_check.sh`` runs these and the 1-GPU benchmark row.

Each test compares with the unwrapped model trained on the same GPU.
"""

from __future__ import annotations

import pytest
import torch

import ftsdp
from ftsdp.examples.gpt import GPT, Block, GPTConfig, param_groups
from ftsdp.fsdp import _streams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=12, n_head=4, n_embd=128)
OFFLOAD = ftsdp.CPUOffload(offload_params=True)


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def train(model, steps: int = 5, shape: tuple[int, int] = (4, 17)) -> list[float]:
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        t = torch.randint(0, 64, shape, generator=g).to(device())
        loss = model(t[:, :-1], t[:, 1:])[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_offload_uses_streams_pinned_shards_and_trains_like_the_unwrapped_model():
    reference = gpt().to(device())
    model = ftsdp.FSDP(gpt(), auto_wrap_policy={Block}, device_id=device(), cpu_offload=OFFLOAD)
    units = model._units
    assert all(isinstance(u.schedule, _streams.StreamSchedule) for u in units)
    assert units[1].schedule.gather_stream != torch.cuda.current_stream()
    assert all(u.shard.device.type == "cpu" and u.shard.is_pinned() for u in units)
    losses, ref_losses = train(model), train(reference)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-4, atol=1e-4)
    full = model.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(full[key].to(value.device), value, rtol=1e-4, atol=1e-4)
    t = torch.randint(0, 64, (2, 17)).to(device())
    model(t[:, :-1], t[:, 1:])[1].backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.device.type == "cpu" for g in grads)  # sharded grads on the host
    copies = model.comm_stats.copies
    assert copies["h2d"] > 0 and copies["d2h"] > 0, dict(copies)


def test_offload_keeps_device_memory_to_a_few_units():
    """A 1 x 1 token batch makes activations negligible: what the GPU holds during a step is
    the engine's full buffers and flat gradients (the shards and AdamW live on the host)."""
    model = ftsdp.FSDP(gpt(), auto_wrap_policy={Block}, device_id=device(), cpu_offload=OFFLOAD)
    train(model, steps=1, shape=(1, 2))  # warm the caching allocator
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    train(model, steps=1, shape=(1, 2))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    units = model._units
    whole = sum(u.full_bytes for u in units)  # 13 units: the root and 12 blocks
    largest = max(u.full_bytes for u in units)
    # Two gathered (prefetch), two flat gradients (one reducing), the flatten's pieces, and
    # the host-to-device copy of a shard being gathered: six units, plus the root and the
    # allocator's rounding.
    assert peak <= 7 * largest, (peak, largest)
    assert peak < 0.6 * whole, (peak, whole)


def test_bf16_on_the_device_follows_fp32():
    reference = gpt().to(device())
    mp = ftsdp.MixedPrecision(param_dtype=torch.bfloat16)
    model = ftsdp.FSDP(gpt(), auto_wrap_policy={Block}, device_id=device(), mixed_precision=mp)
    assert model._units[1]._full.dtype == torch.bfloat16
    losses, ref_losses = train(model, steps=6), train(reference, steps=6)
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=0.03)
