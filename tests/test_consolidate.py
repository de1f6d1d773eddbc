"""Streaming checkpoint I/O: consolidation (one fp32 state dict from sharded files) and resharding on load
against full_state_dict, and memory bounds of saving and consolidating."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
from dist import run_distributed
from harness import config
from toy_models import batches, make_model

import infinity
from infinity.engine.checkpoint import OPTIM_STATES, CheckpointError, CheckpointFiles, resolve_folder
from infinity.engine.consolidate import choose_format, consolidate


def _train(engine, data, steps: int) -> None:
    for _ in range(steps):
        x, y = next(data)
        if x.is_floating_point():
            x, y = x.to(engine.compute_dtype), y.to(engine.compute_dtype)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()


def _config(kind: str, offload: str, dtype: str, elastic: bool = False) -> dict:
    cfg = config(kind, micro_bs=2, persistence=64, offload_param=offload, dtype=dtype)
    cfg["zero_optimization"]["offload_optimizer"]["device"] = offload
    cfg["zero_optimization"]["elastic_checkpoint"] = elastic
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}}
    return cfg


def train_and_save(ckpt_dir: str, kind: str, offload: str, dtype: str, steps: int) -> dict:
    """On each rank: train `steps`, save; returns the full state dict and the step count."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, _, _, _ = infinity.initialize(model=make_model(kind), config=_config(kind, offload, dtype))
    _train(engine, batches(kind, 2, rank=rank, world_size=world), steps)
    engine.save_checkpoint(ckpt_dir, client_state={"step": steps})
    return {"full": engine.full_state_dict(), "steps": engine.global_steps}


@pytest.mark.parametrize(
    "kind,world,offload,dtype",
    [("gpt", 1, "cpu", "bf16"), ("gpt_functional_tie", 2, "none", "fp32"), ("mlp_h40", 2, "cpu", "fp32")],
)
def test_consolidated_state_dict_equals_full_state_dict(tmp_path, kind, world, offload, dtype):
    results = run_distributed(train_and_save, world, str(tmp_path / "ckpt"), kind, offload, dtype, 3)
    result = consolidate(tmp_path / "ckpt", tmp_path / "model.pt")
    assert result.format == "torch"
    loaded = torch.load(result.path)  # weights_only: plain tensors only
    full = results[0]["full"]
    assert list(loaded) == list(full)  # every name of a tied weight, in state_dict order
    for key, value in full.items():
        assert loaded[key].dtype == torch.float32
        assert torch.equal(loaded[key], value), key
    plain = make_model(kind, seed=123)
    plain.load_state_dict(loaded, strict=True)
    if kind == "gpt":
        assert loaded["lm_head.weight"].data_ptr() == loaded["wte.weight"].data_ptr()  # stored once, as torch.save does
    assert result.parameters == sum(p.numel() for p in plain.parameters())


def _read_safetensors(path) -> dict[str, torch.Tensor]:
    """A reader written from the format's spec, independent of the writer."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16}
    data = raw[8 + n :]
    spans = sorted(v["data_offsets"] for v in header.values())
    assert spans[0][0] == 0 and spans[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))  # contiguous, no overlap
    out = {}
    for name, v in header.items():
        start, end = v["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[start:end]), dtype=dtypes[v["dtype"]]).view(v["shape"])
    return out


def test_safetensors_output_holds_every_name_and_value(tmp_path):
    results = run_distributed(train_and_save, 1, str(tmp_path / "ckpt"), "gpt", "cpu", "fp32", 2)
    result = consolidate(tmp_path / "ckpt", tmp_path / "model.safetensors")
    assert result.format == "safetensors"
    loaded = _read_safetensors(result.path)
    full = results[0]["full"]
    assert set(loaded) == set(full)
    assert all(torch.equal(loaded[k], v) for k, v in full.items())
    try:
        from safetensors.torch import load_file
    except ImportError:
        return
    assert all(torch.equal(t, full[k]) for k, t in load_file(result.path).items())


def test_format_follows_the_suffix_or_the_flag():
    assert choose_format("m.safetensors") == "safetensors"
    assert choose_format("m.pt") == choose_format("m.bin") == "torch"
    assert choose_format("m.safetensors", "torch") == "torch"
    with pytest.raises(ValueError, match="unknown format"):
        choose_format("m.pt", "onnx")


MEMORY_PROBE = textwrap.dedent(
    """
    import json, sys
    from infinity.engine.consolidate import consolidate

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to the current RSS
    before = status("VmRSS:")
    consolidate(sys.argv[1], sys.argv[2] + "/model.pt")
    print(json.dumps({"before": before, "peak": status("VmHWM:")}))
    """
)


def test_consolidation_memory_stays_near_the_largest_tensor(tmp_path):
    from infinity.models.mlp import MLP

    torch.manual_seed(0)
    model = MLP(in_features=1536, hidden=1536, out_features=8, n_layers=6)  # 6 x 9.4 MB weights
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "block_classes": ["MLPLayer"]},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    model_bytes = sum(p.numel() for p in model.parameters()) * 4
    largest = 1536 * 1536 * 4
    engine, _, _, _ = infinity.initialize(model=model, config=cfg)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    probe = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(tmp_path / "ckpt"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    rss = json.loads(probe.stdout.strip().splitlines()[-1])
    grown = rss["peak"] - rss["before"]
    # One tensor at a time (~1x the largest, measured) plus the reader's and writer's own few MB.
    assert grown < 2 * largest + 6e6, f"peak RSS grew {grown / 1e6:.1f} MB; largest tensor {largest / 1e6:.1f} MB"
    assert grown < model_bytes / 2
    loaded = torch.load(tmp_path / "model.pt")
    assert all(torch.equal(loaded[k], v) for k, v in engine.full_state_dict().items())


def test_save_holds_one_shards_state_in_memory_at_a_time(tmp_path, monkeypatch):
    import weakref

    engine, _, _, _ = infinity.initialize(model=make_model("mlp_h40"), config=_config("mlp_h40", "cpu", "fp32"))
    _train(engine, batches("mlp_h40", 2), 1)
    live = {"now": 0, "peak": 0}

    def track(t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        live["now"] += nbytes
        live["peak"] = max(live["peak"], live["now"])
        weakref.finalize(t, lambda: live.__setitem__("now", live["now"] - nbytes))
        return t

    read = engine.shards.read
    monkeypatch.setattr(engine.shards, "read", lambda flat, kind: track(read(flat, kind)))
    engine.save_checkpoint(str(tmp_path))
    largest_shard = max(f.shard_numel for f in engine.flats) * 4
    everything = sum(f.shard_numel for f in engine.flats) * 4 * 4  # weights, master and two moments
    assert live["peak"] <= 3 * largest_shard < everything / 2
    assert live["now"] == 0


def test_consolidation_refuses_a_corrupted_rank_file(tmp_path):
    run_distributed(train_and_save, 2, str(tmp_path / "ckpt"), "mlp_h40", "none", "fp32", 1)
    victim = next((tmp_path / "ckpt" / "global_step1").glob("zero_pp_rank_1_*optim_states.pt"))
    data = bytearray(victim.read_bytes())
    data[-200] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{victim.name}.*corrupted"):
        consolidate(tmp_path / "ckpt", tmp_path / "model.pt")
    assert not (tmp_path / "model.pt").exists()


# -- resharding on load ------------------------------------------------------------------------------------


def load_resave(src: str, dst: str, kind: str, offload: str, elastic: bool, steps_after: int) -> dict:
    """On each rank: a fresh engine (other seed) loads `src`, saves to `dst`, then trains `steps_after` more."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, _, _, _ = infinity.initialize(
        model=make_model(kind, seed=7), config=_config(kind, offload, "fp32", elastic)
    )
    _, client = engine.load_checkpoint(src)
    engine.save_checkpoint(dst)
    loaded = engine.full_state_dict()
    # The global batch of `world` ranks with micro batch m is the same rows as one rank with world*m.
    data = batches(kind, 4 // world, rank=rank, world_size=world)
    for _ in range(client["step"]):
        next(data)
    _train(engine, data, steps_after)
    return {"loaded": loaded, "after": engine.full_state_dict(), "steps": engine.global_steps, "lr": engine.get_lr()}


def _assert_same_optimizer_state(a, b) -> None:
    with CheckpointFiles(resolve_folder(a)) as fa, CheckpointFiles(resolve_folder(b)) as fb:
        flats = fa.reader("model", 0).obj["flats"]
        assert flats.keys() == fb.reader("model", 0).obj["flats"].keys()
        for name, meta in flats.items():
            kinds = ("param", *OPTIM_STATES) if meta["trainable"] else ("param",)
            for kind in kinds:
                assert torch.equal(
                    fa.read_range(kind, name, 0, meta["numel"]), fb.read_range(kind, name, 0, meta["numel"])
                )
            if meta["trainable"]:
                for rank in range(fb.world_size):
                    assert fb.reader("optim", rank).obj["shards"][name]["step"] == 3


@pytest.mark.parametrize("saved_world,loaded_world", [(2, 1), (1, 2)])
def test_elastic_load_reshards_weights_and_optimizer_state_exactly(tmp_path, saved_world, loaded_world):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    saved = run_distributed(train_and_save, saved_world, src, "mlp_h40", "cpu", "fp32", 3)
    # The run continued on its own world size, for comparison after two more steps.
    straight = run_distributed(load_resave, saved_world, src, str(tmp_path / "same"), "mlp_h40", "cpu", False, 2)
    resharded = run_distributed(load_resave, loaded_world, src, dst, "mlp_h40", "cpu", True, 2)
    for r in resharded:
        assert all(torch.equal(r["loaded"][k], v) for k, v in saved[0]["full"].items())
        assert r["steps"] == 5 and r["lr"] == straight[0]["lr"]
        for key, value in straight[0]["after"].items():  # other world size: same math, another summation order
            torch.testing.assert_close(r["after"][key], value, rtol=1e-5, atol=1e-6)
    _assert_same_optimizer_state(src, dst)


def refuse_other_world(src: str) -> str:
    engine, _, _, _ = infinity.initialize(model=make_model("mlp_h40"), config=_config("mlp_h40", "none", "fp32"))
    try:
        engine.load_checkpoint(src)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


def test_other_world_size_without_elastic_checkpoint_is_refused_saying_how_to_reshard(tmp_path):
    run_distributed(train_and_save, 2, str(tmp_path), "mlp_h40", "none", "fp32", 1)
    (message,) = run_distributed(refuse_other_world, 1, str(tmp_path))
    assert "written by 2 rank(s) and this run has 1" in message
    assert '"elastic_checkpoint": true' in message
