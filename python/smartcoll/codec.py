"""Wire codecs: float32 data to and from its on-the-wire bytes.

    from smartcoll import codec
    buf = codec.encode(grad, "bfp16")              # numpy uint8, codec.encoded_size("bfp16", grad.size) bytes
    approx = codec.decode(buf, "bfp16", grad.size)  # numpy float32

Formats (``formats()``): identity, fp16, bf16, block floating point (``bfp16``, or ``bfp:block=B,mant=M,exp=E``)
and the OCP Microscaling formats mxint8, mxfp8_e4m3, mxfp8_e5m2, mxfp6_e3m2, mxfp6_e2m3, mxfp4_e2m1. Rounding is
to nearest, ties to even; docs/wire-format.md gives each byte layout. ``error_bound(fmt)`` says how far a decoded
value may be from the original. Encoding in pieces whose lengths are multiples of ``block_elems(fmt)`` gives the
same bytes as encoding at once.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import _core

__all__ = [
    "ErrorBound",
    "block_elems",
    "decode",
    "decode_add",
    "decode_add_encode",
    "encode",
    "encoded_size",
    "error_bound",
    "formats",
    "info",
    "ratio",
]


class ErrorBound(NamedTuple):
    """``|decode(encode(x))[i] - x[i]| <= rel * ref + abs`` for blocks whose values are finite and below ``limit``.

    ``ref`` is ``|x[i]|`` when ``per_block`` is false (identity, fp16, bf16) and the largest ``|x|`` of the block
    holding ``x[i]`` when it is true (BFP and MX, whose shared scale follows that largest value). A BFP or MX block
    holding a NaN or an infinity decodes to NaN throughout.
    """

    rel: float
    abs: float
    limit: float
    per_block: bool


def formats() -> list[str]:
    """The preset codec names."""
    return list(_core.codec_formats())


def info(fmt: str) -> dict[str, Any]:
    """Canonical name, block_elems, block_bytes, mant_bits, exp_bits, ratio and the error bound of a codec."""
    return dict(_core.codec_info(fmt))


def error_bound(fmt: str) -> ErrorBound:
    i = info(fmt)
    return ErrorBound(i["error_rel"], i["error_abs"], i["error_limit"], i["error_per_block"])


def block_elems(fmt: str) -> int:
    """Elements per block (1 for identity, fp16, bf16); pieces that are multiples of it encode independently."""
    return int(info(fmt)["block_elems"])


def ratio(fmt: str) -> float:
    """float32 bytes per encoded byte, for whole blocks."""
    return float(info(fmt)["ratio"])


def encoded_size(fmt: str, count: int) -> int:
    """Exact encoded bytes for ``count`` float32 elements."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    return int(_core.codec_encoded_size(fmt, count))


def _float32_view(x: Any, what: str) -> np.ndarray:
    """A flat, contiguous float32 NumPy view of an array or CPU tensor (copied only if it is not contiguous)."""
    if type(x).__module__.startswith("torch"):
        if x.device.type != "cpu":
            raise TypeError(
                f"{what} is a {x.device.type} tensor; smartcoll.codec works on CPU memory: use .cpu()"
            )
        x = x.detach().contiguous().numpy()
    a = np.asarray(x)
    if a.dtype != np.float32:
        raise TypeError(
            f"{what} has dtype {a.dtype}; codecs encode float32: convert with .astype(numpy.float32)"
        )
    return np.ascontiguousarray(a).reshape(-1)


def _bytes_view(buf: Any) -> np.ndarray:
    if isinstance(buf, (bytes, bytearray, memoryview)):
        return np.frombuffer(buf, dtype=np.uint8)
    a = np.asarray(buf)
    if a.dtype != np.uint8:
        raise TypeError(f"encoded data must be uint8 (or bytes), got dtype {a.dtype}")
    return np.ascontiguousarray(a).reshape(-1)


def _output(out: np.ndarray | None, dtype: type, size: int, what: str) -> np.ndarray:
    if out is None:
        return np.empty(size, dtype=dtype)
    if (
        not isinstance(out, np.ndarray)
        or out.dtype != dtype
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        raise TypeError(f"{what} must be a writeable, C-contiguous numpy {np.dtype(dtype).name} array")
    if out.size != size:
        raise ValueError(f"{what} has {out.size} elements, expected {size}")
    return out.reshape(-1)


def encode(x: Any, fmt: str, out: np.ndarray | None = None) -> np.ndarray:
    """Encode float32 data (a NumPy array or CPU tensor, any shape, read in C order) into ``fmt``'s bytes."""
    flat = _float32_view(x, "x")
    dst = _output(out, np.uint8, encoded_size(fmt, flat.size), "out")
    _core.codec_encode(fmt, flat, dst)
    return dst if out is None else out


def decode(buf: Any, fmt: str, count: int, out: np.ndarray | None = None) -> np.ndarray:
    """Decode ``count`` float32 elements from ``buf``, which must be exactly ``encoded_size(fmt, count)`` bytes."""
    src = _bytes_view(buf)
    dst = _output(out, np.float32, count, "out")
    _core.codec_decode(fmt, src, dst)
    return dst if out is None else out


def decode_add(buf: Any, fmt: str, addend: Any, out: np.ndarray | None = None) -> np.ndarray:
    """``addend + decode(buf)`` in float32 (one fused pass); ``out`` may be ``addend`` itself."""
    add = _float32_view(addend, "addend")
    dst = _output(out, np.float32, add.size, "out")
    _core.codec_decode_add(fmt, _bytes_view(buf), add, dst)
    return dst if out is None else out


def decode_add_encode(
    buf: Any, fmt: str, addend: Any, out: np.ndarray | None = None, sum: np.ndarray | None = None
) -> np.ndarray:
    """``encode(addend + decode(buf))`` in one fused pass; ``sum``, if given, receives ``addend + decode(buf)``."""
    add = _float32_view(addend, "addend")
    dst = _output(out, np.uint8, encoded_size(fmt, add.size), "out")
    total = None if sum is None else _output(sum, np.float32, add.size, "sum")
    _core.codec_decode_add_encode(fmt, _bytes_view(buf), add, dst, total)
    return dst if out is None else out
