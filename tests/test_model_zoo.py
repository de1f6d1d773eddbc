"""The model zoo: tiny transformers models of ten architectures trained by infinity match plain PyTorch.

Each (zoo_cases.py) is built from its config with no download, trained for a few steps with parameters and
optimizer on NVMe, on one and on two ranks, and compared with `torch.optim.AdamW` and global-norm clipping
in fp32 on one process: losses to rtol 1e-5 and final weights by the harness's `assert_weights_close`
(`assert_matches_reference`). Each world size trains every architecture in one distributed run
(transformers is imported once per rank), and prints each one's seconds.
"""

from __future__ import annotations

import functools
import tempfile

import pytest
from dist import run_distributed
from harness import assert_matches_reference
from zoo_cases import ZOO, plain_zoo, train_zoo

pytest.importorskip("transformers")

STEPS = 3
MICRO_BS = 2


@functools.cache
def _zoo_run(world: int) -> tuple[dict, ...]:
    with tempfile.TemporaryDirectory() as nvme:
        return tuple(run_distributed(train_zoo, world, list(ZOO), STEPS, MICRO_BS, nvme, timeout_s=600))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("arch", list(ZOO))
def test_zoo_model_matches_plain_pytorch_with_nvme_offload(arch, world):
    results = [r[arch] for r in _zoo_run(world)]
    print(f"{arch} world {world}: {results[0]['seconds']:.2f} s")
    ref_losses, ref_state = plain_zoo(arch, STEPS, MICRO_BS * world)
    assert_matches_reference(results, ref_losses, ref_state)
