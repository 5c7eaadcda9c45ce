"""Turn a scheduled step into the flat arrays a backend consumes (a `Batch`)."""

from __future__ import annotations

import numpy as np

from tinyvllm.backends.base import Batch, SamplingBatch
from tinyvllm.backends.sampler import step_keys
from tinyvllm.engine.scheduler import ScheduledStep


def build_batch(step: ScheduledStep, block_size: int) -> Batch:
    seqs = step.seqs
    starts = np.array([seq.num_computed_tokens for seq in seqs], np.int32)
    query_lens = np.asarray(step.num_new_tokens, np.int32)
    ends = starts + query_lens
    query_start_loc = np.zeros(len(seqs) + 1, np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    is_prefill = bool(query_lens.max() > 1)
    if is_prefill:
        token_ids = np.concatenate([np.asarray(seq.token_ids[s:e], np.int32) for seq, s, e in zip(seqs, starts, ends)])
        positions = np.concatenate([np.arange(s, e, dtype=np.int32) for s, e in zip(starts, ends)])
    else:
        # one new token each: mostly the last sampled one, but it can be a 1-token prompt chunk
        token_ids = np.array([seq.token_ids[s] for seq, s in zip(seqs, starts)], np.int32)
        positions = starts
    # A token still being sampled by the previous step (the engine runs one step ahead) is read on the backend
    # from that step's sampled ids: token_sources gives the row there, -1 where token_ids holds the token.
    pending = [i for i, (seq, e) in enumerate(zip(seqs, ends)) if seq.num_pending and e == len(seq)]
    token_sources = None
    if pending:
        token_sources = np.full(len(token_ids), -1, np.int32)
        token_sources[query_start_loc[1:][pending] - 1] = [seqs[i].sample_row for i in pending]
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
        num_logprobs=max((-1 if p.logprobs is None else p.logprobs for p in params), default=-1),
    )
    # Prompt logprobs: new position p predicts prompt token p + 1, for as long as that is a prompt token.
    targets = {}
    for i, (seq, s, e) in enumerate(zip(seqs, starts, ends)):
        if seq.params.prompt_logprobs is not None and s + 1 < seq.num_prompt_tokens:
            targets[i] = np.asarray(seq.prompt_token_ids[s + 1: min(e + 1, seq.num_prompt_tokens)], np.int32)
    num_prompt_logprobs = max((seqs[i].params.prompt_logprobs for i in targets), default=0)
    copies = np.asarray(step.block_copies, np.int32).reshape(-1, 2) if step.block_copies else None
    return Batch(is_prefill, token_ids, positions, slot_mapping, query_start_loc, ends.astype(np.int32),
                 block_tables, sampling, targets, num_prompt_logprobs, token_sources, block_copies=copies)
