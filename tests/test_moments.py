"""Specification of the moment storage formats (`infinity.shards.moments`), checked against
independent computations: torch's float8 cast, brute-force nearest search, Python-int hashing,
and hand-counted layouts."""

import math

import pytest
import torch

from infinity.shards import moments
from infinity.shards.moments import FORMATS, Q8_BLOCK_ELEMS, code_table, decode, encode, moment_format

NAMES = ("exp_avg", "exp_avg_sq")


def wide_values(n: int, seed: int = 0, signed: bool = True) -> torch.Tensor:
    """Values spanning 40 decades, so every binade of both 8-bit maps is hit."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 10.0 ** torch.empty(n).uniform_(-30, 10, generator=gen)
    return x if signed else x.abs()


def test_exp_avg_code_points_are_float8_e4m3fn_over_256():
    fp8 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float() / 256
    table = code_table("exp_avg")
    finite = torch.isfinite(fp8)  # 0x7F and 0xFF are NaN in e4m3fn; the largest point we use is 1.0 (0x78)
    assert torch.equal(table[finite], fp8[finite])
    assert table[0x78].item() == 1.0 and table[0xF8].item() == -1.0


def test_exp_avg_sq_code_points_are_unsigned_e5m3():
    table = code_table("exp_avg_sq").double()
    assert table[0xF8].item() == 1.0
    assert table[1].item() == 2.0**-33 and table[8].item() == 2.0**-30  # subnormal step, smallest normal
    assert torch.all(table[1:] > table[:-1])  # monotone, so codes order like values
    assert table[0x9B].item() == (1 + 3 / 8) * 2.0 ** (0x9B // 8 - 31)


@pytest.mark.parametrize("name", NAMES)
def test_nearest_encoding_is_the_closest_code_ties_to_even(name):
    x = wide_values(157 * Q8_BLOCK_ELEMS, signed=name == "exp_avg")
    codes, scale = encode(x, "8bit", name)
    blocks = x.view(-1, Q8_BLOCK_ELEMS)
    assert torch.equal(scale, blocks.abs().amax(dim=1))
    y = (blocks.abs() / scale[:, None]).flatten().double()
    table = code_table(name).double()[: 128 if name == "exp_avg" else 256]
    dist = (y[:, None] - table[None, :]).abs()
    if name == "exp_avg_sq":  # a positive exp_avg_sq may not take code 0: the nearest of the others
        dist[:, 0] = torch.where(x.abs() >= 2.0**-126, math.inf, dist[:, 0])
    best = dist.min(dim=1).values
    ties = (dist == best[:, None]).sum(dim=1) > 1
    mags = codes.long() & (0x7F if name == "exp_avg" else 0xFF)
    chosen = dist.gather(1, mags[:, None]).squeeze(1)
    assert torch.equal(chosen, best), "some code is not a nearest code point"
    assert torch.all(mags[ties] % 2 == 0), "a tie went to the odd code"
    if name == "exp_avg":
        assert torch.equal(codes >= 0x80, (x < 0) & (x.abs() >= 2.0**-126))


def test_ties_are_broken_toward_the_even_code():
    block = torch.zeros(Q8_BLOCK_ELEMS)
    block[0] = 1.0
    block[1:4] = torch.tensor([0.53125, 0.59375, 0.53])  # 0.5 (0x70) | 0.5625 (0x71) | 0.625 (0x72)
    codes, _ = encode(block, "8bit", "exp_avg")
    assert codes[1:4].tolist() == [0x70, 0x72, 0x70]


@pytest.mark.parametrize("name", NAMES)
def test_decode_is_code_value_times_block_scale(name):
    gen = torch.Generator().manual_seed(1)
    n = 3 * Q8_BLOCK_ELEMS + 5
    codes = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    scale = torch.rand(4, generator=gen) * 1e3
    values = decode(codes, scale, "8bit", name)
    for i in (0, 255, 256, 700, n - 1):
        expected = code_table(name)[int(codes[i])].item() * scale[i // 256].item()  # exact in double
        assert values[i].item() == torch.tensor(expected).float().item()


@pytest.mark.parametrize("name", NAMES)
def test_stochastic_rounding_is_unbiased_and_stays_between_neighbours(name):
    """Each value rounded at 2048 steps: always one of its two neighbours, the mean within 5 sigma."""
    block = torch.zeros(Q8_BLOCK_ELEMS)
    block[0] = 1.0
    block[1:9] = torch.tensor([0.3, 0.0007, 0.51, 1e-5, 3e-9, 0.999, 0.2, 0.6])
    table = code_table(name).double()
    points = table[: 0x79 if name == "exp_avg" else 0xF9]  # the non-negative points up to 1.0
    y = block.double()
    below = (torch.searchsorted(points, y, right=True) - 1).clamp(max=len(points) - 2)
    lo, hi = points[below], points[below + 1]
    sums = torch.zeros(Q8_BLOCK_ELEMS, dtype=torch.float64)
    steps = 2048
    for step in range(1, steps + 1):
        codes, scale = encode(block, "8bit", name, step=step)
        assert scale.item() == 1.0
        values = table[codes.long()]
        assert torch.all((values == lo) | (values == hi) | (y == 1.0))
        sums += values
    p = (y - lo) / (hi - lo)
    sigma = (hi - lo) * torch.sqrt(p * (1 - p) / steps)
    assert torch.all((sums / steps - y).abs()[1:9] <= 5 * sigma[1:9])


@pytest.mark.parametrize("name", NAMES)
def test_bf16_stochastic_rounding_is_unbiased_and_stays_between_neighbours(name):
    """Each value rounded at 2048 steps: always its bf16 neighbour below or above (in magnitude), exact
    values unchanged, the mean within 5 sigma of the value; NaN becomes 0xFFFF as torch's cast."""
    x = torch.tensor([1.0, 0.3, -0.0007, 1e-30, 3.0e9, -2.5, 1.0 + 2.0**-9, 0.1, float("nan")])
    if name == "exp_avg_sq":
        x[:8] = x[:8].abs()
    finite = x[:8].double()
    down = (x[:8].view(torch.int32) & ~0xFFFF).view(torch.float32).double()  # truncated: toward zero
    up = ((x[:8].view(torch.int32) & ~0xFFFF) + 0x10000).view(torch.float32).double()
    exact = finite == down
    sums = torch.zeros(8, dtype=torch.float64)
    steps = 2048
    for step in range(1, steps + 1):
        codes, scale = encode(x, "bf16", name, step=step)
        assert scale is None and codes.dtype == torch.bfloat16
        assert codes.view(torch.int16)[8].item() == -1  # 0xFFFF
        values = codes[:8].double()
        assert torch.all((values == down) | ((values == up) & ~exact))
        sums += values
    p = (finite - down) / (up - down)
    sigma = (up - down).abs() * torch.sqrt(p * (1 - p) / steps)
    assert torch.all((sums / steps - finite).abs() <= 5 * sigma + 1e-300)
    assert not torch.equal(encode(x, "bf16", name, step=1)[0], encode(x, "bf16", name, step=2)[0])


def test_mix32_is_lowbias32_on_python_ints():
    def lowbias32(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    xs = [0, 1, 2, 255, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF]
    assert moments.mix32(torch.tensor(xs, dtype=torch.int64)).tolist() == [lowbias32(x) for x in xs]
    bits = moments.rounding_bits(7, 5).tolist()
    assert bits == [lowbias32(i ^ lowbias32(0 ^ lowbias32(7))) for i in range(5)]


def test_zero_nan_and_subnormal_blocks():
    x = torch.zeros(4 * Q8_BLOCK_ELEMS)
    x[256:512] = torch.linspace(-1, 1, 256)
    x[300] = float("nan")  # block 1: NaN
    x[512] = float("inf")  # block 2: infinity
    x[768:1024] = 1e-39  # block 3: float32 subnormals only
    for name in NAMES:
        codes, scale = encode(x, "8bit", name)
        assert scale[0].item() == 0.0 and scale[3].item() == 0.0
        assert math.isnan(scale[1].item()) and math.isnan(scale[2].item())
        assert torch.all(codes == 0)
        values = decode(codes, scale, "8bit", name)
        assert torch.all(values[:256] == 0) and torch.all(values[768:] == 0)
        assert torch.all(torch.isnan(values[256:768]))


def test_a_positive_exp_avg_sq_never_decodes_to_zero():
    x = torch.full((Q8_BLOCK_ELEMS,), 1e-20)
    x[0] = 1e10  # y = 1e-30, far below the smallest code point 2^-33
    for step in (None, 1, 2):
        codes, scale = encode(x, "8bit", "exp_avg_sq", step=step)
        assert torch.all(codes[1:] == 1) and codes[0].item() == 0xF8
        codes, _ = encode(-x, "8bit", "exp_avg", step=step)
        assert torch.all(codes[1:] == 0x80)  # exp_avg may round to (negative) zero


@pytest.mark.parametrize("fmt", ("fp32", "bf16"))
def test_float_formats_are_torch_casts(fmt):
    x = wide_values(1000)
    codes, scale = encode(x, fmt, "exp_avg")
    assert scale is None and codes.dtype == FORMATS[fmt].code_dtype
    assert torch.equal(codes, x.to(codes.dtype))
    assert torch.equal(decode(codes, None, fmt, "exp_avg"), x.to(codes.dtype).float())


@pytest.mark.parametrize(
    "fmt, numel, expected",
    [("fp32", 1000, 8000), ("bf16", 1001, 4004), ("8bit", 256, 2 * 256 + 8), ("8bit", 257, 2 * 257 + 16),
     ("8bit", 1, 2 + 8), ("8bit", 0, 0)],
)  # fmt: skip
def test_state_bytes_counts_codes_and_scales(fmt, numel, expected):
    assert moment_format(fmt).state_bytes(numel) == expected


@pytest.mark.parametrize("fmt", ("fp32", "bf16", "8bit"))
def test_packed_views_tile_the_buffer_without_overlap(fmt):
    numel = 1001
    f = moment_format(fmt)
    buffer = torch.zeros(f.state_bytes(numel) + 3, dtype=torch.uint8)
    views = moments.packed_views(buffer, fmt, numel)
    assert list(views) == (["exp_avg_scale", "exp_avg_sq_scale"] if fmt == "8bit" else []) + list(NAMES)
    offset = buffer.data_ptr()
    for marker, (key, view) in enumerate(views.items(), start=1):
        assert view.data_ptr() == offset and view.data_ptr() % view.element_size() == 0, key
        offset += view.numel() * view.element_size()
        view.view(torch.uint8).fill_(marker)
    end = f.state_bytes(numel)
    assert offset - buffer.data_ptr() == end
    sizes = [v.numel() * v.element_size() for v in views.values()]
    expected = torch.cat([torch.full((size,), m, dtype=torch.uint8) for m, size in enumerate(sizes, start=1)])
    assert torch.equal(buffer[:end], expected) and torch.all(buffer[end:] == 0)
    assert views["exp_avg"].numel() == numel and views["exp_avg"].dtype == f.code_dtype


def test_packed_views_refuse_a_short_or_misaligned_buffer():
    with pytest.raises(ValueError, match=">= 2080 bytes for 1024 elements"):
        moments.packed_views(torch.zeros(100, dtype=torch.uint8), "8bit", 1024)
    with pytest.raises(ValueError, match="4-byte aligned"):
        moments.packed_views(torch.zeros(5000, dtype=torch.uint8)[1:], "8bit", 1024)


def test_unknown_format_lists_the_choices():
    with pytest.raises(ValueError, match="moments='int4' is not a moment format; choose one of fp32, bf16, 8bit"):
        moment_format("int4")


def test_config_offers_exactly_these_formats():
    from infinity.config.sections import MOMENT_FORMATS

    assert MOMENT_FORMATS == moments.MOMENT_FORMATS


def test_step_bytes_count_what_one_adam_pass_reads_and_writes():
    n = 1000
    assert moment_format("fp32").step_bytes(n) == 28 * n  # p r/w 8, g 4, m and v r/w 16
    assert moment_format("bf16").step_bytes(n, grad_bytes=2, copy_bytes=2) == (8 + 2 + 2 + 8) * n
    assert moment_format("8bit").step_bytes(n) == 16 * n + 2 * 8 * 4  # 4 blocks, two float32 scales each, r/w


@pytest.mark.parametrize("name", NAMES)
def test_codec_works_chunk_by_chunk_with_the_same_result(name, monkeypatch):
    x = wide_values(5 * Q8_BLOCK_ELEMS + 77, signed=name == "exp_avg")
    whole_codes, whole_scale = encode(x, "8bit", name, step=3)
    whole_values = decode(whole_codes, whole_scale, "8bit", name)
    monkeypatch.setattr(moments, "_CHUNK_ELEMS", 2 * Q8_BLOCK_ELEMS)
    codes, scale = encode(x, "8bit", name, step=3)
    assert torch.equal(codes, whole_codes) and torch.equal(scale, whole_scale)
    assert torch.equal(decode(codes, scale, "8bit", name), whole_values)
