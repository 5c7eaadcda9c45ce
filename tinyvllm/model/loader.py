"""load_model: an HF checkpoint dir (safetensors) or a .gguf file -> config, weights and tokenizer.

The weights of a checkpoint dir stay in their files until a backend packs them (SafetensorsWeights): only the
headers are read at load, and each tensor is read when asked for, in its stored dtype (`stored`) or as float32 (`[]`).
So the CUDA backend streams a bf16 checkpoint to the device as stored, piece by piece (Bf16Bytes, stream_bf16), and
no one holds the model on the host.

Safetensors are read directly (8-byte little-endian header length, JSON header, raw little-endian data) because
numpy has no bfloat16 and the safetensors numpy API refuses it; nothing is ever unpickled.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tinyvllm.model.config import ModelConfig, read_json_object
from tinyvllm.model.dtypes import bf16_to_f32, e4m3_to_f32, f32_to_bf16
from tinyvllm.model.fp8_checkpoint import Fp8CheckpointWeights, scale_names
from tinyvllm.model.kv_scales import KVCacheScales, kv_scale_names, stored_kv_cache_scales
from tinyvllm.model.layout import layout_of, tied_copies, weight_shapes
from tinyvllm.model.weights import LazyWeights
from tinyvllm.tokenizer import Tokenizer

# safetensors dtype -> (numpy storage dtype, config/torch name)
ST_DTYPES = {"F32": (np.float32, "float32"), "F16": (np.float16, "float16"), "BF16": (np.uint16, "bfloat16"),
             "F8_E4M3": (np.uint8, "float8_e4m3fn")}
ST_NAMES = {name: code for code, (_, name) in ST_DTYPES.items()}


@dataclass
class TensorEntry:
    """Where one tensor of a safetensors file lies."""

    path: Path
    code: str  # the safetensors dtype: F32, F16, BF16 or F8_E4M3
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(ST_DTYPES[self.code][0]).itemsize

    def read(self) -> np.ndarray:
        """The tensor in its stored dtype (bf16 as uint16 bit patterns, e4m3 as uint8 codes), read from the file into a
        new array."""
        out = np.empty(self.shape, np.dtype(ST_DTYPES[self.code][0]).newbyteorder("<"))
        self.read_into(0, out.reshape(-1).view(np.uint8))
        return out

    def read_into(self, start: int, out: np.ndarray) -> None:
        """Bytes start.. of the tensor's data into `out` (contiguous uint8), straight from the file. Read rather
        than mapped: touched pages of a map stay in the resident set while it is open."""
        with open(self.path, "rb") as f:
            f.seek(self.offset + start)
            if f.readinto(memoryview(out)) != out.nbytes:
                raise ValueError(f"{self.path} was truncated while the model was loaded")


class SafetensorsWeights(MutableMapping, LazyWeights):
    """The tensors of a checkpoint's safetensors files by HF name, read lazily: `weights[name]` reads one as float32,
    `weights.stored(name)` in its stored dtype. A tensor assigned here replaces the file's (tests zero a head)."""

    def __init__(self, entries: dict[str, TensorEntry]) -> None:
        self.entries = entries
        self.replaced: dict[str, np.ndarray] = {}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.replaced[name].shape if name in self.replaced else self.entries[name].shape

    def stored(self, name: str) -> np.ndarray:
        """float32, float16, or bfloat16 as uint16 bit patterns: the tensor as the file holds it."""
        return self.replaced[name] if name in self.replaced else self.entries[name].read()

    def bf16_entry(self, name: str) -> TensorEntry | None:
        """Where the file holds the tensor, if it holds it as bf16 (and no tensor replaced it)."""
        entry = None if name in self.replaced else self.entries[name]
        return entry if entry is not None and entry.code == "BF16" else None

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self.replaced:
            return self.replaced[name]
        entry = self.entries[name]
        data = entry.read()
        if entry.code == "F8_E4M3":
            return e4m3_to_f32(data)  # the codes' values: an FP8 checkpoint's scales apply on top (fp8_checkpoint.py)
        return bf16_to_f32(data) if entry.code == "BF16" else data.astype(np.float32)

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        self.replaced[name] = value

    def __delitem__(self, name: str) -> None:
        raise TypeError("the tensors of a checkpoint cannot be removed")

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


def as_bf16(weights: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    """One tensor as bfloat16 bit patterns (uint16), what the CUDA backend uploads: a bf16 checkpoint's (or random
    model's) tensor as stored, with no float32 copy; float32 and float16 ones rounded."""
    if isinstance(weights, LazyWeights):
        data = weights.stored(name)
        if data.dtype == np.uint16:
            return data
        return f32_to_bf16(data.astype(np.float32, copy=False))  # float32, or float16 (exact in float32): rounded once
    return f32_to_bf16(weights[name])


class StoredBytes:
    """One array's bytes (an FP8 checkpoint's e4m3 codes as stored, or a tensor converted to bf16), read piece by
    piece into a caller's buffer (the CUDA backend's pinned staging buffers)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self.nbytes = self.array.nbytes

    def read_into(self, start: int, out: np.ndarray) -> None:
        """Bytes start..start + out.nbytes into `out` (contiguous uint8)."""
        out[:] = self.array[start:start + out.nbytes]


class Bf16Bytes:
    """One tensor as bfloat16 bytes, read piece by piece as StoredBytes are: a bf16 checkpoint's straight from its
    file, never whole on the host; any other converted once here (as_bf16)."""

    def __init__(self, weights: Mapping[str, np.ndarray], name: str) -> None:
        entry = weights.bf16_entry(name) if isinstance(weights, SafetensorsWeights) else None
        self.source = entry if entry is not None else StoredBytes(as_bf16(weights, name))
        self.nbytes = self.source.nbytes

    def read_into(self, start: int, out: np.ndarray) -> None:
        self.source.read_into(start, out)


def stream_bf16(tensors: Iterable[tuple[int, Bf16Bytes]], buffers: Sequence[np.ndarray],
                wait: Callable[[int], None], send: Callable[[int, int, int], None]) -> None:
    """Hand each (destination address, tensor) to `send` piece by piece through the staging buffers in turn, so
    that filling one buffer overlaps sending the others: wait(i) returns once buffer i's last send is done (it may be
    refilled), send(i, nbytes, address) starts sending its first nbytes to address (an asynchronous copy)."""
    size, turn = len(buffers[0]), 0
    for address, tensor in tensors:
        for start in range(0, tensor.nbytes, size):
            i = turn % len(buffers)
            turn += 1
            piece = buffers[i][:min(size, tensor.nbytes - start)]
            wait(i)
            tensor.read_into(start, piece)
            send(i, piece.nbytes, address + start)


@dataclass
class LoadedModel:
    config: ModelConfig
    # HF names and shapes ([out, in] for linears) -> float32 arrays: a dict of arrays (random models), or LazyWeights
    # that read each tensor from the model file when asked (SafetensorsWeights, gguf.GGUFWeights)
    weights: Mapping[str, np.ndarray]
    tokenizer: Tokenizer
    source: str
    kv_cache_scales: KVCacheScales | None = None  # an FP8 checkpoint's, for the fp8 KV cache (model/kv_scales.py)


def load_model(path: str | os.PathLike, tokenizer: str | os.PathLike | None = None) -> LoadedModel:
    """Load an HF model dir (model.safetensors or sharded + index) or a .gguf file; `tokenizer`: a tokenizer dir
    (or a .gguf file, whose tokenizer is read) to use instead of the model's own."""
    path = Path(path)
    separate = _separate_tokenizer(Path(tokenizer)) if tokenizer is not None else None  # before the (slow) weights
    if path.is_file() and path.suffix == ".gguf":
        from tinyvllm.model.gguf import load_gguf  # the gguf package is only needed for .gguf files

        config, weights, tokenizer = load_gguf(path)
        tokenizer = separate or tokenizer
        kv_scales = None
    elif path.is_dir():
        config = ModelConfig.from_dir(path)
        tokenizer = separate or Tokenizer.from_dir(path)  # the model dir may have no tokenizer of its own
        weights, kv_scales = _load_hf_weights(path, config)
    else:
        raise FileNotFoundError(f"{path} is neither a model directory nor a .gguf file")
    check_weights(weights, config, str(path))
    if separate is not None and separate.vocab_size > config.vocab_size:
        raise ValueError(f"the tokenizer has {separate.vocab_size} tokens but the model {path} only "
                         f"{config.vocab_size}")
    # One stop list for everyone: the model's eos ids and the tokenizer's agree.
    eos = config.eos_token_ids + [i for i in tokenizer.eos_token_ids if i not in config.eos_token_ids]
    config.eos_token_ids, tokenizer.eos_token_ids = eos, list(eos)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=str(path), kv_cache_scales=kv_scales)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of an HF model dir (or a tokenizer dir) or a .gguf file, without the weights."""
    return _separate_tokenizer(Path(path))


def _separate_tokenizer(path: Path) -> Tokenizer:
    if path.is_file() and path.suffix == ".gguf":  # vLLM takes a GGUF file as the tokenizer too
        from tinyvllm.model.gguf import load_gguf

        return load_gguf(path)[2]  # its tensors stay mapped, unread
    return Tokenizer.from_dir(path)


def check_weights(weights: Mapping[str, np.ndarray], config: ModelConfig, source: str) -> None:
    """ValueError naming the first missing, unexpected or misshapen tensor (a checkpoint's from its headers)."""
    shapes = weight_shapes(config)
    lazy = isinstance(weights, LazyWeights)  # shapes from the file's header; its dtypes were checked at load
    for name, shape in shapes.items():
        if name not in weights:
            raise ValueError(f"{source}: tensor {name} is missing")
        got = weights.shape(name) if lazy else weights[name].shape
        if got != shape:
            raise ValueError(f"{source}: tensor {name} has shape {got}, expected {shape}")
        if not lazy and weights[name].dtype != np.float32:
            raise ValueError(f"{source}: tensor {name} is {weights[name].dtype}, expected float32")
    extra = sorted(set(weights) - set(shapes))
    if extra:
        raise ValueError(f"{source}: unexpected tensors {extra[:5]} (unsupported model variant?)")


def _load_hf_weights(path: Path, config: ModelConfig) -> tuple[LazyWeights, KVCacheScales | None]:
    """The checkpoint's weights, read lazily, and the KV cache scales an FP8 checkpoint stores (or None)."""
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = read_json_object(index_file).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index_file}: weight_map must map tensor names to file names")
        files = sorted(set(weight_map.values()))
        for file in files:  # shards are files of this folder: never a path out of it (/etc/passwd as weights)
            if Path(file).name != file or not file.endswith(".safetensors"):
                raise ValueError(f"{index_file}: shard {file!r:.80} is not a .safetensors file name of {path}")
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    wanted, ignored, skipped = set(weight_shapes(config)), layout_of(config).hf_ignored, layout_of(config).hf_skipped
    kv_names: dict[str, tuple[int, str]] = {}
    if config.quantization is not None:
        wanted |= scale_names(config)
        ignored += layout_of(config).hf_attention_scales
        kv_names = kv_scale_names(config)
    entries: dict[str, TensorEntry] = {}
    kv_entries: dict[str, TensorEntry] = {}
    for file in files:
        found = safetensors_entries(path / file)
        float8 = [name for name, entry in found.items() if entry.code == "F8_E4M3"]
        if float8 and config.quantization is None:
            raise ValueError(f"{path / file}: tensor {float8[0]} is float8 but config.json has no "
                             "quantization_config for its scales")
        for name, entry in found.items():
            if name in kv_names:
                kv_entries[name] = entry
                continue
            if name.endswith(ignored) or name.startswith(skipped):
                continue
            if name not in wanted:
                raise ValueError(f"{path / file}: unexpected tensor {name} (unsupported model variant?)")
            entries[name] = entry
    for name, source in tied_copies(config).items():
        # Tied: the output projection IS the embedding (some checkpoints also store a copy; HF ignores it too).
        if source in entries:
            entries[name] = entries[source]
    kv_tensors = SafetensorsWeights(kv_entries)
    kv_scales = stored_kv_cache_scales({name: kv_tensors[name] for name in kv_tensors}, config, str(path))
    if config.quantization is not None:
        return Fp8CheckpointWeights(SafetensorsWeights(entries), config, str(path)), kv_scales
    return SafetensorsWeights(entries), kv_scales


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of one .safetensors file, converted to float32."""
    weights = SafetensorsWeights(safetensors_entries(path))
    return {name: weights[name] for name in weights}


def safetensors_entries(path: str | os.PathLike) -> dict[str, TensorEntry]:
    """Where each tensor of one .safetensors file lies, from its header (checked against the file's size)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"safetensors file {path} not found")
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        header_len = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
        if header_len is None or header_len > size - 8:
            raise ValueError(f"{path} is not a safetensors file: its header length is missing or beyond the file")
        try:
            header = json.loads(f.read(header_len))
        except (ValueError, RecursionError):
            header = None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is not a JSON object")
    data_len = size - 8 - header_len
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        _, shape, (start, _) = _tensor_entry(path, name, info, data_len)
        entries[name] = TensorEntry(path, info["dtype"], tuple(shape), 8 + header_len + start)
    return entries


def _tensor_entry(path: Path, name: str, info: object, data_len: int) -> tuple[type, list[int], list[int]]:
    """(numpy dtype, shape, data offsets) of one header entry, checked against the data that follows the header."""
    if not isinstance(info, dict):
        raise ValueError(f"{path}: header entry {name!r:.80} is not an object")
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if code not in ST_DTYPES:
        raise ValueError(f"{path}: tensor {name} has unsupported dtype {code!r:.20}")
    ints = all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in [*(shape or [0]), *(offsets or [])])
    if not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2 or not ints:
        raise ValueError(f"{path}: tensor {name} has a malformed shape or data_offsets")
    dtype = ST_DTYPES[code][0]
    start, end = offsets
    if not start <= end <= data_len or end - start != math.prod(shape) * np.dtype(dtype).itemsize:
        raise ValueError(f"{path}: tensor {name} (shape {shape}, {code}) does not match its data_offsets "
                         f"{offsets} in {data_len} bytes of data")
    return dtype, shape, offsets


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray], dtype: str = "float32") -> None:
    """Write float arrays as one safetensors file in `dtype` ("float32", "float16" or "bfloat16")."""
    code = ST_NAMES[dtype]
    blobs, header, offset = [], {}, 0
    for name, array in tensors.items():
        array = np.asarray(array, dtype=np.float32)
        data = f32_to_bf16(array) if code == "BF16" else array.astype(ST_DTYPES[code][0])
        blob = np.ascontiguousarray(data).astype(data.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header so tensor data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for blob in blobs:
            f.write(blob)
