"""lm-evaluation-harness on tinyvllm: the `tinyvllm` model of lm-eval's registry.

Importing this module registers it. lm-eval looks for models only in its own package, so its `lm_eval` command
cannot load this one: `tinyvllm eval ARGS` imports it and then runs lm-eval's own command line as
`lm_eval run --model tinyvllm ARGS`. From Python: import this module, then
`lm_eval.simple_evaluate(model="tinyvllm", model_args="pretrained=PATH,...", tasks=[...])`.

Every request of one lm-eval call goes to the one engine in one generate(), which batches them itself:
- loglikelihood: context + continuation as one prompt with prompt_logprobs=1 from the continuation on; its
  logprobs are summed, and it is greedy when each of its tokens is the most likely one. A context that several
  requests share (an item's choices) is computed once first, so they find its KV blocks in the prefix cache.
- loglikelihood_rolling: lm-eval's disjoint rolling windows over the text, each scored as above.
- generate_until: the task's gen_kwargs as SamplingParams, stopped at its `until` strings and at EOS.
Tokenization, stop handling and truncation follow lm-eval's `hf` model, so results agree with it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter

from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from tinyvllm.inputs import TokensPrompt
from tinyvllm.llm import LLM
from tinyvllm.sampling_params import SamplingParams

# lm-eval's --device, when backend= is not given; auto: the backend's own choice (cuda when a GPU is usable)
DEVICE_BACKENDS = {"auto": "auto", "cpu": "numpy", "cuda": "cuda", "cuda:0": "cuda"}
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


@register_model("tinyvllm")
class TinyvllmLM(TemplateLM):
    """lm-eval's model interface over one tinyvllm LLM.

    pretrained: an HF model dir or a .gguf file. max_gen_toks: generate_until's length when a task sets none.
    max_length: the longest sequence (vLLM's max_model_len; default: the model's). prefix_token_id: the token an
    empty context stands for (default: BOS, else EOS). Other keyword arguments go to LLM (backend, dtype,
    max_num_seqs, tokenizer, ...). lm-eval's batch_size and max_batch_size are accepted and unused: the engine
    forms its own batches (max_num_seqs, max_num_batched_tokens).
    """

    def __init__(self, pretrained: str, max_gen_toks: int = 256, max_length: int | None = None,
                 prefix_token_id: int | None = None, batch_size: int | str | None = None,
                 max_batch_size: int | None = None, device: str | None = None, **llm_kwargs) -> None:
        super().__init__()
        if device is not None and "backend" not in llm_kwargs:
            if device not in DEVICE_BACKENDS:
                raise ValueError(f"device={device!r}: choose {', '.join(DEVICE_BACKENDS)} (other GPUs: set "
                                 "CUDA_VISIBLE_DEVICES)")
            llm_kwargs["backend"] = DEVICE_BACKENDS[device]
        if max_length is not None:
            if llm_kwargs.get("max_model_len") not in (None, max_length):
                raise ValueError("max_length and max_model_len are the same setting: give one")
            llm_kwargs["max_model_len"] = max_length
        self.llm = LLM(pretrained, **llm_kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.pretrained = str(pretrained)
        self.max_gen_toks = max_gen_toks
        self.custom_prefix_token_id = prefix_token_id

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.llm.llm_engine.model_config.max_model_len

    @property
    def tokenizer_name(self) -> str:
        return self.pretrained.replace("/", "__")

    def get_model_info(self) -> dict:
        return {"tinyvllm": self.llm.info()}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None:  # text that already starts with BOS (a chat template's) gets no second one
            bos = self.tokenizer.decode(self.prefix_token_id, skip_special_tokens=False)
            add_special_tokens = not string.startswith(bos)
        return self.tokenizer.encode(string, add_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        text = self.tokenizer.apply_chat_template(chat_history, add_generation_prompt)
        if add_generation_prompt:
            return text
        # Continue the final (assistant) message, as HF's continue_final_message: cut the end-of-turn after it.
        final = chat_history[-1]["content"].strip()
        if final not in text:
            raise ValueError("the chat template does not render the final message's content as given")
        return text[: text.rindex(final) + len(final)]

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        limit = self.max_length - 1  # the engine keeps room for one generated token
        prompts, starts = [], []
        for _, context, continuation in requests:
            tokens = (context + continuation)[-limit:]  # over-long: the context loses its oldest tokens
            prompts.append(tokens)
            starts.append(max(1, len(tokens) - len(continuation)))
        self._cache_shared_contexts(prompts, starts)
        params = [SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, prompt_logprobs_start=start,
                                 detokenize=False) for start in starts]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                    use_tqdm=not disable_tqdm)
        results = []
        for (cache_key, _, _), tokens, start, output in zip(requests, prompts, starts, outputs):
            # Entry i holds token i's logprob and the most likely token's at position i.
            entries = list(zip(tokens[start:], output.prompt_logprobs[start:]))
            answer = (sum(entry[token].logprob for token, entry in entries),
                      all(entry[token].logprob == max(e.logprob for e in entry.values())
                          for token, entry in entries))
            results.append(answer)
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, answer)
        return results

    def _cache_shared_contexts(self, prompts: list[list[int]], starts: list[int]) -> None:
        """Compute once each context that several requests share and that fills a KV block: the prefix cache then
        serves it to all of them (scored together, they would be admitted in one step, before any had it cached)."""
        block = self.llm.engine_config.block_size
        counts = Counter(tuple(p[:start]) for p, start in zip(prompts, starts) if start > block)
        shared = [list(context) for context, count in counts.items() if count > 1]
        if shared and self.llm.engine_config.enable_prefix_caching:
            self.llm.generate([TokensPrompt(prompt_token_ids=c) for c in shared],
                              SamplingParams(max_tokens=1, temperature=0, detokenize=False), use_tqdm=False)

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            token_windows = get_rolling_token_windows(token_list=self.tok_encode(text),
                                                      prefix_token=self.prefix_token_id,
                                                      max_seq_len=self.max_length - 2, context_len=1)
            for context, continuation in map(make_disjoint_window, token_windows):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[index] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        prompts, params, stops = [], [], []
        for context, gen_kwargs in (request.args for request in requests):
            sampling, until = self._sampling_params(gen_kwargs, eos)
            # Left-truncate the context to leave room for the generation, as lm-eval's hf model does.
            prompts.append(TokensPrompt(prompt_token_ids=self.tok_encode(context)[-max(1, self.max_length -
                                                                                         sampling.max_tokens):]))
            params.append(sampling)
            stops.append(until)
        outputs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        texts = []
        for request, output, until in zip(requests, outputs, stops):
            # The generated ids decoded on their own, as the hf model does (the engine's text would leave out an
            # incomplete UTF-8 sequence at the end), then cut at the first stop string.
            text = postprocess_generated_text(
                self.tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=True), until, None)
            texts.append(text)
            self.cache_hook.add_partial("generate_until", request.args, text)
        return texts

    def _sampling_params(self, gen_kwargs: dict, eos: str) -> tuple[SamplingParams, list[str]]:
        """A task's gen_kwargs (normalized as for lm-eval's hf model) as SamplingParams, and its stop strings."""
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        until = handle_stop_sequences(kwargs.pop("until"), eos)
        max_tokens = kwargs.pop("max_gen_toks")
        if not kwargs.pop("do_sample"):
            kwargs["temperature"] = 0.0  # greedy, as the hf model decodes (a task that sets no temperature too)
        unknown = sorted(set(kwargs) - SAMPLING_FIELDS)
        if unknown:
            raise ValueError(f"gen_kwargs not supported by tinyvllm: {', '.join(unknown)}")
        return SamplingParams(max_tokens=max_tokens, stop=[s for s in until if s], **kwargs), until


def main(argv: list[str]) -> None:
    """lm-eval's command line (`lm_eval run`) with this model: `tinyvllm eval --model_args pretrained=PATH ...`.
    Without --device (nor a --config file, which may set one) the backend picks the device, as tinyvllm's `auto`
    does, where lm-eval would pass its own default, cuda:0."""
    from lm_eval.__main__ import cli_evaluate

    given = {arg.split("=", 1)[0] for arg in argv}
    device = [] if given & {"--device", "--config", "-C"} else ["--device", "auto"]
    saved, sys.argv = sys.argv, ["lm_eval", "run", "--model", "tinyvllm", *argv, *device]  # lm-eval parses sys.argv
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
