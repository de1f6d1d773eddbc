"""One full fp32 state dict from a sharded checkpoint, without the model and without holding it in memory.

Every parameter is assembled from the fp32 master shards of all ranks (compute-dtype weights for
frozen ones) using the slot metadata the checkpoint carries, and written as soon as it is complete,
so memory stays near the largest tensor. Tied weights appear under every name the model's
`state_dict()` gives them; `model.load_state_dict(torch.load(out))` restores the model.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from infinity.engine.checkpoint import (
    CheckpointError,
    CheckpointFiles,
    resolve_folder,
    verify_rank,
)
from infinity.engine.checkpoint_folder import check_not_in_checkpoints
from infinity.engine.checkpoint_format import order_aliases_after_sources, write_torch_file
from infinity.models.weight_files import TensorSpec, write_safetensors_file

FORMATS = ("torch", "safetensors")


@dataclass(frozen=True)
class ConsolidateResult:
    """What `consolidate` wrote."""

    path: Path
    format: str
    tensors: int
    parameters: int
    bytes: int


def choose_format(out: str | os.PathLike, fmt: str | None = None) -> str:
    """`fmt` if given; else by suffix (.safetensors, or .pt/.pth/.bin for torch); else safetensors when
    that package is installed (to load the file with), torch otherwise."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
        return fmt
    suffix = Path(out).suffix
    if suffix == ".safetensors":
        return "safetensors"
    if suffix in (".pt", ".pth", ".bin"):
        return "torch"
    return "safetensors" if importlib.util.find_spec("safetensors") is not None else "torch"


def _output_error(out: Path, exc: OSError) -> OSError:
    """`exc` (a write of the output failed) restated naming `out`, with the free space on a full disk."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        folder = next((p for p in (out.parent, *out.parent.parents) if p.exists()), Path("."))
        reason += f" ({shutil.disk_usage(folder).free} bytes free there); free space or write elsewhere"
    elif exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        reason += "; choose a folder you can write"
    return OSError(exc.errno, f"cannot write '{out}': {reason}", str(out))


def consolidate(
    ckpt_dir: str | os.PathLike,
    out: str | os.PathLike,
    tag: str | None = None,
    fmt: str | None = None,
    overwrite: bool = False,
) -> ConsolidateResult:
    """Write the checkpoint in `ckpt_dir` (its `latest`, or `tag`, or the folder itself) to `out`; an existing
    `out` is replaced only with `overwrite` (it may be a user's own weights)."""
    folder = resolve_folder(ckpt_dir, tag)
    check_not_in_checkpoints(out, "output")
    if not overwrite and os.path.lexists(out):
        raise OSError(
            errno.EEXIST, f"the output '{out}' exists; name a new file, or pass --overwrite to replace it", str(out)
        )
    fmt = choose_format(out, fmt)
    with CheckpointFiles(folder) as files:
        for rank in range(files.world_size):
            verify_rank(folder, rank, files.world_size)
        meta_reader = files.reader("model", 0)
        states = meta_reader.obj
        if "flats" not in states or "state_dict_keys" not in states:
            raise CheckpointError(
                f"checkpoint '{folder}' predates slot metadata (format {states.get('format_version')}); load it "
                "into the engine and save the result of engine.full_state_dict() instead"
            )
        where: dict[str, tuple[str, dict, dict]] = {}
        for flat_name, flat in states["flats"].items():
            for slot in flat["slots"]:
                for name in slot["names"]:
                    where[name] = (flat_name, flat, slot)
        specs: list[TensorSpec] = []
        first_name: dict[tuple[str, str], str] = {}
        for key in states["state_dict_keys"]:
            if key in where:
                flat_name, _, slot = where[key]
                source = first_name.setdefault((flat_name, slot["fqn"]), key)
                specs.append(TensorSpec(key, tuple(slot["shape"]), torch.float32, None if source == key else source))
            elif key in states["buffers"]:
                lazy = states["buffers"][key]
                specs.append(TensorSpec(key, lazy.shape, lazy.dtype))
            else:
                raise CheckpointError(f"checkpoint '{folder}': state dict key '{key}' is no parameter and no buffer")

        def produce(spec: TensorSpec) -> torch.Tensor:
            if spec.name not in where:
                return meta_reader.load(states["buffers"][spec.name])
            flat_name, flat, slot = where[spec.name]
            numel = int(torch.Size(spec.shape).numel())
            kind = "master" if flat["trainable"] else "param"
            values = files.read_range(kind, flat_name, slot["offset"], slot["offset"] + numel)
            return values.to(torch.float32).view(spec.shape)

        out = Path(out)
        partial = out.with_name(f".{out.name}.partial")
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            if fmt == "torch":
                write_torch_file(partial, specs, produce)
            else:
                metadata = {"format": "pt", "source": str(folder)}
                write_safetensors_file(partial, order_aliases_after_sources(specs), produce, metadata)
            os.replace(partial, out)
        except OSError as exc:
            raise _output_error(out, exc) from exc
        finally:
            if partial.exists():  # a failed or interrupted write leaves nothing behind
                partial.unlink()
    params = sum(torch.Size(s.shape).numel() for s in specs if s.name in where and s.alias_of is None)
    return ConsolidateResult(out, fmt, len(specs), params, out.stat().st_size)
