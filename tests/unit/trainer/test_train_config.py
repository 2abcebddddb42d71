"""The training entry's config: validation, batch geometry, the generated CLI, the schedule."""

from __future__ import annotations

import dataclasses
import itertools
import re
import subprocess
import sys

import pytest

from ftsdp.trainer._config import TrainConfig, build_parser, normalise_flags, parse_args
from ftsdp.trainer._job import lr_at


def test_defaults_are_valid_and_split_over_two_ranks() -> None:
    cfg = TrainConfig()
    assert cfg.geometry(1).accum_steps * cfg.micro_batch == cfg.global_batch
    assert cfg.geometry(2).accum_steps * cfg.micro_batch * 2 == cfg.global_batch
    assert cfg.model_config().n_layer == cfg.n_layer


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"steps": 0}, "steps=0 must be >= 1"),
        ({"global_batch": 0}, "global_batch=0 must be >= 1"),
        ({"micro_batch": 3}, "global_batch=32 must be a multiple of micro_batch=3"),
        ({"lr": 0.0}, "lr=0.0 must be > 0"),
        ({"min_lr": 1.0}, r"min_lr=1.0 must be in \[0, lr="),
        ({"warmup": -1}, "warmup=-1 must be >= 0"),
        ({"weight_decay": -0.1}, "weight_decay=-0.1 must be >= 0"),
        ({"grad_clip": -1.0}, "grad_clip=-1.0 must be >= 0"),
        ({"seed": -1}, "seed=-1 must be >= 0"),
        ({"log_every": 0}, "log_every=0 must be >= 1"),
        ({"sharding_strategy": "HYBRID"}, "sharding_strategy='HYBRID' must be one of"),
        ({"device": "tpu"}, "device='tpu' must be one of"),
        ({"n_embd": 130}, "n_embd=130 must be divisible by n_head=4"),
        ({"vocab_size": 0}, "vocab_size=0 must be a positive int"),
        ({"model": "hf:"}, "model='hf:' must be gpt, hf:DIR .* or py:MODULE:FUNCTION"),
        ({"model": "py:mod"}, "model='py:mod' must be gpt, hf:DIR"),
        ({"model": "py:a-b:f"}, "model='py:a-b:f' must be"),
        ({"model": "llama"}, "model='llama' must be"),
        ({"data": ""}, "data='' must be markov or a file"),
        ({"data_dtype": "int8"}, "data_dtype='int8' must be one of"),
        ({"mixed_precision": "fp8"}, "mixed_precision='fp8' must be one of"),
        ({"init_from": ""}, "init_from='' must be a checkpoint URL"),
        ({"memory_every": 1}, "memory_every=1 needs --checkpoint-url"),
        ({"memory_url": "/dev/shm/x", "checkpoint_url": "c"}, "memory_url=.* needs --memory-every"),
        # inf passed every >= check, then failed in a timedelta (or trained to NaN)
        ({"pg_timeout_s": float("inf")}, "pg_timeout_s=inf must be a finite number"),
        ({"heartbeat_timeout_s": float("inf")}, "heartbeat_timeout_s=inf must be a finite"),
        ({"lr": float("inf")}, "lr=inf must be a finite number"),
        ({"weight_decay": float("nan")}, "weight_decay=nan must be a finite number"),
        ({"pg_timeout_s": 1e20}, "pg_timeout_s=1e\\+20 must be at most 1e\\+09 seconds"),
        ({"vocab_size": 1}, "vocab_size=1 must be >= 2"),  # the synthetic language needs two
        (
            {"checkpoint_url": "ck", "memory_url": "ck/", "memory_every": 1},
            "memory_url='ck/' must differ from --checkpoint-url",
        ),
    ],
)
def test_bad_values_raise_naming_the_value_and_rule(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**overrides)


def test_config_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        TrainConfig(256)  # type: ignore[misc]


def test_every_world_size_keeps_the_global_batch() -> None:
    """Uneven shares where W does not divide the micro-batches; W > G pads whole ranks."""
    cfg = TrainConfig(global_batch=32, micro_batch=4)
    for world in range(1, 11):
        g = cfg.geometry(world)
        shares = [g.share(r) for r in range(world)]
        assert sum(shares) * cfg.micro_batch == cfg.global_batch
        assert max(shares) - min(shares) <= 1 and g.accum_steps == max(shares), (world, shares)
    assert [cfg.geometry(w).accum_steps for w in (1, 2, 3, 7, 8, 9)] == [8, 4, 3, 2, 1, 1]


def test_every_field_is_a_flag_with_its_default() -> None:
    parser = build_parser()
    dests = {a.dest for a in parser._actions} - {"help", "config", "version"}
    assert dests == {f.name for f in dataclasses.fields(TrainConfig)}
    assert parse_args([]) == TrainConfig()


def test_parse_args_maps_flags_to_fields() -> None:
    cfg = parse_args(
        [
            "--n-layer=2",
            "--n-embd",
            "64",
            "--global-batch",
            "16",
            "--micro-batch",
            "4",
            "--lr",
            "1e-2",
            "--sharding-strategy",
            "NO_SHARD",
            "--metrics",
            "/tmp/m.jsonl",
            "--device",
            "cpu",
        ]
    )
    assert (cfg.n_layer, cfg.n_embd, cfg.global_batch, cfg.micro_batch) == (2, 64, 16, 4)
    assert cfg.lr == 1e-2 and cfg.sharding_strategy == "NO_SHARD"
    assert cfg.metrics == "/tmp/m.jsonl" and cfg.device == "cpu"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "ten"], "invalid int value"),
        (["--sharding-strategy", "HYBRID_SHARD"], "invalid choice"),
        (["--micro-batch", "5"], "must be a multiple of micro_batch=5"),
        (["--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_bad_command_lines_exit_with_usage(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    # one line, as ftsdp-ckpt's: the error and where to look, not the whole usage first
    assert err.count("\n") == 1 and err.startswith("ftsdp-train: error: "), err
    assert err.endswith("(see ftsdp-train --help)\n") and "usage:" not in err


def test_help_lists_the_flags(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--global-batch", "--micro-batch", "--sharding-strategy", "--metrics"):
        assert flag in out
    text = " ".join(out.split())
    assert "(default: 50)" in text  # the defaults are shown, each once
    assert "(default: /dev/shm/ftsdp-<uid>-<hash of the checkpoint root>)" in text
    assert "(default: None)" not in text.split("--memory-url")[1].split("--pg-timeout-s")[0]


PROBE = """
import runpy, sys
sys.argv = ["ftsdp.train", *sys.argv[1:]]
try:
    runpy.run_module("ftsdp.train", run_name="__main__")
except SystemExit as e:
    print("exit", e.code, "torch" in sys.modules, file=sys.stderr)
"""


@pytest.mark.parametrize(
    "argv, code",
    [(["--global-batch", "30", "--micro-batch", "8"], 2), (["--help"], 0), (["--version"], 0)],
)
def test_the_entry_answers_a_bad_command_line_help_and_version_before_importing_torch(
    argv, code
) -> None:
    """A worker that would fail on its flags stops in a fraction of a second, not after seconds of
    importing torch: its last line is the error, and torch was never imported."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60
    )
    *said, last = proc.stderr.strip().splitlines()
    assert last == f"exit {code} False", proc.stderr
    if code:
        assert said == [
            "ftsdp-train: error: TrainConfig: global_batch=30 must be a multiple of "
            "micro_batch=8 (see ftsdp-train --help)"
        ]


def test_lr_schedule_warms_up_then_decays_to_min_lr() -> None:
    cfg = TrainConfig(steps=100, warmup=10, lr=1.0, min_lr=0.1)
    lrs = [lr_at(s, cfg) for s in range(cfg.steps)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a < b for a, b in itertools.pairwise(lrs[:10]))
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))
    assert lrs[10] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1, abs=1e-3)
    assert lr_at(cfg.steps, cfg) == pytest.approx(0.1)
    assert lr_at(0, TrainConfig(warmup=0, lr=0.5, min_lr=0.0)) == pytest.approx(0.5)
    short = TrainConfig(steps=5, warmup=10, lr=1.0)  # warm-up longer than the run: ramp only
    assert [lr_at(s, short) for s in range(5)] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])


def test_model_specs_parse() -> None:
    from ftsdp.trainer._config import ModelSpec

    assert ModelSpec.parse("gpt") == ModelSpec("gpt")
    assert ModelSpec.parse("hf:./a:b") == ModelSpec("hf", "./a:b")  # a path may hold ':'
    assert ModelSpec.parse("py:pkg.mod:make_model") == ModelSpec("py", "pkg.mod:make_model")
    # the GPT's shape flags are not checked for another model (they do not apply)
    assert TrainConfig(model="hf:/x", n_embd=130).model == "hf:/x"


def test_underscore_spellings_of_every_flag_are_accepted() -> None:
    argv = ["--checkpoint_every", "5", "--global_batch=16", "--micro_batch", "4", "--no-async_save"]
    cfg = parse_args([*argv, "--checkpoint_url", "/c", "--mixed_precision", "bf16"])
    assert (cfg.checkpoint_every, cfg.global_batch, cfg.micro_batch) == (5, 16, 4)
    assert cfg.async_save is False and cfg.checkpoint_url == "/c"
    assert cfg.mixed_precision == "bf16"
    parser = build_parser()
    for f in dataclasses.fields(TrainConfig):  # every flag, both spellings (and --no-x)
        dashed = "--" + f.name.replace("_", "-")
        assert normalise_flags([f"--{f.name}", "v"], parser) == [dashed, "v"]
        assert normalise_flags([f"--{f.name}=a_b"], parser) == [f"{dashed}=a_b"]
        if f.type == "bool":
            assert normalise_flags([f"--no-{f.name}"], parser) == ["--no" + dashed[1:]]
    assert normalise_flags(["--", "--global_batch"], parser) == ["--", "--global_batch"]
    # Not a flag, or after "--": left alone (argparse reports it).
    with pytest.raises(SystemExit):
        parse_args(["--no_such_flag", "1"])


def _toml(tmp_path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_a_toml_config_sets_flags_and_the_command_line_overrides_it(tmp_path) -> None:
    path = _toml(
        tmp_path,
        'model = "hf:./tiny"\ndata = "train.bin"\nglobal-batch = 16\nmicro_batch = 4\n'
        'lr = 1\ndeterministic = true\nsharding-strategy = "NO_SHARD"\n',
    )
    cfg = parse_args(["--config", path])
    assert (cfg.model, cfg.data, cfg.global_batch, cfg.micro_batch) == (
        "hf:./tiny",
        "train.bin",
        16,
        4,
    )
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.deterministic
    assert cfg.sharding_strategy == "NO_SHARD"
    cfg = parse_args([f"--config={path}", "--global-batch", "8", "--no-deterministic"])
    assert (cfg.global_batch, cfg.micro_batch, cfg.deterministic) == (8, 4, False)
    assert parse_args(["--micro_batch", "2", "--config", path]).micro_batch == 2  # any order


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stepz = 3\nglobal_batch = 8\nwarmpu = 1\n", "unknown key(s) ['stepz', 'warmpu']"),
        ('steps = "ten"\n', "steps = 'ten' must be a TOML int"),
        ("steps = true\n", "steps = True must be a TOML int"),
        ("deterministic = 1\n", "deterministic = 1 must be a TOML bool"),
        ("model = 3\n", "model = 3 must be a TOML str (a quoted string)"),
        ('device = "tpu"\n', "device = 'tpu' must be one of"),
        ("steps = 1\nsteps = 2\n", "not valid TOML"),
        ("global-batch = 8\nglobal_batch = 8\n", "global_batch is set twice"),
        ("micro_batch = 5\n", "global_batch=32 must be a multiple of micro_batch=5"),
    ],
)
def test_bad_toml_configs_exit_with_usage_naming_the_key(tmp_path, capsys, text, message) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", _toml(tmp_path, text)])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_toml_config_is_a_usage_error(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--config", str(tmp_path / "nope.toml")])
    assert "--config" in capsys.readouterr().err


SECRET_URL = "https://user:SECRET@host.example/bucket/ckpt?X-Amz-Signature=SIGNED#frag"


@pytest.mark.parametrize(
    "argv",
    [
        ["--init-from", SECRET_URL],
        ["--checkpoint-url", SECRET_URL],
        ["--checkpoint-url", "s3://b/run", "--memory-every", "2", "--memory-url", SECRET_URL],
        ["--metrics", "s3://b/m.jsonl?token=SIGNED"],
        ["--init-from", "s3://ghp_SECRET@b/step"],
        ["--model", "hf:" + SECRET_URL],
    ],
)
def test_a_url_with_credentials_is_refused_without_showing_them(argv, capsys, tmp_path) -> None:
    """The config is saved in every checkpoint (trainer.config), the metrics' start record and
    log lines: a URL carrying credentials (userinfo, a signed query) is refused before any of
    these exist, on the command line and in a TOML config alike, and the refusal says how to
    pass credentials without echoing them."""
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "FTSDP_STORAGE_OPTIONS" in err and "must not carry credentials" in err
    assert "SECRET" not in err and "SIGNED" not in err and "user" not in err.split("(")[0]
    toml = tmp_path / "c.toml"
    pairs = zip(argv[::2], argv[1::2], strict=True)
    toml.write_text("".join(f"{k[2:]} = {v if v.isdigit() else repr(v)}\n" for k, v in pairs))
    with pytest.raises(SystemExit):
        parse_args(["--config", str(toml)])
    err = capsys.readouterr().err
    assert "must not carry credentials" in err and "SECRET" not in err and "SIGNED" not in err
    with pytest.raises(ValueError, match="must not carry credentials") as raised:
        TrainConfig(init_from=SECRET_URL)
    assert "SECRET" not in str(raised.value) and "https://host.example/bucket/ckpt" in str(
        raised.value
    )


def test_urls_and_paths_without_credentials_are_kept_as_given() -> None:
    cfg = parse_args(
        [
            *("--init-from", "s3://bucket/run/step_10", "--checkpoint-url", "HTTPS://H/x/"),
            *("--data", "./tokens?.bin", "--metrics", "file:///tmp/m.jsonl"),
        ]
    )
    assert (cfg.init_from, cfg.checkpoint_url) == ("s3://bucket/run/step_10", "HTTPS://H/x/")
    assert (cfg.data, cfg.metrics) == ("./tokens?.bin", "file:///tmp/m.jsonl")


@pytest.mark.parametrize(
    ("flag", "make", "message"),
    [
        ("--checkpoint-url", "file", "is a file, not a directory"),
        ("--memory-url", "file", "is a file, not a directory"),
        ("--tensorboard", "file", "is a file, not a directory"),
        ("--metrics", "dir", "is a directory, not a file"),
        ("--ledger", "dir", "is a directory, not a file"),
        ("--ledger", "file/under", "cannot be made: .* is a file"),
        ("--checkpoint-url", "file/under", "cannot be made: .* is a file"),
    ],
)
def test_a_local_path_that_cannot_serve_is_refused_before_anything_runs(
    tmp_path, capsys, flag: str, make: str, message: str
) -> None:
    """A checkpoint root that is a file was taken for an empty root: the first save failed in
    the background, and the run trained on until the next one raised. Each such path is one
    line and exit 2 when the flags are read."""
    (tmp_path / "file").write_text("mine")
    (tmp_path / "dir").mkdir()
    argv = [flag, str(tmp_path / make)]
    if flag == "--memory-url":
        argv += ["--memory-every", "1", "--checkpoint-url", str(tmp_path / "ck")]
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1, err
    assert (tmp_path / "file").read_text() == "mine"
