"""Narrow float formats on numpy, which has neither: values travel as their bit patterns.

bfloat16 as uint16 (the high half of a float32); float8 e4m3 (the KV cache's fp8: 4 exponent bits of bias 7, 3
mantissa bits, no infinity, largest finite 448, subnormals down to 2^-9) as uint8 codes, rounded and saturated as
the GPU's cvt.rn.satfinite.e4m3x2.f32 does: these are the twins of cuda/cache.cu's fp8 path.
"""

from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0
E4M3_NAN = 0x7F  # S.1111.111; the other 126 positive codes are finite
CHUNK = 1 << 18  # values f32_to_bf16 and f32_to_e4m3 convert at a time: their temporaries stay in cache


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32: they are the high half of a float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even like torch; CHUNK values at a time, in
    uint32 (a sum past 2^32 is a NaN's, whose high half wraps as it would once cut to 16 bits)."""
    x = np.ascontiguousarray(x, dtype=np.float32)  # at least 1-d
    out = np.empty(x.shape, np.uint16)
    flat, bf16 = x.reshape(-1).view(np.uint32), out.reshape(-1)
    for start in range(0, flat.size, CHUNK):
        bits = flat[start:start + CHUNK]
        bf16[start:start + CHUNK] = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return out


def _e4m3_values() -> np.ndarray:
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 7
    magnitude = np.where(exponent == 0, mantissa * 2.0**-9, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    values = np.where(codes & 0x80, -magnitude, magnitude).astype(np.float32)
    values[(codes & 0x7F) == E4M3_NAN] = np.nan
    return values


E4M3_VALUES = _e4m3_values()  # code -> float32


def e4m3_to_f32(codes: np.ndarray) -> np.ndarray:
    """float8 e4m3 codes (uint8) -> float32 (exact: every e4m3 value is a float32)."""
    return E4M3_VALUES[codes]


def f32_to_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> float8 e4m3 codes (uint8): round to nearest even, saturate to +-448 (infinities too), NaN -> NaN;
    CHUNK values at a time (whole, a large weight's temporaries would be gigabytes)."""
    x = np.asarray(x, dtype=np.float32)
    codes = np.empty(x.shape, np.uint8)
    flat, out = x.reshape(-1), codes.reshape(-1)  # flat: a copy where x is not contiguous
    for start in range(0, flat.size, CHUNK):
        out[start:start + CHUNK] = _f32_to_e4m3(flat[start:start + CHUNK])
    return codes


def _f32_to_e4m3(x: np.ndarray) -> np.ndarray:
    magnitude = np.abs(x)
    bits = magnitude.view(np.int32)  # a NaN's sum below may wrap: NaNs get their code at the end
    # Normal range (>= 2^-6): round the float32 mantissa to 3 bits (ties to even; a carry bumps the exponent), then
    # move the exponent from bias 127 to bias 7: code = exponent << 3 | mantissa.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # Subnormal range: multiples of 2^-9 (rint rounds half to even; 8 * 2^-9 is the smallest normal, code 8).
    subnormal = np.rint(magnitude * np.float32(2.0**9))
    code = np.where(magnitude < 2.0**-6, subnormal, np.minimum(normal, 126)).astype(np.uint8)  # 126: 448
    code[np.isnan(x)] = E4M3_NAN
    return code | np.where(np.signbit(x), 0x80, 0).astype(np.uint8)