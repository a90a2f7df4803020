"""One forward + sample over a batch of requests: the step that the single-process engine,
prefill_svc (first token) and decode_svc (every later token) share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tandem.engine.runner import ModelRunner, SeqInput
from tandem.engine.sampling import Sampler, SamplingBatch, SamplingParams, check_stop


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the pool
    num_cached_prompt_tokens: int = 0
    finish_reason: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one request: its new token and, at the end, why it stopped."""

    request_id: str
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: str | None


def forward_and_sample(
    runner: ModelRunner, sampler: Sampler, batch: Sequence[Request], eos_token_ids: Sequence[int]
) -> list[StepOutput]:
    """Compute every request's uncomputed tokens, sample one token each and check stops.

    Each request's ``block_ids`` must already cover ``len(all_token_ids)`` tokens. Updates the
    requests in place (output tokens, logprobs, ``num_computed_tokens``, ``finish_reason``);
    releasing blocks is the caller's business.
    """
    logits = runner.forward(step_inputs(batch))
    return sample_step(runner, sampler, batch, logits, eos_token_ids)


def step_inputs(batch: Sequence[Request]) -> list[SeqInput]:
    """The runner's input for each request: its tokens from ``num_computed_tokens`` on."""
    return [
        SeqInput(req.all_token_ids[req.num_computed_tokens :], req.num_computed_tokens, req.block_ids) for req in batch
    ]


def sample_step(
    runner: ModelRunner, sampler: Sampler, batch: Sequence[Request], logits: torch.Tensor,
    eos_token_ids: Sequence[int],
) -> list[StepOutput]:
    """Sample one token per request from ``logits`` [len(batch), vocab] of ``step_inputs(batch)``."""
    for req in batch:
        req.num_computed_tokens = len(req.all_token_ids)
    eos = tuple(eos_token_ids)
    sampling = SamplingBatch.build(
        [r.params for r in batch],
        [r.prompt_token_ids for r in batch],
        [r.output_token_ids for r in batch],
        [r.generator for r in batch],
        eos,
        runner.config.vocab_size,
    )
    sampled = sampler.sample(logits, sampling)
    context = runner.config.max_position_embeddings
    outputs: list[StepOutput] = []
    for i, req in enumerate(batch):
        token = sampled.token_ids[i]
        logprob = sampled.logprobs[i] if sampled.logprobs is not None else None
        top = sampled.top_logprobs[i] if sampled.top_logprobs is not None else None
        req.output_token_ids.append(token)
        if req.params.logprobs is not None and logprob is not None:
            req.output_logprobs.append(logprob)
            req.output_top_logprobs.append(top or [])
        reason = check_stop(token, len(req.output_token_ids), req.params, eos)
        if reason is None and len(req.all_token_ids) >= context:
            reason = "length"
        req.finish_reason = reason
        outputs.append(StepOutput(req.request_id, token, logprob, top, reason))
    return outputs


def hybrid_step(
    runner: ModelRunner, sampler: Sampler, decode: Sequence[Request], chunks: Sequence[tuple[Request, int]],
    eos_token_ids: Sequence[int],
) -> tuple[list[StepOutput], list[StepOutput | None]]:
    """One aggregated (chunked-prefill) step: every ``decode`` request's uncomputed tokens plus
    the next ``n`` prompt tokens of each ``(request, n)`` chunk, in one forward.

    Decode requests get a token each. A chunk that reaches the end of its prompt gets its first
    token; a partial chunk only advances ``num_computed_tokens`` (its output is None). Blocks
    must cover each request's tokens, as for ``forward_and_sample``.
    """
    inputs = step_inputs(decode)
    for req, n in chunks:
        start = req.num_computed_tokens
        if not 0 < n <= len(req.all_token_ids) - start:
            raise ValueError(f"{req.request_id}: chunk of {n} tokens at {start} of {len(req.all_token_ids)}")
        inputs.append(SeqInput(req.all_token_ids[start : start + n], start, req.block_ids))
    logits = runner.forward(inputs)  # [len(inputs), vocab]: each sequence's last position
    rows = list(range(len(decode)))
    finishing: list[Request] = []
    for i, (req, n) in enumerate(chunks):
        if req.num_computed_tokens + n == len(req.all_token_ids):
            rows.append(len(decode) + i)
            finishing.append(req)
        else:
            req.num_computed_tokens += n
    sampled = sample_step(runner, sampler, [*decode, *finishing], logits[rows], eos_token_ids)
    by_id = {out.request_id: out for out in sampled[len(decode) :]}
    return sampled[: len(decode)], [by_id.get(req.request_id) for req, _ in chunks]
