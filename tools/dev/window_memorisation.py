"""Do windows on a fixed grid get memorised? Train the built-in GPT on a text file's bytes twice,
on the windows ``TokenDataset`` draws and on windows at multiples of the block size, then
evaluate both on the grid and one byte off (docs/training.md, "--data": the command and figures).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from ftsdp.examples.data import TokenDataset
from ftsdp.examples.gpt import GPT, GPTConfig


def _windows(tokens: np.ndarray, starts: list[int], t: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.stack([torch.from_numpy(tokens[s : s + t + 1].astype(np.int64)) for s in starts])
    return rows[:, :-1], rows[:, 1:]


def main(argv: list[str] | None = None) -> None:
    """Print one line per way of drawing windows: the loss on the grid and one byte off."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a text file; its bytes are the tokens")
    p.add_argument("--bytes", type=int, default=16384, help="how much of the file to use")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--n-embd", type=int, default=64)
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the figures repeat; restored for a caller (the test)
    try:
        _compare(args)
    finally:
        torch.set_num_threads(threads)


def _compare(args: argparse.Namespace) -> None:
    with open(args.data, "rb") as f:
        tokens = np.frombuffer(f.read(args.bytes), dtype=np.uint8)
    t = args.block_size
    ds = TokenDataset(tokens, t, seed=0)
    for mode in ("random offsets", "fixed grid"):
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=256, block_size=t, n_layer=2, n_head=2, n_embd=args.n_embd)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        draw = np.random.default_rng(1)
        started = time.perf_counter()
        for _ in range(args.steps):
            idx = draw.integers(len(ds), size=args.batch).tolist()
            x, y = (
                ds.batch(idx)
                if mode == "random offsets"
                else _windows(tokens, [i * t for i in idx], t)
            )
            loss = model(x, y)[1]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            grid, shifted = (
                model(*_windows(tokens, list(range(shift, len(tokens) - t - 1, t)), t))[1].item()
                for shift in (0, 1)
            )
        print(
            f"{mode}: loss {grid:.3f} on the grid, {shifted:.3f} one byte off "
            f"({args.steps} steps, {time.perf_counter() - started:.0f}s)"
        )


if __name__ == "__main__":
    main()
