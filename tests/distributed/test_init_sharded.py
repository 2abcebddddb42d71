"""``--init-from`` after sharding (``ftsdp.trainer._models.init_sharded``): each rank reads only
the flat ranges of its own FlatParameter shards, from a Hugging Face safetensors file, an ftsdp
checkpoint, a DCP checkpoint and a ``torch.save`` file.

One spawn of W=2 ranks. Per format, each rank builds the model (68 MiB of fp32, tied embedding
and head, a persistent and a non-persistent buffer), wraps it in ``ftsdp.FSDP`` (one unit per
layer, so shards cut parameters in the middle) and initialises it sharded; then builds it again
and initialises the unwrapped model whole (``init_weights``, the reference, itself checked
against the saved tensors). Each shard must equal the same range of the whole init, bitwise.

Peak host memory: each rank resets its RSS high-water mark (``/proc/self/clear_refs``) right
before an init and reads ``VmHWM`` minus the RSS at that moment after it. The ranks fix glibc's
mmap threshold first (``ftsdp.testing.fix_mmap_threshold``), so large blocks go back to the
system when freed and are not reused unseen. The sharded init must stay at most 1.3 x (model bytes / W +
largest tensor bytes); the whole init must exceed that bound (it stages the whole model), which
shows the measurement can fail.

Then, in the same ranks, the main job (``ftsdp.train.main``, as under torchrun) with
``--init-from`` a GPT's safetensors file: its first loss must be that GPT's on the same samples.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch
from torch import nn

from ftsdp.examples.data import TokenDataset
from ftsdp.examples.gpt import GPT, GPTConfig
from ftsdp.testing import fix_mmap_threshold, reset_peak_rss, status_bytes

WORLD = 2
WIDTH, LAYERS = 1024, 8  # 2 x 8 Linear(1024, 1024) + a tied 1024 x 1024 embedding: 68 MiB
SOURCE_SEED, INIT_SEED = 11, 12
FORMATS = ("hf", "ftsdp", "dcp", "torch")

JOB_FLAGS = ["--vocab-size", "128", "--n-layer", "2", "--n-head", "2", "--n-embd", "32"]
JOB_FLAGS += ["--block-size", "8", "--global-batch", "4", "--micro-batch", "2", "--steps", "1"]
JOB_FLAGS += ["--device", "cpu", "--heartbeat-timeout-s", "0", "--seed", "3"]

pytestmark = pytest.mark.timeout(600)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, WIDTH)
        self.down = nn.Linear(WIDTH, WIDTH)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(WIDTH, WIDTH)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, WIDTH, bias=False)
        self.head.weight = self.emb.weight  # tied: saved once
        self.register_buffer("scale", torch.randn(WIDTH))
        self.register_buffer("cache", torch.randn(WIDTH), persistent=False)


def _net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def _model_bytes(net: nn.Module) -> tuple[int, int]:
    """(bytes of every distinct parameter and persistent buffer, bytes of the largest)."""
    sizes = {id(t): t.numel() * t.element_size() for t in net.state_dict(keep_vars=True).values()}
    return sum(sizes.values()), max(sizes.values())


def _write_sources(root: str) -> dict[str, str]:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from ftsdp import storage

    state = _net(SOURCE_SEED).state_dict()
    bare = {k: v for k, v in state.items() if k != "head.weight"}
    urls = {f: f"{root}/{f}" for f in FORMATS}
    urls["hf"] += ".safetensors"
    urls["torch"] += ".pt"
    save_file(bare, urls["hf"])
    storage.save({"model": bare}, urls["ftsdp"], 3).wait()
    dcp.save({"model": bare}, checkpoint_id=urls["dcp"], no_dist=True)
    torch.save(state, urls["torch"])
    return urls


def rank_main(rank: int, world_size: int, urls: dict[str, str]) -> dict[str, tuple]:
    fix_mmap_threshold()  # large blocks from mmap, returned when freed
    urls = dict(urls)
    job_dir = urls.pop("job_dir")
    import gc

    import ftsdp
    from ftsdp.trainer._models import init_sharded, init_weights, plan_init

    source = _net(SOURCE_SEED).state_dict()
    cache = _net(INIT_SEED).cache  # the non-persistent buffer: no checkpoint has it
    out: dict[str, tuple] = {}
    for fmt, url in urls.items():
        net = _net(INIT_SEED)
        plan = plan_init(net, url)
        model = ftsdp.FSDP(net, auto_wrap_policy={Layer})
        gc.collect()
        base = reset_peak_rss()
        line = init_sharded(model, plan)
        sharded_peak = status_bytes("VmHWM") - base
        shards = {k: (v.offset, v.local.clone()) for k, v in model.sharded_state_dict().items()}
        model_cache = net.cache.clone()
        del model, net
        gc.collect()

        whole = _net(INIT_SEED)
        base = reset_peak_rss()
        whole_line = init_weights(whole, url)
        whole_peak = status_bytes("VmHWM") - base
        state = whole.state_dict()
        ref_ok = all(torch.equal(state[k], source[k]) for k in source)
        # every element of this rank's shards, against the same range of the whole init
        same = all(
            torch.equal(local, state[k].reshape(-1)[offset : offset + local.numel()])
            for k, (offset, local) in shards.items()
        )
        tied = whole.head.weight is whole.emb.weight
        cache_kept = torch.equal(whole.cache, cache) and torch.equal(model_cache, cache)
        covered = sum(local.numel() for local in (s for _, s in shards.values()))
        del whole, state, shards
        gc.collect()
        out[fmt] = (
            line == whole_line,
            ref_ok,
            same,
            tied,
            cache_kept,
            covered,
            sharded_peak,
            whole_peak,
        )
    out["job"] = _run_the_job(rank, job_dir)
    return out


def _run_the_job(rank: int, root: str) -> tuple:
    """``ftsdp.train`` with ``--init-from`` on this group (as under torchrun): its exit code."""
    from ftsdp.train import main

    argv = [*JOB_FLAGS, "--data", f"{root}/corpus.txt", "--init-from", f"{root}/gpt.safetensors"]
    argv += ["--metrics", f"{root}/metrics-{rank}.jsonl", "--ledger", f"{root}/ledger.jsonl"]
    return (main(argv),)


def _write_job_inputs(root: pathlib.Path) -> GPT:
    """A GPT saved as safetensors (the tied head once) and a text file; the GPT."""
    from safetensors.torch import save_file

    root.mkdir()
    (root / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    torch.manual_seed(9)  # not the job's seed: its own init gives another loss
    gpt = GPT(GPTConfig(vocab_size=128, block_size=8, n_layer=2, n_head=2, n_embd=32))
    saved = {k: v for k, v in gpt.state_dict().items() if k != "lm_head.weight"}
    save_file(saved, str(root / "gpt.safetensors"))
    return gpt


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP saved in one process
def test_sharded_init_equals_the_whole_init_and_holds_a_shard_of_host_memory(tmp_path) -> None:
    from ftsdp.testing import run_ranks

    urls = _write_sources(str(tmp_path))
    model_bytes, largest = _model_bytes(_net(SOURCE_SEED))
    bound = 1.3 * (model_bytes / WORLD + largest)
    gpt = _write_job_inputs(tmp_path / "job")
    urls["job_dir"] = str(tmp_path / "job")
    results = run_ranks(
        f"{__name__}:rank_main", WORLD, urls, timeout=500, start_method="forkserver"
    )
    # The job under this group: its first loss is the saved GPT's on the same samples.
    assert [r["job"] for r in results] == [(0,)] * WORLD, results
    job = tmp_path / "job"
    events = [json.loads(line) for line in (job / "metrics-0.jsonl").read_text().splitlines()]
    init = {"event": "init_from", "url": f"{job}/gpt.safetensors", "ignored": False}
    assert {**init, "deferred": True} in events
    assert [r["world_size"] for r in events if r["event"] == "start"] == [WORLD]
    ids = json.loads((job / "ledger.jsonl").read_text().splitlines()[0])["ids"]
    x, y = TokenDataset(np.fromfile(job / "corpus.txt", dtype=np.uint8), 8, seed=3).batch(ids)
    with torch.no_grad():  # the mean over the global batch (micro-batches of equal size)
        expected = gpt(x, y)[1].item()
    first = next(r for r in events if r["event"] == "step")
    assert first["loss"] == pytest.approx(expected, abs=1e-5)
    del urls["job_dir"]
    params = sum(p.numel() for p in _net(SOURCE_SEED).parameters())
    for fmt in FORMATS:
        rows = [r[fmt] for r in results]
        for rank, (line_same, ref_ok, same, tied, cache_kept, _, sharded, whole) in enumerate(rows):
            where = f"{fmt}, rank {rank}"
            assert line_same and ref_ok and same and tied and cache_kept, (where, rows)
            assert sharded <= bound, f"{where}: sharded init peaked {sharded} > bound {bound:.0f}"
            assert whole > bound, f"{where}: the whole init peaked {whole} <= {bound:.0f}"
        # the shards of the ranks cover every parameter (padding aside) and each buffer per rank
        assert sum(r[5] for r in rows) == params + WORLD * WIDTH, (fmt, rows)
