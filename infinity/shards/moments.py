"""How Adam's moments are stored: the formats the native CPU Adam steps, and their plain-PyTorch codec.

A shard of n elements keeps two moments, `exp_avg` (m, signed) and `exp_avg_sq` (v, >= 0), in one of:

- **fp32** (default, exact): each moment float32[n]; 8 bytes per element in all.
- **bf16**: each moment bfloat16[n]; 4 bytes per element. The Adam step rounds its fp32 result
  stochastically: the float's bits u become (u + r16) >> 16 (away from zero with probability of the
  dropped 16 bits / 2^16), r16 the element's random bits as for 8bit below; NaN becomes 0xFFFF, as
  torch's cast. Rounded to nearest, exp_avg_sq's 0.1% steps at beta2 = 0.999 fall under bf16's half
  ulp (0.2%) and it freezes: at 110m that ended 3.7% above fp32's loss after 300 steps.
  `encode` without a step rounds to nearest even (torch's cast).
- **8bit**: blockwise dynamic quantization in the manner of 8-bit Adam (Dettmers et al., 2021): each
  run of `Q8_BLOCK_ELEMS` = 256 elements (the last run may be shorter) has one float32 scale per
  moment, the largest magnitude in the run (absmax), and each element one uint8 code for y = |x| / absmax
  (IEEE division, so 0 <= y <= 1 and the largest element is exact). The code points form a small
  floating point map, dense near 0 and sparse near 1 like bitsandbytes' dynamic map, but in powers of
  two, so that rounding to it is integer arithmetic on the float's bits (vectorizable, and
  bit-identical on every SIMD path) instead of a search of a table:
    - exp_avg, signed: bit 7 sign, bits 6-3 exponent e, bits 2-0 fraction f (E4M3, bias 15):
      (1 + f/8) * 2^(e-15) for e >= 1, f * 2^-17 for e == 0. 1.0 is 0x78, the smallest non-zero
      point 2^-17. These are exactly torch.float8_e4m3fn's values divided by 256.
    - exp_avg_sq, unsigned: bits 7-3 exponent e, bits 2-0 fraction f (E5M3, bias 31):
      (1 + f/8) * 2^(e-31) for e >= 1, f * 2^-33 for e == 0. 1.0 is 0xF8. A positive value never
      gets code 0 (it takes code 1): a zero exp_avg_sq under a non-zero exp_avg would make the step
      exp_avg / eps. Its range below the block's largest value, 2^-33, is about the square of
      exp_avg's, as exp_avg_sq goes with the square of the gradient.
  Rounding. The Adam step rounds stochastically: y between code points a < b becomes b with
  probability (y - a) / (b - a), resolved to 1/65536 by 16 random bits, so that updates smaller than
  a gap are kept on average (rounded to nearest, exp_avg_sq's 0.1% steps at beta2 = 0.999 would all
  be lost and the moments would freeze). The gap fraction is first rounded to 20 bits (half to even):
  k = round((y - a) / (b - a) * 2^20); the result is b iff k + 16 * r16 >= 2^20. The random bits of
  element i (counted from the shard's first element) at step s come from lowbias32 (`mix32`):
  r = mix32(lo32(i) ^ mix32(hi32(i) ^ mix32(lo32(s)))); exp_avg uses r >> 16, exp_avg_sq r & 0xFFFF.
  `encode` without a step rounds to nearest, ties to the even code (for conversions).
  A value's decoded float is code_value * scale (one float32 multiply). Magnitudes below 2^-126
  (float32 subnormals) are stored as +0. A run holding a NaN or an infinity stores scale NaN and all
  codes 0: the whole run decodes to NaN, so damage is never silently repaired. A run of zeros stores
  scale 0. In all: 2 bytes per element plus 8 bytes per run (1/32 byte per element).

The state_dict of `CPUAdam` holds these tensors under `exp_avg`, `exp_avg_sq` and, for 8bit,
`exp_avg_scale` and `exp_avg_sq_scale` (float32[num_blocks]). `packed_views` lays one shard's state
out in a single byte buffer (for a storage slot): scales first, then codes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MOMENT_FORMATS = ("fp32", "bf16", "8bit")
MOMENT_NAMES = ("exp_avg", "exp_avg_sq")
SCALE_NAMES = {"exp_avg": "exp_avg_scale", "exp_avg_sq": "exp_avg_sq_scale"}
Q8_BLOCK_ELEMS = 256
_SMALLEST_NORMAL = 2.0**-126
_CHUNK_ELEMS = 4096 * Q8_BLOCK_ELEMS  # the 8-bit codec's working size: bounds its temporaries


@dataclass(frozen=True)
class MomentFormat:
    """One storage format of both moments: code dtype, and per-block float32 scales where quantized."""

    name: str
    code_dtype: torch.dtype
    block_elems: int | None  # elements sharing one scale; None: no scales

    @property
    def code_bytes(self) -> int:
        return torch.empty(0, dtype=self.code_dtype).element_size()

    def num_blocks(self, numel: int) -> int:
        """Scales per moment for a shard of `numel` elements (0 without scales)."""
        return 0 if self.block_elems is None else math.ceil(numel / self.block_elems)

    def state_bytes(self, numel: int) -> int:
        """Bytes both moments of a `numel`-element shard take, scales included (packed_views' size)."""
        return 2 * (numel * self.code_bytes + 4 * self.num_blocks(numel))

    def step_bytes(self, numel: int, grad_bytes: int = 4, copy_bytes: int = 0) -> int:
        """Bytes one native Adam pass over `numel` elements moves: fp32 p read and written, the grad
        (`grad_bytes` per element) read, both moments and their scales read and written, and the
        optional 16-bit copy of p (`copy_bytes` per element) written."""
        return numel * (8 + grad_bytes + copy_bytes) + 2 * self.state_bytes(numel)

    def tensor_specs(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        """State key -> (dtype, numel) of every tensor the format keeps, in packed order (scales first)."""
        specs: dict[str, tuple[torch.dtype, int]] = {}
        if self.block_elems is not None:
            specs.update({SCALE_NAMES[name]: (torch.float32, self.num_blocks(numel)) for name in MOMENT_NAMES})
        specs.update({name: (self.code_dtype, numel) for name in MOMENT_NAMES})
        return specs


FORMATS = {
    "fp32": MomentFormat("fp32", torch.float32, None),
    "bf16": MomentFormat("bf16", torch.bfloat16, None),
    "8bit": MomentFormat("8bit", torch.uint8, Q8_BLOCK_ELEMS),
}


def moment_format(name: str | MomentFormat) -> MomentFormat:
    """The format called `name` ("fp32", "bf16", "8bit"); ValueError naming the choices otherwise."""
    if isinstance(name, MomentFormat):
        return name
    if name not in FORMATS:
        raise ValueError(f"moments={name!r} is not a moment format; choose one of {', '.join(MOMENT_FORMATS)}")
    return FORMATS[name]


def zero_state(fmt: str | MomentFormat, numel: int) -> dict[str, torch.Tensor]:
    """Fresh moments (all zero) of a `numel`-element shard: state key -> tensor."""
    specs = moment_format(fmt).tensor_specs(numel)
    return {key: torch.zeros(count, dtype=dtype) for key, (dtype, count) in specs.items()}


def packed_views(buffer: torch.Tensor, fmt: str | MomentFormat, numel: int) -> dict[str, torch.Tensor]:
    """Views of one shard's state inside `buffer` (uint8, at least state_bytes(numel) long, 4-byte aligned).

    Order: exp_avg_scale, exp_avg_sq_scale (8bit only), exp_avg, exp_avg_sq; each starts where the one
    before ends, so every view is aligned for its dtype.
    """
    fmt = moment_format(fmt)
    need = fmt.state_bytes(numel)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous() or buffer.numel() < need:
        raise ValueError(f"buffer must be a contiguous 1-D uint8 tensor of >= {need} bytes for {numel} elements "
                         f"in moments={fmt.name!r}, got {buffer.dtype} of shape {tuple(buffer.shape)}")  # fmt: skip
    if buffer.data_ptr() % 4:
        raise ValueError("buffer must start at a 4-byte aligned address (the scales are float32)")
    views, offset = {}, 0
    for key, (dtype, count) in fmt.tensor_specs(numel).items():
        nbytes = count * torch.empty(0, dtype=dtype).element_size()
        views[key] = buffer[offset : offset + nbytes].view(dtype)
        offset += nbytes
    return views


# ---------------------------------------------------------------- the 8-bit code maps


def _code_points(exp_bits: int, frac_bits: int) -> list[float]:
    """Magnitudes of a small float with the given field widths, its top binade [1, 2), subnormals at e == 0."""
    bias = 2**exp_bits - 1
    points = []
    for code in range(2 ** (exp_bits + frac_bits)):
        e, f = code >> frac_bits, code & (2**frac_bits - 1)
        if e == 0:
            points.append(f * 2.0 ** (1 - bias - frac_bits))
        else:
            points.append((1 + f / 2**frac_bits) * 2.0 ** (e - bias))
    return points


_MAGNITUDES = {"exp_avg": _code_points(4, 3), "exp_avg_sq": _code_points(5, 3)}


def code_table(name: str) -> torch.Tensor:
    """float32[256]: the value (before scaling) of each 8-bit code of moment `name`."""
    mags = _MAGNITUDES[name]
    values = mags + [-x for x in mags] if name == "exp_avg" else mags
    return torch.tensor(values, dtype=torch.float64).float()


_MASK32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on the low 32 bits of an int64 tensor (results in [0, 2^32))."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32  # int64 products wrap past 2^63; the low 32 bits stay exact
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def rounding_bits(step: int, numel: int, first: int = 0) -> torch.Tensor:
    """The 32 random bits (int64) of elements first..first+numel-1 at `step` that stochastic rounding uses."""
    index = torch.arange(first, first + numel, dtype=torch.int64)
    step_mix = mix32(torch.tensor(step & _MASK32, dtype=torch.int64))
    return mix32((index & _MASK32) ^ mix32((index >> 32) ^ step_mix))


def _stochastic_magnitude_code(y: torch.Tensor, name: str, r16: torch.Tensor) -> torch.Tensor:
    """Index of the code point below y, or the one above with probability (y - below) / gap (int64)."""
    points = torch.tensor(_MAGNITUDES[name], dtype=torch.float64)
    y = y.double()
    below = (torch.searchsorted(points, y, right=True) - 1).clamp(max=len(points) - 2)
    fraction = (y - points[below]) / (points[below + 1] - points[below])  # exact: gaps are powers of two
    k = torch.round(fraction * 2**20)  # half to even
    return below + (k + 16 * r16 >= 2**20).long()


def _nearest_magnitude_code(y: torch.Tensor, name: str) -> torch.Tensor:
    """Index of the code point nearest to each y in [0, 1], ties to the even index (int64)."""
    mags = torch.tensor(_MAGNITUDES[name], dtype=torch.float64)
    midpoints = ((mags[:-1] + mags[1:]) / 2).float()  # exact: one bit more than the points
    index = torch.searchsorted(midpoints, y)  # how many midpoints lie below y
    tie = midpoints[index.clamp(max=len(midpoints) - 1)] == y
    return index + (tie & (index % 2 == 1)).long()


def _encode_bf16_stochastic(x: torch.Tensor, name: str, step: int) -> torch.Tensor:
    """x (float32) rounded to bf16 stochastically with the random bits of `step` (see the module doc)."""
    out = torch.empty(x.numel(), dtype=torch.int16)
    for i in range(0, x.numel(), _CHUNK_ELEMS):
        chunk = x[i : i + _CHUNK_ELEMS]
        bits = rounding_bits(step, chunk.numel(), i)
        r16 = bits >> 16 if name == "exp_avg" else bits & 0xFFFF
        rounded = ((chunk.view(torch.int32).long() & _MASK32) + r16) >> 16
        rounded = torch.where(torch.isnan(chunk), 0xFFFF, rounded)
        out[i : i + chunk.numel()] = rounded - ((rounded >= 0x8000).long() << 16)  # as int16 bits
    return out.view(torch.bfloat16)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """x (flat) zero-padded to whole blocks, shape (num_blocks, Q8_BLOCK_ELEMS)."""
    pad = (-x.numel()) % Q8_BLOCK_ELEMS
    return torch.nn.functional.pad(x, (0, pad)).view(-1, Q8_BLOCK_ELEMS)


def _encode_8bit(x: torch.Tensor, name: str, step: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of x, a chunk of whole blocks at a time (temporaries: ~50 bytes per chunk element)."""
    pieces = [_encode_8bit_chunk(x[i : i + _CHUNK_ELEMS], name, step, i) for i in range(0, x.numel(), _CHUNK_ELEMS)]
    if not pieces:
        return torch.empty(0, dtype=torch.uint8), torch.empty(0)
    return torch.cat([c for c, _ in pieces]), torch.cat([s for _, s in pieces])


def _encode_8bit_chunk(x: torch.Tensor, name: str, step: int | None, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.where(x.abs() < _SMALLEST_NORMAL, torch.zeros_like(x), x)
    blocks = _blocks(x)
    absmax = blocks.abs().amax(dim=1)  # NaN if the block holds one
    usable = torch.isfinite(absmax) & (absmax > 0)
    scale = torch.where(torch.isfinite(absmax), absmax, torch.full_like(absmax, float("nan")))
    y = torch.where(usable[:, None], blocks.abs() / torch.where(usable, absmax, 1.0)[:, None], 0.0)
    if step is None:
        code = _nearest_magnitude_code(y, name)
    else:
        bits = _blocks(rounding_bits(step, x.numel(), first))
        code = _stochastic_magnitude_code(y, name, bits >> 16 if name == "exp_avg" else bits & 0xFFFF)
    if name == "exp_avg":
        code = code | (blocks.signbit().long() << 7)
    else:
        code = torch.where((blocks.abs() > 0) & (code == 0), 1, code)
    code = torch.where(usable[:, None], code, 0)
    return code.to(torch.uint8).flatten()[: x.numel()], scale


def encode(
    x: torch.Tensor, fmt: str | MomentFormat, name: str, *, step: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Store the float32 moment `x` ("exp_avg" or "exp_avg_sq") in `fmt`: (codes, scales or None).

    8bit and bf16: `step` given, stochastic rounding as the native step at that step count does; else
    nearest.
    """
    fmt = moment_format(fmt)
    if name not in MOMENT_NAMES:
        raise ValueError(f"name must be one of {MOMENT_NAMES}, got {name!r}")
    x = x.detach().float().flatten()
    if fmt.name == "fp32":
        return x.clone(), None
    if fmt.name == "bf16":
        return (x.to(torch.bfloat16) if step is None else _encode_bf16_stochastic(x, name, step)), None
    return _encode_8bit(x, name, step)


def decode(codes: torch.Tensor, scale: torch.Tensor | None, fmt: str | MomentFormat, name: str) -> torch.Tensor:
    """The float32 values of a stored moment (inverse of `encode` up to its rounding)."""
    fmt = moment_format(fmt)
    if name not in MOMENT_NAMES:
        raise ValueError(f"name must be one of {MOMENT_NAMES}, got {name!r}")
    codes = codes.flatten()
    if fmt.name != "8bit":
        return codes.float().clone() if fmt.name == "fp32" else codes.float()
    table, out = code_table(name), torch.empty(codes.numel())
    for i in range(0, codes.numel(), _CHUNK_ELEMS):
        chunk = codes[i : i + _CHUNK_ELEMS]
        values = _blocks(table[chunk.long()])
        first_block = i // Q8_BLOCK_ELEMS
        values = values * scale[first_block : first_block + len(values), None]
        out[i : i + chunk.numel()] = values.flatten()[: chunk.numel()]
    return out
