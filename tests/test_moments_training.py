"""Compressed moments train like exact ones: a tiny GPT trained with CPUAdamW on the bundled corpus
ends within 1% of the fp32-moment loss with bf16 and with 8-bit moments (same seed, same data).

The loss is the held-out loss on fixed validation batches, so batch-to-batch noise does not decide it.
(tools/bench_moments.py does the same at the 110m preset.)
"""

import math

import pytest
import torch

from infinity.data.corpus import ByteBatches, load_corpus
from infinity.models.gpt import GPT, gpt_preset
from infinity.optim import CPUAdamW, moment_format

STEPS = 300
LR = 1e-3
BATCH = 16
VAL_BATCHES = 4


def train(moments: str) -> tuple[float, CPUAdamW]:
    """Held-out loss after STEPS steps of the tiny GPT with the given moment format, and the optimizer."""
    torch.manual_seed(0)
    model = GPT(gpt_preset("tiny"))
    opt = CPUAdamW(model.parameters(), lr=LR, weight_decay=0.01, moments=moments)
    batches = ByteBatches(load_corpus("train"), BATCH, model.config.block_size, seed=0)
    for _ in range(STEPS):
        x, y = next(batches)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    val = ByteBatches(load_corpus("val"), 64, model.config.block_size, seed=99)
    with torch.no_grad():
        return sum(model(*next(val))[1].item() for _ in range(VAL_BATCHES)) / VAL_BATCHES, opt


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's ops gain nothing from a second thread, and lose much on a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def fp32_loss(one_thread) -> float:
    loss, _ = train("fp32")
    assert loss < 0.55 * math.log(256), f"the fp32 run did not learn (held-out loss {loss:.3f})"
    return loss


@pytest.mark.parametrize("moments", ("bf16", "8bit"))
def test_compressed_moments_end_within_one_percent_of_fp32(moments, fp32_loss):
    loss, opt = train(moments)
    state = next(iter(opt.state.values()))
    assert state["exp_avg"].dtype == moment_format(moments).code_dtype  # the format was really in use
    assert abs(loss - fp32_loss) <= 0.01 * fp32_loss, f"{moments}: {loss:.4f} vs fp32 {fp32_loss:.4f}"
