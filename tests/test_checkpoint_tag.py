"""`checkpoint.tag_validation`: ranks that pass different tags to save_checkpoint are refused ("Fail") or all
saved under rank 0's tag (with a warning: "Warn"; without: "Ignore"), so one checkpoint is never scattered over
several folders."""

from __future__ import annotations

import contextlib
import io

import torch
from dist import run_distributed
from harness import config, train_steps
from toy_models import batches, make_model

import infinity
from infinity.engine.checkpoint import CheckpointError, list_checkpoints, verify_checkpoint


def save_with_rank_tags(ckpt_dir: str, validation: str, same: bool) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config(micro_bs=2)
    cfg["checkpoint"] = {"tag_validation": validation}
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
    train_steps(engine, batches("gpt", 2, rank=rank, world_size=world), 1)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            folder = engine.save_checkpoint(ckpt_dir, tag="shared" if same else f"mine{rank}")
    except CheckpointError as exc:
        return {"error": str(exc)}
    finally:
        weights = engine.full_state_dict()
        engine.close()
    return {"folder": folder, "stderr": stderr.getvalue(), "weights": weights}


def test_ranks_that_agree_save_under_their_tag(tmp_path):
    results = run_distributed(save_with_rank_tags, 2, str(tmp_path), "Fail", True, timeout_s=120)
    assert [r["folder"] for r in results] == [str(tmp_path / "shared")] * 2
    assert verify_checkpoint(tmp_path / "shared") == 2 and list_checkpoints(tmp_path) == ["shared"]


def test_fail_refuses_different_tags_and_writes_nothing(tmp_path):
    results = run_distributed(save_with_rank_tags, 2, str(tmp_path), "Fail", False, timeout_s=120)
    for rank, result in enumerate(results):
        assert "different tags on different ranks" in result["error"] and f"'mine{rank}'" in result["error"]
        assert "tag_validation" in result["error"]
    assert list(tmp_path.iterdir()) == []


def test_warn_saves_every_rank_under_rank_0s_tag_and_says_so(tmp_path):
    results = run_distributed(save_with_rank_tags, 2, str(tmp_path), "Warn", False, timeout_s=120)
    assert [r["folder"] for r in results] == [str(tmp_path / "mine0")] * 2
    assert "every rank saves under rank 0's tag 'mine0'" in results[0]["stderr"] and results[1]["stderr"] == ""
    assert verify_checkpoint(tmp_path / "mine0") == 2 and list_checkpoints(tmp_path) == ["mine0"]
    cfg = config(micro_bs=2, extra_zero={"elastic_checkpoint": True})  # one process reads both ranks' files
    engine, _, _, _ = infinity.initialize(model=make_model("gpt", seed=99), config=cfg)
    engine.load_checkpoint(str(tmp_path), tag="mine0")
    loaded = engine.full_state_dict()
    engine.close()
    assert loaded.keys() == results[0]["weights"].keys()
    for name, t in results[0]["weights"].items():
        assert torch.equal(loaded[name], t), name


def test_ignore_saves_under_rank_0s_tag_without_a_word(tmp_path):
    results = run_distributed(save_with_rank_tags, 2, str(tmp_path), "Ignore", False, timeout_s=120)
    assert [r["folder"] for r in results] == [str(tmp_path / "mine0")] * 2
    assert [r["stderr"] for r in results] == ["", ""]
    assert verify_checkpoint(tmp_path / "mine0") == 2 and list_checkpoints(tmp_path) == ["mine0"]
