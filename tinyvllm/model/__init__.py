"""Model description (Llama, Mistral, Qwen2, Qwen3) and weights: config, safetensors/GGUF loading, random models."""

from tinyvllm.model.config import ModelConfig
from tinyvllm.model.loader import LoadedModel, load_model

__all__ = ["ModelConfig", "LoadedModel", "load_model"]
