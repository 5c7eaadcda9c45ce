"""Structured outputs: each constrained sequence holds an llguidance matcher; every step, the engine fills the
token bitmask of the rows that sample under a constraint, and the backend removes the forbidden tokens' logits.

llguidance (the grammar engine vLLM, SGLang, llama.cpp and TensorRT-LLM use) compiles JSON schemas, regexes, choices
and Lark/GBNF grammars against the tokenizer's vocabulary and computes a step's masks in parallel in native code.
It is an optional dependency: only a request that asks for a constraint needs it.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from tinyvllm.sampling_params import StructuredOutputsParams

MISSING = "structured outputs need llguidance: pip install 'tinyvllm[structured]'"
WORKER_SWITCH_INTERVAL = 1e-4  # seconds: see StructuredOutputManager.start
MAX_GRAMMARS = 1024  # distinct compiled constraints kept (a job with a schema per row must not grow without bound)


@dataclass
class StructuredOutputStats:
    """What the constraints have cost the host so far: compiling (reported in the job's metadata), and per step
    filling the masks and feeding the matchers their tokens (the benchmark reports those)."""

    grammars: int = 0
    compile_seconds: float = 0.0
    tokenizer_seconds: float = 0.0  # llguidance's view of the vocabulary, built once
    mask_seconds: float = 0.0
    mask_steps: int = 0
    consume_seconds: float = 0.0


@dataclass(eq=False)
class OutputConstraint:
    """One sequence's constraint: its llguidance matcher, fed every token the sequence samples."""

    matcher: object  # llguidance.LLMatcher
    family: int  # which of its grammar's templates it was copied from

    @property
    def done(self) -> bool:
        """It allows nothing more (complete, or broken by a token it forbade)."""
        return self.matcher.is_stopped()

    @property
    def complete(self) -> bool:
        """The tokens so far match the constraint in full."""
        return self.matcher.is_accepting() and not self.matcher.is_error()


@dataclass
class ConstraintWork:
    """Work on constraints running on the worker thread (StructuredOutputManager.start)."""

    future: Future
    constraints: list[OutputConstraint]  # those fed a token, in the order of the future's results
    switch_interval: float  # the interpreter's, restored by finish()


class StructuredOutputManager:
    """Compiles each distinct constraint (cached by content; once per worker thread, below) and gives each sequence
    its own matcher; fills a step's masks and feeds the matchers their tokens, all matchers in parallel.

    A matcher copied from another shares its lexer's lazily built states, behind a lock: copies of one template
    cannot be worked on in parallel (measured on the H200: 512 copies of one template filled no faster on 15
    threads than on one). So each grammar keeps one template per worker thread, new sequences are copied from them
    in turn, and a step hands each worker the matchers of few templates (grouped by template, `_by_family`)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.stats = StructuredOutputStats()
        # llguidance's workers (a core each left to the engine loop and to the thread that drives them). More than 8
        # slowed the engine loop more than they sped up the masks (W6 on the H200's 16 cores: 4, 8, 14 tried).
        self.num_threads = max(1, min(8, len(os.sched_getaffinity(0)) - 2))
        self._llg = None
        self._ll_tokenizer = None
        self._executor = None
        self._worker: ThreadPoolExecutor | None = None
        self._templates: dict[str, list] = {}  # constraint key -> matchers in their start state
        self._handed_out = 0

    def _library(self):
        """llguidance, its tokenizer (built from the model's vocabulary on first use: ~0.3 s) and thread pool."""
        if self._llg is None:
            llguidance = _import_llguidance()
            start = time.perf_counter()
            # the tokenizer's JSON, as HF's fast tokenizers save it (GGUF models build one from their vocabulary)
            self._ll_tokenizer = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                        eos_token=self.eos_token_ids or None)
            self.stats.tokenizer_seconds = time.perf_counter() - start
            self._executor = llguidance.LLExecutor(self.num_threads)
            self._llg = llguidance
        return self._llg

    def constraint(self, params: StructuredOutputsParams) -> OutputConstraint:
        """A new constraint state for a sequence, at the start. ValueError names what is wrong with the constraint
        (an invalid schema, regex or grammar) or says llguidance is missing."""
        llg = self._library()
        key = params.key()
        templates = self._templates.get(key)
        if templates is None:
            if len(self._templates) >= MAX_GRAMMARS:
                self._templates.pop(next(iter(self._templates)))
            templates = self._templates[key] = []
        family = self._handed_out % self.num_threads
        self._handed_out += 1
        if family >= len(templates):
            family = len(templates)
            start = time.perf_counter()
            matcher = llg.LLMatcher(self._ll_tokenizer, _grammar(llg, params), log_level=0)
            if matcher.is_error():
                raise ValueError(f"invalid structured_outputs.{params.kind}: {one_line(matcher.get_error())}")
            self.stats.grammars += not templates
            self.stats.compile_seconds += time.perf_counter() - start
            templates.append(matcher)
        return OutputConstraint(templates[family].deep_copy(), family)

    def start(self, tokens: list[tuple[OutputConstraint, int]], bitmask: np.ndarray | None = None,
              rows: list[tuple[OutputConstraint, int]] = ()) -> ConstraintWork:
        """On a worker thread: feed each constraint the token its sequence sampled, then fill row r of bitmask
        (int32 [R, bitmask_words]) with the tokens allowed next by the constraint given with r (if a bitmask is
        given). Nothing else may touch these constraints until finish(): the caller's thread goes on meanwhile.

        The worker needs the GIL only between llguidance's calls (which release it); while it waits for it, the
        interpreter hands the GIL over every WORKER_SWITCH_INTERVAL instead of every 5 ms."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="tinyvllm-structured-outputs")
        constraints, tokens = self._by_family(tokens)
        rows = self._by_family(rows)[1]
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(switch_interval, WORKER_SWITCH_INTERVAL))
        future = self._worker.submit(self._advance_and_fill, tokens, bitmask, rows)
        return ConstraintWork(future, constraints, switch_interval)

    def _by_family(self, pairs: list[tuple[OutputConstraint, int]]) -> tuple[list[OutputConstraint],
                                                                              list[tuple[object, int]]]:
        """The constraints of (constraint, value) pairs and the (matcher, value) pairs, both grouped by family
        (the order within a family kept) in one pass."""
        if self.num_threads == 1:  # one family
            return [c for c, _ in pairs], [(c.matcher, v) for c, v in pairs]
        groups: list[list[tuple[OutputConstraint, int]]] = [[] for _ in range(self.num_threads)]
        for pair in pairs:
            groups[pair[0].family].append(pair)
        ordered = [pair for group in groups for pair in group]
        return [c for c, _ in ordered], [(c.matcher, v) for c, v in ordered]

    def finish(self, work: ConstraintWork) -> list[OutputConstraint]:
        """Wait for the work start() began; return the constraints that forbade their token."""
        try:
            accepted = work.future.result()
        finally:
            sys.setswitchinterval(work.switch_interval)
        return [c for c, ok in zip(work.constraints, accepted) if not ok]

    def _advance_and_fill(self, tokens: list[tuple[object, int]], bitmask: np.ndarray | None,
                          rows: list[tuple[object, int]]) -> list[bool]:
        from llguidance.numpy import fill_next_token_bitmask_par

        start = time.perf_counter()
        accepted = self._executor.consume_token_par(tokens) if tokens else []
        filled = time.perf_counter()
        self.stats.consume_seconds += filled - start
        if bitmask is not None:
            if rows:
                fill_next_token_bitmask_par(self._executor, rows, bitmask)
            self.stats.mask_seconds += time.perf_counter() - filled
            self.stats.mask_steps += 1
        return accepted

    def take(self, constraint: OutputConstraint, token: int) -> None:
        """Feed one constraint its token now (a sequence that ends with it)."""
        constraint.matcher.consume_token(token)


def check_constraint(params: StructuredOutputsParams) -> None:
    """Compile the constraint without a vocabulary (what a job checks of its job-wide constraint before any row
    runs); ValueError, one line, as constraint() would raise for it: an invalid schema, regex or grammar, or
    llguidance missing."""
    llg = _import_llguidance()
    problem = llg.LLMatcher.validate_grammar(_grammar(llg, params))
    if problem:
        raise ValueError(f"invalid structured_outputs.{params.kind}: {one_line(problem)}")


def one_line(message: str) -> str:
    """llguidance's error as one line: its first line and its `error:` lines, without the source excerpts drawn
    under them."""
    lines = message.strip().splitlines() or [""]
    details = [m.group(1) for line in lines[1:] if (m := re.match(r"\s*error: (.*)", line))]
    return " ".join([lines[0].strip(), *details])


def _import_llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401 (the bitmask fill)
    except ImportError:
        raise ValueError(MISSING) from None
    return llguidance


def _grammar(llg, params: StructuredOutputsParams) -> str:
    """llguidance's grammar text for the constraint."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"invalid structured_outputs.json: not JSON ({exc})") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("invalid structured_outputs.json: a JSON schema is an object")
        options = {}
        if params.disable_any_whitespace:
            options["whitespace_flexible"] = False
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        if params.disable_additional_properties and isinstance(schema, dict):
            schema = _no_additional_properties(schema)
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, overrides=options or None)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"invalid structured_outputs.json: {exc}") from None
    if kind == "choice":
        return llg.grammar_from("choice", params.choice)
    try:
        return llg.grammar_from("regex" if kind == "regex" else "grammar", getattr(params, kind))
    except ValueError as exc:
        raise ValueError(f"invalid structured_outputs.{kind}: {exc}") from None


SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def _no_additional_properties(schema: dict) -> dict:
    """The schema with additionalProperties: false on every object schema that does not set it (vLLM's option),
    following the keywords that hold subschemas (not data: a property named "type" stays a property)."""
    out = dict(schema)
    for key in SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _no_additional_properties(sub) if isinstance(sub, dict) else sub
                        for name, sub in out[key].items()}
    for key in SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_no_additional_properties(sub) if isinstance(sub, dict) else sub for sub in out[key]]
    for key in SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = _no_additional_properties(out[key])
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out
