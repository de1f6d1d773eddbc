"""`infinity.Init` with models that compute buffers at construction (transformers' rotary embeddings, BERT's
position ids): parameters go to the meta device as they are registered, buffers keep their values, and the
model `initialize` materializes trains as plain PyTorch does from the same initial weights."""

from __future__ import annotations

import pytest
import torch
from harness import assert_matches_reference
from torch import nn
from zoo_cases import build_zoo_model, plain_zoo, zoo_batches, zoo_config

import infinity

pytest.importorskip("transformers")

STEPS = 3
MICRO_BS = 2


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "bert"])
def test_parameters_go_to_meta_and_buffers_keep_their_values(tmp_path, arch):
    plain = build_zoo_model(arch)
    register = nn.Module.register_parameter
    with infinity.Init():
        model = build_zoo_model(arch)
    assert nn.Module.register_parameter is register  # put back on exit
    assert all(p.is_meta for p in model.parameters())
    buffers = dict(model.named_buffers())
    assert buffers and buffers.keys() == dict(plain.named_buffers()).keys()
    for name, buf in plain.named_buffers():
        assert not buffers[name].is_meta and torch.equal(buffers[name], buf), name
    with infinity.Init(include_buffers=True):  # everything on meta, as before: initialize refuses such buffers
        on_meta = build_zoo_model(arch)
    assert all(b.is_meta for b in on_meta.buffers())
    with pytest.raises(ValueError, match="is on the meta device: its values cannot be recomputed"):
        infinity.initialize(model=on_meta, config=zoo_config(arch, MICRO_BS, str(tmp_path)))


def test_a_llama_built_under_init_trains_as_plain_pytorch_from_the_weights_initialize_made(tmp_path):
    cfg = zoo_config("llama", MICRO_BS, str(tmp_path))
    with infinity.Init(config=cfg):
        model = build_zoo_model("llama")
    engine = infinity.initialize(model=model, config=cfg)[0]
    initial = {name: t.clone() for name, t in engine.iter_full_state()}
    data = zoo_batches("llama", MICRO_BS)
    losses = []
    for _ in range(STEPS):
        loss = engine(**next(data)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    result = {"losses": losses, "state": engine.full_state_dict()}
    engine.close()
    ref_losses, ref_state = plain_zoo("llama", STEPS, MICRO_BS, initial=initial)
    assert_matches_reference([result], ref_losses, ref_state)
