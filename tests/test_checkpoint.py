"""Sharded checkpoints: exact resume, atomic publication, and damaged files detected by name."""

from __future__ import annotations

import errno
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from dist import run_distributed
from harness import config, train_steps
from toy_models import batches, make_model

import infinity
from infinity.engine.checkpoint import (
    MANIFEST,
    CheckpointError,
    list_checkpoints,
    model_file,
    newest_verified_checkpoint,
    optim_file,
    verify_checkpoint,
)
from infinity.engine.checkpoint_folder import seal_manifest

pytest_plugins = ["storage_fixtures"]  # a tiny tmpfs for a full disk


def _config(offload: str) -> dict:
    cfg = config(micro_bs=2, persistence=64, offload_param=offload, offload_optimizer=offload)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-2}}
    return cfg


def _mlp_config() -> dict:
    return config("mlp_h40", micro_bs=2, persistence=64)


def train_save_resume(ckpt_dir: str, offload: str, n: int, m: int) -> dict:
    """N steps, save, then a fresh engine loads and trains M more; and N+M uninterrupted for comparison."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    straight, _, _, _ = infinity.initialize(model=make_model("gpt"), config=_config(offload))
    train_steps(straight, batches("gpt", 2, rank=rank, world_size=world), n + m)

    first, _, _, _ = infinity.initialize(model=make_model("gpt"), config=_config(offload))
    data = batches("gpt", 2, rank=rank, world_size=world)
    train_steps(first, data, n)
    first.save_checkpoint(ckpt_dir, client_state={"data_step": n})

    resumed, _, _, _ = infinity.initialize(model=make_model("gpt", seed=99), config=_config(offload))
    _, client = resumed.load_checkpoint(ckpt_dir)
    data = batches("gpt", 2, rank=rank, world_size=world)
    for _ in range(client["data_step"]):
        next(data)
    train_steps(resumed, data, m)
    return {
        "straight": straight.full_state_dict(),
        "resumed": resumed.full_state_dict(),
        "steps": (straight.global_steps, resumed.global_steps),
        "lr": (straight.get_lr(), resumed.get_lr()),
    }


@pytest.mark.parametrize("world,offload", [(1, "none"), (2, "cpu")])
def test_resume_is_bit_exact(tmp_path, world, offload):
    results = run_distributed(train_save_resume, world, str(tmp_path), offload, 3, 3)
    for r in results:
        assert r["steps"][0] == r["steps"][1] == 6
        assert r["lr"][0] == r["lr"][1]
        for key, value in r["straight"].items():
            assert torch.equal(r["resumed"][key], value), key
    assert (tmp_path / "latest").read_text() == "global_step3"


def _saved_engine(tmp_path):
    engine, _, _, _ = infinity.initialize(model=make_model("mlp_h40"), config=_mlp_config())
    train_steps(engine, batches("mlp_h40", 2), 2)
    folder = engine.save_checkpoint(str(tmp_path))
    return engine, folder


@pytest.mark.parametrize("change", ["renamed", "reshaped"])
def test_a_model_whose_buffers_differ_is_refused_before_any_weight_is_loaded(tmp_path, change):
    """The checkpoint's weights went in first and a buffer that was not there (KeyError) or had another shape
    (RuntimeError) stopped the load after them: a half-loaded model. It is a RunMismatch naming the buffer,
    and the engine keeps every weight it had."""
    cfg = config("buffers", micro_bs=2, block_classes=("ScaledLayer",))
    engine, _, _, _ = infinity.initialize(model=make_model("buffers"), config=cfg)
    train_steps(engine, batches("buffers", 2), 1)
    engine.save_checkpoint(str(tmp_path))
    engine.close()
    other = make_model("buffers", seed=3)
    layer = next(m for m in other.modules() if hasattr(m, "scale"))
    if change == "renamed":
        scale = layer.scale
        del layer._buffers["scale"]
        layer.register_buffer("gain", scale)
    else:
        layer.register_buffer("scale", torch.ones(3))
    fresh, _, _, _ = infinity.initialize(model=other, config=cfg)
    before = fresh.full_state_dict()
    what = (
        r"gain' is not in the checkpoint" if change == "renamed" else r"scale' has shape \[\d+\] there and \[3\] here"
    )
    with pytest.raises(CheckpointError, match=f"holds a different model: buffer '[a-z.0-9]*{what}"):
        fresh.load_checkpoint(str(tmp_path))
    after = fresh.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    fresh.close()


def test_a_non_persistent_buffer_added_since_the_save_keeps_its_value_and_the_rest_loads(tmp_path):
    """Non-persistent buffers (position ids, caches) are no part of the model's state: one the checkpoint lacks
    is no mismatch."""
    cfg = config("buffers", micro_bs=2, block_classes=("ScaledLayer",))
    engine, _, _, _ = infinity.initialize(model=make_model("buffers"), config=cfg)
    train_steps(engine, batches("buffers", 2), 1)
    engine.save_checkpoint(str(tmp_path))
    saved = engine.full_state_dict()
    engine.close()
    other = make_model("buffers", seed=3)
    layer = next(m for m in other.modules() if hasattr(m, "scale"))
    layer.register_buffer("cache", torch.full((4,), 7.0), persistent=False)
    fresh, _, _, _ = infinity.initialize(model=other, config=cfg)
    fresh.load_checkpoint(str(tmp_path))
    loaded = fresh.full_state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())
    assert torch.equal(layer.cache, torch.full((4,), 7.0))
    fresh.close()


def test_truncated_file_is_named_and_state_untouched(tmp_path):
    engine, folder = _saved_engine(tmp_path)
    before = engine.full_state_dict()
    victim = next(p for p in sorted(tmp_path.glob("global_step2/*optim_states.pt")))
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"{victim.name}.*truncated"):
        engine.load_checkpoint(str(tmp_path))
    after = engine.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_corrupted_and_missing_files_are_named(tmp_path):
    engine, folder = _saved_engine(tmp_path)
    victim = next(tmp_path.glob("global_step2/*model_states.pt"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{victim.name}.*corrupted"):
        engine.load_checkpoint(str(tmp_path))
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"{victim.name}.*missing"):
        engine.load_checkpoint(str(tmp_path))


def save_with_world(ckpt_dir: str) -> None:
    engine, _, _, _ = infinity.initialize(model=make_model("mlp_h40"), config=_mlp_config())
    engine.save_checkpoint(ckpt_dir)


def test_other_world_size_is_refused_with_the_sizes(tmp_path):
    run_distributed(save_with_world, 2, str(tmp_path))
    engine, _, _, _ = infinity.initialize(model=make_model("mlp_h40"), config=_mlp_config())
    with pytest.raises(CheckpointError, match="written by 2 rank.*this run has 1"):
        engine.load_checkpoint(str(tmp_path))


def test_a_folder_that_holds_nothing_yet_loads_nothing_as_in_deepspeed_and_one_without_latest_is_named(tmp_path):
    """A loop that resumes when it can calls load_checkpoint on its first run too: a missing or empty folder gives
    (None, None) and a warning, and the engine is untouched. Checkpoints without a usable `latest` are an error."""
    engine, _, _, _ = infinity.initialize(model=make_model("mlp_h40"), config=_mlp_config())
    before = engine.full_state_dict()
    killed = tmp_path / "killed" / ".global_step5.tmp"  # a first save whose process was killed (kill -9)
    killed.mkdir(parents=True)
    (killed / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"partial")
    (tmp_path / "empty").mkdir()
    for nothing in (tmp_path / "missing", tmp_path / "killed", tmp_path / "empty"):
        with pytest.warns(UserWarning, match="holds no checkpoint yet; nothing was loaded"):
            assert engine.load_checkpoint(str(nothing)) == (None, None)
    after = engine.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    engine.close()
    _, folder = _saved_engine(tmp_path)
    (tmp_path / "latest").unlink()
    engine, _, _, _ = infinity.initialize(model=make_model("mlp_h40"), config=_mlp_config())
    with pytest.raises(CheckpointError, match=f"no 'latest'.*{Path(folder).name}"):
        engine.load_checkpoint(str(tmp_path))


def test_deepspeed_load_options_restore_only_what_they_name(tmp_path):
    engine, folder = _saved_engine(tmp_path)
    saved = engine.full_state_dict()
    fresh, _, _, _ = infinity.initialize(model=make_model("mlp_h40", seed=5), config=_mlp_config())
    fresh.load_checkpoint(str(tmp_path), load_module_only=True)
    assert all(torch.equal(fresh.full_state_dict()[k], v) for k, v in saved.items())
    assert fresh.global_steps == 0
    for flat in fresh.shards.records:
        assert not fresh.shards.read_moments(flat)["exp_avg"].any()  # moments stay the fresh engine's
    other, _, _, _ = infinity.initialize(model=make_model("mlp_h40", seed=6), config=_mlp_config())
    other.load_checkpoint(str(tmp_path), load_optimizer_states=False)
    assert other.global_steps == engine.global_steps
    assert all(not record.step for record in other.shards.records.values())


def test_save_without_latest_leaves_the_pointer(tmp_path):
    engine, _ = _saved_engine(tmp_path)
    train_steps(engine, batches("mlp_h40", 2), 1)
    engine.save_checkpoint(str(tmp_path), tag="extra", save_latest=False)
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert (tmp_path / "extra").is_dir()


# -- finding a checkpoint to resume from -----------------------------------------------------------------


def test_newest_verified_checkpoint_goes_by_step_skips_damaged_ones_and_never_takes_staging(tmp_path):
    engine, _ = _saved_engine(tmp_path)  # global_step2
    train_steps(engine, batches("mlp", 2), 2)
    engine.save_checkpoint(str(tmp_path), tag="best", save_latest=False)  # step 4, a name that sorts first
    train_steps(engine, batches("mlp", 2), 2)
    engine.save_checkpoint(str(tmp_path))  # global_step6
    shutil.copytree(tmp_path / "global_step6", tmp_path / ".global_step8.tmp")  # an unpublished save
    assert list_checkpoints(tmp_path) == ["best", "global_step2", "global_step6"]
    assert newest_verified_checkpoint(tmp_path) == ("global_step6", tmp_path / "global_step6")

    victim = tmp_path / "global_step6" / optim_file(0)
    victim.write_bytes(victim.read_bytes()[:-1])
    assert newest_verified_checkpoint(tmp_path) == ("best", tmp_path / "best")
    assert newest_verified_checkpoint(tmp_path, exclude=[tmp_path / "best"]) == (
        "global_step2",
        tmp_path / "global_step2",
    )


@pytest.mark.parametrize(
    "damage,named",
    [
        (lambda m: m.pop("world_size"), "it has no 'world_size'"),
        (lambda m: m.update(world_size="2"), "its 'world_size' is '2', not a positive integer"),
        (lambda m: m.pop("files"), "it has no 'files'"),
        (
            lambda m: m["files"][model_file(0)].pop("sha256"),
            f"its entry for '{model_file(0)}' lacks 'bytes' or 'sha256'",
        ),
    ],
)
def test_a_manifest_without_what_loading_needs_is_named(tmp_path, damage, named):
    engine, _ = _saved_engine(tmp_path)
    path = tmp_path / "global_step2" / MANIFEST.format(rank=0)
    manifest = json.loads(path.read_text())
    damage(manifest)
    path.write_text(json.dumps(seal_manifest(manifest)))  # as a writer that left it out would
    with pytest.raises(CheckpointError, match=f"manifest '{path}' is damaged: {re.escape(named)}"):
        engine.load_checkpoint(str(tmp_path))


def test_an_empty_latest_is_named_with_the_checkpoints_there(tmp_path):
    engine, _ = _saved_engine(tmp_path)
    (tmp_path / "latest").write_text("\n")
    with pytest.raises(CheckpointError, match=r"latest' is empty.*checkpoints there: global_step2; pass tag="):
        engine.load_checkpoint(str(tmp_path))


# -- a save that fails -----------------------------------------------------------------------------------------


def test_a_full_disk_fails_the_save_naming_the_file_removes_its_staging_at_once_and_keeps_the_last(tmp_path):
    from storage_fixtures import mounted

    probe, _ = _saved_engine(tmp_path / "probe")
    size = sum(p.stat().st_size for p in (tmp_path / "probe" / "global_step2").iterdir())
    room = int(1.5 * size) // 4096 * 4096  # one checkpoint, not two
    with mounted(tmp_path / "small_disk", "-t", "tmpfs", "-o", f"size={room}", "none") as disk:
        probe.save_checkpoint(str(disk), tag="first")
        train_steps(probe, batches("mlp", 2), 1)
        with pytest.raises(OSError, match=r"cannot write checkpoint file '.*\.second\.tmp/.*': No space left") as info:
            probe.save_checkpoint(str(disk), tag="second")
        assert info.value.errno == errno.ENOSPC and "free there" in str(info.value)
        assert sorted(p.name for p in disk.iterdir()) == ["first", "latest"]  # no exit needed to clean up
        verify_checkpoint(disk / "first")
        assert (disk / "latest").read_text() == "first"
