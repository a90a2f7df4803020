"""A whole engine in one process: allocator + runner + sampler with continuous batching.

This is the reference the mesh is checked against (same tokens for the same requests), the
engine behind ``tandem chat`` and the subject of ``bench/engine.py``. Each ``step`` either
prefills waiting requests (prefill first, as vLLM's default scheduler) or runs one decode step
over every running request. Every request's blocks return to the allocator when it finishes,
is aborted, or is preempted for lack of blocks (it is then recomputed from its tokens).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.config import ModelConfig
from tandem.engine.errors import InvalidRequestError
from tandem.engine.grammar import Grammars
from tandem.engine.kv_pool import KVPool, KVPoolSpec, num_blocks_for_budget
from tandem.engine.quant import WeightFormat, best_format
from tandem.engine.runner import ModelRunner
from tandem.engine.sampling import Sampler, SamplingParams, make_generator
from tandem.engine.step import Request, StepOutput, forward_and_sample
from tandem.engine.weight_format import default_kv_dtype
from tandem.engine.weights import parse_dtype


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    num_cached_prompt_tokens: int
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        allocator: BlockAllocator,
        eos_token_ids: Sequence[int],
        max_num_seqs: int = 256,
        max_prefill_tokens: int = 8192,
        grammars: Grammars | None = None,
    ) -> None:
        self.runner = runner
        self.allocator = allocator
        self.config: ModelConfig = runner.config
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.sampler = Sampler(grammars)  # grammars: structured output (None: refused)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_preemptions = 0

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        dtype: torch.dtype = torch.float32,
        kv_cache_bytes: int = 1 << 30,
        block_size: int = 16,
        num_blocks: int | None = None,
        weight_format: WeightFormat | None = None,
        kv_dtype: torch.dtype | None = None,
        **kwargs: int,
    ) -> LLMEngine:
        """An engine with a private KV pool; ``weight_format`` is how its linear layers run
        (default: the fastest accurate format here, ``quant.best_format()``); ``kv_dtype`` is
        the pool's storage dtype (K/V are cast on write and read; default the cell's,
        ``weight_format.default_kv_dtype``: fp16 for ggml's formats on CPU, else ``dtype``)."""
        config = ModelConfig.from_dir(model_dir)
        weight_format = best_format() if weight_format is None else weight_format
        if kv_dtype is None:
            kv_dtype = parse_dtype(default_kv_dtype(weight_format.value, str(dtype).removeprefix("torch.")))
        if num_blocks is None:
            num_blocks = num_blocks_for_budget(config, kv_cache_bytes, block_size, kv_dtype)
        pool = KVPool.create(KVPoolSpec.for_model(config, num_blocks, block_size, kv_dtype))
        runner = ModelRunner.from_dir(model_dir, pool, dtype=dtype,
                                      weight_format=weight_format)
        grammars = Grammars.for_model_dir(model_dir, config.vocab_size, config.eos_token_ids)
        return cls(runner, BlockAllocator(num_blocks, block_size), config.eos_token_ids, grammars=grammars, **kwargs)

    # ------------------------------------------------------------------ requests
    def add_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Queue a request; raises InvalidRequestError for an empty or over-long prompt."""
        prompt = [int(t) for t in prompt_token_ids]
        context = self.config.max_position_embeddings
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        if len(prompt) >= context:
            raise InvalidRequestError(
                f"prompt has {len(prompt)} tokens; the model's context length is {context} "
                f"and at least one token must be generated"
            )
        if any(t < 0 or t >= self.config.vocab_size for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.config.vocab_size})")
        if any(t >= self.config.vocab_size for t, _ in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {self.config.vocab_size})")
        if self.allocator.num_blocks_for(len(prompt) + 1) > self.allocator.num_blocks:
            raise InvalidRequestError(
                f"prompt of {len(prompt)} tokens does not fit the KV pool "
                f"({self.allocator.num_blocks * self.allocator.block_size} tokens)"
            )
        if params.grammar:
            self.sampler.check_grammar(params.grammar)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        req = Request(rid, prompt, params, make_generator(params.seed))
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self._release(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[StepOutput]:
        batch = self._schedule_prefill()
        if batch:
            return self._run(batch, prefill=True)
        if self.running:
            return self._run(self._schedule_decode(), prefill=False)
        return []

    def _schedule_prefill(self) -> list[Request]:
        batch: list[Request] = []
        num_tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            req = self.waiting[0]
            tokens = req.all_token_ids
            if batch and num_tokens + len(tokens) > self.max_prefill_tokens:
                break
            if not self.allocator.can_allocate(tokens):
                break
            self.waiting.popleft()
            alloc = self.allocator.allocate(tokens)
            req.block_ids = list(alloc.block_ids)
            req.num_computed_tokens = alloc.num_cached_tokens
            if not req.output_token_ids:
                req.num_cached_prompt_tokens = alloc.num_cached_tokens
            batch.append(req)
            num_tokens += len(tokens) - alloc.num_cached_tokens
        return batch

    def _schedule_decode(self) -> list[Request]:
        scheduled: list[Request] = []
        for req in list(self.running):
            if req not in self.running:
                continue  # preempted below to make room for an earlier request
            need = len(req.all_token_ids)
            while not self.allocator.can_extend(req.block_ids, need):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req in self.running:
                req.block_ids.extend(self.allocator.extend(req.block_ids, need))
                scheduled.append(req)
        return scheduled

    def _preempt(self, req: Request) -> None:
        self.num_preemptions += 1
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)

    def _run(self, batch: list[Request], prefill: bool) -> list[StepOutput]:
        outputs = forward_and_sample(self.runner, self.sampler, batch, self.eos_token_ids)
        for req, out in zip(batch, outputs, strict=True):
            if prefill:
                # Publish only the prompt part that was just written (all but the new token).
                self.allocator.publish(req.block_ids, req.all_token_ids[: req.num_computed_tokens])
                self.running.append(req)
            if out.finish_reason is not None:
                self.running.remove(req)
                self._release(req)
                self.requests.pop(req.request_id, None)
        return outputs

    def _release(self, req: Request) -> None:
        if req.block_ids:
            # Everything but the last sampled token has K/V in the pool: index it for reuse.
            self.allocator.publish(req.block_ids, req.all_token_ids[: req.num_computed_tokens])
            self.allocator.free(req.block_ids)
            req.block_ids = []

    # ------------------------------------------------------------------ batch API
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        """Run the prompts to completion; results in prompt order."""
        param_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, param_list, strict=True)]
        reqs = [self.requests[rid] for rid in ids]
        while self.has_unfinished():
            self.step()
        results = []
        for rid, req in zip(ids, reqs):
            want_logprobs = req.params.logprobs is not None
            results.append(
                Completion(
                    rid,
                    req.prompt_token_ids,
                    req.output_token_ids,
                    req.finish_reason or "abort",
                    req.num_cached_prompt_tokens,
                    req.output_logprobs if want_logprobs else None,
                    req.output_top_logprobs if want_logprobs else None,
                )
            )
        return results
