"""The memory estimator against hand computation (the layout in infinity/estimator's docstring), the stage
table and its advice, and the commands that print them. tests/test_estimator_engine.py holds the same
figures against real engines."""

from __future__ import annotations

import json
import re

import pytest

from infinity.cli import main
from infinity.estimator import (
    Machine,
    ModelSize,
    advise,
    collective_bytes_per_step,
    estimate,
    fits,
    gpt_model_size,
    home_bytes_per_rank,
    largest_fitting_params,
    probe_machine,
    size_from_params,
    stage_table,
)
from infinity.models.gpt import count_params, gpt_preset

pytestmark = pytest.mark.unit

# Ten blocks of L elements over N = 4 ranks: each flat's shard S = L/4 is a whole number of 1024-element
# units and every slot a whole number of 4 KiB pages, so the hand figures need no padding but the 8-bit one.
L = 4 * 1024 * 25_000
P = 10 * L
GPUS, NODES = 2, 2
S = L // 4  # one flat's shard per rank
ST = 10 * S  # all of a rank's shards
B = S + 1024  # the largest block's shard as the memory plan allows for it (padding included)
OPT_STAGING = 4 * S + 5 * (8 * S + 8 * S)  # gradient read-modify-write + (window 4 + 1) fp32 shards' state
WORK3 = 4 * 2 * L  # bf16: the running and prefetched block's weights, the running block's grads and their reduction


def pad(n: int) -> int:
    return -(-n // 4096) * 4096


@pytest.mark.parametrize(
    "param,optim,device,host,nvme",
    [
        ("none", "none", WORK3 + (2 + 4 + 8 + 4) * ST, 0, 0),
        ("none", "cpu", WORK3 + 2 * ST, GPUS * 16 * ST, 0),
        ("cpu", "cpu", WORK3, GPUS * 18 * ST, 0),
        # on NVMe: master 4, moments 8, and (clipping) the gradient in bf16, 2 (+ the bf16 parameter, 2)
        ("none", "nvme", WORK3 + 2 * ST, GPUS * OPT_STAGING, GPUS * 14 * ST),
        ("cpu", "nvme", WORK3, GPUS * (2 * ST + OPT_STAGING), GPUS * 14 * ST),
        ("nvme", "nvme", WORK3, GPUS * (2 * 500_000_000 + OPT_STAGING), GPUS * 16 * ST),
    ],
)
def test_stage3_bf16_needs_match_hand_computation(param, optim, device, host, nvme):
    need = estimate(ModelSize(P, L), param, optim, gpus_per_node=GPUS, nodes=NODES, dtype_bytes=2)
    assert (need.device_bytes, need.host_bytes, need.nvme_bytes) == (device, host, nvme)


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_and_2_replicate_the_parameters_and_partition_the_rest(stage):
    # Every device holds all P bf16 weights and the running block's gradients and their reduction buffer; the
    # optimizer's master, moments and gradient accumulator are partitioned as at stage 3.
    for optim, device_states, host_states in (("none", 16 * ST, 0), ("cpu", 0, 16 * ST)):
        need = estimate(ModelSize(P, L), "none", optim, GPUS, NODES, 2, stage=stage)
        assert need.device_bytes == 2 * P + 2 * 2 * L + device_states
        assert need.host_bytes == GPUS * host_states
    with pytest.raises(ValueError, match="offload_param='cpu' at stage 2: parameters are offloaded at stage 3"):
        estimate(ModelSize(P, L), "cpu", "cpu", stage=2)


@pytest.mark.parametrize(
    "moments,state_per_shard", [("fp32", 8 * S), ("bf16", 4 * S), ("8bit", pad(2 * (S + 4 * (S // 256))))]
)
def test_moment_formats_take_their_bytes_on_nvme(moments, state_per_shard):
    # bf16 weights on NVMe: parameter 2S, master 4S, moments, gradient 2S (clipping on: one micro-batch's
    # gradient waits there, in bf16 as it was computed).
    need = estimate(ModelSize(P, L), "nvme", "nvme", GPUS, NODES, 2, moments=moments)
    assert need.nvme_bytes == GPUS * 10 * (2 * S + 4 * S + state_per_shard + 2 * S)


def test_nvme_gradients_take_a_slot_only_where_they_wait_for_the_step():
    size = ModelSize(P, L)
    clipped = estimate(size, "nvme", "nvme", 1, 1, 2, clip=True).nvme_bytes
    in_backward = estimate(size, "nvme", "nvme", 1, 1, 2, clip=False).nvme_bytes
    accumulating = estimate(size, "nvme", "nvme", 1, 1, 2, clip=False, accumulation=2).nvme_bytes
    assert clipped - in_backward == 2 * P  # one bf16 micro-batch waits as computed
    assert accumulating - in_backward == 4 * P  # micro-batches are summed in fp32
    assert estimate(size, "nvme", "nvme", 1, 1, 4, clip=True).nvme_bytes - estimate(size, "nvme", "nvme", 1, 1, 4,
                    clip=False).nvme_bytes == 4 * P  # fmt: skip
    # in host memory the accumulator is always there
    assert estimate(size, "none", "cpu", clip=False).host_bytes == estimate(size, "none", "cpu").host_bytes


def test_fp32_master_is_the_parameter_slot_where_both_share_a_tier():
    size = ModelSize(P, L)
    assert estimate(size, "cpu", "cpu", dtype_bytes=4).host_bytes == 16 * P  # 4 master/param + 8 moments + 4 grad
    assert estimate(size, "nvme", "nvme", dtype_bytes=4).nvme_bytes == 16 * P  # one NVMe slot too
    assert estimate(size, "cpu", "nvme", dtype_bytes=4).nvme_bytes == 16 * P  # different tiers: the master is apart
    assert estimate(size, "cpu", "nvme", dtype_bytes=4).host_bytes - estimate(size, "none", "nvme").host_bytes == 4 * P
    # without CUDA the device is host memory: a 'none' parameter and a 'cpu' optimizer share it
    on_gpu = home_bytes_per_rank(size, "none", "cpu", dtype_bytes=4)
    on_cpu = home_bytes_per_rank(size, "none", "cpu", dtype_bytes=4, device_is_host=True)
    assert on_gpu["cpu"] - on_cpu["cpu"] == 4 * P and on_gpu["none"] == on_cpu["none"] == 4 * P


def test_each_flat_is_padded_to_1024_elements_per_shard_and_4_KiB_per_slot():
    # three flats of 1000 elements over 2 ranks: 500-element shards become 1024; fp32 on NVMe, clipping on:
    # a 4 KiB parameter/master slot, 8 KiB of moments and a 4 KiB gradient slot per flat and rank
    size = ModelSize(3000, 1000, flat_params=(1000, 1000, 1000))
    assert estimate(size, "nvme", "nvme", 1, 2, dtype_bytes=4).nvme_bytes == 3 * (4096 + 8192 + 4096)
    # 8-bit moments: 2 * (1024 + 4 * 4) bytes, one page
    assert estimate(size, "nvme", "nvme", 1, 2, dtype_bytes=4, moments="8bit").nvme_bytes == 3 * 3 * 4096
    with pytest.raises(ValueError, match="flat_params sum to 2000, not total_params=3000"):
        ModelSize(3000, 1000, flat_params=(1000, 1000))


def test_a_frozen_flat_holds_its_parameters_alone():
    # the three flats above, one of them frozen: its 4 KiB parameter slot per rank, no master, moments or gradient
    size = ModelSize(3000, 1000, flat_params=(1000, 1000), frozen_flat_params=(1000,))
    assert size.trainable_params == 2000 and size.frozen_params == 1000
    assert estimate(size, "nvme", "nvme", 1, 2, dtype_bytes=4).nvme_bytes == 2 * (4096 + 8192 + 4096) + 4096
    # bf16 on the host: the frozen flat adds its 16-bit parameters (1024 x 2 bytes, one page) and nothing else
    trainable = ModelSize(2000, 1000, flat_params=(1000, 1000))
    with_frozen = home_bytes_per_rank(size, "cpu", "cpu", 2, dtype_bytes=2)
    without = home_bytes_per_rank(trainable, "cpu", "cpu", 2, dtype_bytes=2)
    assert with_frozen["cpu"] - without["cpu"] == 4096 and with_frozen["nvme"] == without["nvme"] == 0
    # a bare count: the trainable parameters alone are taken as flats of the largest block
    assert ModelSize(3000, 1000, frozen_flat_params=(1000,)).flat_counts() == [(1000, 2)]
    with pytest.raises(ValueError, match="not total_params=3000 less the 500 frozen"):
        ModelSize(3000, 1000, flat_params=(1000, 1000), frozen_flat_params=(500,))
    with pytest.raises(ValueError, match="frozen_flat_params sum to 4000, more than total_params=3000"):
        ModelSize(3000, 1000, frozen_flat_params=(4000,))


def test_frozen_flats_are_gathered_at_stage_3_and_never_reduced():
    # two ranks, bf16, one micro-batch: a frozen flat's padded 2048 elements cross twice at stage 3 (forward and
    # backward gathers), each pass (N-1)/N of them at 2 bytes; at stages 1 and 2 (replicated, no update) never
    size = ModelSize(3000, 1000, flat_params=(1000, 1000), frozen_flat_params=(1000,))
    trainable = ModelSize(2000, 1000, flat_params=(1000, 1000))
    assert collective_bytes_per_step(size, 3, 2) - collective_bytes_per_step(trainable, 3, 2) == 2 * 2048 * 2 // 2
    for stage in (1, 2):
        assert collective_bytes_per_step(size, stage, 2) == collective_bytes_per_step(trainable, stage, 2)


def test_bad_choices_are_refused_naming_the_fix():
    size = ModelSize(P, L)
    with pytest.raises(ValueError, match="moments='8bit' with offload_optimizer='none'"):
        estimate(size, "none", "none", moments="8bit")
    with pytest.raises(ValueError, match="moments='int4'.*fp32, bf16, 8bit"):
        estimate(size, "none", "cpu", moments="int4")
    with pytest.raises(ValueError, match="stage=0: infinity implements ZeRO stages 1, 2 and 3"):
        estimate(size, "none", "cpu", stage=0)
    with pytest.raises(ValueError, match="offload_param='disk': choose one of none, cpu, nvme"):
        estimate(size, "disk", "nvme")


def test_no_offload_model_states_are_deepspeeds_18_bytes_per_parameter_per_rank():
    # DeepSpeed: 2 (16-bit weights) + 4 (fp32 grads) + 12 (fp32 master, m, v) bytes per parameter, over ranks.
    size = ModelSize(8 * 1024 * 1000, 0)  # one flat; no working set
    assert estimate(size, "none", "none", gpus_per_node=8, nodes=1).device_bytes == 18 * size.total_params // 8


def test_gpt_preset_is_counted_on_the_meta_device():
    size = gpt_model_size("tiny")
    assert size.total_params == count_params(gpt_preset("tiny")) == 34_688
    # tiny: n_embd 32. A block: two LayerNorms (2*64) + 12*32^2 weights + 288 biases; the root: wte 256*32,
    # wpe 32*32, ln_f 64 (the head is tied to wte).
    assert size.largest_block_params == max(128 + 12 * 32 * 32 + 288, 256 * 32 + 32 * 32 + 64) == 12_704
    assert sorted(size.flat_params) == [9_280, 12_704, 12_704]  # the root and two layers, one flat each
    big = gpt_model_size("13b")  # 13B parameters are never allocated
    assert big.total_params == count_params(gpt_preset("13b"))


def test_bare_parameter_count_guesses_a_gpt_shaped_largest_block():
    size = size_from_params(13e9)
    hidden = (13e9 * 128 / 12) ** (1 / 3)  # depth ~ hidden/128, as in GPT-3 13B (5120 wide, 40 deep)
    assert size.largest_block_params == int(12 * hidden * hidden)
    assert 5000 < hidden < 5300


def test_largest_fitting_model_is_the_boundary_of_the_fit():
    machine = Machine(device_bytes=10**15, devices=1, host_bytes=180 * 10**9, nvme_bytes=0, nvme_path="/x")
    n = largest_fitting_params(machine, "cpu", "cpu")
    # Host holds 18 bytes per parameter (bf16 weights + fp32 master, moments, grads): 180 GB / 18 = 10B.
    assert n == pytest.approx(10**10, rel=1e-3)
    assert fits(estimate(size_from_params(n), "cpu", "cpu"), machine)
    assert not fits(estimate(size_from_params(n * 1.001), "cpu", "cpu"), machine)


def test_without_a_gpu_device_and_host_share_the_memory():
    need = estimate(ModelSize(P, L), "none", "cpu")
    both = need.device_bytes + need.host_bytes
    assert fits(need, Machine(None, 1, both, 0, "/x"))
    assert not fits(need, Machine(None, 1, both - 1, 0, "/x"))
    assert not fits(need, Machine(None, 1, both, 0, "/x"), ranks_here=2)  # two ranks' device tiers in one host


# -- which stage fits -------------------------------------------------------------------------------------------


def test_stage_3_sends_one_and_a_half_times_stage_2s_bytes_between_ranks():
    size = ModelSize(P, L)  # P is a whole number of shards at N = 4: no padding
    per_pass = 3 * 2 * P // 4  # a ring collective over P bf16 elements: each rank sends (N-1)/N of them
    assert collective_bytes_per_step(size, 2, 4) == 2 * per_pass  # reduce-scatter, all-gather of the update
    assert collective_bytes_per_step(size, 3, 4) == 3 * per_pass  # all-gather twice, reduce-scatter
    assert collective_bytes_per_step(size, 1, 4) == 3 * per_pass  # all-reduce (twice a reduce-scatter), all-gather
    assert collective_bytes_per_step(size, 3, 4, accumulation=2) == 6 * per_pass  # gathers every micro-batch
    assert collective_bytes_per_step(size, 2, 4, accumulation=2) == 3 * per_pass
    assert collective_bytes_per_step(size, 3, 1) == 0


GB = 10**9


def test_stage_table_marks_each_stage_and_offload_against_the_machine():
    # 1e9 bf16 parameters on 8 GPUs of 10 GB: stages 1-2 need the 2 GB of replicated weights plus the
    # optimizer's 16/8 GB per device unless offloaded; stage 3 needs 2.25 GB per device without offload.
    size = ModelSize(P, L)
    machine = Machine(device_bytes=3 * GB, devices=8, host_bytes=200 * GB, nvme_bytes=0, nvme_path="/x")
    rows = {row.key: row for row in stage_table(size, machine)}
    assert len(rows) == 12
    assert not rows[(2, "none", "none")].fits  # 2P + 16P/8 = 4.1 GB per device
    assert rows[(2, "none", "cpu")].fits and rows[(1, "none", "cpu")].fits
    assert not rows[(2, "none", "nvme")].fits and not rows[(3, "nvme", "nvme")].fits  # no disk here
    assert not rows[(3, "none", "none")].fits and rows[(3, "none", "cpu")].fits  # 18P/8 + 8L = 3.12 GB; 2P/8 + 8L
    for row in rows.values():
        assert row.fits == (row.need.device_bytes <= 3 * GB and row.need.host_bytes <= 200 * GB
                            and row.need.nvme_bytes == 0)  # fmt: skip


def test_stage_3_where_stage_2_fits_gets_the_waste_note():
    size = ModelSize(P, L)
    machine = Machine(device_bytes=80 * GB, devices=4, host_bytes=500 * GB, nvme_bytes=10**13, nvme_path="/x")
    advice = advise(size, machine, 3, "cpu", "cpu")
    assert advice.fits
    assert "stage 2 (offload_optimizer cpu) fits too" in advice.note and "1.5x stage 2's traffic" in advice.note
    assert "set zero_optimization.stage to 2 and remove offload_param" in advice.note
    assert advise(size, machine, 2, "none", "cpu").note is None  # already the cheapest
    stage1 = advise(size, machine, 1, "none", "cpu").note
    assert "stage 2 (offload_optimizer cpu) fits too" in stage1 and "half the gradient traffic" in stage1


def test_stage_3_is_the_only_fit_where_replicated_parameters_do_not_fit():
    size = ModelSize(P, L)  # 2 GB of bf16 weights: more than a 1.5 GB device
    machine = Machine(device_bytes=1.5 * GB, devices=4, host_bytes=500 * GB, nvme_bytes=10**13, nvme_path="/x")
    assert advise(size, machine, 3, "cpu", "cpu").note is None
    refused = advise(size, machine, 2, "none", "cpu")
    assert not refused.fits and "device memory: needs" in refused.shortfall
    assert refused.note == "stage 3 (offload_param none, offload_optimizer cpu) fits: use it"


def test_a_model_that_fits_nowhere_says_so():
    machine = Machine(device_bytes=GB, devices=1, host_bytes=GB, nvme_bytes=GB, nvme_path="/x")
    advice = advise(ModelSize(P, L), machine, 3, "nvme", "nvme")
    assert not advice.fits and "disk: needs" in advice.shortfall
    assert advice.note.startswith("no stage or offload fits this machine")


# -- the commands ----------------------------------------------------------------------------------------------


def test_estimate_command_prints_the_stage_table_and_the_largest_fit(capsys):
    assert main(["estimate", "--params", "13e9", "--gpus", "8", "--nodes", "2", "--moments", "8bit"]) == 0
    out = capsys.readouterr().out
    assert "13.00B parameters" in out and "2 node(s) x 8 GPU(s)" in out and "moments 8bit" in out
    table = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"], ["3"])]
    keys = {(int(t[0]), t[1], t[2]) for t in table if len(t) > 8}
    assert {(1, "none", "cpu"), (2, "none", "nvme"), (3, "cpu", "cpu"), (3, "nvme", "nvme")} <= keys
    assert all(t[-1] in ("yes", "no") for t in table if len(t) > 8)
    assert "Best fit here:" in out or "Nothing fits here" in out
    assert "Largest overall:" in out
    # the NVMe rows are a budgeted run's; a run without a budget may grow into a quarter of the memory here
    assert re.search(r"may hold up to [0-9.]+ [KMGT]?B more per node here than its row says", out)
    assert main(["estimate", "--model", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "34.69K parameters" in out and "Best fit here: stage 2 (offload_optimizer none)" in out


def _config_file(tmp_path, stage: int, param: str, optim: str) -> str:
    path = tmp_path / "ds.json"
    zero = {"stage": stage, "offload_optimizer": {"device": optim, "nvme_path": str(tmp_path)}}
    if param != "none":
        zero["offload_param"] = {"device": param, "nvme_path": str(tmp_path)}
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}))
    return str(path)


def test_config_command_says_a_stage_3_config_wastes_traffic_where_stage_2_fits(tmp_path, capsys):
    assert main(["config", _config_file(tmp_path, 3, "cpu", "cpu"), "--model", "tiny", "--world-size", "2"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)  # stdout is still the resolved config alone
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("fit: stage 3 (offload_param cpu, offload_optimizer cpu), moments fp32, GPT 'tiny' on 2")
    assert "fits this machine" in line
    assert "Note: stage 2 (offload_optimizer cpu) fits too" in line and "x stage 2's traffic" in line


def test_config_command_says_what_fits_where_the_configs_choice_does_not(tmp_path, capsys):
    assert main(["config", _config_file(tmp_path, 3, "nvme", "nvme"), "--model", "13b"]) == 0
    (line,) = capsys.readouterr().err.strip().splitlines()
    machine = probe_machine(tmp_path)
    rows = stage_table(gpt_model_size("13b"), machine, 1, dtype_bytes=4)
    mine = next(row for row in rows if row.key == (3, "nvme", "nvme"))
    # 13B in fp32 needs 16 bytes per parameter on NVMe (207 GB): more than most development disks
    assert ("does NOT fit this machine" in line) == (not mine.fits)
    if not any(row.fits for row in rows):
        assert "Note: no stage or offload fits this machine" in line
    elif not mine.fits:
        assert "fits: use it" in line


def test_config_command_reports_a_stage_the_estimator_cannot_estimate(tmp_path, capsys):
    assert main(["config", _config_file(tmp_path, 0, "none", "cpu"), "--model", "tiny"]) == 0
    assert capsys.readouterr().err.strip() == "fit: not estimated: stage=0: infinity implements ZeRO stages 1, 2 and 3"
