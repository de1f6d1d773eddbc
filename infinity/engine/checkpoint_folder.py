"""A checkpoint folder on disk: staging, atomic publication, manifests, verification and finding one.

`save_dir/tag/` holds each rank's files and `manifest_rank{r}.json` (every file's size and SHA-256);
`save_dir/latest` names the current tag. A save writes into `save_dir/.tag.tmp` and renames it into
place (`publish`), so a crash leaves the previous checkpoint loadable. A save that fails or is
interrupted (a full disk, SIGTERM / SIGINT raised as an exception, a peer's death) removes its partial
files and staging folder: at once where a write failed, otherwise when the process exits or the next
save starts. `newest_verified_checkpoint` finds the newest checkpoint whose files all match their
manifests, for a resume when `latest` is missing, empty or names a damaged one.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from infinity.engine.checkpoint_errors import CheckpointError
from infinity.engine.checkpoint_format import Produce, TorchFileReader, write_torch_object
from infinity.engine.save_dir_lock import hold_save_dir
from infinity.estimator import format_bytes
from infinity.storage.checksum import file_sha256

MANIFEST = "manifest_rank{rank}.json"
MANIFEST_SEAL = "manifest_sha256"
LATEST = "latest"
FORMAT_VERSION = 2  # 2: model states carry "flats" (slot metadata) and "state_dict_keys"


def model_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def optim_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Staging folders this process created and has not published yet: removed if the save fails, when the
# process exits (atexit also runs after SIGTERM / SIGINT raised as exceptions) or when a later save starts.
_UNPUBLISHED: set[Path] = set()


def _remove_unpublished() -> None:
    for staging in list(_UNPUBLISHED):
        shutil.rmtree(staging, ignore_errors=True)
        _UNPUBLISHED.discard(staging)


atexit.register(_remove_unpublished)


def check_tag(root: Path, tag: str) -> None:
    """Refuse a tag that is not one plain folder name, or that would replace something not a checkpoint."""
    odd = not tag or tag in (".", "..") or tag.startswith(".") or "/" in tag or os.sep in tag or tag == LATEST
    if odd or tag != tag.strip() or not tag.isprintable():  # `latest` is read back stripped
        raise CheckpointError(
            f"checkpoint tag {tag!r} is not a plain folder name: a tag must not be empty, contain '/', start with "
            f"'.', begin or end with white space, hold control characters or be '{LATEST}' (the file naming the "
            "newest checkpoint); e.g. 'global_step100' or 'best'"
        )
    final = root / tag
    if final.exists() and not (final / MANIFEST.format(rank=0)).is_file():
        raise CheckpointError(
            f"'{final}' exists and is not a checkpoint: saving under tag {tag!r} would replace it; choose another "
            "tag or save_dir, or move it away"
        )


def begin_staging(root: Path, staging: Path, holder: object) -> None:
    """Create the empty staging folder `staging` in `root` (rank 0), registered for removal until published;
    `holder` takes the folder's writer lock (`hold_save_dir`)."""
    _remove_unpublished()
    hold_save_dir(root, holder)
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    except OSError as exc:
        raise OSError(
            exc.errno, f"cannot create the checkpoint folder '{staging}': {exc.strerror or exc}", str(staging)
        ) from exc
    _UNPUBLISHED.add(staging)


def _discard_partial(path: Path) -> None:
    """After a failed write: remove `path` and, where this process created it, its staging folder."""
    path.unlink(missing_ok=True)
    if path.parent in _UNPUBLISHED:
        shutil.rmtree(path.parent, ignore_errors=True)
        _UNPUBLISHED.discard(path.parent)


def _free_space(folder: Path) -> str:
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return "free space unknown"
    return f"{format_bytes(free)} free there"


def _written(path: Path, write: Callable[[], None]) -> None:
    """Run `write()`, which creates `path`; on any failure the partial file (and staging) is removed, and an
    OSError of the write itself (a full disk, permissions) is re-raised naming `path` and the free space."""
    from infinity.storage.errors import StorageError  # a swap read failing inside `write`: not a write error

    try:
        write()
    except StorageError:
        _discard_partial(path)
        raise
    except OSError as exc:
        free, staged = _free_space(path.parent), path.parent in _UNPUBLISHED
        _discard_partial(path)
        notes = [f"{exc.strerror or exc} ({free})"]
        if staged:
            notes.append("the unfinished checkpoint was removed, the previous ones are untouched")
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            notes.append("free space there or save to another folder")
        raise OSError(exc.errno, f"cannot write checkpoint file '{path}': {'; '.join(notes)}", str(path)) from exc
    except BaseException:
        _discard_partial(path)
        raise


def write_file(path: Path, obj: Any, produce: Produce) -> dict[str, Any]:
    """Write `obj` (TensorSpecs in it filled by `produce`, one at a time), fsync it; its size and SHA-256."""

    def write() -> None:
        write_torch_object(path, obj, produce)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    _written(path, write)
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def write_text(path: Path, text: str) -> None:
    def write() -> None:
        with path.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    _written(path, write)


def publish(root: Path, staging: Path, final: Path, tag: str, save_latest: bool = True) -> None:
    """Rename the finished staging folder to `final` and point `latest` at it, each step atomic."""
    _fsync_dir(staging)
    old = root / f".{tag}.old"
    if final.exists():  # re-saving a tag: keep the old folder where loading finds it until the new one is in place
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staging, final)
    _UNPUBLISHED.discard(staging)
    if save_latest:
        latest_tmp = root / f".{LATEST}.tmp"
        write_text(latest_tmp, tag)
        os.replace(latest_tmp, root / LATEST)
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)


def check_not_in_checkpoints(path: str | os.PathLike, what: str) -> None:
    """Refuse to write `what` at `path` where it would replace a checkpoint's file: inside a checkpoint folder
    (or a save's staging folder), or as the `latest` of a folder that holds checkpoints."""
    target = Path(path).resolve()
    for folder in target.parents:
        staging = folder.name.startswith(".") and folder.name.endswith(".tmp")
        if staging or (folder / MANIFEST.format(rank=0)).is_file():
            raise CheckpointError(
                f"{what} '{path}' is inside checkpoint folder '{folder}': writing it there would damage that "
                "checkpoint; choose a path outside it"
            )
    if target.name == LATEST and list_checkpoints(target.parent):
        raise CheckpointError(
            f"{what} '{path}' would replace the '{LATEST}' file that names the newest checkpoint in "
            f"'{target.parent}'; choose another name"
        )


def list_checkpoints(save_dir: str | os.PathLike) -> list[str]:
    """The tags of `save_dir`'s checkpoint folders (with a rank-0 manifest), in natural order; never a staging
    folder. A re-saved tag whose new folder is not in place yet is listed under its own name."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    tags = []
    for entry in root.iterdir():
        name = entry.name
        if name.startswith(".") and name.endswith(".old") and not (root / name[1:-4]).is_dir():
            name = name[1:-4]  # resolve_folder finds `.tag.old` under `tag`
        elif name.startswith("."):
            continue  # `.tag.tmp`: a save in progress or interrupted; `.tag.old` beside its replacement
        if (entry / MANIFEST.format(rank=0)).is_file():
            tags.append(name)
    return sorted(tags, key=lambda t: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", t)])


def _no_checkpoint_hint(root: Path, tag_hint: str) -> str:
    tags = list_checkpoints(root)
    shown = tags if len(tags) <= 6 else [*tags[:2], "...", *tags[-3:], f"({len(tags)} in all)"]
    found = f"checkpoints there: {', '.join(shown)}" if tags else "no checkpoint is there"
    return f"{found}; {tag_hint}" if tags and tag_hint else found


def resolve_folder(
    load_dir: str | os.PathLike, tag: str | None = None, tag_hint: str = "pass tag= to name one"
) -> Path:
    """The checkpoint folder for `load_dir` and `tag`: `load_dir/tag`, the tag `load_dir/latest` names, or
    `load_dir` itself when it is a checkpoint folder. `tag_hint` is the advice given when there is no usable
    `latest` (the command line says which flag names a tag)."""
    root = Path(load_dir)
    if tag is None:
        latest = root / LATEST
        if latest.is_file():
            try:
                tag = latest.read_text().strip()
            except UnicodeDecodeError as exc:
                raise CheckpointError(
                    f"'{latest}' is damaged (not text: {exc}); it should name the checkpoint to load; "
                    f"{_no_checkpoint_hint(root, tag_hint)}"
                ) from exc
            if not tag:
                raise CheckpointError(
                    f"'{latest}' is empty: it should name the checkpoint to load; {_no_checkpoint_hint(root, tag_hint)}"
                )
        elif (root / MANIFEST.format(rank=0)).is_file():
            return root
        elif not root.is_dir():
            raise CheckpointError(f"checkpoint folder '{root}' does not exist")
        else:
            raise CheckpointError(f"'{root}' has no '{LATEST}' file; {_no_checkpoint_hint(root, tag_hint)}")
    folder = root / tag
    if not folder.is_dir() and (root / f".{tag}.old").is_dir():
        folder = root / f".{tag}.old"  # a re-save of this tag was interrupted between its two renames
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint '{root / tag}' does not exist; {_no_checkpoint_hint(root, tag_hint)}")
    if not (folder / MANIFEST.format(rank=0)).is_file():
        raise CheckpointError(
            f"checkpoint '{folder}' has no {MANIFEST.format(rank=0)}: it is incomplete or not a checkpoint; "
            f"{_no_checkpoint_hint(root, tag_hint)}"
        )
    return folder


def seal_manifest(manifest: dict[str, Any]) -> dict[str, Any]:
    """`manifest` with `manifest_sha256`: the SHA-256 of its other fields (sorted JSON), so that a manifest edited
    or damaged after it was written (a world size, a file's checksum) is named as damaged, never believed."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_SEAL}
    return {**body, MANIFEST_SEAL: hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()}


def _manifest_problem(manifest: Any, rank: int) -> str:
    """What is wrong with a parsed manifest, or ''. One with a seal (`seal_manifest`) must match it; older
    manifests have none."""
    if not isinstance(manifest, dict):
        return "it is not a JSON object"
    if MANIFEST_SEAL in manifest and seal_manifest(manifest)[MANIFEST_SEAL] != manifest[MANIFEST_SEAL]:
        return "its contents do not match its own checksum: it changed after it was written"
    for key in ("world_size", "files"):
        if key not in manifest:
            return f"it has no '{key}'"
    world = manifest["world_size"]
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        return f"its 'world_size' is {world!r}, not a positive integer"
    if manifest.get("rank", rank) != rank:
        return f"it says rank {manifest['rank']}"
    version = manifest.get("format_version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        return f"its 'format_version' is {version!r}, not a positive integer"
    steps = manifest.get("global_steps", 0)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        return f"its 'global_steps' is {steps!r}, not a step number"
    if not isinstance(manifest["files"], dict):
        return "its 'files' is not an object"
    for name in (model_file(rank), optim_file(rank)):  # a file the manifest leaves out would load unverified
        if name not in manifest["files"]:
            return f"it lists no '{name}'"
    for name, entry in manifest["files"].items():
        if not (
            isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)
        ):
            return f"its entry for '{name}' lacks 'bytes' or 'sha256'"
    return ""


def read_manifest(folder: Path, rank: int) -> dict[str, Any]:
    """Rank `rank`'s manifest in `folder`, checked for the keys loading needs; CheckpointError naming it if not."""
    path = folder / MANIFEST.format(rank=rank)
    if not path.is_file():
        raise CheckpointError(f"checkpoint '{folder}' has no {path.name}: it is incomplete or not a checkpoint")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint manifest '{path}' is corrupted: {exc}") from exc
    problem = _manifest_problem(manifest, rank)
    if problem:
        raise CheckpointError(f"checkpoint manifest '{path}' is damaged: {problem}")
    if manifest.get("format_version", 1) > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint '{folder}' is in format {manifest['format_version']}, written by a newer infinity (this one "
            f"reads formats up to {FORMAT_VERSION}): load it with that version, or upgrade infinity"
        )
    return manifest


def verify_rank(folder: Path, rank: int, world_size: int) -> None:
    """Check rank `rank`'s files against its manifest: present, full size, same SHA-256."""
    manifest = read_manifest(folder, rank)
    if manifest["world_size"] != world_size:
        raise CheckpointError(
            f"checkpoint '{folder}': {MANIFEST.format(rank=rank)} says {manifest['world_size']} ranks, "
            f"rank 0's says {world_size}; the folder mixes two checkpoints"
        )
    for name, expect in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file '{path}' is missing")
        size = path.stat().st_size
        if size != expect["bytes"]:
            raise CheckpointError(
                f"checkpoint file '{path}' is truncated: {size} bytes, the manifest says {expect['bytes']}"
            )
        if file_sha256(path) != expect["sha256"]:
            raise CheckpointError(f"checkpoint file '{path}' is corrupted: its SHA-256 differs from the manifest's")


def verify_checkpoint(folder: Path) -> int:
    """Check every rank's files in `folder` against their manifests; returns the world size that wrote it."""
    world_size = read_manifest(folder, 0)["world_size"]
    for rank in range(world_size):
        verify_rank(folder, rank, world_size)
    return world_size


def _saved_step(folder: Path) -> int:
    """The global step a checkpoint folder was saved at (-1 if unknown: an unreadable model-states file)."""
    try:
        step = json.loads((folder / MANIFEST.format(rank=0)).read_text()).get("global_steps")
        if isinstance(step, int):
            return step
        with TorchFileReader(folder / model_file(0)) as reader:  # written before manifests carried the step
            return int(reader.obj["global_steps"])
    except Exception:  # a damaged file: it will not verify either
        return -1


def newest_verified_checkpoint(save_dir: str | os.PathLike, exclude: Collection[Path] = ()) -> tuple[str, Path] | None:
    """The newest checkpoint in `save_dir` whose every file matches its manifest, as (tag, folder), or None.

    Newest: the highest saved global step, then the latest written manifest. Staging folders of saves
    in progress or interrupted are never candidates; nor are the folders in `exclude`.
    """
    root = Path(save_dir)
    candidates = []
    for tag in list_checkpoints(root):
        folder = resolve_folder(root, tag)
        if folder in exclude:
            continue
        try:
            written_ns = (folder / MANIFEST.format(rank=0)).stat().st_mtime_ns
        except OSError:
            continue
        candidates.append((_saved_step(folder), written_ns, tag, folder))
    for _, _, tag, folder in sorted(candidates, key=lambda c: c[:2], reverse=True):
        try:
            verify_checkpoint(folder)
        except CheckpointError:
            continue
        return tag, folder
    return None
