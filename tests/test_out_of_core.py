"""Out of core: models whose training state is far larger than the host and device budgets, built
without materializing them (infinity.Init), trained with NVMe offload, against plain PyTorch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist import run_distributed
from harness import WEIGHT_DECAY, assert_weights_close
from out_of_core_cases import LR, gpt_config, nvme_config, train_from_init
from toy_models import batches

import infinity
from infinity.models.gpt import GPT

STEPS = 3


def _plain_from(initial: dict, world: int) -> tuple[list[float], dict]:
    """Plain PyTorch from the engine's initial weights, on the ranks' concatenated batches."""
    model = GPT(gpt_config())
    model.load_state_dict(initial)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)
    data = batches("gpt", 2 * world)
    losses = []
    for _ in range(STEPS):
        x, y = next(data)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.parametrize("world", [1, 2])
def test_state_four_times_the_budgets_trains_like_plain_pytorch(tmp_path, world):
    params = sum(p.numel() for p in GPT(gpt_config()).parameters())
    state_bytes = 16 * params // world  # fp32 weights, gradients and two moments, per rank
    budget = state_bytes // 4
    results = run_distributed(train_from_init, world, str(tmp_path), STEPS, budget, budget, timeout_s=180)
    assert results[0]["built_on_meta"]
    ref_losses, ref_state = _plain_from(results[0]["initial"], world)
    losses = [sum(r["losses"][i] for r in results) / world for i in range(STEPS)]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_weights_close(results[0]["state"], ref_state)
    for r in results:
        for tier in ("host", "device"):
            stats = r["stats"][tier]
            assert stats["budget_bytes"] == budget
            assert 0 < stats["high_water_bytes"] <= budget, (tier, stats)


def test_initializers_of_a_meta_model_give_the_usual_statistics(tmp_path):
    (result,) = run_distributed(train_from_init, 1, str(tmp_path), 0, None, None)
    initial = result["initial"]
    assert torch.equal(initial["blocks.0.ln_1.weight"], torch.ones(32))
    assert abs(initial["blocks.0.attn.c_attn.weight"].std().item() - 0.02) < 2e-3
    assert initial["wte.weight"] is initial["lm_head.weight"] or torch.equal(
        initial["wte.weight"], initial["lm_head.weight"]
    )


def test_peak_rss_stays_below_the_model_state(tmp_path):
    """A ~101M-parameter model (1.6 GB of training state) with 96 MiB budgets, in a fresh process."""
    n_layer, n_embd, budget = 32, 512, 96 << 20
    script = Path(__file__).with_name("out_of_core_cases.py")
    env = {**os.environ, "PYTHONPATH": str(script.parent)}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(n_layer), str(n_embd), str(budget), str(budget)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["state_bytes"] >= 4 * budget
    assert out["peak_rss_bytes"] < out["state_bytes"], out
    assert out["stats"]["host"]["high_water_bytes"] <= budget
    assert out["stats"]["device"]["high_water_bytes"] <= budget
    assert out["streamed_elems"] >= out["params"]
    assert torch.isfinite(torch.tensor(out["loss"]))


def test_pretrained_weights_load_block_by_block_from_torch_and_safetensors(tmp_path):
    source = GPT(gpt_config())
    torch.save(source.state_dict(), tmp_path / "model.pt")
    from safetensors.torch import save_file

    shards = tmp_path / "st"
    shards.mkdir()
    items = {k: v.contiguous() for k, v in source.state_dict().items() if k != "lm_head.weight"}
    keys = sorted(items)
    save_file({k: items[k] for k in keys[: len(keys) // 2]}, str(shards / "a.safetensors"))
    save_file({k: items[k] for k in keys[len(keys) // 2 :]}, str(shards / "b.safetensors"))
    for where in (tmp_path / "model.pt", shards):
        cfg = nvme_config(str(tmp_path))
        with infinity.Init(config=cfg):
            model = GPT(gpt_config())
        engine, _, _, _ = infinity.initialize(model=model, config=cfg)
        engine.load_full_state(where)
        loaded = engine.full_state_dict()
        for key, value in source.state_dict().items():
            assert torch.equal(loaded[key], value), (where, key)
        engine.close()


def test_a_safetensors_index_names_the_files_read_and_a_weight_in_two_files_is_refused(tmp_path):
    """A folder holding a stale copy beside the indexed files loads the indexed weights only; without an
    index, a weight found in two files is an error rather than whichever file came last."""
    from safetensors.torch import save_file

    source = GPT(gpt_config())
    items = {k: v.contiguous() for k, v in source.state_dict().items() if k != "lm_head.weight"}
    folder = tmp_path / "st"
    folder.mkdir()
    save_file(items, str(folder / "model-00001-of-00001.safetensors"))
    save_file({k: torch.zeros_like(v) for k, v in items.items()}, str(folder / "stale.safetensors"))
    cfg = nvme_config(str(tmp_path))
    with infinity.Init(config=cfg):
        model = GPT(gpt_config())
    engine, _, _, _ = infinity.initialize(model=model, config=cfg)
    with pytest.raises(ValueError, match="more than one safetensors file"):
        engine.load_full_state(folder)
    index = {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in items}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert engine.load_full_state(folder) == []
    loaded = engine.full_state_dict()
    for key, value in source.state_dict().items():
        assert torch.equal(loaded[key], value), key
    index["weight_map"]["transformer.wte.weight"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        engine.load_full_state(folder)
    engine.close()
