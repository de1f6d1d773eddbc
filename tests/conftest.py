"""Shared test set-up: deterministic seeds, CPU float hygiene, and `tests/` importable (`from dist import ...`)."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import torch

TESTS_DIR = str(Path(__file__).resolve().parent)
if TESTS_DIR not in sys.path:  # pytest's default import mode adds it too; this keeps importlib mode working
    sys.path.insert(0, TESTS_DIR)

SEED = 1234


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "unit: the fast tier, no processes or disk-heavy runs (`pytest -m unit`)")
    torch.set_flush_denormal(True)  # decaying weights in denormals slow CPU math several-fold
    torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(SEED)
    torch.manual_seed(SEED)


@pytest.fixture
def seed() -> int:
    """The seed every test starts from (already applied to `random` and torch)."""
    return SEED
