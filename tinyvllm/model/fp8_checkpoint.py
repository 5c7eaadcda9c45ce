"""An FP8 checkpoint's weights (HF `quantization_config` quant_method fp8 or compressed-tensors float8 W8A8), as
vLLM reads them: each quantized linear weight is F8_E4M3 in the file, with its `weight_scale` (one per tensor, one
per row as [out, 1], or, with block scales, [ceil(out / rows), ceil(in / columns)]; fp8's block scales are named
`weight_scale_inv`, and multiply like the others) and, for static activations, its per-tensor `input_scale`. A
layer the checkpoint left unquantized (its ignore list) is stored in a float dtype and runs as one. A
mixture-of-experts model's experts are linear layers too (each expert's gate, up and down, with scales of their
own); its routers must be stored unquantized (as vLLM runs them). The checkpoint's
KV cache scales (k_scale, v_scale) are read by the loader for the fp8 KV cache (model/kv_scales.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from tinyvllm.model.config import ModelConfig
from tinyvllm.model.fp8 import Fp8Rows
from tinyvllm.model.layout import fp8_scale_names, linear_weights, router_weights
from tinyvllm.model.weights import LazyWeights


def scale_names(config: ModelConfig) -> set[str]:
    """Every scale tensor an FP8 checkpoint of this config may hold beside its weights (a router's are refused)."""
    out = set()
    for weight in linear_weights(config) + router_weights(config):
        weight_scales, input_scale = fp8_scale_names(config, weight)
        out |= {*weight_scales, input_scale}
    return out


class Fp8CheckpointWeights(LazyWeights):
    """An FP8 checkpoint's tensors by HF name (its scales not among them): `weights[name]` dequantizes a float8
    weight to float32; `fp8_or_float(name)` gives a linear layer's e4m3 weight as stored (Fp8Rows), with its scales.
    `tensors`: the file's tensors (loader.SafetensorsWeights), scales included."""

    def __init__(self, tensors, config: ModelConfig, source: str) -> None:
        self.tensors, self.scheme, self.source = tensors, config.quantization, source
        scales = scale_names(config)
        self.names = [name for name in tensors if name not in scales]
        self.known = set(self.names)
        self._refuse_quantized_routers(config)
        linear = set(linear_weights(config))
        # quantized weight -> (its weight scale's name, its input scale's name or None)
        self.scales: dict[str, tuple[str, str | None]] = {}
        for name in self.names:
            if tensors.entries[name].code != "F8_E4M3":
                continue
            if name not in linear:
                raise ValueError(f"{source}: tensor {name} is float8 but is no linear layer's weight")
            self.scales[name] = self._scale_of(name, config)

    def _refuse_quantized_routers(self, config: ModelConfig) -> None:
        for router in router_weights(config):
            weight_scales, input_scale = fp8_scale_names(config, router)
            if (router in self.known and self.tensors.entries[router].code == "F8_E4M3"
                    or any(name in self.tensors for name in (*weight_scales, input_scale))):
                raise ValueError(f"{self.source}: the router {router} is float8: tinyvllm runs routers unquantized, "
                                 "as vLLM does")

    def _scale_of(self, name: str, config: ModelConfig) -> tuple[str, str | None]:
        """The names of a float8 weight's scales, checked against its shape from the file's header."""
        weight_scales, input_scale = fp8_scale_names(config, name)
        found = [s for s in weight_scales if s in self.tensors]
        if not found:
            raise ValueError(f"{self.source}: float8 tensor {name} has no {' or '.join(weight_scales)}")
        out, n_in = self.tensors.shape(name)
        block, size = self.scheme.block, math.prod(self.tensors.shape(found[0]))
        if block is not None:
            want = (-(-out // block[0]), -(-n_in // block[1]))
            ok = self.tensors.shape(found[0]) == want
        else:
            want, ok = f"1 or {out} values", size in (1, out)
        if not ok:
            raise ValueError(f"{self.source}: {found[0]} has shape {self.tensors.shape(found[0])}, expected {want}")
        if not self.scheme.static_input:
            return found[0], None
        if input_scale not in self.tensors or math.prod(self.tensors.shape(input_scale)) != 1:
            raise ValueError(f"{self.source}: float8 tensor {name} needs one static {input_scale}")
        return found[0], input_scale

    def fp8_or_float(self, name: str) -> Fp8Rows | np.ndarray:
        """A linear layer's e4m3 weight [out, in] with its scales, or a float tensor as float32."""
        if name not in self.scales:
            return self.tensors[name]
        weight_scale, input_scale = self.scales[name]
        codes = self.tensors.stored(name)
        scale = self.row_scales(name) if self.scheme.block is None else self.tensors[weight_scale]
        inputs = None if input_scale is None else float(self.tensors[input_scale].reshape(-1)[0])
        return Fp8Rows(codes, scale.astype(np.float32), self.scheme.block, inputs)

    def row_scales(self, name: str) -> np.ndarray:
        """A float8 weight's scale for each output row (float32 [out]), of a checkpoint with a scale per tensor or
        per channel (block scales have none)."""
        if self.scheme.block is not None:
            raise ValueError(f"{self.source}: {name} has block scales, not one per row")
        scale = self.tensors[self.scales[name][0]].reshape(-1).astype(np.float32)
        return np.broadcast_to(scale, (self.tensors.shape(name)[0],)).copy()

    def block_scales(self, name: str) -> np.ndarray:
        """A float8 weight's scales [ceil(out / rows), ceil(in / columns)] (float32), of a checkpoint with block
        scales."""
        if self.scheme.block is None:
            raise ValueError(f"{self.source}: {name} has no block scales")
        return self.tensors[self.scales[name][0]].astype(np.float32)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.known:
            raise KeyError(name)
        return self.tensors.shape(name)

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self.scales:
            return self.fp8_or_float(name).dequantize()
        self.shape(name)
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
