"""``ftsdp-ckpt convert --to hf`` of a training checkpoint is a Hugging Face model folder:
``AutoModelForCausalLM.from_pretrained`` loads it with no missing or unexpected keys and gives the
trained model's logits; the tokenizer comes along; ``--include-optimizer`` adds the optimizer
state; the built-in GPT's export is what docs/cli.md says.

The checkpoint is made as a run of the main job makes it: an HF GPT-2 wrapped by ``ftsdp.FSDP``,
one AdamW step, saved by ``CheckpointManager`` with the ``trainer.model`` record.
"""

from __future__ import annotations

import io
import json
import pathlib
import shutil
from typing import Any

import pytest
import torch
from safetensors import safe_open

import ftsdp
from ftsdp import storage
from ftsdp.tools.ckpt import main

transformers = pytest.importorskip("transformers")

TOKENIZER = ("tokenizer.json", "tokenizer_config.json")


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def _keys(path: pathlib.Path) -> set[str]:
    with safe_open(str(path), "pt") as f:
        return set(f.keys())


def _tokenizer(folder: pathlib.Path) -> Any:
    """A byte-level tokenizer of 256 ids (no merges), saved as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.save_pretrained(str(folder))
    return fast


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny GPT-2 (tied embeddings) trained one AdamW step under ftsdp.FSDP and saved by
    CheckpointManager with the model record; its logits on a fixed batch after the step."""
    tmp = tmp_path_factory.mktemp("hfexport")
    config_dir = tmp / "gpt2-tiny"
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=64, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    config.save_pretrained(str(config_dir))
    tokenizer = _tokenizer(config_dir)
    torch.manual_seed(0)
    model = ftsdp.FSDP(
        transformers.GPT2LMHeadModel(config),
        auto_wrap_policy={transformers.models.gpt2.modeling_gpt2.GPT2Block},
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (2, 16), generator=g)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()
    batch = torch.randint(0, 256, (3, 20), generator=g)
    with torch.no_grad():
        logits = model(input_ids=batch).logits
    record = {"spec": f"hf:{config_dir}", "hf_config": config.to_dict()}
    record["tokenizer_dir"] = str(config_dir)
    ckpt = ftsdp.CheckpointManager(str(tmp / "run"), model, opt, async_save=False)
    ckpt.save(1, {"model": json.dumps(record, sort_keys=True), "step": 1})  # as the job records it
    ckpt.close()
    names = set(storage.catalog.read_manifest(str(tmp / "run")).tensors)
    # The same model as a torch engine's state dict holds it (FSDP2, DDP, a plain module): the
    # tied weight under both of its names.
    plain = transformers.GPT2LMHeadModel(config)
    plain.load_state_dict(model.state_dict(), strict=False)
    plain.tie_weights()
    full = plain.state_dict()
    assert "lm_head.weight" in full and "transformer.wte.weight" in full
    storage.save({"model": full, "trainer": {"model": json.dumps(record)}}, str(tmp / "both"), 1)
    return {
        "url": str(tmp / "run"), "tmp": tmp, "batch": batch, "logits": logits, "names": names,
        "tokenizer": tokenizer, "both": str(tmp / "both"), "config_dir": str(config_dir),
    }  # fmt: skip


def _load(folder: pathlib.Path, **kwargs: Any) -> tuple[Any, dict[str, list]]:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), output_loading_info=True, **kwargs
    )
    return model.eval(), info


def test_export_loads_with_from_pretrained(run: dict[str, Any]) -> None:
    out = run["tmp"] / "hf"
    argv = ["convert", run["url"], str(out), "--to", "hf", "--tokenizer", run["config_dir"], "-q"]
    code, text, err = _cli(*argv)
    assert code == 0, err
    assert "note:" not in text
    for name in TOKENIZER:  # each file copied, and where from
        assert f"copied {name} from {run['config_dir']}/{name}\n" in text, text
    files = {p.name for p in out.iterdir()}
    assert files == {"model.safetensors", "config.json", *TOKENIZER}, files
    model_names = {n.removeprefix("model.") for n in run["names"] if n.startswith("model.")}
    assert _keys(out / "model.safetensors") == model_names  # weights only, no prefix
    assert "transformer.wte.weight" in model_names and "lm_head.weight" not in model_names  # once
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    model, info = _load(out)
    assert {k: v for k, v in info.items() if v} == {}, info  # no missing/unexpected/mismatched
    assert model.lm_head.weight is model.transformer.wte.weight  # tied again by transformers
    with torch.no_grad():
        got = model(input_ids=run["batch"]).logits
    torch.testing.assert_close(got, run["logits"], atol=1e-6, rtol=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    text_in = "hello, world"
    assert tokenizer(text_in)["input_ids"] == run["tokenizer"](text_in)["input_ids"]


def test_a_tied_weight_saved_under_both_names_is_written_once(run: dict[str, Any]) -> None:
    out = run["tmp"] / "hf-both"
    tokenizer = ("--tokenizer", run["config_dir"])
    code, text, err = _cli("convert", run["both"], str(out), "--to", "hf", *tokenizer, "-q")
    assert code == 0 and "note:" not in text, (text, err)
    keys = _keys(out / "model.safetensors")
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys
    model, info = _load(out)
    assert {k: v for k, v in info.items() if v} == {}, info
    with torch.no_grad():
        got = model(input_ids=run["batch"]).logits
    torch.testing.assert_close(got, run["logits"], atol=1e-6, rtol=0)
    # Names the model ties but whose bytes differ are both written, with a note.
    state = storage.load_state_dict(run["both"])
    state["model.lm_head.weight"] = state["model.lm_head.weight"] + 1
    values = storage.catalog.read_manifest(run["both"]).values
    untied = str(run["tmp"] / "untied")
    storage.save({**state, **values}, untied, 1)
    code, text, _ = _cli("convert", untied, str(run["tmp"] / "hf-untied"), "--to", "hf", "-q")
    assert code == 0 and "model.lm_head.weight differs from model.transformer.wte.weight" in text
    assert "lm_head.weight" in _keys(run["tmp"] / "hf-untied" / "model.safetensors")


def test_bf16_shards_set_the_config_dtype(run: dict[str, Any]) -> None:
    out = run["tmp"] / "hf-bf16"
    argv = ["convert", run["url"], str(out), "--to", "hf", "--dtype", "bf16"]
    assert _cli(*argv, "--max-shard-size", "40KB", "-q")[0] == 0
    assert (out / "model.safetensors.index.json").exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model, info = _load(out)
    assert {k: v for k, v in info.items() if v} == {}, info
    assert model.transformer.wte.weight.dtype == torch.bfloat16


def test_include_optimizer_keeps_optimizer_state_and_values(run: dict[str, Any]) -> None:
    out = run["tmp"] / "hf-optim"
    argv = ["convert", run["url"], str(out), "--to", "hf", "--include-optimizer", "-q"]
    assert _cli(*argv)[0] == 0
    optim = {n for n in run["names"] if n.startswith("optim.")}
    assert len(optim) == 3 * len(run["names"] - optim) and optim  # exp_avg, exp_avg_sq, step
    model_names = {n.removeprefix("model.") for n in run["names"] - optim}
    assert _keys(out / "model.safetensors") == model_names | optim
    lazy = storage.LazyStateDict(str(out))
    assert lazy.values["trainer.step"] == 1 and "optim.param_groups" in lazy.values
    src = storage.LazyStateDict(run["url"])
    some = sorted(optim)[0]
    assert torch.equal(lazy[some], src[some])
    model, info = _load(out)  # still a model folder; the optimizer state is unexpected to it
    assert not info["missing_keys"] and set(info["unexpected_keys"]) <= optim
    with torch.no_grad():
        got = model(input_ids=run["batch"]).logits
    torch.testing.assert_close(got, run["logits"], atol=1e-6, rtol=0)
    # --keep-names: every name as saved, converting back to the training checkpoint bitwise.
    dump, back = run["tmp"] / "dump", run["tmp"] / "back"
    assert _cli("convert", run["url"], str(dump), "--to", "hf", "--include-optimizer",
                "--keep-names", "-q")[0] == 0  # fmt: skip
    assert not (dump / "config.json").exists()
    assert _cli("convert", str(dump), str(back), "--to", "ftsdp", "--dst-step", "1", "-q")[0] == 0
    a, b = storage.load_state_dict(run["url"]), storage.load_state_dict(str(back))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert (
        storage.catalog.read_manifest(str(back)).values
        == storage.catalog.read_manifest(run["url"]).values
    )


def test_builtin_gpt_export_is_what_the_docs_say(tmp_path: pathlib.Path) -> None:
    """docs/cli.md: no record, so the weights without the ``model.`` prefix (the tied head once,
    as ``wte.weight``), no config.json, and a one-line note."""
    from ftsdp.examples.gpt import GPT, Block, GPTConfig

    config = GPTConfig(vocab_size=31, block_size=8, n_layer=2, n_head=2, n_embd=16)
    gpt = GPT(config)
    expected = set(gpt.state_dict()) - {"lm_head.weight"}
    model = ftsdp.FSDP(gpt, auto_wrap_policy={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = ftsdp.CheckpointManager(str(tmp_path / "run"), model, opt, async_save=False)
    ckpt.save(3, {"step": 3})
    out = tmp_path / "hf"
    code, text, _ = _cli("convert", str(tmp_path / "run"), str(out), "--to", "hf", "-q")
    assert code == 0
    assert {p.name for p in out.iterdir()} == {"model.safetensors"}
    assert _keys(out / "model.safetensors") == expected
    notes = [line for line in text.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "no config.json" in notes[0], text
    with torch.device("meta"):
        loaded = GPT(config)
    result = storage.load_into(loaded, str(out))  # as the docs say to load it
    assert not result.missing and not result.unexpected
    x = torch.randint(0, 31, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x)[0], model(x)[0], atol=1e-6, rtol=0)


def test_the_record_is_read_flattened_or_as_json_text() -> None:
    from ftsdp.tools.ckpt._hf_export import read_record

    config = {"n_layer": 2, "label2id": {"a.b": 0}, "rope_scaling": {}}
    whole = {"trainer.model": {"spec": "hf:x", "hf_config": json.dumps(config)}}
    assert read_record(whole, "src")["hf_config"] == config  # exact, as JSON text
    flat = {
        "trainer.model.spec": "hf:x",
        "trainer.model.hf_config.n_layer": 2,
        "trainer.model.hf_config.id2label.0": "L0",
        "trainer.model.tokenizer_dir": None,
        "trainer.step": 5,
    }
    record = read_record(flat, "src")
    assert record == {
        "spec": "hf:x", "hf_config": {"n_layer": 2, "id2label": {"0": "L0"}}, "tokenizer_dir": None
    }  # fmt: skip
    assert read_record({"trainer.step": 5}, "src") is None
    with pytest.raises(ValueError, match="hf_config is not a JSON object"):
        read_record({"trainer.model.hf_config": [1]}, "src")


def test_bad_flags_and_extra_files_where_they_cannot_go(run: dict[str, Any]) -> None:
    tmp = run["tmp"]
    for argv, message in (
        (["--to", "ftsdp", "--include-optimizer"], "--include-optimizer applies to --to hf only"),
        (["--to", "torch", "--keep-names"], "--keep-names applies to --to hf only"),
        (["--to", "hf", "--include-optimizer", "--model-only"], "contradicts --model-only"),
    ):
        code, _, err = _cli("convert", run["url"], str(tmp / "x"), *argv)
        assert code == 2 and message in err, err
    # One file: the weights only, and a note that config.json has no folder to go into.
    code, text, _ = _cli("convert", run["url"], str(tmp / "one.safetensors"), "--to", "hf", "-q")
    assert code == 0 and "config.json and tokenizer files not written" in text
    with pytest.raises(ValueError, match="hf folder destination only"):
        storage.conversion.convert(
            run["url"], str(tmp / "y.pt"), to="torch", extra_files={"a.json": b"{}"}
        )
    with pytest.raises(ValueError, match="a name the hf checkpoint itself uses"):
        storage.conversion.convert(
            run["url"], str(tmp / "y"), to="hf", extra_files={"model.safetensors": b""}
        )
    assert not (tmp / "y").exists() and not (tmp / "y.pt").exists()


def test_interrupted_export_is_resumed_without_overwrite(
    run: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """config.json and the tokenizer files are written first and recorded as the export's own:
    an interrupted export leaves no checkpoint, and the next one replaces them."""
    from ftsdp.storage.conversion._interfaces import Feed

    def failing(self: Any, requests: Any) -> Any:
        raise KeyboardInterrupt
        yield

    real = Feed.stream
    monkeypatch.setattr(Feed, "stream", failing)
    out = run["tmp"] / "hf-interrupted"
    argv = ["convert", run["url"], str(out), "--to", "hf", "--tokenizer", run["config_dir"], "-q"]
    assert _cli(*argv)[0] == 130
    assert (out / "config.json").exists() and not (out / "model.safetensors").exists()
    monkeypatch.setattr(Feed, "stream", real)
    assert _cli(*argv)[0] == 0
    assert {p.name for p in out.iterdir()} == {"model.safetensors", "config.json", *TOKENIZER}


@pytest.mark.timeout(30)
def test_a_hostile_config_depth_builds_one_layer_and_huge_integers_are_refused() -> None:
    """Ties do not depend on depth: a recorded config of ten million layers (a few bytes that
    took hours and hundreds of GB to build) is built with one and still gives the tie, as the
    normal GPT-2 does; an integer no model has is a ValueError naming it (the export then writes
    every tensor with a note)."""
    from ftsdp.tools.ckpt._hf_export import _tied_groups

    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=64, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0,
    ).to_dict()  # fmt: skip
    tie = [["transformer.wte.weight", "lm_head.weight"]]
    assert _tied_groups(config) == tie
    assert _tied_groups({**config, "n_layer": 10**7}) == tie
    assert _tied_groups({**config, "model_type": "gpt2", "num_hidden_layers": 10**7}) == tie
    with pytest.raises(ValueError, match=r"hf_config.n_embd=1000000000000 is beyond"):
        _tied_groups({**config, "n_embd": 10**12})
    with pytest.raises(ValueError, match=r"hf_config\.task_specific_params\.x\[1\]=1000"):
        _tied_groups({**config, "task_specific_params": {"x": [1, 10**30]}})


def test_tokenizer_files_come_only_from_a_named_folder_or_the_checkpoint(
    run: dict[str, Any], tmp_path: pathlib.Path
) -> None:
    """A checkpoint from elsewhere records a tokenizer_dir holding a private key named
    tokenizer.json: nothing is copied unless the user names the folder (--tokenizer) or it lies
    inside the checkpoint; a link leaving the folder is refused; a Hugging Face cache snapshot,
    whose files link into its repository's blobs/, works; each file copied is printed with
    where it came from."""
    secret = b"-----BEGIN OPENSSH PRIVATE KEY-----\nsecret\n"
    private = tmp_path / "home" / ".ssh"
    private.mkdir(parents=True)
    (private / "tokenizer.json").write_bytes(secret)
    record = json.loads(storage.catalog.read_manifest(run["url"]).values["trainer.model"])
    state = storage.load_state_dict(run["url"])

    def checkpoint(name: str, tokenizer_dir: str) -> str:
        url = str(tmp_path / name)
        model = json.dumps({**record, "tokenizer_dir": tokenizer_dir})
        storage.save({**state, "trainer": {"model": model, "step": 1}}, url, 1)
        return url

    def export(url: str, name: str, *flags: str) -> tuple[int, str, str, pathlib.Path]:
        out = tmp_path / name
        return (*_cli("convert", url, str(out), "--to", "hf", *flags, "-q"), out)

    def leaked(folder: pathlib.Path) -> bool:
        return folder.exists() and any(secret in p.read_bytes() for p in folder.iterdir())

    # Recorded outside the checkpoint (absolute, or relative and climbing out): not copied.
    for recorded in (str(private), "../home/.ssh"):
        code, text, err, out = export(checkpoint("elsewhere", recorded), "o1", "--overwrite")
        assert code == 0, err
        assert not (out / "tokenizer.json").exists() and not leaked(out)
        assert "tokenizer files not copied" in text and "pass --tokenizer DIR" in text, text
        assert "copied" not in text.replace("not copied", "")
        shutil.rmtree(tmp_path / "elsewhere")
    # Recorded inside the checkpoint (relative to its root): copied, and printed.
    url = checkpoint("inside", "tok")
    shutil.copytree(run["config_dir"], tmp_path / "inside" / "tok")
    code, text, err, out = export(url, "o2")
    assert code == 0 and "note:" not in text, (text, err)
    assert f"copied tokenizer.json from {tmp_path}/inside/tok/tokenizer.json\n" in text, text
    names = {"tokenizer.json", "tokenizer_config.json"}
    for name in names:
        assert (out / name).read_bytes() == (pathlib.Path(run["config_dir"]) / name).read_bytes()
    # ... but not through a link out of it, nor from a named folder whose link leaves it.
    (tmp_path / "inside" / "tok" / "tokenizer.json").unlink()
    (tmp_path / "inside" / "tok" / "tokenizer.json").symlink_to(private / "tokenizer.json")
    code, _, err, out = export(url, "o3")
    assert code == 2 and "leads to" in err and "outside" in err and not leaked(out), err
    code, _, err, out = export(url, "o4", "--tokenizer", str(tmp_path / "inside" / "tok"))
    assert code == 2 and "leads to" in err and "outside" in err and not leaked(out), err
    # A Hugging Face cache snapshot: its files link to ../../blobs/<hash>, inside models--*.
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for i, name in enumerate(sorted(names)):
        (repo / "blobs" / f"blob{i}").write_bytes(
            (pathlib.Path(run["config_dir"]) / name).read_bytes()
        )
        (snapshot / name).symlink_to(f"../../blobs/blob{i}")
    code, text, err, out = export(
        checkpoint("cached", str(private)), "o5", "--tokenizer", str(snapshot)
    )
    assert code == 0 and "note:" not in text, (text, err)
    blob = (repo / "blobs" / "blob0").resolve()
    assert f"copied tokenizer.json from {snapshot}/tokenizer.json (a link to {blob})\n" in text
    assert not leaked(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tokenizer("hello, world")["input_ids"] == run["tokenizer"]("hello, world")["input_ids"]


def _llama(folder: pathlib.Path) -> Any:
    """A tiny Llama with an untied head (its names: ``model.*`` and ``lm_head.weight``), saved
    by ``save_pretrained``, with a tokenizer beside it."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
        intermediate_size=32, vocab_size=256, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(str(folder))
    _tokenizer(folder)
    return model


def test_a_hugging_face_folder_exports_whole_under_its_own_names(tmp_path: pathlib.Path) -> None:
    """A Llama's folder to hf (a cast to bf16): every tensor under its own name (``lm_head``
    was dropped and ``model.`` stripped from the rest, exit 0), its config with the new dtype
    and its tokenizer; from_pretrained gives the source model's logits."""
    src, dst = tmp_path / "llama", tmp_path / "out"
    model = _llama(src)
    code, out, err = _cli("convert", str(src), str(dst), "--to", "hf", "--dtype", "bf16")
    assert code == 0, err
    assert "a Hugging Face folder: wrote every tensor under its own name" in out
    assert _keys(dst / "model.safetensors") == _keys(src / "model.safetensors")
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"
    assert all((dst / name).is_file() for name in TOKENIZER)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float32)
    rounded = {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}
    model.load_state_dict(rounded)  # the source's weights as the cast wrote them
    x = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(loaded.eval()(x).logits, model(x).logits)


def test_a_models_own_state_dict_keeps_its_head_with_model_only(tmp_path: pathlib.Path) -> None:
    """The same Llama's ``state_dict()`` in a torch file is not a training checkpoint although
    its names start with ``model.``: ``--model-only`` and ``--to hf`` keep ``lm_head.weight``
    and every name."""
    model = _llama(tmp_path / "llama")
    sd = model.state_dict()
    torch.save(sd, tmp_path / "llama.pt")
    code, _, err = _cli("convert", str(tmp_path / "llama.pt"), str(tmp_path / "ft"), "--to",
                        "ftsdp", "--model-only")  # fmt: skip
    assert code == 0, err
    assert set(storage.load_state_dict(str(tmp_path / "ft"))) == set(sd)
    code, out, err = _cli("convert", str(tmp_path / "llama.pt"), str(tmp_path / "hf"), "--to", "hf")
    assert code == 0, err and "not a training checkpoint" in out
    assert _keys(tmp_path / "hf" / "model.safetensors") == set(sd)
