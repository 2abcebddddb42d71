"""State dicts benchmark: what building a save's model and optimizer leaves costs the caller.

    python -m ftsdp.tools.dev.bench_state_dicts --calls 60

One process (gloo, world size 1), the built-in GPT after one AdamW step, under ``ftsdp.FSDP``
and under FSDP2 (``fully_shard``). Per engine, the median over ``--calls`` calls (the first 10
left out) of ``model_state()`` + ``optim_state()``: ``reused`` while nothing was replaced (the
adapters' identity check, then dicts of their own over the same leaves: [Note: reusing the state
dicts between saves] in ftsdp/checkpoint/_engines.py), ``rebuilt`` with the cache dropped before
each call (what every save would cost without it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def main(argv: list[str] | None = None) -> None:
    """Print one line per engine and mode: the median milliseconds per call."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=60)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    args = p.parse_args(argv)
    import ftsdp
    from ftsdp.checkpoint._engines import engine_for
    from ftsdp.examples.gpt import GPT, Block, GPTConfig, param_groups

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = GPTConfig(
        vocab_size=256, block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd
    )
    try:
        for kind in ("ftsdp", "fsdp2"):
            torch.manual_seed(0)
            model = GPT(cfg)
            if kind == "ftsdp":
                model = ftsdp.FSDP(model, auto_wrap_policy={Block})
            else:
                from torch.distributed.fsdp import fully_shard

                for block in model.blocks:
                    fully_shard(block)
                fully_shard(model)
            opt = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=1e-3)
            x = torch.randint(0, 256, (2, 64))
            out = model(x, x)
            (out[1] if isinstance(out, tuple) else out).backward()
            opt.step()
            engine = engine_for(model, opt)
            for mode in ("reused", "rebuilt"):
                times = []
                for _ in range(args.calls):
                    if mode == "rebuilt":
                        engine._model_cache = engine._optim_cache = None
                    start = time.perf_counter()
                    engine.model_state()
                    engine.optim_state()
                    times.append(time.perf_counter() - start)
                ms = statistics.median(times[10:]) * 1e3
                print(f"{kind:6s} {mode:8s} {ms:.2f} ms per call")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
