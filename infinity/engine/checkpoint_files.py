"""Reading a checkpoint folder's per-rank files: one tensor range at a time, at any world size."""

from __future__ import annotations

from pathlib import Path

import torch

from infinity.engine.checkpoint_folder import CheckpointError, model_file, optim_file, read_manifest
from infinity.engine.checkpoint_format import FormatError, LazyTensor, TorchFileReader
from infinity.shards.moments import moment_format


class CheckpointFiles:
    """The per-rank files of one checkpoint folder, opened lazily, read one tensor range at a time.

    `read_range(kind, flat, start, end)` returns elements [start, end) of a FlatParam's full buffer as the
    saving run laid it out (its ranks' shards concatenated), whatever world size reads it; elements past
    that buffer's end are padding and read as zeros. `kind` is "param" (compute-dtype weights), "master",
    or one of the moments' tensors (`shard_moments` reads those). Memory: only the requested range is read.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.world_size = read_manifest(folder, 0)["world_size"]
        self._readers: dict[tuple[str, int], TorchFileReader] = {}

    def reader(self, kind: str, rank: int) -> TorchFileReader:
        """The model-states (`kind` "model") or optim-states ("optim") file of `rank`."""
        key = (kind, rank)
        if key not in self._readers:
            name = model_file(rank) if kind == "model" else optim_file(rank)
            try:
                self._readers[key] = TorchFileReader(self.folder / name)
            except FormatError as exc:
                raise CheckpointError(f"checkpoint file '{self.folder / name}' cannot be read: {exc}") from exc
        return self._readers[key]

    def _shard(self, kind: str, rank: int, flat_name: str) -> LazyTensor:
        if kind == "param":
            return self.reader("model", rank).obj["param_shards"][flat_name]
        return self.reader("optim", rank).obj["shards"][flat_name][kind]

    def shard_numel(self, flat_name: str) -> int:
        return self._shard("param", 0, flat_name).numel

    def moment_format(self, flat_name: str) -> str:
        """The format its moments were saved in ("fp32" in checkpoints older than the formats)."""
        return self.reader("optim", 0).obj["shards"][flat_name].get("moments", "fp32")

    def shard_moments(self, flat_name: str, start: int, end: int) -> tuple[str, dict[str, torch.Tensor]]:
        """(the saved format, its tensors) of the moments of elements [start, end) of a flat, start and end
        multiples of the format's block (shards always are): per-block scales are read for those blocks."""
        fmt = moment_format(self.moment_format(flat_name))
        per = fmt.block_elems or 1
        values = {}
        for kind in fmt.tensor_specs(1):
            scaled = kind.endswith("_scale")
            values[kind] = self.read_range(
                kind, flat_name, start // per if scaled else start, -(-end // per) if scaled else end
            )
        return fmt.name, values

    def read_range(self, kind: str, flat_name: str, start: int, end: int) -> torch.Tensor:
        shard_numel = self._shard(kind, 0, flat_name).numel  # per rank, in this kind's own elements
        saved_end = shard_numel * self.world_size
        dtype = self._shard(kind, 0, flat_name).dtype
        out = torch.empty(end - start, dtype=dtype)
        out[max(0, min(end, saved_end) - start) :] = 0  # past the saved buffer: padding
        pos = start
        while pos < min(end, saved_end):
            rank, offset = divmod(pos, shard_numel)
            n = min(end, (rank + 1) * shard_numel) - pos
            reader = self.reader("model" if kind == "param" else "optim", rank)
            try:
                reader.read_into(self._shard(kind, rank, flat_name), offset, out[pos - start : pos - start + n])
            except FormatError as exc:
                raise CheckpointError(str(exc)) from exc
            pos += n
        return out

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
