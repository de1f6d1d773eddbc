"""The user's text (`infinity.data.text`): parsed, tokenized once into a verified cache, packed into batches.

Token streams are checked against the tokenizer applied by hand; the cache against what a fresh
tokenization gives; the batches against the one-rank stream.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from infinity.data.text import ByteTokenizer, DataError, HFTokenizer, PackedBatches, load_tokens


def _cache_files(path):
    return sorted(path.parent.glob(f"{path.name}.tokens-*"))


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("transformers")
    from hf_cases import tiny_tokenizer

    return HFTokenizer(tiny_tokenizer())


def test_json_lines_are_documents_joined_by_the_end_of_sequence_token(tmp_path, tokenizer):
    docs = ["To be, or not to be", "that is the question:", "Whether 'tis nobler"]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": d, "source": "x"}) + "\n" for d in docs) + "\n")
    expected: list[int] = []
    for d in docs:
        if expected:
            expected.append(tokenizer.eos_token_id)
        expected += tokenizer.tokenizer(d, add_special_tokens=False)["input_ids"]
    assert load_tokens(path, tokenizer).tolist() == expected


def test_plain_text_is_one_document(tmp_path):
    path = tmp_path / "t.txt"
    text = "Friends, Romans, countrymen,\n\nlend me your ears;\n" * 3
    path.write_text(text)
    assert load_tokens(path, ByteTokenizer()).tolist() == list(text.encode())


@pytest.mark.parametrize(
    "line,problem", [('{"text": "ok"', "line 2 is not valid JSON"), ('{"body": "no text"}', 'line 2 has no "text"')]
)
def test_a_bad_json_line_is_named(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=problem):
        load_tokens(path, ByteTokenizer())
    assert _cache_files(path) == []


def test_the_cache_is_read_instead_of_tokenizing_again(tmp_path, monkeypatch):
    path = tmp_path / "t.txt"
    path.write_text("It is a tale told by an idiot\n")
    first = load_tokens(path, ByteTokenizer())
    assert len(_cache_files(path)) == 2
    monkeypatch.setattr("infinity.data.text.tokenize_file", lambda *a: pytest.fail("tokenized again"))
    assert torch.equal(load_tokens(path, ByteTokenizer()), first)


def test_another_tokenizer_or_changed_text_gets_its_own_cache(tmp_path, tokenizer):
    path = tmp_path / "t.txt"
    path.write_text("Full of sound and fury\n")
    load_tokens(path, ByteTokenizer())
    load_tokens(path, tokenizer)
    assert len(_cache_files(path)) == 4
    path.write_text("Signifying nothing\n")
    assert load_tokens(path, ByteTokenizer()).tolist() == list(b"Signifying nothing\n")
    assert len(_cache_files(path)) == 6


def test_a_damaged_cache_is_rebuilt_with_a_notice(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("Out, out, brief candle!\n" * 10)
    expected = load_tokens(path, ByteTokenizer())
    tokens_file = next(p for p in _cache_files(path) if p.suffix == ".npy")
    data = np.load(tokens_file)
    data[3] += 1
    np.save(tokens_file, data)
    notices: list[str] = []
    assert torch.equal(load_tokens(path, ByteTokenizer(), notices.append), expected)
    assert any("damaged" in n for n in notices)
    assert np.array_equal(np.load(tokens_file), expected.numpy().astype(np.uint32))
    tokens_file.write_bytes(b"")  # emptied (a copy that stopped): numpy's EOFError, not a traceback
    assert torch.equal(load_tokens(path, ByteTokenizer(), notices.append), expected)
    assert np.array_equal(np.load(tokens_file), expected.numpy().astype(np.uint32))


def test_a_cache_that_cannot_be_written_leaves_no_partial_file_and_trains_on(tmp_path, monkeypatch):
    """A disk that fills while the cache is written: the notice gives the free space, and the partial file is
    removed (each run used to leave one more in the user's data folder)."""
    import errno

    path = tmp_path / "t.txt"
    path.write_text("Out, out, brief candle!\n" * 10)

    def full_disk(f, array, allow_pickle=False):
        f.write(b"\x93NUMPY partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "save", full_disk)
    notices: list[str] = []
    tokens = load_tokens(path, ByteTokenizer(), notices.append)
    assert torch.equal(tokens, torch.tensor(list(path.read_bytes()), dtype=torch.int64))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]
    assert any("No space left on device" in n and "free" in n for n in notices)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(DataError, match="nothing.txt' does not exist"):
        load_tokens(tmp_path / "nothing.txt", ByteTokenizer())


def test_a_folder_is_named_as_a_folder_not_as_missing(tmp_path):
    (tmp_path / "texts").mkdir()
    with pytest.raises(DataError, match="'.*texts' is a folder, not a file") as info:
        load_tokens(tmp_path / "texts", ByteTokenizer())
    assert "does not exist" not in str(info.value)


@pytest.mark.parametrize(
    "name,content,offset,byte",
    [
        ("latin1.txt", "na\u00efve caf\u00e9\n".encode("latin-1"), 2, 0xEF),
        ("binary.bin", b"\x00\x01PK\x03\x04\xff\xfe", 6, 0xFF),
        ("late.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', 28, 0xE9),
        # a two-byte character straddles the decoder's 1 MiB chunks before the bad byte; the offset is the file's
        ("straddle.txt", b"x" + "\u00e9".encode() * (1 << 19) + b"\xc3(", 1 + (1 << 20), 0xC3),
        ("cut.txt", b"abc\xe2\x82", 3, 0xE2),  # the file ends inside a character
    ],
)
def test_a_file_that_is_not_utf8_is_named_with_the_offset_of_its_first_bad_byte(tmp_path, name, content, offset, byte):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=f"'.*{name}' is not UTF-8 text: byte 0x{byte:02x} at offset {offset} ") as info:
        load_tokens(path, ByteTokenizer())
    assert "UTF-8 plain text or JSON lines" in str(info.value)
    content[:offset].decode("utf-8")  # the reference: all before the offset decodes
    assert _cache_files(path) == []


def test_two_ranks_batches_together_are_the_one_rank_batches():
    tokens = torch.arange(10 * 8)
    one = PackedBatches(tokens, 4, 8, seed=3)
    ranks = [PackedBatches(tokens, 2, 8, seed=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(5):  # across an epoch boundary (2 batches of 4 per epoch)
        assert torch.equal(next(one), torch.cat([next(r) for r in ranks]))


def test_an_epoch_serves_whole_sequences_each_once():
    tokens = torch.arange(12 * 5 + 3)
    batches = PackedBatches(tokens, 3, 5, seed=1)
    rows = torch.cat([next(batches) for _ in range(batches.batches_per_epoch)])
    assert sorted(rows[:, 0].tolist()) == list(range(0, 60, 5))
    assert all(torch.equal(r, torch.arange(r[0], r[0] + 5)) for r in rows)


def test_resuming_continues_the_stream_and_refuses_another_one():
    tokens = torch.arange(200)
    a = PackedBatches(tokens, 2, 8, seed=5)
    for _ in range(3):
        next(a)
    b = PackedBatches(tokens, 2, 8, seed=5)
    b.load_state_dict(a.state_dict())
    assert torch.equal(next(a), next(b))
    with pytest.raises(ValueError, match="seq"):
        PackedBatches(tokens, 2, 4, seed=5).load_state_dict(a.state_dict())


def test_too_little_text_for_one_batch_says_so():
    with pytest.raises(DataError, match="fewer than one global batch"):
        PackedBatches(torch.arange(30), 4, 8)
