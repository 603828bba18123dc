"""float8 e4m3 (OCP "e4m3fn", torch.float8_e4m3fn) in NumPy: the element type of an fp8 KV
cache (BatchAttention(kv_dtype="fp8")), for CuPy users without an fp8 dtype and for checks
against the float64 reference.

An e4m3 byte is a sign, 4 exponent bits (bias 7) and 3 mantissa bits: normal values
2^(e - 7) (1 + m / 8), subnormals m 2^-9, largest 448; there are no infinities, and
S.1111.111 is NaN. The kernels read value = e4m3 value * scale of the token's KV head.

    bits = to_e4m3(k / k_scale)              # uint8, round to nearest even, saturating
    k_seen = from_e4m3(bits) * k_scale       # what the kernels compute with (float64)
"""

from __future__ import annotations

import numpy as np

__all__ = ["E4M3_MAX", "from_e4m3", "to_e4m3"]

E4M3_MAX = 448.0


def _table() -> np.ndarray:
    code = np.arange(256)
    e, m = (code >> 3) & 15, code & 7
    value = np.where(e > 0, 2.0 ** (e - 7) * (1 + m / 8), m * 2.0**-9)
    value[(e == 15) & (m == 7)] = np.nan
    return np.where(code & 0x80, -value, value)


_VALUES = _table()
# The 127 finite non-negative values in code order (0x00 .. 0x7e), increasing.
_POSITIVE = _VALUES[:127]


def from_e4m3(bits) -> np.ndarray:
    """The float64 values of e4m3 bytes (uint8, or a torch/ml_dtypes float8 array viewed as
    uint8 by the caller). Exact.

    >>> from_e4m3(np.array([0x38, 0x01, 0xFE], np.uint8)).tolist()
    [1.0, 0.001953125, -448.0]
    """
    return _VALUES[np.asarray(bits, np.uint8)]


def to_e4m3(x) -> np.ndarray:
    """float values -> e4m3 bytes (uint8): round to nearest, ties to even; magnitudes past 448
    saturate to +-448 (as torch's and the usual cache writers' conversions do for finite
    values); NaN -> 0x7F.

    >>> to_e4m3([1.0, -3.3, 1000.0]).tolist()
    [56, 197, 126]
    """
    x = np.asarray(x, np.float64)
    a = np.abs(x)
    hi = np.clip(np.searchsorted(_POSITIVE, a), 1, 126)  # first value >= a (clamped)
    lo = hi - 1
    d_lo, d_hi = a - _POSITIVE[lo], _POSITIVE[hi] - a
    code = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    code = np.where(a >= E4M3_MAX, 126, code)
    code = np.where(np.signbit(x), code | 0x80, code)
    return np.where(np.isnan(x), 0x7F, code).astype(np.uint8)
