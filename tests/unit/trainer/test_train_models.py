"""``--model py:MODULE:FUNCTION``, ``--init-from``, ``--mixed-precision`` and the one-line refusals
of the main job, run in this process (world 1) through ``ftsdp.train.main``; ``--model hf:`` under
torchrun is tests/e2e/test_train_hf.py.

References: the factory's unwrapped module computes the first step's loss on the same samples;
``--init-from`` must give exactly the source checkpoint's tensors, in every format."""

from __future__ import annotations

import json
import logging
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import ftsdp
from ftsdp import storage
from ftsdp.examples.data import TokenDataset
from ftsdp.examples.gpt import GPT, GPTConfig
from ftsdp.train import main
from ftsdp.trainer._config import TrainConfig
from ftsdp.trainer._errors import JobError
from ftsdp.trainer._models import build_deferred, init_sharded, init_weights, plan_init, plan_model

pytestmark = pytest.mark.timeout(120)

FACTORY = """
import torch
import torch.nn.functional as F
from torch import nn


class Layer(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, h):
        return h + F.gelu(self.fc(h))


class Tiny(nn.Module):
    def __init__(self, vocab, width):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Layer(width) for _ in range(2))
        self.head = nn.Linear(width, vocab)

    def forward(self, x, y):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def make(cfg):
    return Tiny(256, 16), {Layer}


def make_plain(cfg):
    return Tiny(256, cfg.block_size)


def make_nothing(cfg):
    return "not a module"


def make_derived(cfg):  # a buffer computed from a parameter: no checkpoint holds it
    tiny = Tiny(256, 16)
    tiny.register_buffer("norm", tiny.head.weight.detach().norm(dim=1), persistent=False)
    return tiny


def make_reading(cfg):  # reads a parameter's value while building
    tiny = Tiny(256, 16)
    tiny.first = float(tiny.head.bias.detach()[0])
    return tiny


def make_sized(cfg):  # the same spec, another model: a width from the environment
    import os

    return Tiny(256, int(os.environ.get("BYO_WIDTH", "16"))), {Layer}
"""


@pytest.fixture
def world_of_one(monkeypatch, tmp_path):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "FTSDP_FAULT"):
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "byo_factory.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("byo_factory", None)


def _text(tmp_path) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    return str(path)


BASE = ["--block-size", "8", "--global-batch", "4", "--micro-batch", "2", "--steps", "2"]
BASE += ["--warmup", "1", "--log-every", "1", "--device", "cpu", "--heartbeat-timeout-s", "0"]


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_py_factory_trains_on_a_text_file_and_its_first_loss_is_the_unwrapped_one(
    world_of_one,
) -> None:
    tmp = world_of_one
    data, metrics, ledger = _text(tmp), tmp / "m.jsonl", tmp / "l.jsonl"
    argv = [*BASE, "--model", "py:byo_factory:make", "--data", data, "--seed", "3"]
    assert main([*argv, "--metrics", str(metrics), "--ledger", str(ledger)]) == 0
    steps = [r for r in _records(metrics) if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2] and steps[1]["loss"] < steps[0]["loss"]
    # The reference: the factory's module, unwrapped, on the first step's samples.
    import byo_factory

    torch.manual_seed(3)
    module, _ = byo_factory.make(None)
    ids = _records(ledger)[0]["ids"]
    ds = TokenDataset(np.fromfile(data, dtype=np.uint8), 8, seed=3)
    x, y = ds.batch(ids)
    with torch.no_grad():
        expected = (module(x[:2], y[:2]).item() + module(x[2:], y[2:]).item()) / 2
    assert steps[0]["loss"] == pytest.approx(expected, abs=1e-6)
    # Without a policy: one unit.
    assert (
        main([*BASE, "--model", "py:byo_factory:make_plain", "--data", data, "--steps", "1"]) == 0
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "py:byo_factory:nope"], "byo_factory has no function nope"),
        (["--model", "py:no_such_module_x:f"], "cannot import no_such_module_x"),
        (["--model", "py:byo_factory:make_nothing"], "returned str; it must return an nn.Module"),
        (["--vocab-size", "64"], "holds token id 122 but the model embeds only 64 ids"),
        (["--model", "hf:/no/such/dir"], "no config.json in /no/such/dir"),
        (["--init-from", "/no/such/ckpt"], "--init-from /no/such/ckpt: cannot read it"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(world_of_one, capsys, caplog, argv, message) -> None:
    with caplog.at_level(logging.ERROR, logger="ftsdp.train"):
        assert main([*BASE, "--data", _text(world_of_one), *argv]) == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "ftsdp.train"]
    assert len(lines) == 1 and message in lines[0] and "\n" not in lines[0], lines
    assert "Traceback" not in capsys.readouterr().err


def test_resuming_another_models_checkpoint_is_refused_in_one_line(world_of_one, capsys, caplog):
    url = str(world_of_one / "ckpt")
    gpt = [*BASE, "--vocab-size", "32", "--n-layer", "1", "--n-head", "2", "--n-embd", "16"]
    assert main([*gpt, "--checkpoint-url", url, "--steps", "1"]) == 0
    with caplog.at_level(logging.ERROR, logger="ftsdp.train"):
        assert main([*gpt, "--checkpoint-url", url, "--n-layer", "2"]) == 2
        assert main([*gpt, "--checkpoint-url", url, "--data", _text(world_of_one)]) == 2
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "ftsdp.train" and r.levelno >= logging.ERROR  # not the progress lines
    ]
    assert lines == [
        f"error: the checkpoint at {url} (step 1) was trained with another "
        f"configuration: {diff}; resume it with its own flags or use another --checkpoint-url"
        for diff in ("n_layer: 1 -> 2", f"data 'markov' -> '{world_of_one / 'corpus.txt'}'")
    ]
    assert "Traceback" not in capsys.readouterr().err
    assert storage.list_steps(url) == [1]  # nothing was written
    # --init-from is ignored when resuming, and says so.
    metrics = world_of_one / "m.jsonl"
    argv = [*gpt, "--checkpoint-url", url, "--init-from", "/x", "--metrics", str(metrics)]
    assert main(argv) == 0
    events = _records(metrics)
    assert {"event": "init_from", "url": "/x", "ignored": True} in events
    assert [r["step"] for r in events if r["event"] == "resume"] == [1]


def test_a_py_model_that_changed_under_the_same_spec_is_refused_in_one_line(
    world_of_one, capsys, caplog, monkeypatch
) -> None:
    # The records cannot tell (same spec, data and flags): the load does, and says so in one line.
    url, data = str(world_of_one / "ckpt"), _text(world_of_one)
    argv = [*BASE, "--model", "py:byo_factory:make_sized", "--data", data, "--checkpoint-url", url]
    assert main([*argv, "--steps", "1"]) == 0
    monkeypatch.setenv("BYO_WIDTH", "8")
    with caplog.at_level(logging.ERROR, logger="ftsdp.train"):
        assert main(argv) == 2
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and "\n" not in lines[0] and len(lines[0]) < 700, lines
    assert f"the checkpoint at {url} does not match this model or optimizer" in lines[0]
    assert lines[0].endswith("with the model it was trained with or use another --checkpoint-url")
    assert "Traceback" not in capsys.readouterr().err
    assert storage.list_steps(url) == [1]


def _gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process
def test_init_from_reads_every_format_with_or_without_the_model_prefix(tmp_path) -> None:
    source = _gpt(1).state_dict()
    bare = {k: v for k, v in source.items() if k != "lm_head.weight"}  # tied: saved once
    h = storage.save({"model": bare, "optim": {"x": torch.ones(2)}}, str(tmp_path / "run"), 6)
    h.wait()
    (tmp_path / "hf").mkdir()
    save_file({k: v.contiguous() for k, v in bare.items()}, str(tmp_path / "hf/model.safetensors"))
    torch.save({"model": source}, tmp_path / "model.pt")
    dcp.save({"model": bare}, checkpoint_id=str(tmp_path / "dcp"))
    for name, fmt in [
        ("run", "ftsdp, step 6"),
        ("hf", "hf"),
        ("model.pt", "torch"),
        ("dcp", "dcp"),
    ]:
        module = _gpt(2)
        line = init_weights(module, str(tmp_path / name))
        assert line == f"initialised from {tmp_path / name} ({fmt})"
        got = module.state_dict()
        assert all(torch.equal(got[k], source[k]) for k in source), name
        assert module.lm_head.weight is module.wte.weight  # still tied


def test_init_from_another_model_is_refused_in_one_line_and_changes_nothing(tmp_path) -> None:
    other = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16))
    torch.save(other.state_dict(), tmp_path / "other.pt")
    module = _gpt(2)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(JobError, match=r"does not match the model: 0 missing, 12 unexpected"):
        init_weights(module, str(tmp_path / "other.pt"))
    wider = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16))
    torch.save(wider.state_dict(), tmp_path / "wider.pt")
    with pytest.raises(JobError, match=r"other shapes than the model .*wpe.weight \[16, 16\]"):
        init_weights(module, str(tmp_path / "wider.pt"))
    renamed = {f"net.{k}": v for k, v in module.state_dict().items()}
    torch.save(renamed, tmp_path / "renamed.pt")
    # the names it could not have guessed are named (16 tensors, 17 names: a tied pair)
    with pytest.raises(JobError, match=r"16 missing .*; it holds 17 tensors \(net\.blocks"):
        init_weights(module, str(tmp_path / "renamed.pt"))
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def test_the_job_starts_from_the_init_from_weights_read_after_wrapping(world_of_one, caplog):
    tmp = world_of_one
    data, metrics, ledger = _text(tmp), tmp / "m.jsonl", tmp / "l.jsonl"
    torch.manual_seed(9)  # not the job's seed: its own init would give another loss
    source = GPT(GPTConfig(vocab_size=128, block_size=8, n_layer=1, n_head=2, n_embd=16))
    saved = {k: v for k, v in source.state_dict().items() if k != "lm_head.weight"}  # tied
    url = str(tmp / "init.safetensors")
    save_file(saved, url)
    gpt = [*BASE, "--vocab-size", "128", "--n-layer", "1", "--n-head", "2", "--n-embd", "16"]
    argv = [*gpt, "--data", data, "--seed", "3", "--init-from", url]
    assert main([*argv, "--metrics", str(metrics), "--ledger", str(ledger)]) == 0
    events = _records(metrics)
    # built with its parameters on meta: the checkpoint fills each shard
    assert {"event": "init_from", "url": url, "ignored": False, "deferred": True} in events
    ids = _records(ledger)[0]["ids"]
    x, y = TokenDataset(np.fromfile(data, dtype=np.uint8), 8, seed=3).batch(ids)
    with torch.no_grad():
        expected = (source(x[:2], y[:2])[1].item() + source(x[2:], y[2:])[1].item()) / 2
    first = next(r for r in events if r["event"] == "step")
    assert first["loss"] == pytest.approx(expected, abs=1e-6)
    # A checkpoint that passes the checks but whose bytes are damaged: one line, exit 2.
    run = str(tmp / "run")
    storage.save({"model": saved}, run, 1).wait()
    objects = sorted((tmp / "run").glob("step-*/*.safetensors"), key=lambda p: p.stat().st_size)
    with open(objects[-1], "r+b") as f:
        f.seek(-8, 2)
        last = f.read(1)
        f.seek(-8, 2)
        f.write(bytes([last[0] ^ 1]))
    with caplog.at_level(logging.ERROR, logger="ftsdp.train"):
        assert main([*argv[:-1], run, "--steps", "1"]) == 2
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert f"--init-from {run} (ftsdp, step 1): loading failed: CorruptCheckpointError" in lines[0]
    assert "checksum mismatch" in lines[0]
    # Another model's checkpoint: refused before the model is wrapped, as the whole load was.
    other = GPT(GPTConfig(vocab_size=128, block_size=8, n_layer=2, n_head=2, n_embd=16))
    torch.save(other.state_dict(), tmp / "other.pt")
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="ftsdp.train"):
        assert main([*argv[:-1], str(tmp / "other.pt"), "--steps", "1"]) == 2
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and "does not match the model: 0 missing, 12 unexpected" in lines[0]


class _Strided(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 6)
        self.register_buffer("t", torch.randn(3, 5).t())  # not contiguous: its view is a copy


def test_init_sharded_fills_a_wrapped_model_as_the_whole_init_does(tmp_path) -> None:
    torch.manual_seed(1)
    source = _Strided()
    url = str(tmp_path / "m.safetensors")
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, url)
    torch.manual_seed(2)
    whole, module = _Strided(), _Strided()
    assert init_weights(whole, url) == f"initialised from {url} (hf)"
    plan = plan_init(module, url)
    model = ftsdp.FSDP(module)  # one process, no group
    assert init_sharded(model, plan) == f"initialised from {url} (hf)"
    expected = whole.state_dict()
    assert all(torch.equal(expected[k], source.state_dict()[k]) for k in expected)
    views = model.sharded_state_dict()
    assert sorted(views) == sorted(expected)
    for k, v in views.items():
        assert torch.equal(v.local, expected[k].reshape(-1)[v.offset : v.offset + v.length]), k
    assert torch.equal(module.t, expected["t"]) and not module.t.is_contiguous()


def test_a_model_built_on_meta_unless_it_needs_parameter_values(world_of_one) -> None:
    def deferred(spec: str) -> bool:
        cfg = TrainConfig(model=spec, init_from="/x")
        return build_deferred(cfg, plan_model(cfg)) is not None

    assert deferred("gpt") and deferred("py:byo_factory:make")
    cfg = TrainConfig(model="gpt")
    built = build_deferred(cfg, plan_model(cfg))
    assert built is not None and all(p.is_meta for p in built.module.parameters())
    gpt = built.module
    assert gpt.lm_head.weight is gpt.wte.weight  # still tied
    assert not any(b.is_meta for b in gpt.buffers())
    assert not torch.nn.Linear(2, 2).weight.is_meta  # the patch is gone
    assert not deferred("py:byo_factory:make_derived")  # its buffer would be zeros
    assert not deferred("py:byo_factory:make_reading")  # built whole instead


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_close_to_fp32_and_fp16_resumes_its_scaler(
    world_of_one, precision
) -> None:
    tmp = world_of_one
    gpt = [*BASE, "--vocab-size", "32", "--n-layer", "1", "--n-head", "2", "--n-embd", "16"]
    losses = {}
    for mp in ("none", precision):
        metrics = tmp / f"{mp}.jsonl"
        argv = [*gpt, "--mixed-precision", mp, "--metrics", str(metrics)]
        url = str(tmp / f"ckpt-{mp}")
        assert main([*argv, "--checkpoint-url", url]) == 0
        losses[mp] = [r["loss"] for r in _records(metrics) if r["event"] == "step"]
    assert losses[precision] == pytest.approx(losses["none"], abs=0.05)
    assert losses[precision] != losses["none"]  # it did compute in low precision
    values = storage.catalog.read_manifest(url).values
    if precision == "fp16":
        scaler = json.loads(values["trainer.grad_scaler"])
        assert scaler["scale"] == 65536.0 and scaler["_growth_tracker"] == 2
        assert main([*argv, "--checkpoint-url", url, "--steps", "3"]) == 0
        resumed = json.loads(storage.catalog.read_manifest(url).values["trainer.grad_scaler"])
        assert resumed["_growth_tracker"] == 3  # continued from the saved state
    else:
        assert "trainer.grad_scaler" not in values
