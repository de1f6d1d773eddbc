"""Weight gradients rebuilt from kept factors for a deferred NVMe step (`scheduler/linear_factors.py`), against
plain PyTorch and against the same run with its gradients waiting on NVMe.

With clipping under a host budget the NVMe step is deferred and its gradients recomputed (`test_grad_replay`).
Where a micro-batch has few tokens for the blocks' width, the replay rebuilds each linear weight's gradient from
its input and its output's gradient, kept from backward (one product, the one autograd makes), and keeps the
other parameters' gradients as they are; a block that calls a linear layer twice or reads its weight elsewhere,
or whose factors would be too large, runs again as before.
"""

from __future__ import annotations

import pytest
import torch
from dist import run_distributed
from harness import assert_matches_plain_pytorch, rank_and_world, train_steps
from test_grad_replay import _config
from torch import nn
from toy_models import batches, make_model

import infinity
from infinity.scheduler.linear_factors import weight_grad

STEPS = 3
BUDGET = 640 << 20


@pytest.fixture(autouse=True)
def one_thread():
    """Runs and references in one thread, as each rank computes: a wide model's sums split across threads round
    differently as the machine's load changes the split, and Adam makes those ulps of its small gradients visible
    in many weights."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 64), (1, 16, 64)])
def test_the_product_of_the_factors_is_the_weight_gradient_autograd_makes_bit_for_bit(dtype, bias, shape) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias).to(dtype)
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
    y = linear(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.equal(weight_grad(x.detach(), dy), linear.weight.grad)
    flat = torch.full((3 + linear.weight.numel() + 5,), float("nan"), dtype=dtype)  # a reused buffer, at an offset
    piece = flat[3 : 3 + linear.weight.numel()].view_as(linear.weight)
    assert weight_grad(x.detach(), dy, out=piece) is piece
    assert torch.equal(piece, linear.weight.grad)


def _train(
    kind: str,
    path: str,
    recompute: bool = True,
    blocks: tuple[str, ...] | None = None,
    steps: int = STEPS,
    dtype: str = "fp32",
    extra: dict | None = None,
) -> dict:
    """Train `kind` with one row per micro-batch on this rank (16 tokens for the GPTs) under a host budget,
    clipping, parameters and optimizer on NVMe; with the counts of replays and of those rebuilt from factors."""
    rank, world = rank_and_world()
    cfg = _config(kind, path, recompute=recompute, block_classes=blocks, micro_bs=1, dtype=dtype)
    cfg.update(extra or {})
    cfg["zero_optimization"]["host_budget_bytes"] = BUDGET  # a wide block streams through, its gradients wait on NVMe
    engine, _, _, _ = infinity.initialize(model=make_model(kind), config=cfg)
    losses = train_steps(engine, batches(kind, 1, rank=rank, world_size=world), steps)
    state = engine.full_state_dict()  # (settles the last step: its blocks are replayed then)
    replay = engine.grad_replay
    counts = {
        "replayed": replay.replayed_blocks if replay is not None else 0,
        "factored": replay.inputs.factored_blocks if replay is not None else 0,
        "products": replay.inputs.factors.products if replay is not None else 0,
        "in_place": replay.inputs.factors.products_in_place if replay is not None else 0,
        "blocks": len(engine.blocks),
    }
    engine.close()
    return {"losses": losses, "state": state, **counts}


@pytest.mark.parametrize("kind,narrow", [("gpt_wide", 0), ("gpt_wide_checkpointed", 0), ("mlp_wide", 1)])
def test_wide_blocks_rebuild_their_gradients_from_factors_bit_for_bit_as_backward_made_them(tmp_path, kind, narrow):
    """Every replay of the wide blocks rebuilds the gradients from factors, the trial's included, with
    non-reentrant activation checkpointing in the blocks too (backward recomputes the saved tensors, but the
    outputs' gradients flow through the forward's own graph); mlp_wide's first block (16 features in, 1024 out)
    would keep more than its share and runs again instead. Each weight's product is made in the memory its
    gradient is handed over in. The run is bit for bit the one whose gradients waited on NVMe, and plain
    PyTorch's."""
    on = _train(kind, str(tmp_path / "on"))
    assert on["replayed"] == STEPS * on["blocks"]
    assert on["factored"] == STEPS * (on["blocks"] - narrow)
    assert on["in_place"] == on["products"] > 0  # each made in the memory it is handed over in (fp32 both)
    off = _train(kind, str(tmp_path / "off"), recompute=False)
    assert off["replayed"] == 0
    assert on["losses"] == off["losses"]
    for key, value in on["state"].items():
        assert torch.equal(value, off["state"][key]), key
    _matches_plain_pytorch([on], kind)


def _two_ranks(kind: str, path: str, recompute: bool) -> dict:
    return _train(kind, f"{path}/rank{torch.distributed.get_rank()}", recompute=recompute)


def test_on_two_ranks_each_rebuilds_its_own_gradients_and_the_reduction_trains_as_plain_pytorch(tmp_path):
    on = run_distributed(_two_ranks, 2, "gpt_wide", str(tmp_path / "on"), True, timeout_s=240)
    for r in on:
        assert r["factored"] == r["replayed"] == STEPS * r["blocks"]
        assert r["in_place"] == r["products"] > 0  # in the reduce-scatter's input
    off = run_distributed(_two_ranks, 2, "gpt_wide", str(tmp_path / "off"), False, timeout_s=240)
    assert [r["losses"] for r in on] == [r["losses"] for r in off]
    for key, value in on[0]["state"].items():
        assert torch.equal(value, off[0]["state"][key]), key
    _matches_plain_pytorch(on, "gpt_wide")


def _two_ranks_bf16_sent_in_fp32(path: str, recompute: bool) -> dict:
    extra = {"communication_data_type": "fp32"}
    return _train("gpt_wide", f"{path}/rank{torch.distributed.get_rank()}", recompute, dtype="bf16", extra=extra)


def test_products_in_another_dtype_than_the_reduction_are_made_apart_and_handed_over_as_before(tmp_path):
    """bf16 compute, gradients reduced in fp32: no product can be made in the reduction's input, so none is, and
    the run is bit for bit the one whose gradients waited on NVMe."""
    on = run_distributed(_two_ranks_bf16_sent_in_fp32, 2, str(tmp_path / "on"), True, timeout_s=240)
    for r in on:
        assert r["factored"] == r["replayed"] == STEPS * r["blocks"]
        assert r["products"] > 0 and r["in_place"] == 0
    off = run_distributed(_two_ranks_bf16_sent_in_fp32, 2, str(tmp_path / "off"), False, timeout_s=240)
    assert [r["losses"] for r in on] == [r["losses"] for r in off]
    for key, value in on[0]["state"].items():
        assert torch.equal(value, off[0]["state"][key]), key


def _matches_plain_pytorch(results: list[dict], kind: str, steps: int = STEPS) -> None:
    assert_matches_plain_pytorch(results, kind, steps, 1)


def test_a_block_using_a_linear_weight_twice_runs_again_and_trains_as_plain_pytorch(tmp_path):
    """twice_wide: MLPLayer(16, 1024) (narrow), a TwiceLayer (its linear called twice), a ReadBackLayer (its
    linear called once, its weight also read by `F.linear`: one call's factors are not the gradient) and
    MLPLayer(1024, 1024): only the last rebuilds its gradients from factors, every replay passes its trial."""
    run = _train("twice_wide", str(tmp_path), blocks=("MLPLayer", "TwiceLayer", "ReadBackLayer"))
    assert run["replayed"] == STEPS * run["blocks"]
    assert run["factored"] == STEPS
    _matches_plain_pytorch([run], "twice_wide")


def test_a_tied_weight_or_a_replaced_forward_runs_again_and_a_hooked_output_keeps_its_factors(tmp_path):
    """hooked_wide: a TiedLayer (its linear weight is also an embedding's there: the embedding's small share of the
    gradient is not in the linear's factors, and the trial's relative bound would not catch it) and a linear whose
    forward is replaced on the instance run again; a linear with a forward hook that doubles its output keeps its
    factors, taken before the hook (the doubled output's gradient reaches the layer's backward doubled). Bit for
    bit the run whose gradients wait on NVMe, and plain PyTorch's (two steps: this regression net's third step
    overshoots at the tests' learning rate, where plain PyTorch's own roundings part)."""
    blocks, steps = ("MLPLayer", "TiedLayer"), 2
    on = _train("hooked_wide", str(tmp_path / "on"), blocks=blocks, steps=steps)
    assert on["replayed"] == steps * on["blocks"]
    assert on["factored"] == steps
    off = _train("hooked_wide", str(tmp_path / "off"), recompute=False, blocks=blocks, steps=steps)
    assert on["losses"] == off["losses"]
    for key, value in on["state"].items():
        assert torch.equal(value, off["state"][key]), key
    _matches_plain_pytorch([on], "hooked_wide", steps)
