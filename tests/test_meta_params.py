"""A parameter's class and attributes survive being built on the meta device and materialized by the engine,
whether the model was built under `infinity.Init` or on `torch.device("meta")`."""

from __future__ import annotations

import pytest
import torch
from harness import config
from torch import nn

import infinity
from infinity.models.meta import parameter_like


class TaggedParameter(nn.Parameter):
    """A `nn.Parameter` subclass, as libraries define to mark parameters (tensor-parallel, no weight decay)."""


class TaggedLayer(nn.Module):
    def __init__(self, width: int, index: int) -> None:
        super().__init__()
        weight = TaggedParameter(torch.empty(width, width))
        weight.tag = f"layer{index}"  # set before registration, as such code does
        self.weight = weight
        self.bias = nn.Parameter(torch.empty(width))
        self.bias.no_decay = True
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.1)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight + self.bias)


class TaggedNet(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TaggedLayer(width, i) for i in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


BUILDERS = {"init": lambda cfg: infinity.Init(config=cfg), "meta_device": lambda cfg: torch.device("meta")}


@pytest.mark.parametrize("built", list(BUILDERS))
@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_class_and_attributes_survive_materialization_and_training(tmp_path, built, offload):
    cfg = config(
        "mlp", block_classes=("TaggedLayer",), offload_param=offload, offload_optimizer=offload, nvme_path=str(tmp_path)
    )
    with BUILDERS[built](cfg):
        model = TaggedNet()
    assert all(p.is_meta for p in model.parameters())
    assert all(type(layer.weight) is TaggedParameter for layer in model.layers)
    engine = infinity.initialize(model=model, config=cfg)[0]
    try:
        for _ in range(2):
            engine.backward(engine(torch.randn(2, 16)))
            engine.step()
        for i, layer in enumerate(model.layers):
            assert type(layer.weight) is TaggedParameter and layer.weight.tag == f"layer{i}"
            assert type(layer.bias) is nn.Parameter and layer.bias.no_decay is True
            assert not layer.weight.is_meta
        full = dict(engine.iter_full_state())
        assert all(torch.isfinite(t).all() and t.abs().sum() > 0 for k, t in full.items() if k.endswith("weight"))
    finally:
        engine.close()


class NeedsAName(nn.Parameter):
    def __new__(cls, data: torch.Tensor, requires_grad: bool = True, *, name: str):
        return super().__new__(cls, data, requires_grad)


def test_a_class_that_cannot_be_remade_is_named_in_the_error():
    param = NeedsAName(torch.zeros(2), name="w")
    with pytest.raises(TypeError, match="NeedsAName: its constructor must accept \\(data, requires_grad\\)"):
        parameter_like(param, torch.empty(2, device="meta"))
    with pytest.raises(TypeError, match="NeedsAName"), infinity.Init():
        nn.Module().register_parameter("w", param)


def test_a_weight_marked_initialized_on_meta_is_still_initialized_when_materialized(tmp_path):
    """transformers' initializers skip a tensor marked `_is_hf_initialized` (its values loaded or set); a mark
    made while the weight was on meta must not survive materialization, or the weight would keep torch.empty's
    bytes."""
    pytest.importorskip("transformers")
    from zoo_cases import build_zoo_model, zoo_config

    cfg = zoo_config("llama", 2, str(tmp_path))
    with infinity.Init(config=cfg):
        model = build_zoo_model("llama")
    marked = model.model.layers[0].mlp.up_proj.weight
    marked._is_hf_initialized = True  # as a model's own init code does once it has set a weight
    assert not hasattr(parameter_like(marked, torch.empty(marked.shape)), "_is_hf_initialized")
    engine = infinity.initialize(model=model, config=cfg)[0]
    try:
        weight = dict(engine.iter_full_state())["model.layers.0.mlp.up_proj.weight"]
    finally:
        engine.close()
    std = model.config.initializer_range  # _init_weights draws Linear weights from N(0, std)
    assert 0.8 * std < weight.std().item() < 1.2 * std and weight.mean().abs().item() < 0.1 * std


def test_initializers_a_hugging_face_model_runs_on_parent_modules_are_kept_under_init(tmp_path):
    """GPT-2's `_init_weights` scales the residual projections (`c_proj`) to initializer_range / sqrt(2 n_layer)
    when called on the attention and MLP modules, after their children, as `model.apply` does. Built under
    `infinity.Init` they had the unscaled std (2x here, 7x at 24 layers); now both builds draw the same."""
    pytest.importorskip("transformers")
    from zoo_cases import build_zoo_model, zoo_config

    cfg = zoo_config("gpt2", 2, str(tmp_path))
    eager = build_zoo_model("gpt2").state_dict()
    with infinity.Init(config=cfg):
        model = build_zoo_model("gpt2")
    engine = infinity.initialize(model=model, config=cfg)[0]
    try:
        built = dict(engine.iter_full_state())
    finally:
        engine.close()
    base = model.config.initializer_range
    scaled = base / (2 * model.config.n_layer) ** 0.5
    for name in ("attn.c_proj.weight", "mlp.c_proj.weight", "attn.c_attn.weight", "mlp.c_fc.weight"):
        std = scaled if "c_proj" in name else base
        for layer in range(model.config.n_layer):
            key = f"transformer.h.{layer}.{name}"
            assert 0.85 * std < built[key].std().item() < 1.15 * std, (key, built[key].std().item(), std)
            assert 0.85 * std < eager[key].std().item() < 1.15 * std, key  # what the eager build draws too
