"""Hugging Face models from a local folder: built without weights, their blocks found from the architecture.

`load_hf_folder(path)` reads `config.json` (and the tokenizer files, when present) and builds the model
with `transformers` with every parameter on the meta device and buffers real (rotary tables are
computed in `__init__` and cannot be recomputed later), so a model of any size is built in seconds and
the engine materializes, shards and offloads it block by block. Its weights are then streamed in with
`engine.load_full_state(checkpoint_tensors(folder, model))` (`infinity.models.hf_weights`).

`transformers` is an optional dependency (`pip install 'infinity[hf]'`), imported only here.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infinity.config import ConfigError
from infinity.models.folder_checksums import CHECKSUMS_FILE, verify_folder_checksums, write_folder_checksums
from infinity.models.meta import parameters_on_meta
from infinity.storage.disk_space import write_failure

CONFIG_FILE = "config.json"


def require_transformers():
    """The `transformers` module, or an error that says how to install it."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "loading a Hugging Face model folder needs the 'transformers' package: pip install 'infinity[hf]' "
            "(or pip install transformers)"
        ) from exc
    return transformers


def is_hf_folder(path: str | os.PathLike) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


@dataclass
class HFFolder:
    """A model built from a folder: the model (meta parameters), its config, its tokenizer (None without
    tokenizer files), the folder, and the module classes that form its blocks."""

    model: nn.Module
    config: Any
    tokenizer: Any
    folder: Path
    block_classes: tuple[str, ...]

    @property
    def hidden_size(self) -> int | None:
        for name in ("hidden_size", "n_embd", "d_model"):
            value = getattr(self.config, name, None)
            if isinstance(value, int):
                return value
        return None

    @property
    def max_positions(self) -> int | None:
        for name in ("max_position_embeddings", "n_positions", "n_ctx"):
            value = getattr(self.config, name, None)
            if isinstance(value, int):
                return value
        return None


def load_hf_folder(path: str | os.PathLike, with_tokenizer: bool = True) -> HFFolder:
    """Build the causal language model a Hugging Face folder describes, without its weights (see the module
    docstring); the tokenizer too when the folder has one and `with_tokenizer`. The files infinity listed when
    it wrote the folder are checked first (`folder_checksums`)."""
    transformers = require_transformers()
    folder = Path(path)
    if not is_hf_folder(folder):
        raise ConfigError(f"'{folder}' is not a Hugging Face model folder: it has no {CONFIG_FILE}")
    verify_folder_checksums(folder)  # before transformers reads config.json and the tokenizer
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:  # transformers' own words: an unreadable or unknown config.json
        raise ConfigError(f"'{folder / CONFIG_FILE}' cannot be read as a model config: {exc}") from exc
    # fp32 parameters whatever the folder's dtype: the engine keeps fp32 masters and casts for compute
    dtype_kwarg = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    try:
        with parameters_on_meta():
            model = transformers.AutoModelForCausalLM.from_config(config, **{dtype_kwarg: torch.float32})
    except ValueError as exc:
        raise ConfigError(
            f"'{folder}' holds a {type(config).__name__} ({config.model_type}), which transformers cannot build as "
            f"a causal language model: {exc}"
        ) from exc
    tokenizer = None
    if with_tokenizer and _has_tokenizer_files(folder):
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return HFFolder(model, config, tokenizer, folder, find_block_classes(model))


def _has_tokenizer_files(folder: Path) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model")
    return any((folder / name).is_file() for name in names)


def find_block_classes(model: nn.Module) -> tuple[str, ...]:
    """The module classes whose instances are the model's layers (one block each).

    The classes transformers keeps whole when splitting a model (`_no_split_modules`) that repeat in it; else
    the class of the children of the outermost lists of identical modules with parameters."""
    counts = Counter(type(m).__name__ for m in model.modules() if any(True for _ in m.parameters()))
    declared = [c for c in sorted(getattr(model, "_no_split_modules", None) or ()) if counts.get(c, 0) >= 2]
    if declared:
        return tuple(declared)
    found: list[str] = []
    inside: list[str] = []  # names of lists already taken: lists nested in their layers (experts) are not layers

    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2 or any(name.startswith(p) for p in inside):
            continue
        kinds = {type(child).__name__ for child in module}
        if len(kinds) == 1 and any(True for _ in module.parameters()):
            inside.append(name + ".")
            kind = kinds.pop()
            if kind not in found:
                found.append(kind)
    if not found:
        raise ConfigError(
            f"no repeated layers found in {type(model).__name__}; name the classes that form one block each in "
            "'zero_optimization.block_classes'"
        )
    return tuple(found)


# what a folder save_hf_folder wrote holds (weights, config, tokenizer), so that an earlier one may be replaced
_HF_FILE = re.compile(
    r"[\w.-]*\.(safetensors|bin)|[\w.-]*\.index\.json|(generation_|tokenizer_|preprocessor_)?config\.json"
    r"|tokenizer\.(json|model)|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|merges\.txt"
    r"|spiece\.model|chat_template\.(jinja|json)|" + re.escape(CHECKSUMS_FILE)
)


def check_hf_output(
    out: str | os.PathLike, keep: tuple[str | os.PathLike, ...] = (), what: str = "Hugging Face output folder"
) -> None:
    """Refuse `out` as the folder `save_hf_folder` replaces unless it is new, empty, or a Hugging Face folder
    (config.json, weights and tokenizer files only); and where it is, holds or is inside one of `keep`."""
    target = Path(out).resolve()
    for path in keep:
        other = Path(path).resolve()
        if target == other or other in target.parents or target in other.parents:
            raise ConfigError(
                f"{what} '{out}' is, holds or is inside '{path}', which it must not replace; name a new folder"
            )
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{what} '{out}' is a file, not a folder: name a new folder")
    if target.is_dir():
        entries = list(target.iterdir())
        others = sorted(e.name for e in entries if e.is_dir() or not _HF_FILE.fullmatch(e.name))
        if entries and (others or not (target / CONFIG_FILE).is_file()):
            held = f"it holds {', '.join(others[:3])}" if others else f"it has no {CONFIG_FILE}"
            raise ConfigError(
                f"{what} '{out}' exists and is not a Hugging Face model folder ({held}): writing there would delete "
                "what it holds; name a new or empty folder"
            )
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} '{out}' cannot be written: '{existing}' is not writable by this user")


def save_hf_folder(engine, hf: HFFolder, out: str | os.PathLike, max_shard_bytes: int | None = None) -> Path:
    """Write the engine's trained weights (fp32) with the folder's config and tokenizer as a folder that
    `from_pretrained` loads. Every rank calls it (the weights are gathered block by block); rank 0 writes
    into a staging folder and renames it to `out` (an older `out` is replaced) once it is complete."""
    from infinity.models.hf_weights import DEFAULT_MAX_SHARD_BYTES, hf_tensors, write_hf_weights

    out = Path(out)
    check_hf_output(out, keep=(hf.folder,))
    named = engine.iter_full_state()
    if engine.comm.rank != 0:
        for _ in named:  # the gathers are collectives: every rank walks the whole model
            pass
        engine.comm.barrier("Hugging Face folder written")
        return out
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write_hf_weights(hf_tensors(hf.model, named), staging, max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
        config = copy.deepcopy(hf.config)
        config.dtype = torch.float32  # the trained fp32 master weights are what is written
        config.save_pretrained(staging)
        generation = getattr(hf.model, "generation_config", None)
        if generation is not None and (hf.folder / "generation_config.json").is_file():
            generation.save_pretrained(staging)
        if hf.tokenizer is not None:
            hf.tokenizer.save_pretrained(staging)
        write_folder_checksums(staging)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)  # the earlier folder at `out`, if any, is untouched
        failure = write_failure(exc, "the Hugging Face folder", out, "choose another --save-hf folder")
        if failure is exc:
            raise
        raise failure from exc
    old = out.with_name(f".{out.name}.old")
    if out.exists():  # an earlier Hugging Face folder (`check_hf_output`): replaced once the new one is complete
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(staging, out)
    shutil.rmtree(old, ignore_errors=True)
    engine.comm.barrier("Hugging Face folder written")
    return out
