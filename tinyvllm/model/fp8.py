"""FP8 W8A8 on the host: e4m3 weights with their scales, the activations' quantization, and how a checkpoint's
`quantization_config` says its linear layers were quantized.

A weight [out, in] becomes e4m3 codes with one scale per output row, amax(row) / 448 (`quantize_rows`), or comes from
an FP8 checkpoint as stored: one scale per tensor (given to each of its rows), per row, or per 128 x 128 block. The
input of each linear layer is quantized to e4m3 before the product (`quantize_activations`): dynamically, one scale
per token (amax(row) / 448), per token and 128-column group where the weight has block scales, or with a
checkpoint's static per-tensor `input_scale`. The product is then the float32 product of the dequantized values:
what an ideal fake-quantization computes, and what an FP8 GEMM computes up to its accumulation order. A value's code
is e4m3(value * (1 / scale)) in float32 (`e4m3_codes`: a multiply by the scale's inverse, as the kernels quantize,
cuda/fp8.cu); the e4m3 conversion itself is model/dtypes.py's (round to nearest even, saturating at 448).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tinyvllm.model.dtypes import E4M3_MAX, e4m3_to_f32, f32_to_e4m3

FP8_DTYPE = "float8_e4m3fn"  # torch's name of e4m3 with no infinities: a weight dtype (backends/host_weight.py)
FP8_METHODS = ("fp8", "compressed-tensors")  # the quant_methods loaded; any other is refused naming it


@dataclass(frozen=True)
class Fp8Scheme:
    """How an FP8 checkpoint's linear layers were quantized, from its config.json `quantization_config`."""

    method: str  # a quant_method of FP8_METHODS
    block: tuple[int, int] | None = None  # (rows, columns) of the weight blocks that share one scale; None: per
    # tensor or per row, as each weight's scale is shaped
    static_input: bool = False  # activations quantized with the checkpoint's per-tensor input_scale, not per token
    config: dict = field(default_factory=dict, compare=False)  # the quantization_config as config.json holds it


def fp8_scheme(config: object) -> Fp8Scheme | None:
    """The scheme of a config.json's quantization_config (None: none); ValueError, one line, for another method or a
    float8 scheme tinyvllm does not run."""
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else None
    if method not in FP8_METHODS:
        raise ValueError(f"unsupported quantization_config quant_method {method!r:.40}: tinyvllm loads fp8 and "
                         "compressed-tensors float8 (W8A8) checkpoints, or unquantized ones")
    return _fp8_method(config) if method == "fp8" else _compressed_tensors(config)


def _fp8_method(config: dict) -> Fp8Scheme:
    activation = config.get("activation_scheme", "dynamic")
    if activation not in ("dynamic", "static"):
        raise ValueError(f"unsupported fp8 activation_scheme {activation!r:.40}: choose dynamic or static")
    if config.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"unsupported fp8 fmt {config['fmt']!r:.40}: tinyvllm loads e4m3 weights")
    block = _block(config.get("weight_block_size"), "weight_block_size")
    if block is not None and activation == "static":
        raise ValueError("unsupported fp8 checkpoint: block-wise weight scales need dynamic activations")
    return Fp8Scheme("fp8", block, activation == "static", config)


def _compressed_tensors(config: dict) -> Fp8Scheme:
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("unsupported compressed-tensors checkpoint: no config_groups")
    schemes = {_ct_group(g) for g in groups.values()}
    if len(schemes) != 1:
        raise ValueError("unsupported compressed-tensors checkpoint: its config_groups quantize layers differently")
    block, static = schemes.pop()
    return Fp8Scheme("compressed-tensors", block, static, config)


def _ct_group(group: object) -> tuple[tuple[int, int] | None, bool]:
    """(block, static activations) of one compressed-tensors config group: float8 weights and activations."""
    weights = group.get("weights") if isinstance(group, dict) else None
    inputs = group.get("input_activations") if isinstance(group, dict) else None
    for what, args in (("weights", weights), ("input_activations", inputs)):
        if not isinstance(args, dict) or args.get("type") != "float" or args.get("num_bits") != 8:
            kind = f"{args.get('type')} {args.get('num_bits')}-bit" if isinstance(args, dict) else "no"
            raise ValueError(f"unsupported compressed-tensors scheme: {kind} {what} (tinyvllm runs float8 weights "
                             "with float8 activations, W8A8)")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise ValueError(f"unsupported compressed-tensors weight strategy {strategy!r:.40}: choose tensor, channel "
                         "or block")
    block = _block(weights.get("block_structure"), "block_structure") if strategy == "block" else None
    static = not inputs.get("dynamic", True)
    if static and (block is not None or inputs.get("strategy", "tensor") != "tensor"):
        raise ValueError("unsupported compressed-tensors scheme: static activation scales must be per tensor, "
                         "with per-tensor or per-channel weight scales")
    return block, static


def _block(value: object, key: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in value)):
        raise ValueError(f"invalid {key} {value!r:.40} in the quantization_config: must be two positive integers")
    return value[0], value[1]


# ---- quantization -----------------------------------------------------------------------------------------------

def e4m3_scale(amax: np.ndarray) -> np.ndarray:
    """amax / 448, float32 (1 where amax is 0, so that an all-zero row quantizes to zeros)."""
    amax = np.asarray(amax, np.float32)
    return np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)


def e4m3_codes(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The e4m3 codes of x with scale (broadcast against it): x times the float32 1 / scale, rounded to nearest
    even (cuda/fp8.cu quantize_fp8, the FP8 GEMV's in-lane quantization)."""
    return f32_to_e4m3(np.asarray(x, np.float32) * (np.float32(1) / np.asarray(scale, np.float32)))


@dataclass(frozen=True)
class Fp8Rows:
    """A linear layer's weight [out, in] in e4m3 as a checkpoint stores it: codes and their scales."""

    codes: np.ndarray  # uint8 [out, in] ([experts, out, in] for stacked experts: by_expert)
    scale: np.ndarray  # float32 [out] (one per row) or, with `block`, [ceil(out / rows), ceil(in / columns)]
    block: tuple[int, int] | None = None  # (rows, columns) of a block of one scale
    input_scale: float | None = None  # the static activation scale; None: dynamic

    def by_expert(self, num_experts: int) -> Fp8Rows:
        """A stacked expert layer's rows [num_experts * out, in] (stack_rows of every expert's parts) as codes
        [num_experts, out, in] with scales [num_experts, out] or, per block, [num_experts, out / rows, in / columns]."""
        codes = self.codes.reshape(num_experts, -1, self.codes.shape[-1])  # stack_rows kept each on whole blocks
        return Fp8Rows(codes, self.scale.reshape(num_experts, -1, *self.scale.shape[1:]), self.block,
                       self.input_scale)

    def dequantize(self) -> np.ndarray:
        """The float32 weight [out, in] the codes stand for."""
        if self.block is None:
            return e4m3_to_f32(self.codes) * self.scale[:, None]
        return e4m3_to_f32(self.codes) * expand_block_scale(self.scale, self.block, self.codes.shape)


def quantize_rows(w: np.ndarray) -> Fp8Rows:
    """A float weight [out, in] in e4m3 with one scale per row (output channel): amax(row) / 448."""
    w = np.asarray(w, np.float32)
    scale = e4m3_scale(np.abs(w).max(axis=1))
    return Fp8Rows(e4m3_codes(w, scale[:, None]), scale)


def expand_block_scale(scale: np.ndarray, block: tuple[int, int], shape: tuple[int, int]) -> np.ndarray:
    """Block scales [ceil(rows / block[0]), ceil(columns / block[1])] -> one per element of a matrix of `shape`."""
    return np.repeat(np.repeat(scale, block[0], axis=0), block[1], axis=1)[:shape[0], :shape[1]]


def quantize_activations(x: np.ndarray, input_scale: float | None = None, group: int | None = None) -> np.ndarray:
    """x [T, in] through e4m3 and back (float32): with the static `input_scale`, else dynamically with one scale per
    token (row), amax / 448, or per token and `group` consecutive columns."""
    x = np.asarray(x, np.float32)
    if input_scale is not None:
        scale = np.float32(input_scale)
    elif group is None:
        scale = e4m3_scale(np.abs(x).max(axis=1, initial=0))[:, None]
    else:
        starts = np.arange(0, x.shape[1], group)
        amax = np.maximum.reduceat(np.abs(x), starts, axis=1) if len(x) else np.zeros((0, len(starts)), np.float32)
        scale = np.repeat(e4m3_scale(amax), group, axis=1)[:, :x.shape[1]]
    return e4m3_to_f32(e4m3_codes(x, scale)) * scale


def stack_rows(parts: Sequence[Fp8Rows | np.ndarray]) -> Fp8Rows | np.ndarray:
    """The parts of a packed tensor (Q, K, V; gate, up) stacked row after row: float arrays as arrays, e4m3 weights
    as one e4m3 weight (their row or block scales stacked too; a static input scale becomes the parts' largest, as
    vLLM takes it)."""
    if not any(isinstance(p, Fp8Rows) for p in parts):
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
    if not all(isinstance(p, Fp8Rows) for p in parts) or len({p.block for p in parts}) != 1:
        raise ValueError("the parts of a fused projection (q/k/v, gate/up) and a layer's experts must all be float8 "
                         "with the same scales, or all unquantized")
    block = parts[0].block
    if len(parts) > 1 and block is not None and any(len(p.codes) % block[0] for p in parts):
        raise ValueError(f"a fused projection's parts must have a multiple of the weight block's {block[0]} rows")
    inputs = [p.input_scale for p in parts if p.input_scale is not None]
    return Fp8Rows(np.concatenate([p.codes for p in parts]), np.concatenate([p.scale for p in parts]), block,
                   max(inputs) if inputs else None)
