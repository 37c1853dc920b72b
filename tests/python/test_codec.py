"""smartcoll.codec against the independent reference quantizer (mx_reference.py): bit-exact bytes and decoded
values for every format on random data of many shapes and magnitudes, special values, partial blocks and edge
counts; round trips within each format's stated error bound; pieces == whole; identical bits on every SIMD level.
"""

from __future__ import annotations

import math

import mx_reference as ref
import numpy as np
import pytest
from smartcoll import _core

if not hasattr(_core, "codec_encode"):
    pytest.skip("smartcoll._core was built without bind_codec()", allow_module_level=True)

from smartcoll import codec

PRESETS = codec.formats()
BFP_VARIANTS = [
    "bfp:block=32,mant=7,exp=8",
    "bfp:block=8,mant=7,exp=8",
    "bfp:block=16,mant=7,exp=5",
    "bfp:block=13,mant=3,exp=8",
    "bfp:block=64,mant=15,exp=8",
    "bfp:block=5,mant=1,exp=1",
    "bfp:block=48,mant=7,exp=3",
    "bfp:block=1,mant=4,exp=8",
]
ALL = PRESETS + BFP_VARIANTS
BLOCK_FORMATS = [f for f in ALL if codec.block_elems(f) > 1]

F32 = np.finfo(np.float32)
DENORM_MIN = np.float32(F32.smallest_subnormal)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    g, w = bits(got), bits(want)
    bad = np.nonzero(g != w)[0]
    assert bad.size == 0, f"{what}: {bad.size} differ, first at {bad[:5]}: got {g[bad[:5]]} want {w[bad[:5]]}"


def check_against_reference(x: np.ndarray, fmt: str) -> None:
    x = np.ascontiguousarray(x, dtype=np.float32)
    want = ref.encode(x, fmt)
    got = codec.encode(x, fmt)
    assert got.size == want.size == codec.encoded_size(fmt, x.size)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, f"{fmt}: encoded bytes differ at {bad[:5]}: got {got[bad[:5]]} want {want[bad[:5]]}"
    assert_same_bits(codec.decode(got, fmt, x.size), ref.decode(want, fmt, x.size), f"{fmt} decode")


# ----------------------------------------------------------------------------------------------------------------
# Data.


def distribution(name: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if name == "normal":
        x = rng.standard_normal(n)
    elif name == "uniform":
        x = rng.uniform(-1, 1, n)
    elif name == "gradients":  # per-block magnitudes spread over the whole float range
        x = rng.standard_normal(n) * np.exp2(np.repeat(rng.integers(-140, 120, n // 16 + 1), 16)[:n])
    elif name == "heavy_tailed":
        x = rng.standard_cauchy(n)
    elif name == "lognormal":
        x = rng.lognormal(0, 8, n) * rng.choice([-1, 1], n)
    elif (
        name == "ties"
    ):  # small integers on a per-block power-of-two grid: exact halfway cases for every format
        per_block = n // 16 + 1
        span = np.repeat(np.exp2(rng.integers(3, 18, per_block)), 16)[:n]  # integers of 3 to 17 bits
        x = (
            np.round(rng.uniform(-1, 1, n) * span)
            * np.repeat(np.exp2(rng.integers(-26, 14, per_block) - 17.0), 16)[:n]
        )
    elif name == "grid":  # multiples of assorted powers of two
        x = rng.integers(-4096, 4096, n) * np.exp2(rng.integers(-12, 4, n).astype(float))
    elif name == "sparse":
        x = rng.standard_normal(n) * (rng.random(n) < 0.1)
    elif name == "tiny":
        x = rng.standard_normal(n) * 1e-38
    elif name == "huge":
        x = rng.uniform(-1, 1, n) * 3.4e38
    else:
        raise ValueError(name)
    return x.astype(np.float32)


DISTRIBUTIONS = [
    "normal",
    "uniform",
    "gradients",
    "heavy_tailed",
    "lognormal",
    "ties",
    "grid",
    "sparse",
    "tiny",
    "huge",
]

SPECIALS = np.array(
    [
        0.0,
        -0.0,
        DENORM_MIN,
        -DENORM_MIN,
        F32.smallest_normal,
        np.float32(3.0) * DENORM_MIN,
        F32.max,
        -F32.max,
        np.inf,
        -np.inf,
        np.nan,
        65504.0,
        65520.0,  # fp16 overflow
        -70000.0,
        np.float32(np.uint32(0x7F7F8000).view(np.float32)),  # bf16 overflow
        1.0,
        -1.0,
        448.0,
        480.0,
        57344.0,
        61440.0,
        1.96875,
        7.5,
        7.75,
        6.0,
        7.0,
    ],
    dtype=np.float32,
)


@pytest.fixture
def restore_simd():
    level = _core.build_info()["simd"]
    yield
    _core.simd_force(level)


def simd_levels() -> list[str]:
    order = ["scalar", "avx2", "avx512"]
    return order[: order.index(_core.build_info()["simd_supported"]) + 1]


# ----------------------------------------------------------------------------------------------------------------
# API.


def test_formats_are_the_presets():
    assert PRESETS == [
        "identity",
        "fp16",
        "bf16",
        "bfp16",
        "mxint8",
        "mxfp8_e4m3",
        "mxfp8_e5m2",
        "mxfp6_e3m2",
        "mxfp6_e2m3",
        "mxfp4_e2m1",
    ]


def test_info_and_ratio():
    i = codec.info("bfp16")
    assert (i["name"], i["block_elems"], i["block_bytes"], i["mant_bits"], i["exp_bits"]) == (
        "bfp16",
        16,
        17,
        7,
        8,
    )
    assert codec.ratio("bfp16") == pytest.approx(64 / 17)  # the paper's ~3.8x
    assert codec.ratio("mxfp8_e4m3") == pytest.approx(128 / 33)
    assert codec.ratio("mxfp6_e2m3") == pytest.approx(128 / 25)
    assert codec.ratio("mxfp4_e2m1") == pytest.approx(128 / 17)
    assert codec.info("none")["name"] == "identity"
    assert codec.info("bfp:block=16,mant=7,exp=8")["name"] == "bfp16"


@pytest.mark.parametrize("fmt", ALL)
def test_encoded_size(fmt):
    b = codec.block_elems(fmt)
    for n in sorted({0, 1, 2, 3, 5, b - 1, b, b + 1, 2 * b, 3 * b + 7, 1000}):
        if n >= 0:
            assert codec.encoded_size(fmt, n) == ref.encoded_size(fmt, n), n


@pytest.mark.parametrize("fmt", ALL)
def test_error_bound_is_the_documented_one(fmt):
    rel, abs_, per_block = ref.error_bound(fmt)
    e = codec.error_bound(fmt)
    assert (e.rel, e.abs, e.per_block) == (rel, abs_, per_block)


def test_error_bounds_of_presets():
    rel = {f: codec.error_bound(f).rel for f in PRESETS}
    assert rel == {
        "identity": 0.0,
        "fp16": 2**-11,
        "bf16": 2**-8,
        "bfp16": 2**-7,
        "mxint8": 2**-7,
        "mxfp8_e4m3": 2**-3,
        "mxfp8_e5m2": 2**-3,
        "mxfp6_e3m2": 2**-3,
        "mxfp6_e2m3": 2**-4,
        "mxfp4_e2m1": 2**-2,
    }
    assert codec.error_bound("fp16").limit == 65520.0
    assert math.isinf(codec.error_bound("mxfp8_e4m3").limit)


def test_bad_arguments():
    x = np.ones(40, dtype=np.float32)
    with pytest.raises(ValueError, match="mxfp4_e2m1"):
        codec.encode(x, "zstd")
    with pytest.raises(ValueError):
        codec.encode(x, "bfp:block=0")
    with pytest.raises(TypeError, match="float32"):
        codec.encode(x.astype(np.float64), "bfp16")
    buf = codec.encode(x, "bfp16")
    with pytest.raises(ValueError, match="bytes"):
        codec.decode(buf[:-1], "bfp16", 40)
    with pytest.raises(ValueError, match="bytes"):
        codec.decode(buf, "bfp16", 41)
    with pytest.raises(TypeError, match="uint8"):
        codec.decode(buf.astype(np.int16), "bfp16", 40)
    with pytest.raises(ValueError):
        codec.decode_add(buf, "bfp16", np.ones(39, dtype=np.float32))
    with pytest.raises(ValueError):
        codec.encode(x, "bfp16", out=np.empty(buf.size + 1, dtype=np.uint8))


def test_inputs_any_shape_and_bytes():
    x = np.arange(64, dtype=np.float32).reshape(4, 16)
    buf = codec.encode(x, "mxfp8_e4m3")
    assert np.array_equal(buf, codec.encode(x.reshape(-1), "mxfp8_e4m3"))
    assert np.array_equal(codec.decode(bytes(buf), "mxfp8_e4m3", 64), codec.decode(buf, "mxfp8_e4m3", 64))
    non_contiguous = np.arange(128, dtype=np.float32)[::2]
    assert np.array_equal(codec.encode(non_contiguous, "bfp16"), codec.encode(non_contiguous.copy(), "bfp16"))
    out = np.empty(codec.encoded_size("bfp16", 64), dtype=np.uint8)
    assert codec.encode(x, "bfp16", out=out) is out


def test_torch_cpu_tensor():
    torch = pytest.importorskip("torch")
    t = torch.randn(1000)
    x = t.numpy().copy()
    for fmt in ("bf16", "bfp16", "mxfp8_e5m2"):
        assert np.array_equal(codec.encode(t, fmt), codec.encode(x, fmt))
    assert np.array_equal(codec.encode(t.requires_grad_(), "bfp16"), codec.encode(x, "bfp16"))
    with pytest.raises(TypeError):
        codec.encode(t.detach().double(), "bfp16")


# ----------------------------------------------------------------------------------------------------------------
# Bit-exact against the reference.


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("fmt", ALL)
def test_matches_reference(fmt, dist):
    check_against_reference(distribution(dist, 3000 + 7, seed=len(dist)), fmt)


@pytest.mark.parametrize("fmt", ALL)
def test_counts(fmt):
    b = codec.block_elems(fmt)
    for n in sorted({0, 1, b - 1, b, b + 1, 2 * b - 1, 2 * b + 1}):
        check_against_reference(distribution("normal", n, seed=n), fmt)


@pytest.mark.parametrize("fmt", ALL)
def test_special_values(fmt):
    b = codec.block_elems(fmt)
    rng = np.random.default_rng(7)
    # Each special alone, in a block of ordinary values, and in a block of its own.
    for s in SPECIALS:
        check_against_reference(np.array([s], dtype=np.float32), fmt)
        block = rng.standard_normal(b).astype(np.float32)
        block[rng.integers(b)] = s
        check_against_reference(block, fmt)
        check_against_reference(np.full(b + 1, s, dtype=np.float32), fmt)
    check_against_reference(rng.permutation(np.tile(SPECIALS, 5)), fmt)


@pytest.mark.parametrize("fmt", ALL)
def test_all_equal_and_zero_blocks(fmt):
    b = codec.block_elems(fmt)
    for v in [0.0, -0.0, 1.0, -3.0, 0.1, 1e-30, 1e30, DENORM_MIN, F32.max]:
        check_against_reference(np.full(2 * b + 3, v, dtype=np.float32), fmt)


@pytest.mark.parametrize("fmt", ALL)
def test_denormals_and_tiny_scales(fmt):
    rng = np.random.default_rng(3)
    n = 4 * codec.block_elems(fmt) + 1
    denormals = (rng.integers(-(2**23), 2**23, n)).astype(np.float32) * DENORM_MIN
    check_against_reference(denormals, fmt)
    near_min_normal = rng.standard_normal(n).astype(np.float32) * np.float32(2.0**-120)
    check_against_reference(near_min_normal, fmt)


@pytest.mark.parametrize("fmt", ALL)
def test_decoding_arbitrary_bytes(fmt):
    """Bytes from any encoder (infinities, NaN codes, -128, NaN scales, stray scale bits) decode as specified."""
    rng = np.random.default_rng(11)
    n = 50 * codec.block_elems(fmt) + 3
    buf = rng.integers(0, 256, codec.encoded_size(fmt, n), dtype=np.uint8)
    assert_same_bits(codec.decode(buf, fmt, n), ref.decode(buf, fmt, n), fmt)


def test_mx_nan_and_inf_blocks():
    for fmt in BLOCK_FORMATS:
        b = codec.block_elems(fmt)
        for special in (np.nan, np.inf, -np.inf):
            x = np.ones(2 * b, dtype=np.float32)
            x[b - 1] = special
            buf = codec.encode(x, fmt)
            nan_field = (
                0xFF if fmt.startswith("mx") or fmt == "bfp16" else (1 << codec.info(fmt)["exp_bits"]) - 1
            )
            assert buf[0] == nan_field
            y = codec.decode(buf, fmt, x.size)
            assert np.all(bits(y[:b]) == 0x7FC00000)
            assert np.all(y[b:] == 1.0)


def test_e4m3_saturates_to_448_not_nan():
    x = np.zeros(32, dtype=np.float32)
    x[0] = 1.96875  # 504 in element units: beyond 448, below 512
    buf = codec.encode(x, "mxfp8_e4m3")
    assert buf[0] == 127 - 8 and buf[1] == 0x7E
    assert codec.decode(buf, "mxfp8_e4m3", 32)[0] == 1.75


# ----------------------------------------------------------------------------------------------------------------
# Properties.


@pytest.mark.parametrize("dist", ["normal", "gradients", "heavy_tailed", "ties", "tiny", "huge", "sparse"])
@pytest.mark.parametrize("fmt", ALL)
def test_round_trip_within_error_bound(fmt, dist):
    x = distribution(dist, 4096 + 5, seed=99)
    y = codec.decode(codec.encode(x, fmt), fmt, x.size)
    e = codec.error_bound(fmt)
    b = codec.block_elems(fmt)
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    for start in range(0, x.size, b):
        xs, ys = x64[start : start + b], y64[start : start + b]
        block_max = np.max(np.abs(xs))
        if block_max >= e.limit:
            continue
        ref_mag = np.full(xs.shape, block_max) if e.per_block else np.abs(xs)
        err = np.abs(ys - xs)
        assert np.all(err <= e.rel * ref_mag + e.abs), (fmt, start, xs[err > e.rel * ref_mag + e.abs])


@pytest.mark.parametrize("fmt", ALL)
def test_pieces_equal_whole(fmt):
    b = codec.block_elems(fmt)
    x = distribution("gradients", 9 * b + 5, seed=1)
    x[3] = np.nan
    whole = codec.encode(x, fmt)
    for split in (b, 4 * b, 9 * b):
        head = codec.encode(x[:split], fmt)
        tail = codec.encode(x[split:], fmt)
        assert np.array_equal(np.concatenate([head, tail]), whole), split
        y = np.concatenate([codec.decode(head, fmt, split), codec.decode(tail, fmt, x.size - split)])
        assert_same_bits(y, codec.decode(whole, fmt, x.size), f"{fmt} split {split}")


@pytest.mark.parametrize("fmt", ALL)
def test_simd_levels_give_scalar_bits(fmt, restore_simd):
    x = np.concatenate([distribution("gradients", 5000, seed=2), SPECIALS, distribution("ties", 333, seed=4)])
    rng = np.random.default_rng(5)
    foreign = rng.integers(0, 256, codec.encoded_size(fmt, x.size), dtype=np.uint8)
    _core.simd_force("scalar")
    want = codec.encode(x, fmt)
    want_decoded = bits(codec.decode(want, fmt, x.size))
    want_foreign = bits(codec.decode(foreign, fmt, x.size))
    for level in simd_levels():
        _core.simd_force(level)
        assert _core.build_info()["simd"] == level
        assert np.array_equal(codec.encode(x, fmt), want), level
        assert np.array_equal(bits(codec.decode(want, fmt, x.size)), want_decoded), level
        assert np.array_equal(bits(codec.decode(foreign, fmt, x.size)), want_foreign), level


@pytest.mark.parametrize("fmt", ALL)
def test_decode_add_and_decode_add_encode(fmt, restore_simd):
    x = distribution("gradients", 10007, seed=8)
    addend = distribution("gradients", 10007, seed=9)
    buf = codec.encode(x, fmt)
    for level in simd_levels():
        _core.simd_force(level)
        total = addend + codec.decode(buf, fmt, x.size)  # numpy float32 add
        assert_same_bits(codec.decode_add(buf, fmt, addend), total, f"{fmt} decode_add {level}")
        acc = addend.copy()
        codec.decode_add(buf, fmt, acc, out=acc)
        assert_same_bits(acc, total, f"{fmt} decode_add in place {level}")
        s = np.empty_like(addend)
        fused = codec.decode_add_encode(buf, fmt, addend, sum=s)
        assert np.array_equal(fused, codec.encode(total, fmt)), level
        assert_same_bits(s, total, f"{fmt} decode_add_encode sum {level}")
