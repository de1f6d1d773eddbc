"""Engine features a DeepSpeed/FSDP user relies on, each checked against plain PyTorch or a hand computation.

World size 1 and, where sharding or collectives change the picture, 2 (real Gloo processes). Tolerances are
the harness's (`assert_matches_reference`, `assert_weights_close`: losses to rtol 1e-5 in fp32, the engine
differing from the reference only in summation order); any other tolerance is justified where it is used.
Rank functions live in engine_features_cases.py, the models in toy_models.py.
"""

from __future__ import annotations

import functools
import math
import shutil
import tempfile

import pytest
import torch
from dist import run_distributed
from engine_features_cases import (
    accumulation_session,
    client_adam_l2,
    client_adamw,
    control_flow_session,
    eval_session,
    fp16_session,
    gathered_parameters_session,
    half_per_step,
    modify_gathered_weight_without_modifier_rank,
    no_decay_groups,
    plain_with_modification,
    probe_input,
    skip_on_steps_2_to_4,
)
from harness import (
    LR,
    WEIGHT_DECAY,
    assert_matches_reference,
    assert_weights_close,
    config,
    reference_for,
    reference_train,
    train_on_rank,
)
from toy_models import FROZEN, batches, make_model

import infinity
from infinity.config import FP16Config
from infinity.optim.loss_scaler import LossScaler
from infinity.shards import ShardKind

STEPS = 4
MICRO_BS = 2
FP32_LOSS_RTOL = 1e-5


@functools.cache
def _features_run(kind: str, world: int, **options) -> tuple:
    cfg = config(kind, micro_bs=MICRO_BS, **options)
    return tuple(run_distributed(train_on_rank, world, kind, cfg, STEPS, MICRO_BS))


@functools.cache
def _gpt_run(kind: str, world: int) -> tuple:
    cfg = config(kind, micro_bs=MICRO_BS, persistence=64)
    return tuple(run_distributed(train_on_rank, world, kind, cfg, STEPS, MICRO_BS))


# -- 1. weight tying --------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kind", ["gpt", "gpt_functional_tie"])
def test_tied_embedding_and_head_train_like_plain_pytorch(kind, world):
    """(a) lm_head.weight is wte.weight; (b) wte.weight used through F.linear outside its module."""
    results = _gpt_run(kind, world)
    ref_losses, ref_state, _ = reference_for(kind, STEPS, MICRO_BS * world)
    assert_matches_reference(list(results), ref_losses, ref_state)


def test_full_state_dict_has_a_tied_weight_under_every_name_with_equal_values():
    results = _gpt_run("gpt", 2)
    for result in results:
        state = result["state"]
        assert list(state) == list(make_model("gpt").state_dict())
        assert "wte.weight" in state and "lm_head.weight" in state
        assert torch.equal(state["wte.weight"], state["lm_head.weight"])


def test_full_state_dict_of_a_functionally_tied_model_keys_like_its_state_dict():
    state = _gpt_run("gpt_functional_tie", 2)[0]["state"]
    assert list(state) == list(make_model("gpt_functional_tie").state_dict())
    assert "wte.weight" in state and "lm_head.weight" not in state


# -- 2. a module called more than once per forward -------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2])
def test_block_applied_twice_per_forward_matches_plain_pytorch(world):
    ref_losses, ref_state, _ = reference_for("reused", STEPS, MICRO_BS * world)
    assert_matches_reference(list(_features_run("reused", world)), ref_losses, ref_state)


@pytest.mark.parametrize("world", [1, 2])
def test_linear_shared_by_two_blocks_matches_plain_pytorch(world):
    ref_losses, ref_state, _ = reference_for("shared_linear", STEPS, MICRO_BS * world)
    assert_matches_reference(list(_features_run("shared_linear", world)), ref_losses, ref_state)


# -- 3. frozen parameters ----------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2])
def test_frozen_parameters_keep_their_values(world):
    for result in _features_run("frozen", world):
        for name in FROZEN:
            assert torch.equal(result["state"][name], result["initial"][name]), name


@pytest.mark.parametrize("world", [1, 2])
def test_trainable_parameters_beside_frozen_ones_match_plain_pytorch(world):
    # The reference's optimizer gets only the trainable parameters (harness.config_adamw).
    ref_losses, ref_state, _ = reference_for("frozen", STEPS, MICRO_BS * world)
    assert_matches_reference(list(_features_run("frozen", world)), ref_losses, ref_state)


@pytest.mark.parametrize(
    "world,offload", [(1, "nvme"), (2, "none"), (2, "cpu")]  # where blocks are gathered, not resident
)
def test_lora_blocks_with_a_frozen_base_match_plain_pytorch(tmp_path, world, offload):
    """Each block's adapter gets its gradients before backward reads the frozen base weight for the input's
    gradient: the block used to be resharded at its last trainable gradient, and backward then read an empty
    shard ("setStorage: ... out of bounds for storage of size 0")."""
    cfg = config("lora", micro_bs=MICRO_BS, block_classes=("LoRALayer",), offload_param=offload,
                 offload_optimizer=offload, nvme_path=str(tmp_path))  # fmt: skip
    results = run_distributed(train_on_rank, world, "lora", cfg, STEPS, MICRO_BS)
    ref_losses, ref_state, _ = reference_for("lora", STEPS, MICRO_BS * world)
    assert_matches_reference(list(results), ref_losses, ref_state)
    for result in results:
        base = [k for k in result["state"] if ".base." in k]
        assert base and all(torch.equal(result["state"][k], result["initial"][k]) for k in base)


def test_lora_blocks_under_reentrant_checkpointing_match_plain_pytorch():
    """The same where each block's forward runs without autograd and backward recomputes it (reentrant
    checkpointing): the recomputation's inputs are watched instead."""
    cfg = config("lora", micro_bs=MICRO_BS, block_classes=("LoRALayer",))
    results = run_distributed(train_on_rank, 2, "lora_reentrant", cfg, STEPS, MICRO_BS)
    ref_losses, ref_state, _ = reference_for("lora", STEPS, MICRO_BS * 2)
    assert_matches_reference(list(results), ref_losses, ref_state)


def _train_counting_gathered_blocks(cfg: dict, steps: int, micro_bs: int) -> dict:
    """Train "lora_cross", counting the blocks gathered at once in backward; step 1 also runs a forward with
    autograd on whose graph is dropped without a backward (a batch skipped for its loss)."""
    from harness import rank_and_world

    from infinity.partition.sharded_block import BlockState

    rank, world = rank_and_world()
    engine, _, _, _ = infinity.initialize(model=make_model("lora_cross"), config=cfg)
    blocks, peak = engine.scheduler.blocks, [0]
    for block in blocks:
        for p in block.trainable:
            p.register_post_accumulate_grad_hook(
                lambda _p: peak.__setitem__(0, max(peak[0], sum(b.state is BlockState.UNSHARDED for b in blocks)))
            )
    data, losses = batches("lora_cross", micro_bs, rank=rank, world_size=world), []
    for step in range(steps):
        x, y = next(data)
        if step == 1:
            engine(x, y)  # dropped: its calls owe nothing once its graph is freed
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    result = {"losses": losses, "state": engine.full_state_dict(), "peak": peak[0], "blocks": len(blocks)}
    engine.close()
    return result


@pytest.mark.parametrize("world,offload", [(1, "nvme"), (2, "none")])
def test_lora_blocks_sharing_a_context_are_resharded_one_by_one_in_backward(tmp_path, world, offload):
    """Every block reads one trainable context (cross-attention's encoder states): its gradient is whole only
    after the last block's backward, and a hook on it kept all six blocks gathered to the end. Each block's
    own use of its inputs is watched instead; a forward whose graph was dropped leaves nothing owed."""
    cfg = config("lora_cross", micro_bs=MICRO_BS, block_classes=("CrossLoRALayer",), offload_param=offload,
                 offload_optimizer=offload, nvme_path=str(tmp_path),
                 extra_zero={"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 1})  # fmt: skip
    results = run_distributed(_train_counting_gathered_blocks, world, cfg, STEPS, MICRO_BS)
    ref_losses, ref_state, _ = reference_for("lora_cross", STEPS, MICRO_BS * world)
    assert_matches_reference(list(results), ref_losses, ref_state)
    assert all(r["blocks"] == 6 and r["peak"] <= 2 for r in results), [r["peak"] for r in results]


def _branch_on_even_steps(step: int) -> dict:
    return {"use_branch": step % 2 == 0}


def test_a_frozen_block_whose_output_a_step_leaves_unused_trains_like_plain_pytorch(tmp_path):
    """The frozen block is gathered again by backward's prefetch (the last step's order) while its input's
    gradient arrives through the other path: resharding it then, mid-gather, raised."""
    cfg = config("frozen_branch", micro_bs=MICRO_BS, offload_param="nvme", offload_optimizer="nvme",
                 nvme_path=str(tmp_path), extra_zero={"stage3_max_reuse_distance": 0})  # fmt: skip
    kwargs = {"step_kwargs": _branch_on_even_steps}
    results = run_distributed(train_on_rank, 1, "frozen_branch", cfg, STEPS, MICRO_BS, **kwargs)
    ref_losses, ref_state, _ = reference_for("frozen_branch", STEPS, MICRO_BS, **kwargs)
    assert_matches_reference(list(results), ref_losses, ref_state)


def _train_embedding_outside(cfg: dict, steps: int, micro_bs: int) -> dict:
    """Train with each batch projected by the root's `inp` before the engine's forward, then call `inp` alone
    with no pass running (as generate() calls an encoder)."""
    from harness import rank_and_world

    rank, world = rank_and_world()
    engine, _, _, _ = infinity.initialize(model=make_model("embed_outside"), config=cfg)
    data, losses = batches("embed_outside", micro_bs, rank=rank, world_size=world), []
    for _ in range(steps):
        x, y = next(data)
        _, loss = engine(engine.module.inp(x), y, embedded=True)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with torch.no_grad():
        direct = engine.module.inp(x)
    result = {"losses": losses, "state": engine.full_state_dict(), "x": x, "direct": direct}
    engine.close()
    return result


@pytest.mark.parametrize("world,offload", [(1, "nvme"), (2, "none")])
def test_a_root_module_called_before_the_engines_forward_trains_like_plain_pytorch(tmp_path, world, offload):
    """`inputs_embeds` made by the model's own embedding before `engine(...)`, and an encoder called alone by
    generate(): a module owning root parameters runs with no pass started, and read an empty shard ("'weight'
    must be 2-D")."""
    cfg = config("embed_outside", micro_bs=MICRO_BS, offload_param=offload, offload_optimizer=offload,
                 nvme_path=str(tmp_path))  # fmt: skip
    results = run_distributed(_train_embedding_outside, world, cfg, STEPS, MICRO_BS)
    ref_losses, ref_state, _ = reference_for("embed_outside", STEPS, MICRO_BS * world)
    assert_matches_reference(list(results), ref_losses, ref_state)
    for result in results:
        w, b = ref_state["inp.weight"], ref_state["inp.bias"]
        assert torch.allclose(result["direct"], result["x"] @ w.t() + b, rtol=1e-5, atol=1e-6)


def test_deepspeed_engine_getters_report_the_run():
    """Scripts written against DeepSpeed's engine read its ranks, batch sizes, precision and whether the last
    step was applied; each is checked against the config or the engine's own counters."""
    cfg = config("gpt", micro_bs=2, grad_accum=2)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 18, "hysteresis": 1}  # the first steps overflow
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
    assert (engine.global_rank, engine.world_size, engine.dp_world_size, engine.local_rank) == (0, 1, 1, 0)
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu()) == (4, 2)
    assert engine.zero_optimization_stage() == 3 and engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.get_mom() == [(0.9, 0.999)]  # AdamW's default betas: the config gives lr and weight decay
    assert [n for n, _ in engine.named_parameters()] == [n for n, _ in make_model("gpt").named_parameters()]
    data, applied = batches("gpt", 2), []
    for micro in range(2 * 8):
        _, loss = engine(*next(data))
        engine.backward(loss)
        skipped = engine.skipped_steps
        engine.step()
        if micro % 2 == 1:
            applied.append(engine.was_step_applied())
            assert applied[-1] == (engine.skipped_steps == skipped)
        else:  # between accumulation boundaries nothing is applied
            assert not engine.was_step_applied()
    assert applied[0] is False and applied[-1] is True
    assert engine.global_samples == engine.global_steps * 4 == 32
    engine.zero_grad()
    engine.close()


# -- 4. buffers --------------------------------------------------------------------------------------------


def test_buffers_used_and_updated_in_forward_train_like_plain_pytorch():
    # World 1: the running buffer is updated from each rank's own rows, so with 2 ranks it is per-rank state.
    results = _features_run("buffers", 1, block_classes=("ScaledLayer",))
    ref_losses, ref_state, _ = reference_for("buffers", STEPS, MICRO_BS)
    assert_matches_reference(list(results), ref_losses, ref_state)


def test_full_state_dict_holds_the_persistent_buffers_and_not_the_others():
    state = _features_run("buffers", 1, block_classes=("ScaledLayer",))[0]["state"]
    plain = make_model("buffers")
    assert list(state) == list(plain.state_dict())  # "layers.0.pos_ids" is persistent=False: absent in both
    assert torch.equal(state["layers.1.scale"], plain.layers[1].scale)
    assert torch.equal(state["out_shift"], plain.out_shift)
    assert state["layers.0.running"].item() != 1.0  # forward updated it (its value is checked against the reference)


# -- 5. sizes that do not divide by the world size ---------------------------------------------------------


def test_odd_sized_parameters_match_plain_pytorch_on_two_ranks():
    # 13->7->7->7->5: 7x13, 7x7, 5x7 weights and 7, 5 biases; none divides by 2, all are sharded.
    ref_losses, ref_state, _ = reference_for("odd", STEPS, MICRO_BS * 2)
    assert_matches_reference(list(_features_run("odd", 2)), ref_losses, ref_state)


# -- 6. activation checkpointing ---------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2])
def test_activation_checkpointing_matches_plain_pytorch(world):
    # The reference runs without checkpointing: recomputation is the same math.
    results = _gpt_run("gpt_checkpointed", world)
    ref_losses, ref_state, _ = reference_for("gpt", STEPS, MICRO_BS * world)
    assert_matches_reference(list(results), ref_losses, ref_state)


@functools.cache
def _reentrant_run(world: int) -> tuple:
    cfg = config("gpt_reentrant", micro_bs=MICRO_BS, persistence=64)
    return tuple(run_distributed(train_on_rank, world, "gpt_reentrant", cfg, STEPS, MICRO_BS))


@pytest.mark.parametrize("world", [1, 2])
def test_reentrant_activation_checkpointing_matches_plain_pytorch(world):
    ref_losses, ref_state, _ = reference_for("gpt", STEPS, MICRO_BS * world)
    assert_matches_reference(list(_reentrant_run(world)), ref_losses, ref_state)


def test_reentrant_activation_checkpointing_keeps_the_forward_trace_valid():
    for result in _reentrant_run(1):
        assert result["forward_invalidations"] == 0


# -- 7. inference --------------------------------------------------------------------------------------------


@functools.cache
def _eval_run(world: int) -> tuple:
    return tuple(run_distributed(eval_session, world, "gpt", config(micro_bs=MICRO_BS, persistence=64), 2, 2, MICRO_BS))


@pytest.mark.parametrize("world", [1, 2])
def test_eval_no_grad_outputs_equal_the_plain_model_with_the_same_weights(world):
    for result in _eval_run(world):
        plain = make_model("gpt")
        plain.load_state_dict(result["state_before"])
        plain.eval()
        x, y = result["probe_rows"]
        with torch.no_grad():
            logits, loss = plain(x, y)
        # The same weights bit for bit and the same operations: only fp32 rounding may differ.
        torch.testing.assert_close(result["eval_logits"], logits, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(result["inference_mode_logits"], logits, rtol=1e-6, atol=1e-6)
        assert result["eval_loss"] == pytest.approx(loss.item(), rel=1e-6)


@pytest.mark.parametrize("world", [1, 2])
def test_no_block_stays_gathered_after_inference(world, tmp_path):
    runs = [_eval_run(world)]
    if world == 1:  # offload none keeps one rank's blocks resident; parameters on NVMe are gathered and freed
        cfg = config(micro_bs=MICRO_BS, persistence=64, offload_param="nvme", nvme_path=str(tmp_path))
        runs.append(tuple(run_distributed(eval_session, 1, "gpt", cfg, 2, 2, MICRO_BS)))
    for results in runs:
        for result in results:
            assert not any(result["gathered_after_no_grad"]), result["gathered_after_no_grad"]
            assert not any(result["in_flight_after_no_grad"])
            assert not any(result["gathered_after_inference_mode"]), result["gathered_after_inference_mode"]
    if world == 1:
        in_memory, on_nvme = runs[0][0], runs[1][0]
        assert in_memory["resident_blocks"] > 0 and in_memory["gathered_after_no_grad"] == []  # all resident
        assert on_nvme["resident_blocks"] == 0 and len(on_nvme["gathered_after_no_grad"]) > 0
    else:
        assert [r["resident_blocks"] for r in runs[0]] == [0, 0]  # several ranks always gather


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_one_rank_keeps_in_memory_shards_resident(offload):
    """One rank whose shards live in memory the compute addresses (the device, or on a CPU-only machine
    the host): the parameters are views of the shards themselves, so nothing is gathered or copied and
    the optimizer's new weights are what the next forward reads."""
    if offload == "cpu" and torch.cuda.is_available():
        pytest.skip("with a GPU the host is not the compute's memory: shards on the host are gathered")
    cfg = config(micro_bs=MICRO_BS, persistence=64, offload_param=offload, offload_optimizer=offload)
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
    homes = {flat: engine.shards.shard_view(flat, ShardKind.PARAM) for flat in engine.flats}
    for flat, home in homes.items():
        assert flat.resident and flat.full.data_ptr() == home.data_ptr(), flat.name
        for p in flat.params:
            assert p.untyped_storage().data_ptr() == home.untyped_storage().data_ptr(), flat.name
    x, y = next(batches("gpt", MICRO_BS))
    for _ in range(2):
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    assert engine.scheduler.stall_s == 0.0 and "host->device" not in engine.bytes_moved
    for flat, record in engine.shards.records.items():
        master = engine.shards.shard_view(flat, ShardKind.MASTER)
        assert record.step == 2 and torch.equal(flat.full, master), flat.name  # fp32: the master itself
    assert all(f.full.data_ptr() == home.data_ptr() for f, home in homes.items())


@pytest.mark.parametrize("world", [1, 2])
def test_training_after_inference_matches_plain_pytorch(world):
    ref_losses, ref_state, _ = reference_for("gpt", 4, MICRO_BS * world)
    assert_matches_reference(list(_eval_run(world)), ref_losses, ref_state)


# -- 8. GatheredParameters ------------------------------------------------------------------------------------


@functools.cache
def _gathered_run(world: int) -> tuple:
    return tuple(run_distributed(gathered_parameters_session, world, 2, 2))


@functools.cache
def _gathered_reference(world: int) -> dict:
    return plain_with_modification(2, 2, MICRO_BS * world)


@pytest.mark.parametrize("world", [1, 2])
def test_gathered_parameters_shows_the_full_weights(world):
    for result in _gathered_run(world):
        for name, value in result["inside"].items():
            assert torch.equal(value, result["state_before"][name]), name
        assert not any(result["blocks_gathered_after_read"])


@pytest.mark.parametrize("world", [1, 2])
def test_gathered_parameters_without_modifier_rank_discards_changes(world):
    ref = _gathered_reference(world)
    for result in _gathered_run(world):
        for name, value in result["state_after_unmodified"].items():
            assert torch.equal(value, result["state_before"][name]), name
        torch.testing.assert_close(result["output_after_unmodified"], ref["output_unmodified"], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("world", [1, 2])
def test_gathered_parameters_without_modifier_rank_discards_changes_to_gathered_weights(world):
    plain = make_model("mlp")
    with torch.no_grad():
        expected = plain(probe_input())[0]
    for result in run_distributed(modify_gathered_weight_without_modifier_rank, world):
        assert result["was_gathered"]  # the case under test: the persistent flat was gathered on entry
        assert torch.equal(result["state"]["layers.0.fc.bias"], plain.layers[0].fc.bias.detach())
        torch.testing.assert_close(result["output"], expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("world", [1, 2])
def test_gathered_parameters_with_modifier_rank_writes_its_values_to_every_rank(world):
    ref = _gathered_reference(world)
    for result in _gathered_run(world):
        state = result["state_after_modified"]
        assert torch.all(state["layers.1.fc.weight"] == 0.5)
        assert torch.all(state["layers.0.fc.bias"] == 0.25)
        for name, value in state.items():
            if name not in ("layers.1.fc.weight", "layers.0.fc.bias"):
                assert torch.equal(value, result["state_before"][name]), name
        # The next forward uses the new values: outputs as the plain model holding the same weights.
        torch.testing.assert_close(result["output_after_modified"], ref["output_modified"], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_gathered_parameters_cut_short_by_an_error_keeps_the_weights(tmp_path, offload):
    """An exception inside the block discards the edits, also with modifier_rank and resident weights."""
    cfg = config(micro_bs=MICRO_BS, persistence=64, offload_param=offload, nvme_path=str(tmp_path))
    model = make_model("gpt")
    engine, _, _, _ = infinity.initialize(model=model, config=cfg)
    before = engine.full_state_dict()
    with pytest.raises(ValueError, match="user code failed"):
        with infinity.GatheredParameters(list(model.parameters()), modifier_rank=0):
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(3.0)
            raise ValueError("user code failed")
    after = engine.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    engine.close()


def test_nvme_optimizer_mid_step_refuses_state_access_until_step(tmp_path):
    """Stepping shards as gradients arrive leaves the optimizer mid-step between backward and step():
    reading or writing its state (a checkpoint) or zero_grad then says to call step() first. (A host budget: without
    one the step is deferred into the next forward instead, `memory_plan.balance_step_timing`.)"""
    cfg = config(
        micro_bs=MICRO_BS,
        persistence=64,
        offload_optimizer="nvme",
        clip=0.0,
        nvme_path=str(tmp_path),
        extra_zero={"host_budget_bytes": 256 << 20},
    )
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
    x, y = next(batches("gpt", MICRO_BS))
    _, loss = engine(x, y)
    engine.backward(loss)
    assert engine.optimizer.step_in_progress
    with pytest.raises(RuntimeError, match=r"save_checkpoint between backward and step.*call engine.step\(\) first"):
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()  # refused before anything was written
    with pytest.raises(RuntimeError, match=r"call engine.step\(\) first"):
        engine.optimizer.zero_grad()
    engine.step()
    assert not engine.optimizer.step_in_progress
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.close()


@pytest.mark.parametrize("world", [1, 2])
def test_training_continues_from_weights_written_in_gathered_parameters(world):
    ref = _gathered_reference(world)
    results = list(_gathered_run(world))
    assert_matches_reference(results, ref["losses"], ref["state"])


# -- 9. fp16 dynamic loss scaling -----------------------------------------------------------------------------

# fp16 compute against an fp32 reference: the fp16 forward/backward rounds at 2**-11 relative, less than
# bf16's 2**-8, so the bf16 tolerances of test_engine_correctness (losses 2e-2, weights "bf16") bound it.
FP16_LOSS_RTOL = 2e-2


@functools.cache
def _fp16_run(world: int, inf_at_step: int | None, inf_on_rank: int) -> tuple:
    return tuple(run_distributed(fp16_session, world, 20, 10, inf_at_step, inf_on_rank))


def _fp16_reference(rows: list[dict], world: int) -> tuple[list[float], dict]:
    """fp32 AdamW on exactly the batches of the steps the engine applied (skipped steps consume theirs)."""
    applied = [i for i, r in enumerate(rows) if r["skipped"] == (rows[i - 1]["skipped"] if i else 0)]
    stream = batches("mlp", MICRO_BS * world, dtype=torch.float16)
    fp32 = [tuple(t.float() for t in b) for _, b in zip(range(len(rows)), stream, strict=False)]
    data = iter([fp32[i] for i in applied])
    losses, state, _ = reference_train(lambda: make_model("mlp"), data, len(applied))
    return losses, state


def test_fp16_overflowing_steps_are_skipped_with_the_scale_halved_each_time():
    rows = _fp16_run(1, None, 0)[0]["rows"]
    assert rows[0]["loss_dtype"] == "torch.float16"
    # 2**20 x a loss of order 1 overflows fp16 (max 65504): the first step must be skipped.
    skipped = next(i for i, r in enumerate(rows) if r["changed"])
    assert skipped >= 1
    for i in range(skipped):
        assert rows[i]["scale"] == 2.0 ** (20 - i)
        assert rows[i]["skipped"] == i + 1 and not rows[i]["changed"]
        assert rows[i]["global_steps"] == i + 1  # DeepSpeed counts skipped steps in global_steps
    assert all(r["changed"] and r["skipped"] == skipped for r in rows[skipped:])
    assert rows[skipped]["scale"] == 2.0 ** (20 - skipped)  # the window (1000) never doubled it back


def test_fp16_training_after_the_skipped_steps_matches_plain_pytorch():
    result = _fp16_run(1, None, 0)[0]
    ref_losses, ref_state = _fp16_reference(result["rows"], 1)
    applied = [r["loss"] for r in result["rows"] if r["changed"]]
    assert applied == pytest.approx(ref_losses, rel=FP16_LOSS_RTOL)
    assert_weights_close(result["state"], ref_state, dtype="bf16")


def test_fp16_forced_overflow_on_one_rank_skips_the_step_on_every_rank():
    results = _fp16_run(2, 8, 1)
    for result in results:
        rows = result["rows"]
        assert rows[7]["changed"] and not rows[8]["changed"], "step 8 (inf loss on rank 1) must be skipped"
        assert rows[8]["skipped"] == rows[7]["skipped"] + 1
        assert rows[9]["scale"] == rows[8]["scale"] / 2
        assert rows[9]["changed"] and rows[9]["skipped"] == rows[8]["skipped"]
    assert [r["scale"] for r in results[0]["rows"]] == [r["scale"] for r in results[1]["rows"]]
    for key, value in results[0]["state"].items():
        assert torch.equal(results[1]["state"][key], value), key
    ref_losses, ref_state = _fp16_reference(results[0]["rows"], 2)
    assert_weights_close(results[0]["state"], ref_state, dtype="bf16")


def _scale_after_each_update(flags: list[bool], **fp16) -> list[float]:
    scaler = LossScaler(FP16Config(enabled=True, **fp16))
    out = []
    for overflow in flags:
        scaler.update(overflow)
        out.append(scaler.scale)
    return out


# DeepSpeed's DynamicLossScaler.update_scale, by hand. delayed_shift = hysteresis. On overflow: halve if the
# current hysteresis is 1, else decrement it. On a clean step: with consecutive_hysteresis restore it; when
# (iteration - last overflow iteration) % window == 0, double the scale and (without consecutive_hysteresis)
# restore the hysteresis.
T, F = True, False


def test_loss_scaler_hysteresis_delays_the_first_halving():
    # initial 16, hysteresis 2: the first overflow only uses up hysteresis, the second halves, the third halves
    assert _scale_after_each_update([T, T, T], initial_scale_power=4, hysteresis=2) == [16, 8, 4]


def test_loss_scaler_doubles_after_a_window_of_clean_steps():
    # window 2 from the start (iteration 0, last overflow -1): doubles after clean steps 2 and 4
    assert _scale_after_each_update([F, F, F, F], initial_scale_power=4, loss_scale_window=2) == [16, 32, 32, 64]
    # an overflow restarts the window: T@0 halves (hysteresis 1), then doubles 2 clean steps later
    assert _scale_after_each_update([T, F, F, F], initial_scale_power=4, hysteresis=1, loss_scale_window=2) == [
        8,
        8,
        16,
        16,
    ]


def test_loss_scaler_consecutive_hysteresis_restores_it_on_every_clean_step():
    flags = [T, F, T, T, F]
    assert _scale_after_each_update(flags, initial_scale_power=4, hysteresis=2, consecutive_hysteresis=True) == [
        16,
        16,
        16,
        8,
        8,
    ]


def test_loss_scaler_restores_hysteresis_when_the_scale_grows_back():
    # hysteresis 2, window 2: T (hyst 2->1), T (halve to 8), F, F (double to 16, hysteresis back to 2),
    # T (hyst 2->1: no halving), T (halve to 8)
    flags = [T, T, F, F, T, T]
    assert _scale_after_each_update(flags, initial_scale_power=4, hysteresis=2, loss_scale_window=2) == [
        16,
        8,
        8,
        16,
        16,
        8,
    ]


def test_loss_scaler_stops_with_a_clear_error_when_overflowing_at_min_loss_scale():
    # As DeepSpeed (raise_error_at_min_scale): halving stops at min_loss_scale; overflowing there again is fatal.
    assert _scale_after_each_update([T], initial_scale_power=3, hysteresis=1, min_loss_scale=4) == [4]
    scaler = LossScaler(FP16Config(enabled=True, initial_scale_power=2, hysteresis=1, min_loss_scale=4))
    with pytest.raises(FloatingPointError, match="minimum loss scale"):
        scaler.update(True)


def test_loss_scaler_skips_exactly_the_overflowing_steps():
    scaler = LossScaler(FP16Config(enabled=True, initial_scale_power=4, hysteresis=2))
    assert [scaler.update(o) for o in [T, F, T, T, F]] == [T, F, T, T, F]
    assert scaler.skipped_steps == 3


# -- 10. gradient clipping over ranks ----------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2])
def test_tight_gradient_clipping_uses_the_global_norm(world):
    # clip 0.01 is far below every step's gradient norm (~0.3-1), so the clip coefficient differs every step.
    ref_losses, ref_state, _ = reference_for("mlp", STEPS, MICRO_BS * world, clip=0.01)
    assert_matches_reference(list(_features_run("mlp", world, clip=0.01)), ref_losses, ref_state)
    # The test is sensitive to clipping: without it the reference lands elsewhere.
    _, unclipped, _ = reference_for("mlp", STEPS, MICRO_BS * world, clip=0.0)
    assert max((unclipped[k] - ref_state[k]).abs().max().item() for k in ref_state) > 1e-4


# -- 11. learning-rate schedules ---------------------------------------------------------------------------------


def _ds_warmup_gamma(it: int, warmup: int, kind: str) -> float:
    """DeepSpeed WarmupLR._get_gamma; DeepSpeed uses max(2, warmup_num_steps)."""
    warmup = max(2, warmup)
    if it < warmup:
        return math.log(it + 1) / math.log(warmup) if kind == "log" else it / warmup
    return 1.0


def _ds_warmup_lr(it: int, lo: float, hi: float, warmup: int, kind: str) -> float:
    return lo + (hi - lo) * _ds_warmup_gamma(it, warmup, kind)


def _ds_warmup_decay_lr(it: int, lo: float, hi: float, warmup: int, total: int, kind: str) -> float:
    if it < max(2, warmup):
        return _ds_warmup_lr(it, lo, hi, warmup, kind)
    return lo + (hi - lo) * max(0.0, (total - it) / max(1.0, total - max(2, warmup)))


def _ds_warmup_cosine_lr(it: int, base: float, min_ratio: float, warmup: int, total: int, cos_min: float) -> float:
    """DeepSpeed WarmupCosineLR.get_lr_ratio x the optimizer's lr (log warmup)."""
    warmup = max(2, warmup)
    if it < warmup:
        return base * (min_ratio + (1 - min_ratio) * math.log(it + 1) / math.log(warmup))
    real_last_step = it - warmup + 1
    ratio = (1 + math.cos(math.pi * real_last_step / (total - warmup))) / 2
    return base * max(0.0, cos_min + (1 - cos_min) * ratio)


def _engine_with_schedule(kind: str, params: dict, **options) -> infinity.InfinityEngine:
    cfg = config("mlp", extra={"scheduler": {"type": kind, "params": params}}, **options)
    engine, _, _, _ = infinity.initialize(model=make_model("mlp"), config=cfg)
    return engine


def _lr_at_iterations(engine, iterations: range) -> list[float]:
    out = []
    for it in iterations:
        engine.lr_scheduler.step(it)  # DeepSpeed's step(last_batch_iteration)
        out.append(engine.get_lr()[0])
    return out


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_lr_follows_deepspeeds_formula(warmup_type):
    params = {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 5, "warmup_type": warmup_type}
    engine = _engine_with_schedule("WarmupLR", params)
    expected = [_ds_warmup_lr(it, 1e-4, 1e-2, 5, warmup_type) for it in range(9)]
    assert _lr_at_iterations(engine, range(9)) == pytest.approx(expected, rel=1e-12)


def test_warmup_decay_lr_follows_deepspeeds_formula():
    params = {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4, "total_num_steps": 10}
    engine = _engine_with_schedule("WarmupDecayLR", params)
    expected = [_ds_warmup_decay_lr(it, 0.0, 1e-2, 4, 10, "log") for it in range(13)]
    assert _lr_at_iterations(engine, range(13)) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_warmup_cosine_lr_follows_deepspeeds_formula():
    params = {"warmup_min_ratio": 0.1, "warmup_num_steps": 4, "total_num_steps": 10, "cos_min_ratio": 0.01}
    engine = _engine_with_schedule("WarmupCosineLR", params)
    expected = [_ds_warmup_cosine_lr(it, LR, 0.1, 4, 10, 0.01) for it in range(10)]
    assert _lr_at_iterations(engine, range(10)) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_lr_of_one_step_warms_up_over_two_as_deepspeed(warmup_type):
    params = {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 1, "warmup_type": warmup_type}
    engine = _engine_with_schedule("WarmupLR", params)
    expected = [_ds_warmup_lr(it, 1e-4, 1e-2, 1, warmup_type) for it in range(4)]
    assert _lr_at_iterations(engine, range(4)) == pytest.approx(expected, rel=1e-12)


def _train_steps(engine, n_micro: int, dtype=torch.float32) -> list[list[float]]:
    """engine.get_lr() before each micro-step and after the last."""
    data = batches("mlp", MICRO_BS, dtype=dtype)
    lrs = []
    for _ in range(n_micro):
        lrs.append(engine.get_lr())
        x, y = next(data)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    return lrs + [engine.get_lr()]


def test_lr_after_each_optimizer_step_is_deepspeeds():
    params = {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 4, "warmup_type": "linear"}
    engine = _engine_with_schedule("WarmupLR", params)
    lrs = [lr[0] for lr in _train_steps(engine, 6)]
    # DeepSpeed: 1e-3 at construction (iteration -1 -> warmup_min_lr), then iteration k-1 after step k
    expected = [1e-3] + [_ds_warmup_lr(k - 1, 1e-3, 1e-2, 4, "linear") for k in range(1, 7)]
    assert lrs == pytest.approx(expected, rel=1e-12)


WARMUP_100 = {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 100, "warmup_type": "linear"}


def test_lr_schedule_does_not_advance_between_accumulation_boundaries():
    engine = _engine_with_schedule("WarmupLR", WARMUP_100, grad_accum=3)
    lrs = _train_steps(engine, 6)
    # DeepSpeed's warm-up gives iterations -1 (before any step) and 0 the same (minimum) lr.
    assert lrs[0] == lrs[1] == lrs[2] == lrs[3] == lrs[4] == lrs[5] != lrs[6]
    assert engine.lr_scheduler.last_batch_iteration == 1


def test_lr_schedule_does_not_advance_on_a_skipped_fp16_step():
    # As DeepSpeed's _take_model_step: an overflowing step steps neither the optimizer nor the schedule.
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 30, "hysteresis": 1}}
    cfg = config("mlp", extra={"scheduler": {"type": "WarmupLR", "params": WARMUP_100}, **fp16})
    engine, _, _, _ = infinity.initialize(model=make_model("mlp"), config=cfg)
    lrs = _train_steps(engine, 2, dtype=torch.float16)
    assert engine.skipped_steps == 2 and lrs[0] == lrs[1] == lrs[2]


def _lambda_scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, half_per_step)


@pytest.mark.parametrize("world", [1, 2])
def test_lr_scheduler_passed_as_a_callable_is_stepped_by_the_engine(world):
    results = run_distributed(
        train_on_rank, world, "mlp", config("mlp"), STEPS, MICRO_BS, scheduler_factory=_lambda_scheduler
    )
    ref_losses, ref_state, ref_lrs = reference_for("mlp", STEPS, MICRO_BS * world, lr_lambda=half_per_step)
    assert [lr[0] for lr in results[0]["lrs"]] == pytest.approx([LR * 0.5**k for k in range(STEPS)], rel=1e-12)
    assert results[0]["lrs"] == ref_lrs
    assert_matches_reference(results, ref_losses, ref_state)


def test_lambda_lr_built_on_the_returned_optimizer_drives_the_engine():
    results = run_distributed(train_on_rank, 1, "mlp", config("mlp"), STEPS, MICRO_BS, user_lr_lambda=half_per_step)
    ref_losses, ref_state, ref_lrs = reference_for("mlp", STEPS, MICRO_BS, lr_lambda=half_per_step)
    assert results[0]["lrs"] == ref_lrs
    assert_matches_reference(results, ref_losses, ref_state)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # the client opt never steps
def test_lr_scheduler_built_on_the_client_optimizer_drives_the_engine():
    model = make_model("mlp")
    client = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    sched = torch.optim.lr_scheduler.LambdaLR(client, half_per_step)
    engine, _, _, _ = infinity.initialize(model=model, config=config("mlp"), optimizer=client, lr_scheduler=sched)
    lrs = [lr[0] for lr in _train_steps(engine, 3)]
    assert lrs == pytest.approx([LR * 0.5**k for k in range(4)], rel=1e-12)


# -- 12. client optimizers and parameter groups -------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2])
def test_client_adamw_with_param_groups_matches_plain_pytorch(world):
    results = run_distributed(
        train_on_rank, world, "mlp", config("mlp"), STEPS, MICRO_BS, client_optimizer=client_adamw
    )
    ref_losses, ref_state, ref_lrs = reference_for("mlp", STEPS, MICRO_BS * world, make_optimizer=client_adamw)
    assert results[0]["lrs"][0] == [LR, 2 * LR, LR] == ref_lrs[0]
    assert_matches_reference(results, ref_losses, ref_state)


def test_client_adam_with_l2_weight_decay_matches_plain_pytorch():
    results = run_distributed(
        train_on_rank, 1, "mlp", config("mlp"), STEPS, MICRO_BS, client_optimizer=client_adam_l2
    )
    ref_losses, ref_state, _ = reference_for("mlp", STEPS, MICRO_BS, make_optimizer=client_adam_l2)
    assert_matches_reference(results, ref_losses, ref_state)


def _config_adamw_groups(model):
    # model_parameters groups take the config's AdamW hyper-parameters where a group does not set them
    return torch.optim.AdamW(no_decay_groups(model), lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)


@pytest.mark.parametrize("world", [1, 2])
def test_model_parameters_given_as_groups_match_plain_pytorch(world):
    results = run_distributed(
        train_on_rank, world, "mlp", config("mlp"), STEPS, MICRO_BS, model_parameters=no_decay_groups
    )
    ref_losses, ref_state, ref_lrs = reference_for("mlp", STEPS, MICRO_BS * world, make_optimizer=_config_adamw_groups)
    assert results[0]["lrs"][0] == ref_lrs[0] == [LR, 2 * LR, LR]
    assert_matches_reference(results, ref_losses, ref_state)


# -- 13. gradient accumulation --------------------------------------------------------------------------------------


@functools.cache
def _accumulation_run(world: int) -> tuple:
    return tuple(run_distributed(accumulation_session, world, 3, 2))


@pytest.mark.parametrize("world", [1, 2])
def test_gradient_accumulation_boundary_every_third_micro_step(world):
    for result in _accumulation_run(world):
        assert result["boundaries"] == [False, False, True, False, False, True]


@pytest.mark.parametrize("world", [1, 2])
def test_optimizer_steps_only_at_the_accumulation_boundary(world):
    for result in _accumulation_run(world):
        assert result["changed"] == [False, False, True, False, False, True]
        assert result["global_steps"] == [0, 0, 1, 1, 1, 2]


@pytest.mark.parametrize("world", [1, 2])
def test_accumulated_gradients_match_plain_pytorch(world):
    ref_losses, ref_state, _ = reference_for("mlp", 2, MICRO_BS * world, grad_accum=3)
    assert_matches_reference(list(_accumulation_run(world)), ref_losses, ref_state)


# -- 14. data-dependent control flow and prefetch ------------------------------------------------------------------

CONTROL_STEPS = 7  # layers[1] runs on steps 0, 1, 5, 6 and is skipped on steps 2, 3, 4


@functools.cache
def _control_run(world: int) -> tuple:
    # one rank with in-memory shards gathers nothing (its blocks are resident): put them on NVMe instead
    nvme_path = tempfile.mkdtemp(prefix="infinity-control-") if world == 1 else None
    try:
        return tuple(run_distributed(control_flow_session, world, CONTROL_STEPS, nvme_path))
    finally:
        if nvme_path is not None:
            shutil.rmtree(nvme_path, ignore_errors=True)


@pytest.mark.parametrize("world", [1, 2])
def test_forward_that_skips_a_block_on_some_steps_matches_plain_pytorch(world):
    ref = reference_for("skipping", CONTROL_STEPS, MICRO_BS * world, step_kwargs=skip_on_steps_2_to_4)
    assert_matches_reference(list(_control_run(world)), ref.losses, ref.state)


@pytest.mark.parametrize("world", [1, 2])
def test_changed_block_order_invalidates_the_trace_and_is_recorded_afresh(world):
    for result in _control_run(world):
        # one invalidation where the order changes (steps 2 and 5), none while it holds
        assert result["invalidations"] == [0, 0, 1, 1, 1, 2, 2]
        assert result["orders"][1] == [0, 1, 2, 3]
        assert result["orders"][2] == result["orders"][4] == [0, 2, 3]
        assert result["orders"][6] == [0, 1, 2, 3]


@pytest.mark.parametrize("world", [1, 2])
def test_blocks_are_prefetched_on_steady_state_steps(world):
    for result in _control_run(world):
        ready = result["ready_before_pre_hook"]
        assert ready[0] == {0: False, 1: False, 2: False, 3: False}  # first pass: recording, nothing to prefetch
        for step in (1, 6):
            assert ready[step] == {0: False, 1: True, 2: True, 3: True}, step
        for step in (3, 4):  # the re-recorded order [0, 2, 3] is prefetched too
            assert ready[step] == {0: False, 2: True, 3: True}, step
