"""tinyvllm: an offline batch-inference job runner for Llama-family LLMs."""

from tinyvllm.inputs import TextPrompt, TokensPrompt
from tinyvllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.version import __version__


def __getattr__(name: str):
    # LLM pulls in the engine and model code; import it lazily so `import tinyvllm` stays light.
    if name == "LLM":
        from tinyvllm.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "TextPrompt", "TokensPrompt", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestMetrics", "__version__"]
