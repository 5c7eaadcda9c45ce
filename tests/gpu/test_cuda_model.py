"""The whole model on the GPU: against the numpy backend, against HF transformers, and through the engine.

Random weights with real shapes (Llama-3.2-1B, SmolLM2-135M), rounded to bf16 so that every side computes with the
same weights. Lines starting with REPORT carry the measured numbers (run pytest with -s to see them).
"""

import time
from dataclasses import replace

import numpy as np
import pytest
from agreement import logprob_of

from tinyvllm import LLM, SamplingParams
from tinyvllm.benchmark import measure_limits
from tinyvllm.config import EngineConfig
from tinyvllm.backends.numpy_backend import NumpyBackend, sample_from_logits
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.model_inputs import build_batch
from tinyvllm.engine.scheduler import ScheduledStep
from tinyvllm.engine.sequence import Sequence
from tinyvllm.model.dummy import llama_3_2_1b_config, random_weights, save_hf_model_dir, smollm2_135m_config
from tinyvllm.model.dtypes import bf16_to_f32, f32_to_bf16
from tinyvllm.model.layout import tied_copies
from tinyvllm.model.loader import LoadedModel
from tinyvllm.outputs import RequestMetrics

pytestmark = pytest.mark.gpu

CONFIGS = {"llama-3.2-1b": llama_3_2_1b_config, "smollm2-135m": smollm2_135m_config}


def rel_err(out, ref):
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def bf16_model(config, seed=0) -> LoadedModel:
    tied = tied_copies(config)  # a tied LM head is the embedding (under the family's names)
    weights = {name: bf16_to_f32(f32_to_bf16(w)) for name, w in random_weights(config, seed).items()
               if name not in tied}
    for name, source in tied.items():
        weights[name] = weights[source]
    return LoadedModel(config, weights, None, "random")


def make_seqs(prompts, params=None):
    params = params or [SamplingParams(temperature=0, max_tokens=64)] * len(prompts)
    return [Sequence(str(i), i, None, list(map(int, p)), sp, 0, 0, RequestMetrics(0.0))
            for i, (p, sp) in enumerate(zip(prompts, params))]


def prefill_batch(seqs, bm, block_size):
    for seq in seqs:
        bm.allocate(seq, len(seq))
    return build_batch(ScheduledStep(seqs, [len(s) for s in seqs]), block_size)


def decode_batch(seqs, tokens, bm, block_size):
    for seq, token in zip(seqs, tokens):
        seq.num_computed_tokens = len(seq)
        seq.token_ids.append(int(token))
        bm.grow(seq, len(seq))
    return build_batch(ScheduledStep(seqs, [1] * len(seqs)), block_size)


def gpu_logits(cuda, backend, n):
    """The float32 logits of the last step's n sampled rows, still on the GPU after execute()."""
    out = np.empty((n, backend.config.vocab_size), np.float32)
    cuda.memcpy_dtoh(out, backend.forward.buf.logits.ptr)
    return out


def decode_against_numpy(cuda, ours, ref, seqs, tokens, bm, steps=6):
    """`steps` decode steps on both backends, each fed the numpy backend's greedy tokens so that both caches hold the
    same sequences: the logits' relative errors, the fractions of our sampled tokens that agree, the last tokens."""
    errors, agree = [], []
    for _ in range(steps):
        batch = decode_batch(seqs, tokens, bm, 16)
        got = ours.execute(batch)
        ref_logits = ref.forward(batch, np.arange(len(seqs)))
        errors.append(rel_err(gpu_logits(cuda, ours, len(seqs)), ref_logits))
        tokens = ref_logits.argmax(-1)
        agree.append(np.mean(got.last_token_ids == tokens))
    return errors, agree, tokens


@pytest.mark.parametrize("name,layers", [("llama-3.2-1b", 2), ("smollm2-135m", 4)])
def test_logits_and_logprobs_match_numpy(cuda, cuda_backend, name, layers):
    config = replace(CONFIGS[name](), num_hidden_layers=layers)
    model = bf16_model(config)
    # 64-token prefill chunks: the 100-token prompt is computed in two chunks.
    limits = EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512,
                          num_kv_blocks=64)
    ours, ref = cuda_backend(model, limits), NumpyBackend(model, limits)
    ours.init_kv_cache()
    ref.init_kv_cache()
    rng = np.random.default_rng(0)
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=0, prompt_logprobs=5, logprobs=5),
              SamplingParams(temperature=0)]
    seqs = make_seqs([rng.integers(0, config.vocab_size, n) for n in (7, 100, 33)], params)
    bm = BlockManager(EngineConfig(block_size=16, enable_prefix_caching=False), 64)
    batch = prefill_batch(seqs, bm, 16)

    got = ours.execute(batch)
    qsl = batch.query_start_loc
    rows = np.concatenate([qsl[1:] - 1, np.arange(qsl[1], qsl[2])])  # last positions, then sequence 1's prompt
    ref_logits = ref.forward(batch, rows)
    want = sample_from_logits(ref_logits[:3], batch, ref_logits[3:])
    errors = [rel_err(gpu_logits(cuda, ours, 3), ref_logits[:3])]
    lp_diff = np.abs(got.prompt_logprobs[1].token_logprobs - want.prompt_logprobs[1].token_logprobs).max()
    top_agree = np.mean(got.prompt_logprobs[1].top_ids[:, 0] == want.prompt_logprobs[1].top_ids[:, 0])
    assert got.prompt_logprobs[1].top_ids.shape == want.prompt_logprobs[1].top_ids.shape == (99, 5)
    assert lp_diff < 0.1 and top_agree > 0.9
    asked = [0, 1]  # the third row asks no logprobs: the backend leaves its row unset (logprob_rows)
    assert got.logprobs is not None and batch.sampling.logprob_rows.tolist() == asked
    assert np.abs(got.logprobs.token_logprobs[asked] - want.logprobs.token_logprobs[asked]).max() < 0.1

    agree = [np.mean(got.last_token_ids == want.last_token_ids)]
    decode_errors, decode_agree, tokens = decode_against_numpy(cuda, ours, ref, seqs, want.last_token_ids, bm)
    errors, agree = errors + decode_errors, agree + decode_agree
    # Mixed steps: the three sequences decode while a fourth prompt is prefilled in two chunks beside them.
    newcomer = make_seqs([rng.integers(0, config.vocab_size, 40)])[0]
    bm.allocate(newcomer, 40)
    for chunk in range(2):
        for seq, token in zip(seqs, tokens):
            seq.num_computed_tokens = len(seq)
            seq.token_ids.append(int(token))
            bm.grow(seq, len(seq))
        newcomer.num_computed_tokens = 20 * chunk
        batch = build_batch(ScheduledStep(seqs + [newcomer], [1, 1, 1, 20]), 16)
        ours.execute(batch)
        ref_logits = ref.forward(batch, batch.query_start_loc[1:] - 1)
        errors.append(rel_err(gpu_logits(cuda, ours, 4), ref_logits))
        tokens = ref_logits[:3].argmax(-1)
    print(f"REPORT numpy {name} ({layers} layers): logits rel err prefill {errors[0]:.2e}, decode max "
          f"{max(errors[1:-2]):.2e}, mixed decode + chunked prefill {max(errors[-2:]):.2e}; prompt logprob max "
          f"|diff| {lp_diff:.3f}, top-1 agree {top_agree:.3f}; greedy agree {np.mean(agree):.3f}")
    assert max(errors) < 2e-2
    ours.close()


def test_lm_head_algorithm_timed_from_128_rows(cuda, cuda_backend):
    """At start-up the LM head's cuBLASLt algorithm is chosen by timing for the decode buckets of 128 rows or more
    (and those only), and a decode step at such a bucket gives the numpy backend's logits."""
    from tinyvllm.backends.cuda.cublas import BF16_GEMM_F32_OUT
    from tinyvllm.backends.cuda.forward import LM_HEAD_TUNE_ROWS

    config = replace(smollm2_135m_config(), num_hidden_layers=1)
    model = bf16_model(config, seed=3)
    limits = EngineConfig(block_size=16, max_num_seqs=136, max_num_batched_tokens=2048, max_model_len=256,
                          num_kv_blocks=300)
    ours, ref = cuda_backend(model, limits, use_graphs=False), NumpyBackend(model, limits)
    ours.init_kv_cache()
    ref.init_kv_cache()
    lm_head = (config.vocab_size, config.hidden_size, BF16_GEMM_F32_OUT)
    tuned = sorted(rows for (*shape, rows) in ours.forward.blas.algos if tuple(shape) == lm_head)
    assert LM_HEAD_TUNE_ROWS == 128 and tuned == [128, 136] and "LM head tuning" in ours.startup_times
    rng = np.random.default_rng(5)
    seqs = make_seqs([rng.integers(0, config.vocab_size, 9) for _ in range(130)])  # decode bucket 136
    bm = BlockManager(EngineConfig(block_size=16, enable_prefix_caching=False), 300)
    batch = prefill_batch(seqs, bm, 16)
    ours.execute(batch)
    tokens = ref.forward(batch, batch.query_start_loc[1:] - 1).argmax(-1)
    errors, agree, _ = decode_against_numpy(cuda, ours, ref, seqs, tokens, bm, steps=2)
    assert max(errors) < 2e-2 and min(agree) > 0.9
    ours.close()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_hf_transformers(cuda, cuda_backend, name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = CONFIGS[name]()
    model = bf16_model(config)
    hf_config = transformers.LlamaConfig(**config.to_hf_dict())
    with torch.device("cuda"):
        hf = transformers.LlamaForCausalLM(hf_config).eval()
    state = {k: torch.from_numpy(w) for k, w in model.weights.items()}
    hf.load_state_dict(state, strict=False)
    hf.tie_weights()

    steps, block_size = 32, 16
    limits = EngineConfig(block_size=block_size, max_num_seqs=4, max_num_batched_tokens=512, max_model_len=1024,
                          num_kv_blocks=128)
    ours = cuda_backend(model, limits)
    ours.init_kv_cache()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (5, 17, 64, 129)]
    seqs = make_seqs(prompts)
    bm = BlockManager(EngineConfig(block_size=block_size, enable_prefix_caching=False), 128)
    out = ours.execute(prefill_batch(seqs, bm, block_size))
    logits = [gpu_logits(cuda, ours, 4)]
    generated = [out.last_token_ids]
    step_seconds = []
    for _ in range(steps - 1):
        batch = decode_batch(seqs, generated[-1], bm, block_size)
        start = time.perf_counter()
        out = ours.execute(batch)
        step_seconds.append(time.perf_counter() - start)
        logits.append(gpu_logits(cuda, ours, 4))
        generated.append(out.last_token_ids)
    logits, generated = np.stack(logits, 1), np.stack(generated, 1)  # [4, steps, vocab], [4, steps]
    ours.close()

    # HF over prompt + our tokens (teacher forcing): float32 logits at every generated position, and bf16 argmaxes.
    prefill_err, decode_err, agree, prefix = [], [], [], []
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt + generated[i, :-1].tolist()], device="cuda")
            ref = hf(ids).logits[0, len(prompt) - 1:].float().cpu().numpy()
            prefill_err.append(rel_err(logits[i, 0], ref[0]))
            decode_err.append(max(rel_err(logits[i, t], ref[t]) for t in range(1, steps)))
    hf = hf.to(torch.bfloat16)
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt + generated[i, :-1].tolist()], device="cuda")
            hf_tokens = hf(ids).logits[0, len(prompt) - 1:].argmax(-1).cpu().numpy()
            agree.append(np.mean(hf_tokens == generated[i]))
            free = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=steps, do_sample=False,
                               min_new_tokens=steps)[0, len(prompt):].cpu().numpy()
            prefix.append(next((t for t in range(steps) if free[t] != generated[i, t]), steps))
    del hf
    torch.cuda.empty_cache()
    print(f"REPORT hf {name}: logits rel err vs HF fp32 prefill max {max(prefill_err):.2e}, decode max "
          f"{max(decode_err):.2e}; greedy agreement with HF bf16 over {steps} steps (teacher-forced) "
          f"{np.mean(agree):.3f}; free-running identical prefix {prefix} of {steps}; decode step of 4 sequences "
          f"{1e3 * np.median(step_seconds):.2f} ms (median, graph replay)")
    assert max(prefill_err) < 3e-2 and max(decode_err) < 5e-2
    assert np.mean(agree) >= 0.75


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """SmolLM2 shapes with 4 layers, saved as an HF dir (bf16 safetensors) for LLM(...)."""
    config = replace(smollm2_135m_config(), num_hidden_layers=4)
    return save_hf_model_dir(tmp_path_factory.mktemp("smollm2_4l"), config, random_weights(config, 3),
                             dtype="bfloat16")


def token_ids(outputs):
    return [tuple(o.outputs[0].token_ids) for o in outputs]


def divergence_margins(want, got) -> list[float]:
    """For each request whose greedy tokens differ, at the first differing step: how much each run prefers its own
    token over the other's, in logprob (inf if the other's is not among its top logprobs); the larger of the two.
    Near 0: a near-tie that float rounding flipped (other GEMM shapes, chunk boundaries, kernels); a bug shows as a
    large margin."""
    margins = []
    for w, g in zip(want, got):
        a, b = w.outputs[0], g.outputs[0]
        t = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if t is not None:
            x, y = a.token_ids[t], b.token_ids[t]
            margins.append(max(a.logprobs[t][x].logprob - logprob_of(a.logprobs[t], y),
                               b.logprobs[t][y].logprob - logprob_of(b.logprobs[t], x)))
    return margins


def random_prompts(rng, n, vocab, lo, hi):
    return [rng.integers(3, vocab, rng.integers(lo, hi)).tolist() for _ in range(n)]


def test_graph_replay_matches_eager(model_dir):
    rng = np.random.default_rng(2)
    prompts = random_prompts(rng, 20, 49152, 3, 80)
    params = [SamplingParams(max_tokens=24, ignore_eos=True, **({"temperature": 0} if i % 3 else
                                                                 {"temperature": 0.8, "top_p": 0.9, "seed": i}))
              for i in range(len(prompts))]
    runs = []
    for capture in ("eager", "lazy", None):  # None: no graphs at all
        llm = LLM(model_dir, backend="cuda", max_num_seqs=16, num_kv_blocks=256, max_model_len=1024,
                  enforce_eager=capture is None, cuda_graph_capture=capture or "lazy")
        if capture == "eager":
            assert sorted(llm.backend.graphs.sampled) == llm.backend.graphs.buckets  # every bucket captured at start-up
        runs.append(token_ids(llm.generate(prompts, params)))
        if capture == "lazy":  # the thread goes on to every bucket; finish_startup waits for it
            capturer = llm.backend.graphs.capturer
            llm.backend.finish_startup()
            assert not capturer.thread.is_alive()
            assert capturer.error is None and sorted(llm.backend.graphs.sampled) == llm.backend.graphs.buckets
        assert bool(llm.backend.graphs.sampled) == (capture is not None)
        llm.backend.close()
    assert runs[0] == runs[1] == runs[2]


def test_lazy_capture_runs_steps_eagerly_until_their_graph_is_there(model_dir):
    """While the capture thread is held back, every decode step but batch 1's runs eagerly, with the outputs of
    graph replay; once let go, the thread takes the buckets the steps asked for first, then the rest."""
    import threading

    from tinyvllm.backends.cuda.graphs import GraphCapturer

    rng = np.random.default_rng(5)
    prompts = random_prompts(rng, 13, 49152, 3, 40)
    params = [SamplingParams(max_tokens=4 + 2 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    eager = LLM(model_dir, backend="cuda", max_num_seqs=16, num_kv_blocks=256, max_model_len=1024,
              cuda_graph_capture="eager")
    want = token_ids(eager.generate(prompts, params))
    eager.backend.close()

    release, order = threading.Event(), []
    take = GraphCapturer._next

    def held_back(self, graphs):
        release.wait()
        bucket = take(self, graphs)
        order.append(bucket)
        return bucket

    GraphCapturer._next = held_back
    try:
        llm = LLM(model_dir, backend="cuda", max_num_seqs=16, num_kv_blocks=256, max_model_len=1024,
                  cuda_graph_capture="lazy")
        assert list(llm.backend.graphs.sampled) == [1]  # batch 1's, at start-up
        got = token_ids(llm.generate(prompts, params))
        asked = list(llm.backend.graphs.capturer.wanted)
        assert list(llm.backend.graphs.sampled) == [1]  # the steps ran eagerly
        release.set()
        llm.backend.graphs.capturer.thread.join(timeout=120)
    finally:
        GraphCapturer._next = take
    assert got == want
    # the batch drains 13 -> 1 as requests finish: the steps asked for buckets 16, 8, 4 and 2
    assert sorted(set(asked)) == [2, 4, 8, 16]
    assert order[:len(set(asked))] == sorted(set(asked)) and order[-1] is None  # asked-for first, smallest last
    assert sorted(llm.backend.graphs.sampled) == llm.backend.graphs.buckets
    llm.backend.close()


def test_batching_gives_the_same_greedy_outputs_as_alone(model_dir):
    rng = np.random.default_rng(4)
    prompts = random_prompts(rng, 12, 49152, 3, 60)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5)
    llm = LLM(model_dir, backend="cuda", max_num_seqs=8, num_kv_blocks=256, max_model_len=1024)
    alone = [llm.generate(p, params)[0] for p in prompts]
    continuous = llm.generate(prompts, params)
    llm.backend.close()
    static_llm = LLM(model_dir, backend="cuda", batching="static", max_num_seqs=5, num_kv_blocks=256,
                     max_model_len=1024)
    static = static_llm.generate(prompts, params)
    static_llm.backend.close()
    same_c = np.mean([a == c for a, c in zip(token_ids(alone), token_ids(continuous))])
    same_s = np.mean([a == s for a, s in zip(token_ids(alone), token_ids(static))])
    margins = divergence_margins(alone, continuous) + divergence_margins(alone, static)
    print(f"REPORT batching: requests identical to alone: continuous {same_c:.3f}, static {same_s:.3f}; "
          f"logprob margins where they diverge {np.round(margins, 4).tolist()}")
    assert all(m < 0.1 for m in margins)


def test_logprobs_of_some_rows_equal_those_of_every_row(model_dir):
    """Where only some rows ask logprobs the backend computes theirs alone (SamplingBatch.logprob_rows): the same
    batches give those rows the same logprobs, bit for bit, as when every row asks, and the same tokens."""
    rng = np.random.default_rng(12)
    prompts = random_prompts(rng, 10, 49152, 3, 60)
    every = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    some = [every if i % 3 == 1 else SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            for i in range(len(prompts))]
    llm = LLM(model_dir, backend="cuda", max_num_seqs=16, num_kv_blocks=256, max_model_len=1024)
    want, got = llm.generate(prompts, every), llm.generate(prompts, some)
    llm.backend.close()

    def entries(output):
        return [{t: lp.logprob for t, lp in d.items()} for d in output.outputs[0].logprobs]

    assert token_ids(got) == token_ids(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (entries(g) == entries(w)) if i % 3 == 1 else g.outputs[0].logprobs is None


def test_running_one_step_ahead_stops_exactly(model_dir):
    """The engine queues step N+1 before it reads step N's tokens (the next decode reads them on the GPU): sequences
    that stop on a sampled token end exactly there while others run on, and nothing leaks."""
    rng = np.random.default_rng(5)
    prompts = random_prompts(rng, 10, 49152, 3, 60)
    free = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    llm = LLM(model_dir, backend="cuda", max_num_seqs=8, num_kv_blocks=256, max_model_len=1024)
    full = [o.outputs[0].token_ids for o in llm.generate(prompts, free)]
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[t[3]]) if i % 2 == 0
              else free for i, t in enumerate(full)]
    mixed = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    llm.backend.close()
    for i, (f, m) in enumerate(zip(full, mixed)):
        # (the others only run in smaller batches once these stop: their tokens may differ by near-ties)
        assert m == f[: f.index(f[3]) + 1] if i % 2 == 0 else len(m) == 20


def test_device_busy_ends_with_the_queued_step(model_dir):
    """The cuda backend's steps tell whether the GPU has finished them (QueuedStep.done, a query of the step's
    event): once the step queued last has been read, the engine no longer reports the device busy."""
    llm = LLM(model_dir, backend="cuda", max_num_seqs=8, num_kv_blocks=256, max_model_len=1024)
    engine = llm.llm_engine
    engine.add_request("r", list(range(3, 300)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    queued = engine._in_flight.queued
    assert queued.done is not None
    queued.result()
    assert queued.done() and not engine.device_busy()
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.device_busy()
    llm.backend.close()


def test_prefix_caching_and_chunked_prefill_keep_outputs(model_dir):
    rng = np.random.default_rng(6)
    shared = rng.integers(3, 49152, 48).tolist()  # three full blocks of 16 shared by every prompt
    prompts = [shared + p for p in random_prompts(rng, 10, 49152, 5, 30)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5)
    reference = LLM(model_dir, backend="cuda", max_num_seqs=8, num_kv_blocks=256, max_model_len=1024,
                    enable_prefix_caching=False)
    want = reference.generate(prompts, params)
    reference.backend.close()
    # 24-token budget: prompts are prefilled in chunks (mixed with other requests' decodes); without and with the
    # prefix cache, whose second pass finds whole prompts cached.
    chunked = LLM(model_dir, backend="cuda", max_num_seqs=8, num_kv_blocks=256, max_model_len=1024,
                  max_num_batched_tokens=24, enable_prefix_caching=False)
    runs = [chunked.generate(prompts, params)]
    chunked.backend.close()
    llm = LLM(model_dir, backend="cuda", max_num_seqs=8, num_kv_blocks=256, max_model_len=1024,
              max_num_batched_tokens=24)
    runs += [llm.generate(prompts, params) for _ in range(2)]
    bm = llm.llm_engine.block_manager
    same = [float(np.mean([a == b for a, b in zip(token_ids(want), token_ids(run))])) for run in runs]
    margins = [np.round(divergence_margins(want, run), 4).tolist() for run in runs]
    print(f"REPORT chunked prefill, + prefix caching (2 passes): requests identical to the plain run {same}, "
          f"logprob margins where they diverge {margins}, prefix cache hit rate {bm.prefix_cache_hit_rate:.2f}")
    assert bm.prefix_cache_hit_rate > 0 and all(m < 0.1 for run in margins for m in run)
    llm.backend.close()


def test_prompt_logprobs_after_a_prefix_cache_hit(model_dir):
    """Prompt logprobs asked from the continuation on, with the context's blocks served by the prefix cache (and
    chunked prefill): the entries equal a cold run's (bf16 distance) and the context positions are not recomputed."""
    rng = np.random.default_rng(8)
    context = rng.integers(3, 49152, 70).tolist()
    prompts = [context + p for p in random_prompts(rng, 4, 49152, 2, 9)]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3, prompt_logprobs_start=len(context))
    cold = LLM(model_dir, backend="cuda", max_num_seqs=8, num_kv_blocks=256, max_model_len=1024,
               enable_prefix_caching=False)
    want = cold.generate(prompts, params)
    cold.backend.close()
    llm = LLM(model_dir, backend="cuda", max_num_seqs=8, num_kv_blocks=256, max_model_len=1024,
              max_num_batched_tokens=32)
    llm.generate([context], SamplingParams(max_tokens=1))
    computed = []
    submit = llm.backend.submit

    def counting(batch):
        computed.extend(batch.positions.tolist())
        return submit(batch)

    llm.backend.submit = counting
    got = llm.generate(prompts, params)
    assert min(computed) == 64, "the context's first four blocks of 16 came from the cache"
    worst = 0.0
    for prompt, a, b in zip(prompts, want, got):
        assert a.prompt_logprobs[: len(context)] == b.prompt_logprobs[: len(context)] == [None] * len(context)
        for token, x, y in list(zip(prompt, a.prompt_logprobs, b.prompt_logprobs))[len(context):]:
            worst = max(worst, abs(x[token].logprob - y[token].logprob))
    print(f"REPORT prompt logprobs after a prefix-cache hit: worst difference to a cold run {worst:.4f}")
    assert worst < 0.05
    llm.backend.close()


def test_measure_limits_and_describe(model_dir):
    # the KV cache sized from the memory budget: half the GPU for weights, buffers and cache
    llm = LLM(model_dir, backend="cuda", max_num_seqs=8, max_model_len=1024, gpu_memory_utilization=0.5)
    limits, info = measure_limits(llm.backend, fp8=True), llm.info()
    print(f"REPORT measure_limits: copy {limits['bandwidth_bytes_s'] / 1e12:.2f} TB/s, bf16 GEMM "
          f"{limits['gemm_flops'] / 1e12:.0f} TFLOP/s, FP8 GEMM {limits.get('fp8_gemm_flops', 0) / 1e12:.0f} TFLOP/s; "
          f"describe {llm.backend.describe()}")
    assert limits["bandwidth_bytes_s"] > 1e11 and limits["gemm_flops"] > 1e13
    # Hopper's e4m3 tensor cores: about twice the bf16 rate at 4096^3 (1.2-1.35 PFLOP/s measured with torch)
    assert limits["fp8_gemm_flops"] > 1.3 * limits["gemm_flops"]
    total_gib = llm.backend.device.mem_get_info()[1] / 2**30  # 139 on an H200, 79 on an H100
    assert 0.3 < info["kv_cache_gib"] / total_gib < 0.5 and info["dtype"] == "bfloat16" and info["device"]
    llm.backend.close()


def test_long_job_under_a_tight_kv_budget(model_dir):
    rng = np.random.default_rng(5)
    n = 300
    prompts = random_prompts(rng, n, 49152, 4, 150)
    params = []
    for i in range(n):
        extra = [{"temperature": 0}, {"temperature": 1.0, "top_k": 40, "seed": i}, {"temperature": 0.7, "min_p": 0.1},
                 {"temperature": 0, "logprobs": 3}, {"temperature": 0, "prompt_logprobs": 2}][i % 5]
        params.append(SamplingParams(max_tokens=int(rng.integers(1, 64)), ignore_eos=True, **extra))
    llm = LLM(model_dir, backend="cuda", max_num_seqs=32, max_num_batched_tokens=256, num_kv_blocks=48,
              max_model_len=512)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    engine = llm.llm_engine
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"REPORT long job: {n} requests, {generated} tokens in {seconds:.1f} s, {engine.num_steps} steps, "
          f"{engine.scheduler.num_preemptions} preemptions, graphs for buckets {sorted(llm.backend.graphs.sampled)}")
    assert all(o.error is None and o.finished for o in outputs)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    assert all(len(o.outputs[0].logprobs) == p.max_tokens for o, p in zip(outputs, params) if p.logprobs)
    assert all(len(o.prompt_logprobs) == len(pr) for o, p, pr in zip(outputs, params, prompts) if p.prompt_logprobs)
    assert engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    llm.backend.close()
