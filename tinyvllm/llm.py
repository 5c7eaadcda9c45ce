"""The public API, shaped like vLLM's: LLM(model).generate(prompts, SamplingParams(...)).

A script written for vLLM's offline API runs unchanged as far as it uses what tinyvllm has: LLM takes vLLM's keyword
arguments (those tinyvllm cannot honour only at their default), generate() and chat() take vLLM's, and a request
that cannot be served raises ValueError, as in vLLM.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Sequence as SequenceABC

from tinyvllm.version import __version__
from tinyvllm.backends import create_backend
from tinyvllm.config import EngineConfig
from tinyvllm.engine.gc_scope import engine_run_gc
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.inputs import PromptType
from tinyvllm.model.loader import LoadedModel, load_model
from tinyvllm.outputs import RequestOutput, logprob_objects
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.tokenizer import Tokenizer

_LOCAL_FILES = "tinyvllm loads the local files it is given"
# vLLM's keyword arguments that tinyvllm cannot honour: accepted at the value here (vLLM's default), else ValueError.
UNSUPPORTED_ARGS: dict[str, tuple[object, str]] = {
    "tensor_parallel_size": (1, "tinyvllm runs a model on one device"),
    "pipeline_parallel_size": (1, "tinyvllm runs a model on one device"),
    "data_parallel_size": (1, "run one LLM per device, or a job on Ray (`tinyvllm run --ray`)"),
    "trust_remote_code": (False, "tinyvllm runs its own Llama code, never a model's"),
    "revision": (None, _LOCAL_FILES),
    "tokenizer_revision": (None, _LOCAL_FILES),
    "download_dir": (None, _LOCAL_FILES),
    "hf_token": (None, _LOCAL_FILES),
    "load_format": ("auto", "tinyvllm reads safetensors dirs and .gguf files"),
    "tokenizer_mode": ("auto", "tinyvllm has one tokenizer implementation"),
    "skip_tokenizer_init": (False, "stop strings and output text need the tokenizer"),
    "cpu_offload_gb": (0, "the weights stay on the device"),
    "swap_space": (4, "a preempted sequence is recomputed, never swapped"),
    "enable_lora": (False, "tinyvllm serves no LoRA adapters"),
    "max_lora_rank": (16, "tinyvllm serves no LoRA adapters"),
}
IGNORED_ARGS = ("disable_log_stats",)  # vLLM's periodic stats log: tinyvllm has none, either way


class LLM:
    """A model loaded on a backend, with a paged KV cache and a scheduler.

    model: an HF model directory, a .gguf file, or an already loaded model; tokenizer: a tokenizer directory (or a
    .gguf file) to use instead of the model's. The keyword arguments are EngineConfig's fields (tinyvllm/config.py):
    backend ("auto" | "numpy" | "cuda"), batching ("continuous" | "static"), max_num_seqs, max_num_batched_tokens,
    block_size, max_model_len, num_kv_blocks, gpu_memory_utilization, cpu_kv_cache_gib, seed, enable_prefix_caching,
    enable_chunked_prefill, dtype, kv_cache_dtype ("auto" | "fp8"), quantization (None | "fp8"), quantize_lm_head,
    enforce_eager, max_logprobs, cuda_graph_capture, batch_invariant; None stands for the default, as in vLLM. vLLM's other
    arguments in UNSUPPORTED_ARGS are accepted at their default only. Outputs hold logprobs as vLLM's
    {token_id: Logprob} (the engine's own outputs hold floats).

    close() (or leaving `with LLM(...) as llm:`) gives the device back at once: weights, KV cache, buffers and
    graphs; garbage collection of an LLM does the same. A closed LLM refuses to generate.
    """

    def __init__(self, model: str | os.PathLike | LoadedModel, tokenizer: str | os.PathLike | None = None,
                 **kwargs) -> None:
        engine_config = EngineConfig.from_kwargs(_engine_kwargs(kwargs))  # checked before the (slow) load
        if isinstance(model, LoadedModel) and tokenizer is not None:
            raise ValueError("tokenizer= needs a model path: a loaded model brings its own tokenizer")
        self.model = model if isinstance(model, LoadedModel) else load_model(model, tokenizer)
        self.engine_config = engine_config.for_model(self.model.config.max_position_embeddings)
        self.backend = create_backend(self.model, self.engine_config)
        self.llm_engine = LLMEngine(self.model, self.backend, self.engine_config)
        self._request_ids = itertools.count()
        self.closed = False

    def close(self) -> None:
        """Give back everything the backend holds (on the cuda backend every byte of device memory it took);
        idempotent."""
        self.closed = True
        self.backend.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.model.tokenizer

    def get_tokenizer(self) -> Tokenizer:
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
        compiled = engine.structured_outputs.stats
        return {"prefix_cache_hit_rate": round(engine.block_manager.prefix_cache_hit_rate, 4),
                "num_preemptions": engine.scheduler.num_preemptions, "num_steps": engine.num_steps,
                # structured outputs: distinct constraints compiled, and the seconds that took (the vocabulary's
                # tokenizer for llguidance, built once, included)
                "structured_output_grammars": compiled.grammars,
                "structured_output_compile_s": round(compiled.compile_seconds + compiled.tokenizer_seconds, 3)}

    def generate(self, prompts: PromptType | SequenceABC[PromptType],
                 sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_request: object = None, *,
                 error_outputs: bool = False, priority: list[int] | None = None) -> list[RequestOutput]:
        """Complete each prompt (text, a list of token ids, a TextPrompt or a TokensPrompt); outputs in input order.

        A request that cannot be served (a prompt too long, empty, or outside the vocabulary) raises ValueError
        before anything runs; with error_outputs=True it comes back as an output with `error` set instead.
        `priority` (vLLM's, for its priority scheduling) must stay None: requests run first come, first served."""
        if priority is not None:
            raise ValueError("priority: tinyvllm schedules first come, first served (vLLM too, unless its "
                             "scheduling_policy is 'priority')")
        return self._run(_as_prompt_list(prompts), sampling_params, False, use_tqdm, lora_request, error_outputs)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
             use_tqdm: bool = False, lora_request: object = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, *, error_outputs: bool = False) -> list[RequestOutput]:
        """Render each conversation with the chat template and complete it (errors as in generate()).

        As in vLLM: chat_template is a template's source, used instead of the model's; chat_template_kwargs are
        extra template variables (e.g. {"enable_thinking": False}); continue_final_message=True (with
        add_generation_prompt=False) makes the model continue the last message instead of answering it."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt, chat_template=chat_template,
            continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
            for conversation in conversations]
        return self._run(prompts, sampling_params, True, use_tqdm, lora_request, error_outputs)

    def _run(self, prompts: list, sampling_params, templated: bool, use_tqdm: bool, lora_request,
             error_outputs: bool) -> list[RequestOutput]:
        if self.closed:
            raise RuntimeError("this LLM is closed (close() gave its device memory back): create a new LLM")
        if lora_request is not None:
            raise ValueError("lora_request: tinyvllm serves no LoRA adapters")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for index, (prompt, params) in enumerate(zip(prompts, sampling_params)):
                ids.append(str(next(self._request_ids)))
                error = self.llm_engine.add_request(ids[-1], prompt, params, prompt_is_templated=templated)
                if error is not None and not error_outputs:
                    raise ValueError(f"prompt {index}: {error}")
            with engine_run_gc():
                outputs = self._complete(ids, use_tqdm)
        except BaseException:  # a bad prompt, Ctrl-C, a device error: the next call starts with an empty engine
            self.llm_engine.abort_request(ids)
            raise
        return [_with_logprob_objects(output, params, self.tokenizer)
                for output, params in zip(outputs, sampling_params)]

    def _complete(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(ids), desc="generate", unit="req")
        while self.llm_engine.has_unfinished_requests():
            for output in self.llm_engine.step():
                results[output.request_id] = output
                if progress is not None:
                    progress.update(1)
        if progress is not None:
            progress.close()
        return [results[i] for i in ids]


def _with_logprob_objects(output: RequestOutput, params: SamplingParams, tokenizer: Tokenizer) -> RequestOutput:
    """The output with vLLM's {token_id: Logprob} entries in place of the engine's {token_id: logprob}."""
    completions = [c for c in output.outputs if c.logprobs is not None]
    if output.prompt_logprobs is None and not completions:
        return output
    decoded = None
    if params.detokenize:
        ids = sorted({t for entries in [output.prompt_logprobs or [], *(c.logprobs for c in completions)]
                      for entry in entries if entry is not None for t in entry})
        decoded = dict(zip(ids, tokenizer.backend.decode_batch([[t] for t in ids], skip_special_tokens=False)))
    if output.prompt_logprobs is not None:
        output.prompt_logprobs = logprob_objects(output.prompt_logprobs, output.prompt_token_ids,
                                                 params.prompt_logprobs, decoded)
    for completion in completions:
        completion.logprobs = logprob_objects(completion.logprobs, completion.token_ids, params.logprobs, decoded)
    return output


def _engine_kwargs(kwargs: dict) -> dict:
    """LLM's keyword arguments minus vLLM's that have no engine setting here (ValueError if not at their default)
    and minus those left None (= the default)."""
    for name, (default, why) in UNSUPPORTED_ARGS.items():
        value = kwargs.pop(name, default)
        if value != default:
            raise ValueError(f"{name}={value!r} is not supported ({why}); leave it at {default!r}")
    return {k: v for k, v in kwargs.items() if v is not None and k not in IGNORED_ARGS}


def _as_prompt_list(prompts) -> list[str | list[int]]:
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                            and all(isinstance(t, int) for t in prompts)):
        prompts = [prompts]
    out = []
    for prompt in prompts:
        if isinstance(prompt, dict):
            unsupported = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
            if unsupported:
                raise ValueError(f"prompt keys not supported: {', '.join(unsupported)} (tinyvllm takes 'prompt' or "
                                 "'prompt_token_ids')")
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        out.append(prompt)
    return out
