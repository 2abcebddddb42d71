"""The GPT model: config validation, shapes, weight tying, deterministic per-module init,
the loss at init, and the weight-decay param groups."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ftsdp.examples.gpt import GPT, INIT_STD, Block, GPTConfig, default_no_decay, param_groups

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def make(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**CFG.__dict__, **overrides}))


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("vocab_size", 0, "positive int"),
        ("block_size", -1, "positive int"),
        ("n_layer", 1.5, "positive int"),
        ("n_head", True, "positive int"),
        ("n_embd", 31, "divisible by n_head"),
    ],
)
def test_config_rejects_bad_values(field: str, value: object, rule: str) -> None:
    with pytest.raises(ValueError, match=rule) as e:
        GPTConfig(**{**CFG.__dict__, field: value})
    assert field in str(e.value)


def test_config_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        GPTConfig(64, 16, 2, 2, 32)  # type: ignore[misc]


def test_forward_shapes_and_loss() -> None:
    model = make()
    idx = torch.randint(0, CFG.vocab_size, (3, CFG.block_size))
    logits, loss = model(idx)
    assert logits.shape == (3, CFG.block_size, CFG.vocab_size)
    assert loss is None
    logits, loss = model(idx[:, :5], idx[:, 1:6])
    assert logits.shape == (3, 5, CFG.vocab_size)
    assert loss.shape == ()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="block_size=16"):
        model(torch.zeros(1, CFG.block_size + 1, dtype=torch.long))


def test_blocks_are_a_module_list_of_block() -> None:
    model = make()
    assert isinstance(model.blocks, nn.ModuleList)
    assert [type(b) for b in model.blocks] == [Block] * CFG.n_layer


def test_weight_tying() -> None:
    tied = make()
    assert tied.lm_head.weight is tied.wte.weight
    names = [n for n, _ in tied.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names  # deduplicated
    untied = make(tie_weights=False)
    assert untied.lm_head.weight is not untied.wte.weight
    extra = CFG.vocab_size * CFG.n_embd
    assert untied.num_parameters() == tied.num_parameters() + extra
    assert untied.lm_head.weight.std().item() == pytest.approx(INIT_STD, rel=0.1)


def test_init_is_deterministic_given_the_seed() -> None:
    a, b, c = make(seed=1).state_dict(), make(seed=1).state_dict(), make(seed=2).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert not torch.equal(a["blocks.0.attn.c_attn.weight"], c["blocks.0.attn.c_attn.weight"])


def test_init_distributions() -> None:
    model = make(n_embd=64, n_layer=4)
    proj_std = INIT_STD / math.sqrt(2 * 4)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            assert torch.count_nonzero(p) == 0, name
        elif ".ln" in name or name.startswith("ln"):
            assert torch.all(p == 1), name
        else:
            want = proj_std if name.endswith("c_proj.weight") else INIT_STD
            assert p.std().item() == pytest.approx(want, rel=0.15), name
            assert abs(p.mean().item()) < want / 5, name


def test_meta_materialisation_per_module_reproduces_construction() -> None:
    """A later issue builds the model on the meta device and materialises it one Block at a time
    by calling each module's reset_parameters(); in modules() order under the same seed that must
    give exactly the weights a real-device construction gives."""
    reference = make(seed=3).state_dict()
    with torch.device("meta"):
        meta = GPT(CFG)
    meta.to_empty(device="cpu")
    meta.tie_weights()  # to_empty gives each module its own tensor
    torch.manual_seed(3)
    for unit in [meta.wte, meta.wpe, *meta.blocks, meta.ln_f, meta.lm_head]:
        for module in unit.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    got = meta.state_dict()
    for k in reference:
        torch.testing.assert_close(got[k], reference[k], rtol=0, atol=0, msg=k)
    # The recursive helper is the same walk.
    torch.manual_seed(3)
    meta.init_weights()
    torch.testing.assert_close(meta.state_dict(), reference, rtol=0, atol=0)


def test_loss_at_init_is_about_ln_vocab() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64))
    idx = torch.randint(0, 256, (8, 33))
    _, loss = model(idx[:, :-1], idx[:, 1:])
    assert loss.item() == pytest.approx(math.log(256), abs=0.1)


def test_default_no_decay_by_name() -> None:
    assert default_no_decay("blocks.0.attn.c_attn.bias")
    assert default_no_decay("blocks.3.ln_1.weight")
    assert default_no_decay("ln_f.weight")
    assert default_no_decay("encoder.layer_norm.weight")
    assert not default_no_decay("blocks.0.mlp.c_fc.weight")
    assert not default_no_decay("wte.weight")
    assert not default_no_decay("wpe.weight")


def test_param_groups_match_nanogpt_rule_even_on_1d_slices() -> None:
    model = make()
    # nanoGPT: decay iff the (unsharded) parameter has dim >= 2.
    want_decay = {n for n, p in model.named_parameters() if p.dim() >= 2}
    groups = param_groups(model, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    by_id = {id(p): n for n, p in model.named_parameters()}
    assert {by_id[id(p)] for p in groups[0]["params"]} == want_decay
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(list(model.parameters()))
    # Under the FSDP engine each rank sees 1-D slices (possibly empty): same grouping by name.
    sliced = [
        (n, nn.Parameter(p.detach().flatten()[:3].clone())) for n, p in model.named_parameters()
    ]
    sliced.append(("blocks.0.mlp.c_fc.weight_empty", nn.Parameter(torch.empty(0))))
    groups = param_groups(sliced, 0.1)
    names = {id(p): n for n, p in sliced}
    assert {names[id(p)] for p in groups[0]["params"]} == want_decay | {
        "blocks.0.mlp.c_fc.weight_empty"
    }
    torch.optim.AdamW(groups, lr=1e-3)  # AdamW accepts the groups


def test_param_groups_skip_frozen_and_duplicates_and_take_a_custom_rule() -> None:
    model = make(tie_weights=False)
    model.wpe.weight.requires_grad_(False)
    named = [*model.named_parameters(), ("alias.of.wte", model.wte.weight)]
    groups = param_groups(named, 0.05, no_decay=lambda name: name.startswith("blocks."))
    decay, keep = groups[0]["params"], groups[1]["params"]
    assert all(p is not model.wpe.weight for p in decay + keep)
    assert sum(p is model.wte.weight for p in decay + keep) == 1
    assert {id(p) for p in keep} == {id(p) for p in model.blocks.parameters()}
