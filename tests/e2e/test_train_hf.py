"""Your model on your data, under faults: a tiny Hugging Face GPT-2 (``--model hf:DIR``, built
from a ``config.json`` written by the test) trained on a flat uint16 token file (``--data
FILE.bin``) in deterministic mode, compared with its uninterrupted run as the fault suite does
for the built-in GPT (tests/e2e/test_faults.py): per-step losses and final weights and optimizer
state bitwise, and the sample ledger. Then the faulted run's last checkpoint goes back to
transformers (``ftsdp-ckpt convert RUN OUT --to hf``) and ``from_pretrained(OUT)`` gives the
logits of the reference's final weights loaded into a GPT-2 built from the same config.

Importing transformers' models costs ~7 s of CPU per process, so the processes are few: one
torchrun launch, and the reference and the resume in this process (which imports transformers for
the export check anyway):

- the faulted run, first ``torchrun --nproc-per-node=2 -m ftsdp.train``: rank 1 is SIGKILLed after
  step 5, so the launch fails (no restarts);
- meanwhile, the reference: ``ftsdp.train.main`` in this process, world 1, uninterrupted;
- then ``ftsdp.train.main`` in this process on the faulted run's checkpoint root: it resumes the
  last committed step at world 1 (a world-size change) and finishes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from ftsdp import storage
from ftsdp.tools.ckpt import main as ckpt_main
from ftsdp.train import main as train_main
from tests.e2e.test_faults import REPO, STEPS, Run, check_against_reference
from tests.unit.tools.ckpt.test_hf_export import _tokenizer

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(400)

# GPT-2 of 2 layers, width 32, vocabulary 256, 64 positions, no dropout (deterministic).
HF_CONFIG = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 2,
    "n_positions": 64,
    "vocab_size": 256,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


@dataclasses.dataclass
class HFRun(Run):
    """A fault-suite run whose flags train ``hf:DIR`` on a token file."""

    flags: list[str] = dataclasses.field(default_factory=list)

    def args(self) -> list[str]:
        return [
            *self.flags,
            *["--checkpoint-url", self.url, "--metrics", str(self.root / "metrics.jsonl")],
            *["--ledger", str(self.root / "ledger.jsonl")],
        ]

    def start(self, cmd: list[str], env: dict[str, str], name: str) -> subprocess.Popen:
        """Like ``run``, without waiting."""
        log = self.last_log = self.log_path(name)
        out = open(log, "w")  # noqa: SIM115 - the child holds it; closed by the OS at exit
        return subprocess.Popen(
            [*cmd, *self.args()], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
        )


@pytest.fixture(scope="module")
def flags(tmp_path_factory) -> list[str]:
    base = tmp_path_factory.mktemp("hf")
    model_dir = base / "gpt2-tiny"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(HF_CONFIG))
    _tokenizer(model_dir)  # a byte-level tokenizer of 256 ids: recorded, and exported
    # A token file with structure to learn: a repeating pattern with noise, ids < 256.
    rng = np.random.default_rng(0)
    tokens = (np.arange(4096) * 7 % 251).astype(np.uint16)
    tokens[::5] = rng.integers(0, 256, size=len(tokens[::5]))
    data = base / "train.bin"
    tokens.tofile(data)
    return [
        *["--model", f"hf:{model_dir}", "--data", str(data), "--block-size", "16"],
        *["--global-batch", "4", "--micro-batch", "1", "--steps", str(STEPS)],
        *["--lr", "1e-2", "--warmup", "2", "--min-lr", "1e-3", "--log-every", "1"],
        *["--device", "cpu", "--deterministic", "--checkpoint-every", "2", "--keep-last", "20"],
        *["--heartbeat-timeout-s", "10", "--pg-timeout-s", "60"],
    ]


@pytest.fixture
def world_of_one(monkeypatch):
    """This process as a world of one (the reference runs here)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "FTSDP_FAULT"):
        monkeypatch.delenv(key, raising=False)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the job sets it from the cores


def test_kill9_and_a_world_size_change_equal_the_uninterrupted_run(
    flags, tmp_path, world_of_one
) -> None:
    ref, run = HFRun(tmp_path / "reference", flags=flags), HFRun(tmp_path / "faulted", flags=flags)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc-per-node=2", "--max-restarts=0", "--monitor-interval=0.2"]
    proc = run.start([*torchrun, "-m", "ftsdp.train"], run.env("kill:rank=1:step=5"), "torchrun")
    try:
        assert train_main(ref.args()) == 0  # meanwhile, the reference in this process
    finally:
        proc.wait(timeout=240)
    assert proc.returncode != 0, run.output()[-6000:]  # rank 1 SIGKILLed after step 5
    assert [(f["step"], f["rank"]) for f in run.faults()] == [(5, 1)], run.faults()

    assert train_main(run.args()) == 0  # the resume, at world size 1
    resumes = [r for r in run.metrics() if r["event"] == "resume"]
    assert [(r["saved_world_size"], r["world_size"]) for r in resumes] == [(2, 1)]
    assert resumes[0]["step"] in (2, 4)  # 4 unless its async save was still in flight
    start = [r for r in run.metrics() if r["event"] == "start"]
    assert [r["world_size"] for r in start] == [2, 1]
    assert start[-1]["model"] == flags[1] and start[-1]["data"] == flags[3]
    check_against_reference(run, ref)
    check_the_records(run)
    check_the_export_loads_in_transformers(run, ref, flags[1].removeprefix("hf:"), tmp_path)


def check_the_records(run: HFRun) -> None:
    """What the checkpoint says was trained (the contract with the hf export, docs/training.md)."""
    values = storage.catalog.read_manifest(run.url).values
    model, data = json.loads(values["trainer.model"]), json.loads(values["trainer.data"])
    model_dir = run.flags[run.flags.index("--model") + 1].removeprefix("hf:")
    assert model["spec"] == f"hf:{model_dir}" and model["tokenizer_dir"] == model_dir
    config = transformers.AutoConfig.from_pretrained(model_dir)
    assert model["hf_config"] == json.loads(config.to_json_string(use_diff=False))
    raw = pathlib.Path(flags_data(run)).read_bytes()
    assert data == {
        "spec": flags_data(run),
        "dtype": "uint16",
        "head_sha256": hashlib.sha256(raw[: 1 << 20]).hexdigest(),
        "tokens": len(raw) // 2,
    }


def check_the_export_loads_in_transformers(run: HFRun, ref: HFRun, config_dir: str, tmp) -> None:
    out, err = io.StringIO(), io.StringIO()
    argv = ["convert", run.url, str(tmp / "hf"), "--to", "hf", "--tokenizer", config_dir, "-q"]
    assert ckpt_main(argv, out, err) == 0, err.getvalue()
    files = set(os.listdir(tmp / "hf"))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files, files
    text = "hello, world"
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp / "hf"))
    source = transformers.AutoTokenizer.from_pretrained(config_dir)
    assert tokenizer(text)["input_ids"] == source(text)["input_ids"]
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp / "hf"), output_loading_info=True
    )
    assert {k: v for k, v in info.items() if v} == {}, info  # nothing missing or unexpected
    # The reference: the uninterrupted run's final weights in a GPT-2 built from the config.
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(config_dir)
    )
    weights = {k[len("model.") :]: v for k, v in ref.final().items() if k.startswith("model.")}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # the tied head is saved once
    model.tie_weights()
    batch = torch.from_numpy(
        np.fromfile(flags_data(run), dtype=np.uint16)[: 3 * 16].astype(np.int64)
    ).view(3, 16)
    with torch.no_grad():
        expected = model.eval()(input_ids=batch).logits
        got = exported.eval()(input_ids=batch).logits
    assert torch.equal(got, expected)


def flags_data(run: HFRun) -> str:
    return run.flags[run.flags.index("--data") + 1]
