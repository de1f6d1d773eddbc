"""The Llama-shaped model: its parameter count, rotary positions, and infinity training it like plain PyTorch."""

from __future__ import annotations

import math

import pytest
import torch
from harness import assert_weights_close, reference_train

import infinity
from infinity.data import ByteBatches, load_corpus
from infinity.models.llama import LLAMA_PRESETS, Llama, LlamaBlock, count_llama_params, llama_preset, rotary

SEQ = 16
LR = 1e-2


@pytest.mark.parametrize("name", sorted(LLAMA_PRESETS))
def test_count_params_matches_meta_model(name):
    with torch.device("meta"):
        model = Llama(LLAMA_PRESETS[name])
    assert count_llama_params(LLAMA_PRESETS[name]) == sum(p.numel() for p in model.parameters())


def test_7b_preset_has_llama_7b_widths():
    cfg = LLAMA_PRESETS["7b"]
    assert (cfg.n_embd, cfg.n_head, cfg.n_layer, cfg.hidden) == (4096, 32, 32, 11008)  # the Llama paper's 7B
    assert count_llama_params(llama_preset("7b", n_layer=34)) > 6.7e9


def test_rotary_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    T, d = 12, 16
    q, k = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    rq = rotary(q.expand(1, 1, T, d), 10000.0)[0, 0]  # the same query at every position
    rk = rotary(k.expand(1, 1, T, d), 10000.0)[0, 0]
    scores = rq @ rk.T
    for shift in range(1, 4):  # score(i, j) == score(i + s, j + s), to the fp32 rounding of the angles
        torch.testing.assert_close(scores[shift:, shift:], scores[:-shift, :-shift], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(scores[0, 1:], scores[0, :-1], rtol=1e-3)  # but it does depend on it
    torch.testing.assert_close(rq[0], q)  # position 0 is not rotated
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(T))  # a rotation keeps lengths


def test_forward_shapes_loss_at_init_and_blocks():
    cfg = llama_preset("tiny")
    model = Llama(cfg)
    x, y = next(ByteBatches(load_corpus(), 4, cfg.block_size, seed=0))
    logits, loss = model(x, y)
    assert logits.shape == (4, cfg.block_size, 256)
    assert abs(loss.item() - math.log(256)) < 0.05
    assert [type(m) for m in model.layers] == [LlamaBlock] * cfg.n_layer
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, cfg.block_size + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="head size"):
        llama_preset("tiny", n_head=3)


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(llama_preset("tiny", block_size=SEQ))


def _config(offload: str, nvme_path: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "block_classes": ["LlamaBlock"],
            "stage3_param_persistence_threshold": 64,
            "offload_param": {"device": offload, "nvme_path": nvme_path},
            "offload_optimizer": {"device": offload, "nvme_path": nvme_path},
        },
    }


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_infinity_trains_llama_like_plain_pytorch(tmp_path, offload):
    steps = 3
    engine, _, _, _ = infinity.initialize(model=_model(), config=_config(offload, str(tmp_path)))
    data = ByteBatches(load_corpus(), 2, SEQ, seed=0)
    losses = []
    for _ in range(steps):
        _, loss = engine(*next(data))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.full_state_dict()
    engine.close()
    ref_losses, ref_state, _ = reference_train(
        _model, ByteBatches(load_corpus(), 2, SEQ, seed=0), steps, lr=LR, weight_decay=0.1, clip=1.0
    )
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_weights_close(state, ref_state)


def test_built_on_meta_and_materialized_by_the_engine_as_init_module_weights_says(tmp_path):
    config = _config("nvme", str(tmp_path))
    cfg = llama_preset("small", block_size=SEQ)
    with infinity.Init(config=config):
        model = Llama(cfg)
    assert all(p.is_meta for p in model.parameters())
    engine, _, _, _ = infinity.initialize(model=model, config=config)
    state = engine.full_state_dict()
    assert torch.equal(state["layers.0.attention_norm.weight"], torch.ones(cfg.n_embd))
    assert state["layers.0.attention.wq.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert state["layers.0.feed_forward.w2.weight"].std().item() == pytest.approx(
        0.02 / math.sqrt(2 * cfg.n_layer), rel=0.05
    )
    _, loss = engine(*next(ByteBatches(load_corpus(), 2, SEQ, seed=0)))
    engine.backward(loss)
    engine.step()
    engine.close()
    assert abs(loss.item() - math.log(256)) < 0.05
