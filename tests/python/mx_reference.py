"""Reference encoders and decoders for smartcoll's wire formats, written from their definitions.

Independent of src/codec.cc: values are rounded with float64 NumPy arithmetic (np.round is round-half-to-even,
np.frexp gives exact binary exponents), not with the C++ code's integer bit tricks, and packed with np.packbits.
Sources: OCP Microscaling Formats (MX) v1.0 (element formats, E8M0 scale, the conversion
``X = 2^(floor(log2(max|V|)) - emax_elem)``, ``P_i = round(V_i / X)`` with normals clamped to the largest
finite value), OCP 8-bit floating point (E4M3 without infinities, E5M2 with IEEE specials), IEEE 754 binary16
and bfloat16, and docs/wire-format.md for the choices the specs leave open (byte layout, NaN payloads, blocks
holding NaN or Inf, the BFP preset's parameters).

    encode(x, fmt) -> np.ndarray[uint8]       decode(buf, fmt, count) -> np.ndarray[float32]
    encoded_size(fmt, count) -> int           error_bound(fmt) -> (rel, abs, per_block)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

import numpy as np

F32_QUIET_NAN = 0x7FC00000


@dataclass(frozen=True)
class Element:
    """A block element format: sign + magnitude (or two's complement), `ebits` exponent and `mbits` fraction bits.

    ebits == 0 is fixed point: magnitude * step with step = 2^(1 - bias - mbits).
    """

    bits: int
    ebits: int
    mbits: int
    bias: int
    emax: int  # exponent of the largest normal value (the MX spec's emax_elem)
    max_value: float  # largest finite magnitude
    twos_complement: bool = False
    ieee_specials: bool = False  # exponent field all ones: infinity (fraction 0) or NaN
    nan_magnitude: int | None = None  # the one NaN magnitude code (E4M3: S.1111.111)

    @property
    def emin(self) -> int:
        return 1 - self.bias

    @property
    def step(self) -> float:  # the smallest step, subnormal or fixed-point
        return math.ldexp(1.0, self.emin - self.mbits)


# OCP MX v1.0 Table 1 / OFP8: E4M3 max 448 = 1.75 * 2^8, E5M2 max 57344 = 1.75 * 2^15, E3M2 max 28 = 1.75 * 2^4,
# E2M3 max 7.5 = 1.875 * 2^2, E2M1 max 6 = 1.5 * 2^2; MXINT8: 8-bit two's complement with an implicit 2^-6.
E4M3 = Element(8, 4, 3, 7, 8, 448.0, nan_magnitude=0x7F)
E5M2 = Element(8, 5, 2, 15, 15, 57344.0, ieee_specials=True)
E3M2 = Element(6, 3, 2, 3, 4, 28.0)
E2M3 = Element(6, 2, 3, 1, 2, 7.5)
E2M1 = Element(4, 2, 1, 1, 2, 6.0)
INT8 = Element(8, 0, 6, 1, 0, 127 / 64, twos_complement=True)


def bfp_element(mant: int) -> Element:
    """Sign + `mant` magnitude bits; value = magnitude * 2^(s - (mant - 1)), so magnitudes reach 2 - 2^(1-mant)."""
    return Element(1 + mant, 0, mant - 1, 1, 0, 2.0 - math.ldexp(1.0, 1 - mant))


@dataclass(frozen=True)
class BlockFormat:
    elem: Element
    block: int
    scale_bits: int  # the shared exponent field; a whole byte on the wire

    @property
    def scale_bias(self) -> int:
        return (1 << (self.scale_bits - 1)) - 1

    @property
    def s_min(self) -> int:
        return -self.scale_bias

    @property
    def s_max(self) -> int:
        return (1 << self.scale_bits) - 2 - self.scale_bias

    @property
    def nan_field(self) -> int:
        return (1 << self.scale_bits) - 1

    def block_bytes(self, n: int) -> int:
        return 1 + (n * self.elem.bits + 7) // 8


@dataclass(frozen=True)
class ElementwiseFormat:
    """IEEE-like binary formats with infinities and NaNs (binary16, bfloat16) or float32 itself."""

    ebits: int
    mbits: int

    @property
    def bias(self) -> int:
        return (1 << (self.ebits - 1)) - 1

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits


IDENTITY = ElementwiseFormat(8, 23)
FP16 = ElementwiseFormat(5, 10)
BF16 = ElementwiseFormat(8, 7)

MX = {
    "mxint8": INT8,
    "mxfp8_e4m3": E4M3,
    "mxfp8_e5m2": E5M2,
    "mxfp6_e3m2": E3M2,
    "mxfp6_e2m3": E2M3,
    "mxfp4_e2m1": E2M1,
}

Format = Union[BlockFormat, ElementwiseFormat]


def parse(fmt: str) -> Format:
    if fmt in ("identity", "none"):
        return IDENTITY
    if fmt == "fp16":
        return FP16
    if fmt == "bf16":
        return BF16
    if fmt in MX:
        return BlockFormat(MX[fmt], 32, 8)
    if fmt == "bfp16":
        return BlockFormat(bfp_element(7), 16, 8)
    if fmt.startswith("bfp:"):
        params = {"block": 16, "mant": 7, "exp": 8}
        for item in filter(None, fmt[4:].split(",")):
            key, value = item.split("=")
            params[key] = int(value)
        return BlockFormat(bfp_element(params["mant"]), params["block"], params["exp"])
    raise ValueError(f"unknown format {fmt}")


def encoded_size(fmt: str, count: int) -> int:
    f = parse(fmt)
    if isinstance(f, ElementwiseFormat):
        return count * f.bits // 8
    full, rest = divmod(count, f.block)
    return full * f.block_bytes(f.block) + (f.block_bytes(rest) if rest else 0)


def error_bound(fmt: str) -> tuple[float, float, bool]:
    """(rel, abs, per_block), derived from the format definition (see docs/wire-format.md)."""
    f = parse(fmt)
    if f is IDENTITY:
        return 0.0, 0.0, False
    if isinstance(f, ElementwiseFormat):
        half_ulp = math.ldexp(1.0, -(f.mbits + 1))
        half_min_subnormal = math.ldexp(1.0, 1 - f.bias - f.mbits - 1)
        return half_ulp, half_min_subnormal, False
    e = f.elem
    # Rounding within the top binade [2^emax, 2^(emax+1)) of the scaled block, or saturating at max_value.
    rel = max(math.ldexp(1.0, -(e.mbits + 1)), 1.0 - e.max_value / math.ldexp(1.0, e.emax + 1))
    return rel, math.ldexp(1.0, f.s_min + e.emax - e.mbits - 1), True


# ----------------------------------------------------------------------------------------------------------------
# Bit packing: element i of a block at bits [i*bits, (i+1)*bits), little-endian (bit j = bit j%8 of byte j/8).


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    c = codes.astype(np.uint64)
    planes = ((c[:, None] >> np.arange(bits, dtype=np.uint64)) & np.uint64(1)).astype(np.uint8)
    return np.packbits(planes.reshape(-1), bitorder="little")


def unpack(data: np.ndarray, n: int, bits: int) -> np.ndarray:
    planes = np.unpackbits(data, bitorder="little")[: n * bits].reshape(n, bits).astype(np.int64)
    return (planes << np.arange(bits, dtype=np.int64)).sum(axis=1)


# ----------------------------------------------------------------------------------------------------------------
# Elements.


def floor_log2(a: np.ndarray) -> np.ndarray:
    """floor(log2(a)) for a > 0, exactly (a = m * 2^e with m in [0.5, 1))."""
    _, e = np.frexp(a)
    return e.astype(np.int64) - 1


def round_magnitude(a: np.ndarray, e: Element) -> np.ndarray:
    """|value| rounded to nearest-even on the element grid, saturated at the largest finite value."""
    if e.ebits == 0:
        step = np.full(a.shape, e.step)
    else:
        binade = np.maximum(floor_log2(np.where(a > 0, a, 1.0)), e.emin)
        step = np.ldexp(1.0, binade - e.mbits)
    return np.minimum(np.round(a / step) * step, e.max_value)


def magnitude_code(r: np.ndarray, e: Element) -> np.ndarray:
    if e.ebits == 0:
        return (r / e.step).astype(np.int64)
    normal = r >= math.ldexp(1.0, e.emin)
    exp = np.where(normal, floor_log2(np.where(normal, r, 1.0)), e.emin)
    fraction = np.where(normal, r / np.ldexp(1.0, exp) - 1.0, r / math.ldexp(1.0, e.emin))
    field = np.where(normal, exp + e.bias, 0)
    return (field << e.mbits) | (fraction * (1 << e.mbits)).astype(np.int64)


def element_codes(y: np.ndarray, e: Element) -> np.ndarray:
    """Codes of the finite float64 values y (already divided by the block scale)."""
    mag = magnitude_code(round_magnitude(np.abs(y), e), e)
    neg = np.signbit(y)
    if e.twos_complement:
        return np.where(neg, -mag, mag) & ((1 << e.bits) - 1)
    return mag | (neg.astype(np.int64) << (e.bits - 1))


def element_values(codes: np.ndarray, e: Element) -> tuple[np.ndarray, np.ndarray]:
    """(float64 values, negative flags) of element codes; NaN or +-inf for the special codes."""
    if e.twos_complement:
        signed = np.where(codes >= 1 << (e.bits - 1), codes - (1 << e.bits), codes)
        return signed * e.step, signed < 0
    neg = (codes >> (e.bits - 1)) & 1 == 1
    mag = codes & ((1 << (e.bits - 1)) - 1)
    if e.ebits == 0:
        value = mag * e.step
    else:
        field = mag >> e.mbits
        fraction = (mag & ((1 << e.mbits) - 1)) / (1 << e.mbits)
        value = np.where(
            field == 0, fraction * math.ldexp(1.0, e.emin), (1 + fraction) * np.ldexp(1.0, field - e.bias)
        )
        if e.ieee_specials:
            top = field == (1 << e.ebits) - 1
            value = np.where(top & (fraction == 0), np.inf, np.where(top, np.nan, value))
        if e.nan_magnitude is not None:
            value = np.where(mag == e.nan_magnitude, np.nan, value)
    return value, neg


# ----------------------------------------------------------------------------------------------------------------
# Blocks.


def encode_block(x: np.ndarray, f: BlockFormat) -> np.ndarray:
    n = x.size
    if not np.all(np.isfinite(x)):
        out = np.zeros(f.block_bytes(n), dtype=np.uint8)
        out[0] = f.nan_field
        return out
    a = np.abs(x.astype(np.float64))
    m = a.max()
    s = f.s_min if m == 0 else int(np.clip(floor_log2(np.array([m]))[0] - f.elem.emax, f.s_min, f.s_max))
    codes = element_codes(x.astype(np.float64) / math.ldexp(1.0, s), f.elem)
    return np.concatenate([np.array([s + f.scale_bias], dtype=np.uint8), pack(codes, f.elem.bits)])


def decode_block(data: np.ndarray, n: int, f: BlockFormat) -> np.ndarray:
    if data[0] >= f.nan_field:
        return np.full(n, F32_QUIET_NAN, dtype=np.uint32).view(np.float32)
    scale = math.ldexp(1.0, int(data[0]) - f.scale_bias)
    value, neg = element_values(unpack(data[1:], n, f.elem.bits), f.elem)
    with np.errstate(over="ignore", invalid="ignore"):
        out = (np.abs(value) * scale).astype(np.float32)
    bits = out.view(np.uint32) | np.where(neg, np.uint32(0x80000000), np.uint32(0))
    bits = np.where(np.isnan(value), np.where(neg, np.uint32(0xFFC00000), np.uint32(F32_QUIET_NAN)), bits)
    return bits.astype(np.uint32).view(np.float32)


# ----------------------------------------------------------------------------------------------------------------
# Element-wise formats.


def encode_elementwise(x: np.ndarray, f: ElementwiseFormat) -> np.ndarray:
    if f is IDENTITY:
        return x.astype("<f4").view(np.uint8).copy()
    u = x.view(np.uint32).astype(np.int64)
    neg = (u >> 31) & 1
    a = np.abs(x.astype(np.float64))
    emin = 1 - f.bias
    finite = np.isfinite(a)
    safe = np.where(finite & (a > 0), a, 1.0)
    binade = np.maximum(floor_log2(safe), emin)
    step = np.ldexp(1.0, binade - f.mbits)
    r = np.where(finite, np.round(np.where(finite, a, 0.0) / step) * step, np.inf)
    overflow = r >= math.ldexp(1.0, (1 << f.ebits) - 1 - f.bias)  # rounds to or beyond 2^(emax + 1): infinity
    normal = r >= math.ldexp(1.0, emin)
    exp = np.where(normal & ~overflow, floor_log2(np.where(normal & ~overflow, r, 1.0)), emin)
    scaled = np.where(overflow, 0.0, r)
    fraction = np.where(normal, scaled / np.ldexp(1.0, exp) - 1.0, scaled / math.ldexp(1.0, emin))
    field = np.where(overflow, (1 << f.ebits) - 1, np.where(normal, exp + f.bias, 0))
    mant = np.where(overflow, 0, (fraction * (1 << f.mbits)).astype(np.int64))
    code = (neg << (f.bits - 1)) | (field << f.mbits) | mant
    # NaN: sign kept, quiet bit set, the top payload bits kept (what F16C and float_to_bf16 do).
    nan = np.isnan(x)
    shift = 23 - f.mbits
    nan_code = (
        (neg << (f.bits - 1))
        | (((1 << f.ebits) - 1) << f.mbits)
        | (1 << (f.mbits - 1))
        | ((u & 0x7FFFFF) >> shift)
    )
    code = np.where(nan, nan_code, code)
    return code.astype("<u2").view(np.uint8)


def decode_elementwise(data: np.ndarray, count: int, f: ElementwiseFormat) -> np.ndarray:
    if f is IDENTITY:
        return data.view("<f4").astype(np.float32)
    code = data.view("<u2").astype(np.int64)
    neg = (code >> (f.bits - 1)) & 1
    field = (code >> f.mbits) & ((1 << f.ebits) - 1)
    mant = code & ((1 << f.mbits) - 1)
    emin = 1 - f.bias
    value = np.where(
        field == 0,
        mant * math.ldexp(1.0, emin - f.mbits),
        (1 + mant / (1 << f.mbits)) * np.ldexp(1.0, field - f.bias),
    )
    top = field == (1 << f.ebits) - 1
    value = np.where(top, np.inf, value)
    bits = np.abs(value).astype(np.float32).view(np.uint32).astype(np.int64) | (neg << 31)
    # NaN: binary16 widens like F16C (payload kept, made quiet); bfloat16 is the top half of a float32, kept as is.
    shift = 23 - f.mbits
    quiet = 0 if f is BF16 else 0x400000
    nan_bits = (neg << 31) | 0x7F800000 | quiet | (mant << shift)
    bits = np.where(top & (mant != 0), nan_bits, bits)
    return bits.astype(np.uint32).view(np.float32)


# ----------------------------------------------------------------------------------------------------------------
# Whole buffers.


def encode(x: np.ndarray, fmt: str) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    f = parse(fmt)
    if isinstance(f, ElementwiseFormat):
        return encode_elementwise(x, f)
    parts = [encode_block(x[i : i + f.block], f) for i in range(0, x.size, f.block)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)


def decode(buf: np.ndarray, fmt: str, count: int) -> np.ndarray:
    data = np.asarray(buf, dtype=np.uint8).reshape(-1)
    assert data.size == encoded_size(fmt, count)
    f = parse(fmt)
    if isinstance(f, ElementwiseFormat):
        return decode_elementwise(data, count, f)
    out = []
    offset = 0
    for i in range(0, count, f.block):
        n = min(f.block, count - i)
        size = f.block_bytes(n)
        out.append(decode_block(data[offset : offset + size], n, f))
        offset += size
    return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)
