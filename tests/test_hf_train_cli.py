"""`infinity train --model FOLDER --data FILE`: a Hugging Face folder trained end to end, resumed, written back.

The folder is what `save_pretrained` writes for a tiny Llama (sharded safetensors with an index, a
tokenizer trained here); the data a JSON lines file. The written folder is checked against an independent
path to the same weights: `infinity consolidate` of the sharded checkpoint (the fp32 masters read from
the checkpoint files), and the resumed run against one run straight through.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch
from hf_cases import save_tiny_llama, write_jsonl

from infinity.cli import main

transformers = pytest.importorskip("transformers")


def _train(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["train", *args])
    return code, out.getvalue(), err.getvalue()


def _state(folder: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_job")
    save_tiny_llama(root / "llama")
    write_jsonl(root / "data.jsonl")
    common = ["--model", str(root / "llama"), "--data", str(root / "data.jsonl"), "--seq", "32", "--lr", "1e-2"]
    common += ["--nvme-path", str(root / "nvme")]
    runs = {}
    runs["first"] = _train(*common, "--steps", "3", "--save-dir", str(root / "ck"))
    cache = sorted(p.name for p in root.glob("data.jsonl.tokens-*"))
    mtimes = {p.name: p.stat().st_mtime_ns for p in root.glob("data.jsonl.tokens-*")}
    resume = ["--resume", "--save-hf", str(root / "out")]
    runs["resumed"] = _train(*common, "--steps", "5", "--save-dir", str(root / "ck"), *resume)
    runs["straight"] = _train(*common, "--steps", "5", "--save-dir", str(root / "ck2"), "--save-hf", str(root / "out2"))
    after = {p.name: p.stat().st_mtime_ns for p in root.glob("data.jsonl.tokens-*")}
    return {"root": root, "runs": runs, "cache": cache, "cache_unchanged": mtimes == after}


def test_a_folder_trains_on_jsonl_and_resumes(job):
    for name, (code, out, err) in job["runs"].items():
        assert code == 0, f"{name}: {out}{err}"
    assert "LlamaForCausalLM" in job["runs"]["first"][1]
    assert "params on nvme, optimizer on nvme" in job["runs"]["first"][1]
    assert "at step 3" in job["runs"]["resumed"][1] and "steps 4-5" in job["runs"]["resumed"][1]


def test_the_data_is_tokenized_once_and_cached_beside_the_file(job):
    assert len(job["cache"]) == 2 and job["cache"][0].endswith(".json") and job["cache"][1].endswith(".npy")
    assert job["cache_unchanged"], "later runs read the cache instead of writing it again"


def test_the_written_folder_loads_in_transformers_with_the_trained_weights(job):
    root = job["root"]
    assert main(["consolidate", str(root / "ck"), str(root / "masters.pt")]) == 0
    masters = torch.load(root / "masters.pt")
    state = _state(root / "out")
    assert set(state) == set(masters)
    for key, value in masters.items():
        assert torch.equal(state[key], value), key
    initial = _state(root / "llama")
    assert all(not torch.equal(state[k], initial[k]) for k in initial if k.endswith("proj.weight"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "out")
    assert tokenizer("to be or not")["input_ids"] == transformers.AutoTokenizer.from_pretrained(root / "llama")(
        "to be or not"
    )["input_ids"]


def test_a_resumed_run_ends_where_one_run_straight_through_ends(job):
    resumed, straight = _state(job["root"] / "out"), _state(job["root"] / "out2")
    for key, value in straight.items():
        assert torch.equal(resumed[key], value), key


def test_a_missing_data_file_or_model_folder_is_a_clear_error(tmp_path, job):
    llama = str(job["root"] / "llama")
    code, _, err = _train("--model", llama, "--data", str(tmp_path / "none.jsonl"), "--steps", "1")
    assert code == 2 and "none.jsonl" in err and "does not exist" in err
    code, _, err = _train("--model", llama, "--steps", "1")
    assert code == 2 and "needs --data" in err
    code, _, err = _train("--model", str(tmp_path), "--steps", "1")
    assert code == 2 and "neither a GPT preset" in err
    code, _, err = _train("--model", "tiny", "--save-hf", str(tmp_path / "x"), "--steps", "1")
    assert code == 2 and "--save-hf" in err


def _broken_copy(job, tmp_path: Path, name: str) -> Path:
    import shutil

    return Path(shutil.copytree(job["root"] / "llama", tmp_path / name))


def test_a_broken_folder_is_named_in_one_line_without_a_traceback(tmp_path, job):
    data = ["--data", str(job["root"] / "data.jsonl"), "--seq", "32", "--steps", "1", "--offload", "cpu"]
    unreadable = _broken_copy(job, tmp_path, "config")
    (unreadable / "config.json").write_text("{")
    code, _, err = _train("--model", str(unreadable), *data, "--save-dir", str(tmp_path / "ck1"))
    assert code == 2 and "config.json' cannot be read as a model config" in err and "Traceback" not in err
    weightless = _broken_copy(job, tmp_path, "weightless")
    for f in weightless.glob("model*.safetensors*"):
        f.unlink()
    code, _, err = _train("--model", str(weightless), *data, "--save-dir", str(tmp_path / "ck2"))
    assert code == 6 and "holds no weights" in err and "Traceback" not in err
    truncated = _broken_copy(job, tmp_path, "truncated")
    shard = sorted(truncated.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    code, _, err = _train("--model", str(truncated), *data, "--save-dir", str(tmp_path / "ck3"))
    assert code == 6 and f"weight file '{shard}' cannot be read" in err and "Traceback" not in err


def test_save_hf_over_the_save_dir_or_the_model_is_refused_before_training(tmp_path, job):
    common = ["--data", str(job["root"] / "data.jsonl"), "--seq", "32", "--steps", "1", "--offload", "cpu"]
    llama = str(job["root"] / "llama")
    before = sorted(p.name for p in (job["root"] / "llama").iterdir())
    for target in (str(job["root"] / "llama"), str(tmp_path / "ck"), str(tmp_path)):
        code, out, err = _train("--model", llama, *common, "--save-dir", str(tmp_path / "ck"), "--save-hf", target)
        assert code == 2 and "is, holds or is inside" in err, err
        assert "steps" not in out  # refused before any training
    assert sorted(p.name for p in (job["root"] / "llama").iterdir()) == before
