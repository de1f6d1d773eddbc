"""The user's text: a plain text or JSON lines file, tokenized once (cached beside it) and packed into sequences.

A JSON lines file (`.jsonl`, `.json`, `.ndjson`, or a first character `{`) holds one document per line in
its `text` field; any other file is one plain-text document (tokenized in pieces cut after a newline).
Documents are tokenized without special tokens and joined with the tokenizer's end-of-sequence token
between them into one token stream.

The stream is cached beside the file as `<file>.tokens-<key>.npy` with a JSON sidecar; the key is a hash of
the tokenizer (its full serialized form) and of the file's contents, whose hash is recomputed only when
the file's size or modification time changed. The sidecar holds the SHA-256 of the cached tokens, checked
on every read with their dtype and shape: a damaged cache is rebuilt (with a notice), never used; a damaged
sidecar is ignored.

`PackedBatches` cuts the stream into non-overlapping sequences of `seq` tokens and serves them in a
seeded order, rank-sliced and resumable like `ByteBatches`.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infinity.storage.checksum import file_sha256
from infinity.storage.disk_space import free_bytes

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
CACHE_FORMAT = 1
_DOCS_PER_BATCH = 512
_PLAIN_PIECE_CHARS = 1 << 20


class DataError(ValueError):
    """A data file that cannot be read as text or JSON lines; the message names the file and line."""


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256): the presets' tokenizer."""

    eos_token_id = None
    fingerprint = "utf-8 bytes"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]


class HFTokenizer:
    """A transformers tokenizer, with a fingerprint of everything that decides its output."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        backend = getattr(tokenizer, "backend_tokenizer", None)
        state = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
        identity = f"{type(tokenizer).__name__}|{self.eos_token_id}|{state}"
        self.fingerprint = hashlib.sha256(identity.encode()).hexdigest()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]


def _not_utf8_error(path: Path) -> DataError:
    """The DataError naming `path`'s first byte that is not UTF-8 (the file is decoded again from its start)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # of the next chunk in the file
    with path.open("rb") as f:
        while True:
            chunk = f.read(1 << 20)
            held = len(decoder.getstate()[0])  # the start of a character cut at the previous chunk's end
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as exc:
                return DataError(
                    f"'{path}' is not UTF-8 text: byte 0x{exc.object[exc.start]:02x} at offset "
                    f"{offset - held + exc.start} cannot be decoded; a data file must be UTF-8 plain text or "
                    "JSON lines (convert it, e.g. `iconv -f latin1 -t utf-8`)"
                )
            if not chunk:
                return DataError(f"'{path}' could not be decoded as UTF-8 (did it change while it was read?)")
            offset += len(chunk)


def iter_documents(path: Path) -> Iterator[tuple[str, bool]]:
    """(text, starts a document) pieces of the file: each JSON line's `text`, or the plain text in pieces of
    about `_PLAIN_PIECE_CHARS` cut after a newline (so a large file is never one string). A byte that is
    not UTF-8 raises DataError naming its offset."""
    try:
        yield from _read_documents(path)
    except UnicodeDecodeError as exc:
        raise _not_utf8_error(path) from exc


def _read_documents(path: Path) -> Iterator[tuple[str, bool]]:
    with path.open("r", encoding="utf-8") as f:
        head = f.read(1)
        f.seek(0)
        if path.suffix not in JSONL_SUFFIXES and head != "{":
            piece: list[str] = []
            size, first = 0, True
            for line in f:
                piece.append(line)
                size += len(line)
                if size >= _PLAIN_PIECE_CHARS:
                    yield "".join(piece), first
                    piece, size, first = [], 0, False
            if piece or first:
                yield "".join(piece), first
            return
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"'{path}' line {number} is not valid JSON: {exc}") from exc
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DataError(f"'{path}' line {number} has no \"text\" string field; each line needs one")
            yield record["text"], True


def tokenize_file(path: Path, tokenizer) -> np.ndarray:
    """The whole file as one stream of token ids (uint32), documents joined by the end-of-sequence token."""
    stream: list[int] = []
    batch: list[tuple[str, bool]] = []

    def flush() -> None:
        for ids, (_, starts) in zip(tokenizer.encode_batch([text for text, _ in batch]), batch, strict=True):
            if starts and stream and tokenizer.eos_token_id is not None:
                stream.append(tokenizer.eos_token_id)
            stream.extend(ids)
        batch.clear()

    for piece in iter_documents(path):
        batch.append(piece)
        if len(batch) >= _DOCS_PER_BATCH:
            flush()
    flush()
    return np.asarray(stream, dtype=np.uint32)


def _read_sidecar(sidecar: Path) -> dict[str, Any] | None:
    """A cache sidecar's JSON object, or None when it is unreadable or damaged (not text, not an object)."""
    try:
        meta = json.loads(sidecar.read_text())
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
        return None
    return meta if isinstance(meta, dict) else None


def _content_hash(path: Path) -> str:
    """The file's SHA-256, taken from a previous cache's sidecar when size and modification time match."""
    stat = path.stat()
    for sidecar in path.parent.glob(f"{path.name}.tokens-*.json"):
        meta = _read_sidecar(sidecar)
        if meta is None or not isinstance(meta.get("source_sha256"), str):
            continue
        if meta.get("source_size") == stat.st_size and meta.get("source_mtime_ns") == stat.st_mtime_ns:
            return meta["source_sha256"]
    return file_sha256(path)


def cache_paths(path: Path, tokenizer) -> tuple[Path, Path, str]:
    """(tokens file, sidecar, the source's content hash) of `path`'s cache for `tokenizer`."""
    source_hash = _content_hash(path)
    key = hashlib.sha256(f"{CACHE_FORMAT}|{tokenizer.fingerprint}|{source_hash}".encode()).hexdigest()[:16]
    stem = f"{path.name}.tokens-{key}"
    return path.with_name(f"{stem}.npy"), path.with_name(f"{stem}.json"), source_hash


def _read_cache(tokens_path: Path, sidecar: Path) -> np.ndarray | None:
    """The cached tokens if both files are there, the tokens are 1-D little-endian uint32 as written (the .npy
    header is outside the checksum) and their SHA-256 matches the sidecar's; else None."""
    if not (tokens_path.is_file() and sidecar.is_file()):
        return None
    meta = _read_sidecar(sidecar)
    try:
        tokens = np.load(tokens_path, allow_pickle=False)
    except (OSError, ValueError, EOFError):  # EOFError: an empty file
        return None
    if meta is None or tokens.dtype != np.dtype("<u4") or tokens.ndim != 1:
        return None
    if hashlib.sha256(tokens.tobytes()).hexdigest() != meta.get("tokens_sha256") or len(tokens) != meta.get("tokens"):
        return None
    return tokens


def _write_atomically(path: Path, write: Callable[[Any], None], mode: str = "wb") -> None:
    """Write `path` through a partial file renamed into place; the partial file is removed if that fails."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")  # ranks sharing the folder write apart
    try:
        with partial.open(mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def load_tokens(path: str | os.PathLike, tokenizer, say: Callable[[str], None] = print) -> torch.Tensor:
    """`path` tokenized by `tokenizer` (ByteTokenizer or HFTokenizer), from its cache when one is valid."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"data file '{path}' is a folder, not a file; give a plain text or JSON lines file")
    if not path.is_file():
        what = "is not a regular file" if path.exists() else "does not exist"
        raise DataError(f"data file '{path}' {what}; give a plain text or JSON lines file")
    tokens_path, sidecar, source_hash = cache_paths(path, tokenizer)
    tokens = _read_cache(tokens_path, sidecar)
    if tokens is None:
        if tokens_path.exists():
            say(f"token cache '{tokens_path}' is damaged or incomplete; tokenizing '{path}' again")
        tokens = tokenize_file(path, tokenizer)
        stat = path.stat()
        meta = {
            "format": CACHE_FORMAT,
            "tokenizer": tokenizer.fingerprint,
            "source_size": stat.st_size,
            "source_mtime_ns": stat.st_mtime_ns,
            "source_sha256": source_hash,
            "tokens": len(tokens),
            "tokens_sha256": hashlib.sha256(tokens.tobytes()).hexdigest(),
        }
        try:
            _write_atomically(tokens_path, lambda f: np.save(f, tokens, allow_pickle=False))
            _write_atomically(sidecar, lambda f: f.write(json.dumps(meta, indent=1)), mode="w")
        except OSError as exc:
            say(f"cannot cache the tokens of '{path}' beside it ({exc}; {free_bytes(str(path.parent))} there); "
                "they are tokenized again next run")  # fmt: skip
    return torch.from_numpy(tokens.astype(np.int64))


class PackedBatches:
    """Iterator of (batch_size, seq) long tensors: the stream's non-overlapping `seq`-token sequences.

    Epoch e serves the sequences in a permutation seeded by (seed, e); micro-step s takes the next global batch
    of world_size * batch_size of them and rank r keeps rows [r * batch_size, (r + 1) * batch_size), so N
    ranks see together what one rank with N times the batch sees. The only state is the micro-step counter.
    """

    def __init__(
        self, tokens: torch.Tensor, batch_size: int, seq: int, seed: int = 0, rank: int = 0, world_size: int = 1
    ) -> None:
        self.sequences = len(tokens) // seq
        if self.sequences < batch_size * world_size:
            raise DataError(
                f"the data holds {len(tokens)} tokens: {self.sequences} sequence(s) of {seq}, fewer than one global "
                f"batch of {batch_size * world_size}; give more text or a smaller --seq"
            )
        self.tokens = tokens[: self.sequences * seq].view(self.sequences, seq)
        self.batch_size = batch_size
        self.seq = seq
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.step = 0
        self._order: tuple[int, torch.Tensor] | None = None

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @property
    def batches_per_epoch(self) -> int:
        return self.sequences // self.global_batch_size

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
            self._order = (epoch, torch.randperm(self.sequences, generator=gen))
        return self._order[1]

    def __iter__(self) -> PackedBatches:
        return self

    def __next__(self) -> torch.Tensor:
        epoch, index = divmod(self.step, self.batches_per_epoch)
        start = index * self.global_batch_size + self.rank * self.batch_size
        rows = self._permutation(epoch)[start : start + self.batch_size]
        self.step += 1
        return self.tokens[rows]

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "seq": self.seq,
            "sequences": self.sequences,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state["step"]`; the stream's identity (seed, global batch, seq, size) must match."""
        for key in ("seed", "global_batch_size", "seq", "sequences"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"cannot resume the data stream: saved {key}={state.get(key)}, this run has {getattr(self, key)}"
                )
        self.step = state["step"]
