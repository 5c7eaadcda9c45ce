"""The public API, shaped like vLLM's: LLM(model).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Sequence as SequenceABC

from tinyvllm.version import __version__
from tinyvllm.backends import create_backend
from tinyvllm.config import EngineConfig
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.model.loader import LoadedModel, load_model
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams

Prompt = str | list[int] | dict


class LLM:
    """A model loaded on a backend, with a paged KV cache and a scheduler.

    model: an HF model directory, a .gguf file, or an already loaded model. The keyword arguments are
    EngineConfig's fields (tinyvllm/config.py): backend ("auto" | "numpy" | "cuda"), batching ("continuous" |
    "static"), max_num_seqs, max_num_batched_tokens, block_size, max_model_len, num_kv_blocks,
    gpu_memory_utilization, cpu_kv_cache_gib, seed, enable_prefix_caching, enable_chunked_prefill.
    """

    def __init__(self, model: str | os.PathLike | LoadedModel, **kwargs) -> None:
        engine_config = EngineConfig.from_kwargs(kwargs)  # checked before the (slow) load
        self.model = model if isinstance(model, LoadedModel) else load_model(model)
        self.engine_config = engine_config.for_model(self.model.config.max_position_embeddings)
        self.backend = create_backend(self.model, self.engine_config)
        self.llm_engine = LLMEngine(self.model, self.backend, self.engine_config)
        self._request_ids = itertools.count()

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def model_config(self):
        return self.model.config

    def info(self) -> dict:
        """What this LLM is, for logs and job metadata."""
        return {"model": str(self.model.source), "tinyvllm_version": __version__,
                **dataclasses.asdict(self.engine_config), "num_kv_blocks": self.llm_engine.num_kv_blocks,
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
