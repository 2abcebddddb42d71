"""The training entry's config: validation, batch geometry, the generated CLI, the schedule."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from ftsdp.trainer._config import TrainConfig, build_parser, parse_args
from ftsdp.trainer._job import lr_at


def test_defaults_are_valid_and_split_over_two_ranks() -> None:
    cfg = TrainConfig()
    assert cfg.accum_steps(1) * cfg.micro_batch == cfg.global_batch
    assert cfg.accum_steps(2) * cfg.micro_batch * 2 == cfg.global_batch
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
    ],
)
def test_bad_values_raise_naming_the_value_and_rule(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**overrides)


def test_config_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        TrainConfig(256)  # type: ignore[misc]


def test_accum_steps_lists_the_world_sizes_that_work() -> None:
    cfg = TrainConfig(global_batch=32, micro_batch=4)
    assert [cfg.accum_steps(w) for w in (1, 2, 4, 8)] == [8, 4, 2, 1]
    with pytest.raises(ValueError, match=r"world_size=3.*World sizes that work: \[1, 2, 4, 8\]"):
        cfg.accum_steps(3)
    with pytest.raises(ValueError, match="world_size=16"):
        cfg.accum_steps(16)


def test_every_field_is_a_flag_with_its_default() -> None:
    parser = build_parser()
    dests = {a.dest for a in parser._actions} - {"help"}
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
    assert message in capsys.readouterr().err


def test_help_lists_the_flags(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--global-batch", "--micro-batch", "--sharding-strategy", "--metrics"):
        assert flag in out


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
