"""The checksums of the small files of a Hugging Face folder infinity writes (config, tokenizer, weight index).

`write_folder_checksums` records each file's SHA-256 and size in `CHECKSUMS_FILE`; `verify_folder_checksums`
checks them before the folder is read, so a changed digit in `config.json` stops the run instead of building
another model. Weight shards are not listed: each carries its own checksum (`weight_files`). A folder without
the file (written by another tool) is read unchecked.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from infinity.models.weight_files import DamagedFileError
from infinity.storage.checksum import file_sha256

CHECKSUMS_FILE = "infinity_checksums.json"
_FORMAT = "infinity-folder-checksums-1"
_WEIGHT_SUFFIXES = (".safetensors", ".bin")


def _listing_digest(files: dict[str, dict[str, object]]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_folder_checksums(folder: str | os.PathLike) -> None:
    """Record the SHA-256 and size of every file in `folder` but weight shards (see the module docstring)."""
    folder = Path(folder)
    files: dict[str, dict[str, object]] = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != CHECKSUMS_FILE and not path.name.endswith(_WEIGHT_SUFFIXES):
            files[path.name] = {"sha256": file_sha256(path), "bytes": path.stat().st_size}
    record = {"format": _FORMAT, "files": files, "sha256": _listing_digest(files)}
    (folder / CHECKSUMS_FILE).write_text(json.dumps(record, indent=1) + "\n")


def verify_folder_checksums(folder: str | os.PathLike) -> None:
    """Check the files `folder`'s CHECKSUMS_FILE lists; DamagedFileError naming the file and what to do when one
    is missing, or differs from what was written, or the list itself is damaged. No list: nothing to check."""
    folder = Path(folder)
    listing = folder / CHECKSUMS_FILE
    if not listing.is_file():
        return
    try:
        record = json.loads(listing.read_bytes())
        files = record["files"]
        intact = record.get("format") == _FORMAT and record["sha256"] == _listing_digest(files)
    except (ValueError, KeyError, TypeError) as exc:  # not JSON, not UTF-8, or not this layout
        intact, files = False, {}
        cause = f" ({exc})"
    else:
        cause = ""
    if not intact:
        raise DamagedFileError(
            f"'{listing}' is damaged{cause}: it no longer holds the checksums infinity wrote with the folder; copy "
            f"the folder again, or delete '{CHECKSUMS_FILE}' to read it unchecked"
        )
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            raise DamagedFileError(
                f"'{path}' is missing: infinity wrote it with the folder and lists it in '{CHECKSUMS_FILE}'; copy "
                "the folder again"
            )
        if path.stat().st_size != expected["bytes"] or file_sha256(path) != expected["sha256"]:
            raise DamagedFileError(
                f"'{path}' differs from the file infinity wrote with the folder (its SHA-256 in '{CHECKSUMS_FILE}'): "
                f"it is damaged or was edited; copy the folder again, or, if you edited it on purpose, delete "
                f"'{CHECKSUMS_FILE}'"
            )
