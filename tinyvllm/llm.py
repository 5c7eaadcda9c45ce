"""The public API, shaped like vLLM's: LLM(model).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence as SequenceABC

from tinyvllm import __version__
from tinyvllm.backends import EngineLimits, create_backend
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.model.loader import LoadedModel, load_model
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams

Prompt = str | list[int] | dict


class LLM:
    """A model loaded on a backend, with a paged KV cache and a scheduler.

    model: an HF model directory, a .gguf file, or an already loaded model. backend: "auto" (cuda when a GPU is usable, else numpy), "numpy"
    or "cuda". batching: "continuous" or "static". num_kv_blocks fixes the cache size; otherwise it comes from
    gpu_memory_utilization (cuda) or cpu_kv_cache_gib (numpy).
    """

    def __init__(self, model: str | os.PathLike | LoadedModel, *, backend: str = "auto", batching: str = "continuous",
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, block_size: int = 16,
                 max_model_len: int | None = None, num_kv_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, cpu_kv_cache_gib: float = 2.0, seed: int = 0,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True) -> None:
        for name, value in [("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("block_size", block_size)]:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"invalid {name}={value!r}: must be an integer >= 1")
        if num_kv_blocks is not None and num_kv_blocks < 1:
            raise ValueError(f"invalid num_kv_blocks={num_kv_blocks!r}: must be >= 1")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"invalid gpu_memory_utilization={gpu_memory_utilization!r}: must be in (0, 1]")
        self.model = model if isinstance(model, LoadedModel) else load_model(model)
        config = self.model.config
        if max_model_len is None:
            max_model_len = config.max_position_embeddings
        elif not 1 < max_model_len <= config.max_position_embeddings:
            raise ValueError(f"invalid max_model_len={max_model_len}: the model supports up to "
                             f"{config.max_position_embeddings} positions")
        self.limits = EngineLimits(block_size=block_size, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                   num_kv_blocks=num_kv_blocks, gpu_memory_utilization=gpu_memory_utilization,
                                   cpu_kv_cache_bytes=int(cpu_kv_cache_gib * (1 << 30)))
        self.backend = create_backend(backend, self.model, self.limits)
        self.batching = batching
        self.llm_engine = LLMEngine(self.model, self.backend, self.limits, batching=batching, seed=seed,
                                    enable_prefix_caching=enable_prefix_caching,
                                    enable_chunked_prefill=enable_chunked_prefill)
        self._request_ids = itertools.count()

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def model_config(self):
        return self.model.config

    def info(self) -> dict:
        """What this LLM is, for logs and job metadata."""
        return {"model": str(self.model.source), "tinyvllm_version": __version__, "batching": self.batching,
                "max_num_seqs": self.limits.max_num_seqs, "max_num_batched_tokens": self.limits.max_num_batched_tokens,
                "block_size": self.limits.block_size, "max_model_len": self.limits.max_model_len,
                "num_kv_blocks": self.llm_engine.num_kv_blocks,
                "enable_prefix_caching": self.llm_engine.block_manager.enable_prefix_caching,
                "enable_chunked_prefill": self.llm_engine.scheduler.enable_chunked_prefill,
                **self.backend.describe()}

    def stats(self) -> dict:
        """Counters of the engine so far, for job summaries."""
        engine = self.llm_engine
        return {"prefix_cache_hit_rate": round(engine.block_manager.prefix_cache_hit_rate, 4),
                "num_preemptions": engine.scheduler.num_preemptions, "num_steps": engine.num_steps}

    def generate(self, prompts: Prompt | SequenceABC[Prompt],
                 sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Complete each prompt (text, a list of token ids, or {"prompt_token_ids": [...]}); outputs in input order."""
        return self._run(_as_prompt_list(prompts), sampling_params, templated=False, use_tqdm=use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and complete it."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(conversation) for conversation in conversations]
        return self._run(prompts, sampling_params, templated=True, use_tqdm=use_tqdm)

    def _run(self, prompts: list, sampling_params, templated: bool, use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts")
        ids = [str(next(self._request_ids)) for _ in prompts]
        for request_id, prompt, params in zip(ids, prompts, sampling_params):
            self.llm_engine.add_request(request_id, prompt, params, prompt_is_templated=templated)
        results: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(prompts), desc="generate", unit="req")
        while self.llm_engine.has_unfinished_requests():
            for output in self.llm_engine.step():
                results[output.request_id] = output
                if progress is not None:
                    progress.update(1)
        if progress is not None:
            progress.close()
        return [results[i] for i in ids]


def _as_prompt_list(prompts) -> list[str | list[int]]:
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                            and all(isinstance(t, int) for t in prompts)):
        prompts = [prompts]
    out = []
    for prompt in prompts:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        out.append(prompt)
    return out
