"""Turn a scheduled step into the flat arrays a backend consumes (a `Batch`)."""

from __future__ import annotations

import numpy as np

from tinyvllm.backends.base import Batch, SamplingBatch
from tinyvllm.backends.sampler import step_keys
from tinyvllm.engine.scheduler import ScheduledStep


def build_batch(step: ScheduledStep, block_size: int) -> Batch:
    seqs = step.seqs
    # A prefill computes every token not yet in the cache; a decode computes the last (just sampled) token.
    starts = [seq.num_computed_tokens if step.is_prefill else len(seq) - 1 for seq in seqs]
    ends = [len(seq) for seq in seqs]
    query_lens = np.subtract(ends, starts)
    query_start_loc = np.zeros(len(seqs) + 1, np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    token_ids = np.fromiter((t for seq, s in zip(seqs, starts) for t in seq.token_ids[s:]), np.int32,
                            count=int(query_start_loc[-1]))
    if step.is_prefill:
        positions = np.concatenate([np.arange(s, e, dtype=np.int32) for s, e in zip(starts, ends)])
    else:
        positions = np.asarray(starts, np.int32)
    block_tables = np.zeros((len(seqs), max(len(seq.block_table) for seq in seqs)), np.int32)
    for i, seq in enumerate(seqs):
        block_tables[i, : len(seq.block_table)] = seq.block_table
    seq_index = np.repeat(np.arange(len(seqs)), query_lens)
    slot_mapping = (block_tables[seq_index, positions // block_size] * block_size
                    + positions % block_size).astype(np.int32)

    params = [seq.params for seq in seqs]
    sampling = SamplingBatch(
        temperature=np.array([p.temperature for p in params], np.float32),
        top_p=np.array([p.top_p for p in params], np.float32),
        top_k=np.array([p.top_k for p in params], np.int32),
        min_p=np.array([p.min_p for p in params], np.float32),
        noise_keys=step_keys(np.array([seq.sampling_key for seq in seqs], np.uint32),
                             np.array([seq.num_output_tokens for seq in seqs], np.uint32)),
        num_logprobs=max((p.logprobs or 0 for p in params), default=0),
    )
    # Prompt logprobs are computed once, at a sequence's first prefill (not again after a preemption).
    prompt_logprob_seqs = [i for i, seq in enumerate(seqs) if step.is_prefill
                           and seq.params.prompt_logprobs is not None and seq.prompt_logprobs is None]
    num_prompt_logprobs = max((seqs[i].params.prompt_logprobs for i in prompt_logprob_seqs), default=0)
    return Batch(step.is_prefill, token_ids, positions, slot_mapping, query_start_loc, np.asarray(ends, np.int32),
                 block_tables, sampling, prompt_logprob_seqs, num_prompt_logprobs)
