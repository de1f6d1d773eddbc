"""The example models, the shipped corpus and its batches, and the plain-PyTorch reference trainer."""

from __future__ import annotations

import math

import pytest
import torch
from harness import reference_train

from infinity.data import ByteBatches, load_corpus
from infinity.models import GPT, GPT_PRESETS, MLP, Block, MLPLayer, count_params, gpt_preset

TINY = GPT_PRESETS["tiny"]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# --- GPT -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GPT_PRESETS))
def test_count_params_matches_meta_model(name):
    with torch.device("meta"):
        model = GPT(GPT_PRESETS[name])
    assert count_params(GPT_PRESETS[name]) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("overrides", [{"bias": False}, {"tie_weights": False}, {"tied_head_functional": True}])
def test_count_params_matches_variants(overrides):
    cfg = gpt_preset("tiny", **overrides)
    assert count_params(cfg) == sum(p.numel() for p in GPT(cfg).parameters())


def test_presets_are_about_their_advertised_size():
    for name, target in [("110m", 110e6), ("1b", 1e9), ("3b", 3e9), ("7b", 7e9), ("13b", 13e9)]:
        assert abs(count_params(GPT_PRESETS[name]) / target - 1) < 0.03, name


def test_lm_head_module_shares_the_embedding_weight():
    model = GPT(TINY)
    assert model.lm_head.weight is model.wte.weight
    assert sum(1 for _ in model.parameters()) == len({id(p) for p in model.parameters()})


def test_functional_tied_head_has_no_lm_head_and_matches_module_tying():
    module_tied = GPT(TINY)
    functional = GPT(gpt_preset("tiny", tied_head_functional=True))
    assert not hasattr(functional, "lm_head")
    state = module_tied.state_dict()
    assert state.pop("lm_head.weight").data_ptr() == state["wte.weight"].data_ptr()
    functional.load_state_dict(state)
    x, y = next(ByteBatches(load_corpus(), 2, TINY.block_size, seed=0))
    logits_a, loss_a = module_tied(x, y)
    logits_b, loss_b = functional(x, y)
    torch.testing.assert_close(logits_a, logits_b, rtol=0, atol=0)
    loss_a.backward()
    loss_b.backward()
    torch.testing.assert_close(module_tied.wte.weight.grad, functional.wte.weight.grad, rtol=0, atol=0)


def test_untied_head_is_a_separate_parameter():
    model = GPT(gpt_preset("tiny", tie_weights=False))
    assert model.lm_head.weight is not model.wte.weight


def test_forward_shapes_and_loss_at_init_is_log_vocab():
    model = GPT(TINY)
    x, y = next(ByteBatches(load_corpus(), 4, TINY.block_size, seed=0))
    logits, loss = model(x)
    assert logits.shape == (4, TINY.block_size, 256) and loss is None
    _, loss = model(x, y)
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(256)) < 0.05


def test_blocks_are_the_layers():
    model = GPT(TINY)
    assert [type(m) for m in model.blocks] == [Block] * TINY.n_layer


def test_sequence_longer_than_block_size_is_an_error():
    with pytest.raises(ValueError, match="block_size"):
        GPT(TINY)(torch.zeros(1, TINY.block_size + 1, dtype=torch.long))


def test_activation_checkpointing_gives_identical_gradients():
    x, y = next(ByteBatches(load_corpus(), 2, TINY.block_size, seed=0))
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = GPT(gpt_preset("tiny", activation_checkpointing=ckpt))
        model(x, y)[1].backward()
        grads.append(_grads(model))
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=0, msg=name)


def test_meta_model_materialized_module_by_module_is_initialized_like_nanogpt():
    cfg = GPT_PRESETS["small"]
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()
    for module in model.modules():
        GPT.init_module_weights(module)
    assert model.lm_head.weight is model.wte.weight
    block = model.blocks[0]
    assert torch.equal(block.ln_1.weight, torch.ones(cfg.n_embd))
    assert torch.equal(block.ln_1.bias, torch.zeros(cfg.n_embd))
    assert torch.equal(block.attn.c_attn.bias, torch.zeros(3 * cfg.n_embd))
    assert block.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.mlp.c_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * cfg.n_layer), rel=0.05)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="n_head"):
        gpt_preset("tiny", n_head=3)
    with pytest.raises(ValueError, match="tie_weights"):
        gpt_preset("tiny", tie_weights=False, tied_head_functional=True)
    with pytest.raises(KeyError, match="tiny"):
        gpt_preset("nope")


# --- MLP -------------------------------------------------------------------------------------------


def test_mlp_layers_shapes_and_mse_loss():
    model = MLP(in_features=8, hidden=16, out_features=4, n_layers=3)
    assert [type(m) for m in model.layers] == [MLPLayer] * 3
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    out, loss = model(x, y)
    assert out.shape == (5, 4) and model(x)[1] is None
    torch.testing.assert_close(loss, ((out - y) ** 2).mean())


# --- corpus and batches ----------------------------------------------------------------------------


def test_corpus_is_the_shipped_ascii_text():
    tokens = load_corpus()
    assert tokens.dtype == torch.long and 500_000 < len(tokens) < 1_000_000
    assert int(tokens.max()) < 128
    assert bytes(tokens[:6].tolist()) == b"Hamlet"
    assert len(load_corpus("train")) + len(load_corpus("val")) == len(tokens)


def test_batches_are_deterministic_windows_with_shifted_targets():
    tokens = load_corpus()
    a, b = ByteBatches(tokens, 3, 16, seed=7), ByteBatches(tokens, 3, 16, seed=7)
    for _ in range(3):
        (xa, ya), (xb, yb) = next(a), next(b)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert xa.shape == (3, 16) and torch.equal(xa[:, 1:], ya[:, :-1])
    assert not torch.equal(next(ByteBatches(tokens, 3, 16, seed=8))[0], next(ByteBatches(tokens, 3, 16, seed=7))[0])


def test_ranks_see_slices_of_the_single_process_global_batch():
    tokens = load_corpus()
    whole = ByteBatches(tokens, 4 * 2, 16, seed=3)
    ranks = [ByteBatches(tokens, 2, 16, seed=3, rank=r, world_size=4) for r in range(4)]
    for _ in range(3):
        x, y = next(whole)
        parts = [next(r) for r in ranks]
        assert torch.equal(x, torch.cat([p[0] for p in parts])) and torch.equal(y, torch.cat([p[1] for p in parts]))


def test_batches_resume_from_state_dict_even_at_another_world_size():
    tokens = load_corpus()
    run = ByteBatches(tokens, 4, 16, seed=5)
    next(run)
    state = run.state_dict()
    expected = next(run)
    resumed = [ByteBatches(tokens, 2, 16, seed=5, rank=r, world_size=2) for r in range(2)]
    for r in resumed:
        r.load_state_dict(state)
    assert torch.equal(expected[0], torch.cat([next(r)[0] for r in resumed]))
    with pytest.raises(ValueError, match="seed"):
        ByteBatches(tokens, 4, 16, seed=6).load_state_dict(state)


# --- reference trainer -----------------------------------------------------------------------------


def _mlp() -> MLP:
    torch.manual_seed(0)
    return MLP(in_features=8, hidden=16, out_features=4, n_layers=2)


def test_reference_accumulating_halves_equals_one_big_batch():
    data = [(torch.randn(8, 8), torch.randn(8, 4)) for _ in range(3)]
    halves = [(x[i : i + 4], y[i : i + 4]) for x, y in data for i in (0, 4)]
    kw = dict(lr=1e-2, weight_decay=0.1, clip=0.5)
    losses_big, state_big, _ = reference_train(_mlp, data, 3, **kw)
    losses_acc, state_acc, _ = reference_train(_mlp, halves, 3, grad_accum=2, **kw)
    torch.testing.assert_close(losses_acc, losses_big)
    for name in state_big:
        torch.testing.assert_close(state_acc[name], state_big[name], rtol=1e-5, atol=1e-6)


def test_reference_trains_tiny_gpt_in_bf16_close_to_fp32():
    def model_fn():
        torch.manual_seed(0)
        return GPT(TINY)

    data = [next(ByteBatches(load_corpus(), 4, TINY.block_size, seed=0)) for _ in range(8)]
    fp32, _, _ = reference_train(model_fn, data, 8, lr=3e-3, weight_decay=0.0, clip=0.0)
    bf16, state, _ = reference_train(model_fn, data, 8, lr=3e-3, weight_decay=0.0, clip=0.0, dtype=torch.bfloat16)
    assert fp32[-1] < fp32[0] - 0.3
    assert all(abs(a - b) < 0.05 for a, b in zip(fp32, bf16, strict=True))
    assert all(v.dtype == torch.float32 for v in state.values())
