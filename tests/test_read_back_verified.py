"""Every byte infinity reads back from a file it wrote is verified: the damage is found and named, never used.

Gaps in the verification that the swap (test_swap_integrity) and checkpoint (test_checkpoint*) tests leave
open, each shown on real files damaged on disk: the token cache's header and sidecar, a checkpoint manifest
that leaves a file out, a `latest` that is not text, 16-bit weight files and Hugging Face weight shards
(read back by `load_full_state` and `--model`), a profiled trial's trace read by the tuner, and the
checksum every trace line carries (format version 2), read by `infinity profile`.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
from harness import config, train_steps
from toy_models import batches, make_model

import infinity
from infinity.data.text import ByteTokenizer, cache_paths, load_tokens
from infinity.engine.checkpoint import MANIFEST, CheckpointError, model_file, optim_file, resolve_folder
from infinity.engine.checkpoint_folder import seal_manifest

TEXT = "Friends, Romans, countrymen, lend me your ears;\n" * 40


def _flip(path: Path, offset: int, bit: int = 0x04) -> None:
    """Flip one bit of the byte at `offset` of `path`, on disk."""
    data = bytearray(path.read_bytes())
    data[offset] ^= bit
    path.write_bytes(bytes(data))


def _record_data_offset(path: Path, name: str) -> int:
    """Where zip record `name`'s data starts in `path` (after its local header)."""
    with zipfile.ZipFile(path) as zf:
        start = zf.getinfo(name).header_offset
    header = path.read_bytes()[start : start + 30]
    return start + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")


# -- the token cache ------------------------------------------------------------------------------------------


@pytest.fixture
def cached_text(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A text file tokenized once: (the file, its cached tokens, their sidecar)."""
    path = tmp_path / "t.txt"
    path.write_text(TEXT)
    load_tokens(path, ByteTokenizer(), say=lambda _: None)
    tokens, sidecar, _ = cache_paths(path, ByteTokenizer())
    return path, tokens, sidecar


@pytest.mark.parametrize("descr", [b"<f4", b">u4"])
def test_a_token_cache_whose_header_names_another_dtype_is_rebuilt_not_trained_on(cached_text, descr):
    """The header is outside the tokens' SHA-256: '<u4' read as floats is zeros, as big-endian garbage ids."""
    path, tokens, _ = cached_text
    raw = tokens.read_bytes()
    tokens.write_bytes(raw.replace(b"<u4", descr, 1))
    said: list[str] = []
    got = load_tokens(path, ByteTokenizer(), say=said.append)
    assert got.tolist() == list(TEXT.encode())
    assert len(said) == 1 and "damaged" in said[0] and str(tokens) in said[0]
    assert tokens.read_bytes() == raw  # rebuilt


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: raw.replace(b'"source_sha256"', b'"source_sha256\xa2"', 1),  # a byte that is not UTF-8
        lambda raw: b"[1]",
        lambda raw: json.dumps({k: v for k, v in json.loads(raw).items() if k != "source_sha256"}).encode(),
    ],
    ids=["not-utf8", "not-an-object", "no-source-hash"],
)
def test_a_damaged_token_cache_sidecar_is_tokenized_again_not_a_traceback(cached_text, damage):
    path, _, sidecar = cached_text
    sidecar.write_bytes(damage(sidecar.read_bytes()))
    assert load_tokens(path, ByteTokenizer(), say=lambda _: None).tolist() == list(TEXT.encode())
    assert load_tokens(path, ByteTokenizer(), say=lambda _: None).tolist() == list(TEXT.encode())


# -- checkpoints ----------------------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path):
    """An engine trained 2 steps and its checkpoint in `tmp_path` (global_step2)."""
    engine, _, _, _ = infinity.initialize(model=make_model("mlp"), config=config("mlp"))
    train_steps(engine, batches("mlp", 2), 2)
    engine.save_checkpoint(str(tmp_path))
    yield engine, tmp_path
    engine.close()


@pytest.mark.parametrize("left_out", [optim_file(0), model_file(0)])
def test_a_manifest_that_leaves_out_a_file_is_refused_and_the_file_never_read_unverified(saved, left_out):
    engine, root = saved
    folder = root / "global_step2"
    manifest_path = folder / MANIFEST.format(rank=0)
    manifest = json.loads(manifest_path.read_text())
    manifest["files"].pop(left_out)
    manifest_path.write_text(json.dumps(seal_manifest(manifest)))  # as a writer that left it out would
    victim = folder / left_out
    _flip(victim, _record_data_offset(victim, "archive/data/0") + 8)  # its first record
    before = engine.full_state_dict()
    with pytest.raises(CheckpointError, match=f"manifest '{manifest_path}' is damaged: it lists no '{left_out}'"):
        engine.load_checkpoint(str(root))
    after = engine.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_a_latest_that_is_not_text_is_named_with_the_checkpoints_there(saved):
    _, root = saved
    _flip(root / "latest", 3, 0x80)
    with pytest.raises(CheckpointError, match=r"latest' is damaged.*checkpoints there: global_step2"):
        resolve_folder(root)


# -- weight files read back by load_full_state and --model -------------------------------------------------------


_OPEN: list = []  # the engines `_engine` made in this test, closed after it


@pytest.fixture(autouse=True)
def _close_engines():
    yield
    while _OPEN:
        _OPEN.pop().close()


def _engine(seed: int = 0, save_16bit: bool = False):
    extra = {"stage3_gather_16bit_weights_on_model_save": True} if save_16bit else None
    engine, _, _, _ = infinity.initialize(model=make_model("mlp", seed), config=config("mlp", extra_zero=extra))
    _OPEN.append(engine)
    return engine


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.safetensors"])
def test_a_flipped_byte_in_a_16bit_weight_file_is_named_not_loaded(tmp_path, name):
    engine = _engine(save_16bit=True)
    train_steps(engine, batches("mlp", 2), 1)
    engine.save_16bit_model(str(tmp_path), name)
    path = tmp_path / name
    source = path if name.endswith(".bin") else tmp_path
    fresh = _engine(seed=5)
    fresh.load_full_state(str(source))  # intact: loads
    expected = engine.full_state_dict()
    assert all(torch.equal(fresh.full_state_dict()[k], v) for k, v in expected.items())
    _flip(path, path.stat().st_size * 3 // 4)  # inside the weights' data
    fresh = _engine(seed=5)
    before = fresh.full_state_dict()
    with pytest.raises(ValueError, match=f"weight file '{path}' cannot be read, it is damaged"):
        fresh.load_full_state(str(source))
    assert all(torch.equal(fresh.full_state_dict()[k], v) for k, v in before.items())


def test_a_safetensors_file_written_elsewhere_has_no_checksum_and_loads(tmp_path):
    """Only infinity's writer records the SHA-256: a file from another writer (here safetensors' own) is read
    as before, its layout checked by safetensors."""
    from safetensors.torch import save_file

    state = _engine().full_state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    fresh = _engine(seed=5)
    fresh.load_full_state(str(tmp_path))
    assert all(torch.equal(fresh.full_state_dict()[k], v) for k, v in state.items())


def test_a_truncated_torch_weight_file_is_named(tmp_path):
    engine = _engine(save_16bit=True)
    engine.save_16bit_model(str(tmp_path), "pytorch_model.bin")
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])
    with pytest.raises(ValueError, match=f"weight file '{path}' cannot be read, it is damaged"):
        _engine(seed=5).load_full_state(str(path))


def test_a_flipped_byte_in_a_hugging_face_shard_is_named_not_read(tmp_path):
    """What `--save-hf` writes and `--model` reads back: sharded safetensors and their index."""
    from infinity.models.hf_weights import checkpoint_tensors, write_hf_weights

    model = make_model("mlp")
    state = model.state_dict()
    files = write_hf_weights(state.items(), tmp_path / "out", max_shard_bytes=3000)
    shards = [f for f in files if f.suffix == ".safetensors"]
    assert len(shards) > 1
    tensors = checkpoint_tensors(tmp_path / "out", model)
    assert all(torch.equal(tensors[k], v) for k, v in state.items())
    _flip(shards[0], shards[0].stat().st_size * 3 // 4)
    tensors = checkpoint_tensors(tmp_path / "out", model)
    with pytest.raises(ValueError, match=f"weight file '{shards[0]}' cannot be read, it is damaged"):
        [tensors[k] for k in state]


# -- a profiled trial's trace, read back by the tuner --------------------------------------------------------------


def test_the_tuner_leaves_out_a_malformed_trace_record_as_the_report_does(tmp_path):
    from trace_edits import reseal

    from infinity.profiler.synthetic import SCENARIOS, write_scenario
    from infinity.profiler.traces import load_traces
    from infinity.tuning.auto_prefetch import auto_prefetch

    path = Path(write_scenario(str(tmp_path), next(iter(SCENARIOS.values()))))
    lines = path.read_bytes().split(b"\n")
    k = next(i for i in range(len(lines) // 2, len(lines)) if b'"type":"move"' in lines[i] and b"'param'" in lines[i])
    lines[k] = lines[k].replace(b'"bytes"', b'"bytez"')
    path.write_text(reseal(b"\n".join(lines).decode()))
    evidence = auto_prefetch(load_traces([tmp_path]), "nvme", 1000)
    assert evidence.bucket_elems >= 1000


@pytest.fixture(scope="module")
def saved_hf(tmp_path_factory):
    """`infinity train --save-hf OUT` from a tiny Llama, once: OUT and the flags of a one-step run on its data."""
    pytest.importorskip("transformers")
    from hf_cases import save_tiny_llama, write_jsonl

    root = tmp_path_factory.mktemp("save_hf")
    save_tiny_llama(root / "llama")
    write_jsonl(root / "data.jsonl")
    common = ["train", "--data", str(root / "data.jsonl"), "--seq", "32", "--steps", "1", "--offload", "cpu"]
    code, err = _cli([*common, "--model", str(root / "llama"), "--save-dir", str(root / "ck0"), "--save-hf",
                      str(root / "out")])  # fmt: skip
    assert code == 0, err
    return root / "out", common


def _cli(args: list[str]) -> tuple[int, str]:
    """`infinity ARGS` in this process: the exit code and what it wrote on stderr."""
    import contextlib
    import io

    from infinity.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(args)
    return code, err.getvalue()


def test_a_save_hf_folder_damaged_on_disk_stops_the_next_run_in_one_line(saved_hf, tmp_path):
    """`infinity train --save-hf OUT`, one byte of OUT's weights flipped, then `infinity train --model OUT`."""
    import shutil

    from infinity.cli.faults import ExitCode

    out = shutil.copytree(saved_hf[0], tmp_path / "out")
    shard = max(out.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    _flip(shard, shard.stat().st_size // 2)
    code, err = _cli([*saved_hf[1], "--model", str(out), "--save-dir", str(tmp_path / "ck")])
    assert code == ExitCode.CHECKPOINT
    assert f"weight file '{shard}' cannot be read, it is damaged" in err
    assert "Traceback" not in err and not list((tmp_path / "ck").glob("*"))  # locked at start, nothing saved


def test_a_save_hf_folder_lists_the_checksums_of_its_config_and_tokenizer(saved_hf):
    from infinity.models.folder_checksums import CHECKSUMS_FILE

    out = saved_hf[0]
    listed = json.loads((out / CHECKSUMS_FILE).read_text())["files"]
    small = {p.name for p in out.iterdir() if p.suffix not in (".safetensors", ".bin") and p.name != CHECKSUMS_FILE}
    assert set(listed) == small and {"config.json", "tokenizer_config.json"} <= small
    assert all(len(entry["sha256"]) == 64 and entry["bytes"] > 0 for entry in listed.values())


def _edit_config(folder: Path) -> None:
    """A config that is still valid JSON and still a Llama, but another model: only a checksum can tell."""
    config = json.loads((folder / "config.json").read_text())
    config["rms_norm_eps"] = config["rms_norm_eps"] * 10
    (folder / "config.json").write_text(json.dumps(config, indent=2))


DAMAGE = {
    "config edited": (_edit_config, "config.json' differs from the file infinity wrote with the folder"),
    "tokenizer file gone": (lambda f: (f / "tokenizer_config.json").unlink(), "tokenizer_config.json' is missing"),
    "checksum list changed": (
        lambda f: _flip(f / "infinity_checksums.json", 60),
        "infinity_checksums.json' is damaged",
    ),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_changed_config_or_tokenizer_in_a_save_hf_folder_stops_train_and_estimate_in_one_line(
    saved_hf, tmp_path, damage
):
    import shutil

    from infinity.cli.faults import ExitCode
    from infinity.models.folder_checksums import CHECKSUMS_FILE

    out = shutil.copytree(saved_hf[0], tmp_path / "out")
    apply, named = DAMAGE[damage]
    apply(out)
    for args in (
        [*saved_hf[1], "--model", str(out), "--save-dir", str(tmp_path / "ck")],
        ["estimate", "--model", str(out)],
    ):
        code, err = _cli(args)
        assert code == ExitCode.CHECKPOINT, err
        assert named in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "ck").exists()
    (out / CHECKSUMS_FILE).unlink()  # what the message offers for a file edited on purpose: read it unchecked
    if damage != "tokenizer file gone":
        assert _cli(["estimate", "--model", str(out)])[0] == 0


def _move_line(path: Path) -> int:
    """The index of a move record in the middle of the trace at `path`."""
    lines = path.read_text().splitlines()
    return next(i for i in range(len(lines) // 2, len(lines)) if '"type":"move"' in lines[i])


def _profiled(tmp_path: Path) -> Path:
    from infinity.profiler.synthetic import SCENARIOS, write_scenario

    return Path(write_scenario(str(tmp_path / "traces"), SCENARIOS["clipped"]))


def test_a_changed_digit_in_a_trace_stops_the_report_naming_the_line(tmp_path, capsys):
    """Still JSON and well formed, so only the checksum can tell: without it the report counts other bytes."""
    from infinity.profiler.cli import main

    path = _profiled(tmp_path)
    lines = path.read_text().splitlines(keepends=True)
    k = _move_line(path)
    lines[k] = lines[k].replace('"bytes":', '"bytes":9', 1)
    path.write_text("".join(lines))
    assert main([str(path.parent), "--no-plots", "--out", str(tmp_path / "report")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert f"{path}:{k + 1}: the line's checksum does not match its text" in err and "record the trace again" in err
    assert not (tmp_path / "report").exists()


def test_a_trace_line_that_lost_its_checksum_is_named_but_a_cut_last_line_is_skipped(tmp_path):
    import re

    from infinity.profiler.traces import load_traces

    path = _profiled(tmp_path)
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    k = _move_line(path)
    lines[k] = re.sub(r',"crc32":\d+\}', "}", lines[k])
    path.write_text("".join(lines))
    with pytest.raises(ValueError, match=rf"trace_rank0.jsonl:{k + 1}: the line has lost its checksum"):
        load_traces([path])
    path.write_text(text + text.splitlines(keepends=True)[k][:-12])  # a writer that died mid-line
    assert load_traces([path])[0].truncated


def test_a_version_1_trace_has_no_checksums_and_reads_as_before(tmp_path):
    import re

    from infinity.profiler.analysis import bytes_by_pair, validate
    from infinity.profiler.traces import load_traces

    path = _profiled(tmp_path)
    sealed = load_traces([path])
    assert sealed[0].meta["version"] == 2
    text = path.read_text().replace('"version":2', '"version":1', 1)
    path.write_text(re.sub(r',"crc32":\d+\}', "}", text))
    old = load_traces([path])
    assert validate(old) == [] and bytes_by_pair(old) == bytes_by_pair(sealed)
    assert old[0].records == sealed[0].records
    path.write_text(path.read_text().replace('"version":1', '"version":2', 1))
    with pytest.raises(ValueError, match="trace_rank0.jsonl:1: a version 2 meta line without its checksum"):
        load_traces([path])
