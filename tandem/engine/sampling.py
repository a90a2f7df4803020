"""Per-request sampling parameters and the batched sampler that turns logits into tokens.

Pipeline, applied to one ``[batch_size, vocab_size]`` logits tensor in fp32, every step
vectorized over the batch:

1. logprobs of the *raw* model logits (before any bias, penalty or temperature), as vLLM reports
   by default, so a client sees what the model predicted rather than what our processing made of it;
2. ``logit_bias`` (OpenAI semantics: each bias added to its token's logit, before the penalties
   as in vLLM);
3. repetition penalty (HF semantics, over prompt + output tokens);
4. frequency then presence penalty (OpenAI / vLLM semantics, over output tokens only);
5. ``min_tokens`` masking: eos (unless ``ignore_eos``) and ``stop_token_ids`` get ``-inf``;
   then a structured output's grammar: every token it does not allow next gets ``-inf``
   (``tandem.engine.grammar``; where ``min_tokens`` left a row no token, the grammar wins);
6. greedy rows take the argmax here, so top-k / top-p / min-p can never change them;
7. random rows: temperature, then top-k, top-p and min-p from one sort (HF order: top-p sees the
   top-k-truncated distribution; min-p is a ratio to the most likely token, which no filter
   removes and renormalisation does not change), then one draw.

Random draws use the exponential race ``argmax(probs / q)``, ``q ~ Exp(1)`` i.i.d., which picks
token ``i`` with probability ``probs[i]``. A seeded row draws its ``q`` from its own
``torch.Generator`` (``vocab_size`` numbers per step), so its tokens do not depend on which
other requests share the batch, or where it sits in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.engine import ggml_kernels
from tandem.engine.errors import InvalidRequestError
from tandem.engine.grammar import Grammars
from tandem.protocol import (  # noqa: F401  (re-exported: the engine's callers import them from here)
    GREEDY_TEMPERATURE_EPS,
    MAX_NUM_LOGPROBS,
    MAX_SEED,
    MAX_STOP_TOKEN_IDS,
    MIN_SEED,
    SamplingParams,
)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded with ``seed`` on ``device`` (the logits' device), or None for no seed."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def generator_state(generator: torch.Generator | None) -> bytes:
    """A seeded request's RNG state as bytes, to hand it to another process (b"" if unseeded)."""
    return generator.get_state().numpy().tobytes() if generator is not None else b""


def restore_generator(params: SamplingParams, state: bytes) -> torch.Generator | None:
    """The generator ``params`` asks for, continued from ``generator_state`` bytes when given."""
    generator = make_generator(params.seed)
    if generator is not None and state:
        generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return generator


@dataclass(frozen=True)
class SampleOutput:
    """What ``Sampler.sample`` chose for each row, in batch order.

    ``logprobs`` and ``top_logprobs`` are None unless some row asked for logprobs; then
    ``logprobs[i]`` is the raw-logit log-softmax of ``token_ids[i]`` for every row, and
    ``top_logprobs[i]`` holds ``params.logprobs`` (token_id, logprob) pairs in descending
    logprob order for rows that asked, ``[]`` for rows that did not.
    """

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


def _pad_token_ids(rows: list[list[int]], vocab_size: int, what: str,
                   device: torch.device | str) -> torch.Tensor:
    """Rows padded with ``vocab_size`` to ``[len(rows), max_len]``; ids outside the vocab raise."""
    max_len = max((len(r) for r in rows), default=0)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)  # [num_rows]
    ids = torch.tensor([r + [0] * (max_len - len(r)) for r in rows],
                       dtype=torch.long).reshape(len(rows), max_len)  # [num_rows, max_len]
    real = torch.arange(max_len).unsqueeze(0) < lengths.unsqueeze(1)  # [num_rows, max_len]
    # Checked on real positions only: the pad id is vocab_size itself, a bad id otherwise.
    if bool(((ids < 0) | (ids >= vocab_size))[real].any()):
        raise InvalidRequestError(f"{what} must lie in [0, {vocab_size})")
    return ids.masked_fill_(~real, vocab_size).to(device)


@dataclass(frozen=True)
class SamplingBatch:
    """Sampling parameters of one batch as tensors, built once per step by ``build``.

    Optional tensors are None when no row of the batch uses the feature, so the sampler skips
    that work. Padded token tensors use ``vocab_size`` as the pad id: penalties scatter into a
    ``vocab_size + 1`` wide buffer and drop the last column.
    """

    batch_size: int
    vocab_size: int
    greedy: torch.Tensor  # [batch_size] bool; argmax rows (temperature ~ 0 or top_k == 1)
    greedy_rows: tuple[bool, ...]  # the same on the host, so drawing needs no device sync
    all_greedy: bool
    temperature: torch.Tensor  # [batch_size] fp32; 1.0 on greedy rows so the division is safe
    top_k: torch.Tensor | None  # [batch_size] int64 in [1, vocab_size]; vocab_size = off
    top_p: torch.Tensor | None  # [batch_size] fp32; 1.0 = off
    min_p: torch.Tensor | None  # [batch_size] fp32; 0.0 = off
    repetition_penalty: torch.Tensor | None  # [batch_size] fp32; 1.0 = off
    seen_token_ids: torch.Tensor | None  # [batch_size, max_prompt_plus_output_len] int64, padded
    frequency_penalty: torch.Tensor | None  # [batch_size] fp32
    presence_penalty: torch.Tensor | None  # [batch_size] fp32
    output_token_ids: torch.Tensor | None  # [batch_size, max_output_len] int64, padded
    masked_rows: torch.Tensor | None  # [num_masked] int64; (row, token) pairs masked by min_tokens
    masked_token_ids: torch.Tensor | None  # [num_masked] int64
    bias_rows: torch.Tensor | None  # [num_biased] int64; (row, token, bias) triples of logit_bias
    bias_token_ids: torch.Tensor | None  # [num_biased] int64
    bias_values: torch.Tensor | None  # [num_biased] fp32
    generators: tuple[torch.Generator | None, ...]  # per row; None = shared default generator
    num_logprobs: tuple[int | None, ...]  # per row, from params.logprobs
    max_num_logprobs: int | None  # None when no row asked for logprobs
    # per row (grammar, output token ids) when a row has a structured output's grammar ("" = none)
    grammar_rows: tuple[tuple[str, Sequence[int]], ...] | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        """Gather per-row parameters and token histories into tensors on ``device``.

        All four lists are indexed by batch row and must have the same length. Stop and eos ids
        outside ``[0, vocab_size)`` are ignored for masking (they can never be sampled), and so are
        ``logit_bias`` ids there (callers refuse them up front: the router, ``LLM``).
        Prompt/output ids outside the vocabulary raise ``InvalidRequestError``.
        """
        batch_size = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(generators) == batch_size):
            raise ValueError(
                f"batch lists differ in length: params={batch_size}, "
                f"prompt_token_ids={len(prompt_token_ids)}, "
                f"output_token_ids={len(output_token_ids)}, generators={len(generators)}")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        # top_k == 1 is an argmax: routing it to the greedy path makes it exact (ties included)
        # and spares a sort and a draw.
        greedy_rows = [p.is_greedy or p.top_k == 1 for p in params]
        random_params = [p for p, g in zip(params, greedy_rows) if not g]

        top_k = top_p = min_p = None
        if any(p.top_k > 0 for p in random_params):
            top_k = torch.tensor(
                [vocab_size if g or p.top_k <= 0 else min(p.top_k, vocab_size)
                 for p, g in zip(params, greedy_rows)], dtype=torch.long, device=device)
        if any(p.top_p < 1.0 for p in random_params):
            top_p = floats([1.0 if g else p.top_p for p, g in zip(params, greedy_rows)])
        if any(p.min_p > 0.0 for p in random_params):
            min_p = floats([0.0 if g else p.min_p for p, g in zip(params, greedy_rows)])

        repetition_penalty = seen = None
        if any(p.repetition_penalty != 1.0 for p in params):
            repetition_penalty = floats([p.repetition_penalty for p in params])
            seen = _pad_token_ids(
                [list(pr) + list(out) for pr, out in zip(prompt_token_ids, output_token_ids)],
                vocab_size, "prompt and output token ids", device)
        frequency_penalty = presence_penalty = output = None
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            frequency_penalty = floats([p.frequency_penalty for p in params])
            presence_penalty = floats([p.presence_penalty for p in params])
            output = _pad_token_ids([list(out) for out in output_token_ids], vocab_size,
                                    "output token ids", device)

        rows: list[int] = []
        masked: list[int] = []
        for row, (p, out) in enumerate(zip(params, output_token_ids)):
            if len(out) >= p.min_tokens:
                continue
            stop_ids = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | set(eos_token_ids)
            for token_id in sorted(t for t in stop_ids if 0 <= t < vocab_size):
                rows.append(row)
                masked.append(token_id)
        masked_rows = masked_token_ids = None
        if rows:
            masked_rows = torch.tensor(rows, dtype=torch.long, device=device)
            masked_token_ids = torch.tensor(masked, dtype=torch.long, device=device)

        biased = [(row, token_id, bias) for row, p in enumerate(params)
                  for token_id, bias in p.logit_bias if token_id < vocab_size]
        bias_rows = bias_token_ids = bias_values = None
        if biased:
            bias_rows = torch.tensor([b[0] for b in biased], dtype=torch.long, device=device)
            bias_token_ids = torch.tensor([b[1] for b in biased], dtype=torch.long, device=device)
            bias_values = floats([b[2] for b in biased])

        num_logprobs = tuple(p.logprobs for p in params)
        asked = [n for n in num_logprobs if n is not None]
        return cls(
            batch_size=batch_size,
            vocab_size=vocab_size,
            greedy=torch.tensor(greedy_rows, dtype=torch.bool, device=device),
            greedy_rows=tuple(greedy_rows),
            all_greedy=all(greedy_rows),
            temperature=floats([1.0 if g else p.temperature for p, g in zip(params, greedy_rows)]),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            seen_token_ids=seen,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            output_token_ids=output,
            masked_rows=masked_rows,
            masked_token_ids=masked_token_ids,
            bias_rows=bias_rows,
            bias_token_ids=bias_token_ids,
            bias_values=bias_values,
            generators=tuple(generators),
            num_logprobs=num_logprobs,
            max_num_logprobs=max(asked) if asked else None,
            grammar_rows=(tuple((p.grammar, out) for p, out in zip(params, output_token_ids))
                          if any(p.grammar for p in params) else None),
        )


class Sampler:
    """Turns a batch of logits into one token per row. Its one state is ``grammars``, the model's
    structured-output matchers (None: a row with a grammar is refused); that state is a cache,
    rebuilt from a request's output wherever it is missing.

    Randomness comes from each row's generator in ``SamplingBatch.generators`` (advanced by one
    draw of ``vocab_size`` numbers per random step) or, for unseeded rows, torch's default
    generator. Greedy rows never draw.
    """

    def __init__(self, grammars: Grammars | None = None) -> None:
        self.grammars = grammars

    def _grammars(self) -> Grammars:
        if self.grammars is None:
            raise InvalidRequestError("structured output (a grammar) is not available in this engine")
        return self.grammars

    def check_grammar(self, grammar: str) -> None:
        """InvalidRequestError unless ``grammar`` compiles for this model (and grammars are on)."""
        self._grammars().check(grammar)

    def allowed(self, batch: SamplingBatch) -> torch.Tensor | None:
        """[batch_size, vocab_size] bool of the tokens each row's grammar allows, or None when no
        row has one."""
        if batch.grammar_rows is None:
            if self.grammars is not None:
                self.grammars.tick()
            return None
        grammars = self._grammars()
        if grammars.vocab_size != batch.vocab_size:
            raise ValueError(f"grammar masks of {grammars.vocab_size} tokens for logits of {batch.vocab_size}")
        return grammars.allowed(batch.grammar_rows)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """Choose one token per row of ``logits`` ([batch_size, vocab_size], fp32 or bf16).

        The caller's ``logits`` tensor is never modified.
        """
        if logits.dim() != 2 or logits.shape != (batch.batch_size, batch.vocab_size):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} does not match the batch "
                f"({batch.batch_size}, {batch.vocab_size})")
        allowed = self.allowed(batch)
        if self._plain_greedy(logits, batch):
            kernels = ggml_kernels.own_kernels()
            in_c = kernels.greedy_rows(logits, batch.max_num_logprobs is not None) if kernels else None
            if in_c is not None:
                token_list, logprob_list = in_c
                return SampleOutput(token_ids=token_list, logprobs=logprob_list,
                                    top_logprobs=None if logprob_list is None else [[] for _ in token_list])
        raw = logits.float()  # [batch_size, vocab_size]
        x = self.process_logits(raw, batch, allowed)  # [batch_size, vocab_size]
        token_ids = x.argmax(dim=-1)  # [batch_size]
        if not batch.all_greedy:
            sampled = self._sample_random(x, batch)  # [batch_size]
            token_ids = torch.where(batch.greedy, token_ids, sampled)

        if batch.max_num_logprobs is None:
            return SampleOutput(token_ids=token_ids.tolist(), logprobs=None, top_logprobs=None)
        logprobs = torch.log_softmax(raw, dim=-1)  # [batch_size, vocab_size]
        chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [batch_size]
        top_values, top_ids = logprobs.topk(batch.max_num_logprobs, dim=-1)  # [batch_size, max_n]
        top_values_list: list[list[float]] = top_values.tolist()
        top_ids_list: list[list[int]] = top_ids.tolist()
        top_logprobs = [
            list(zip(top_ids_list[row][:n], top_values_list[row][:n])) if n else []
            for row, n in enumerate(batch.num_logprobs)
        ]
        return SampleOutput(token_ids=token_ids.tolist(), logprobs=chosen.tolist(),
                            top_logprobs=top_logprobs)

    @staticmethod
    def _plain_greedy(logits: torch.Tensor, batch: SamplingBatch) -> bool:
        """Whether every row takes the argmax of its raw fp32 CPU logits (greedy, and no bias,
        penalty, ``min_tokens`` mask or grammar changes them) and asks for no top logprobs: then
        ``ggml_kernels.Kernels.greedy_rows`` gives the same tokens and logprobs in one C call,
        without the copy, argmax and whole log_softmax of the batch below (bench/greedy_rows.py, 16
        rows of SmolLM2's 49,152 logits on a 2-core host: 0.32 against 0.63 ms with a logprob, 0.14
        against 0.37 without, where a decode step of 16 rows takes 26 ms)."""
        return (batch.all_greedy and not batch.max_num_logprobs and logits.dtype == torch.float32
                and logits.device.type == "cpu" and batch.bias_rows is None and batch.repetition_penalty is None
                and batch.frequency_penalty is None and batch.presence_penalty is None
                and batch.masked_rows is None and batch.grammar_rows is None)

    @staticmethod
    def process_logits(logits: torch.Tensor, batch: SamplingBatch, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Biased, penalized, ``min_tokens``-masked and grammar-masked (``allowed``, [batch_size,
        vocab_size] bool, None = every token) fp32 copy of ``logits`` ([batch_size, vocab_size]).

        This is what greedy rows take the argmax of, before temperature and filters.
        """
        # .float() aliases an fp32 input; clone so in-place work never leaks to the caller.
        x = logits.float().clone()  # [batch_size, vocab_size]
        batch_size, vocab_size = x.shape
        if batch.bias_rows is not None and batch.bias_token_ids is not None and batch.bias_values is not None:
            x.index_put_((batch.bias_rows, batch.bias_token_ids), batch.bias_values, accumulate=True)
        if batch.repetition_penalty is not None and batch.seen_token_ids is not None:
            # HF RepetitionPenaltyLogitsProcessor: each token seen in prompt or output once, however
            # often; dividing a positive logit and multiplying a negative one both make it less likely.
            seen = torch.zeros(batch_size, vocab_size + 1, dtype=torch.bool, device=x.device)
            seen.scatter_(1, batch.seen_token_ids, True)
            seen = seen[:, :vocab_size]  # [batch_size, vocab_size]; drops the pad column
            penalty = batch.repetition_penalty.unsqueeze(1)  # [batch_size, 1]
            penalized = torch.where(x > 0, x / penalty, x * penalty)
            x = torch.where(seen, penalized, x)
        if (batch.frequency_penalty is not None and batch.presence_penalty is not None
                and batch.output_token_ids is not None):
            counts = torch.zeros(batch_size, vocab_size + 1, dtype=torch.float32, device=x.device)
            counts.scatter_add_(1, batch.output_token_ids,
                                torch.ones_like(batch.output_token_ids, dtype=torch.float32))
            counts = counts[:, :vocab_size]  # [batch_size, vocab_size]
            x -= batch.frequency_penalty.unsqueeze(1) * counts
            x -= batch.presence_penalty.unsqueeze(1) * (counts > 0).float()
        if batch.masked_rows is not None:
            x[batch.masked_rows, batch.masked_token_ids] = float("-inf")
        if allowed is not None:
            x.masked_fill_(~allowed, float("-inf"))
            # A completed grammar allows EOS alone, which min_tokens may have masked: the grammar wins.
            dead = torch.isneginf(x).all(dim=-1)  # [batch_size]
            if bool(dead.any()):
                x[dead] = logits[dead].float().masked_fill(~allowed[dead], float("-inf"))
        return x

    @staticmethod
    def _sample_random(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Draw one token per row from penalized logits ``x`` ([batch_size, vocab_size]).

        Greedy rows run through the same tensor ops (temperature 1, filters off, no noise drawn)
        and their result is discarded by the caller.
        """
        x = x / batch.temperature.unsqueeze(1)  # [batch_size, vocab_size]
        if batch.top_k is not None or batch.top_p is not None or batch.min_p is not None:
            x = Sampler._filter(x, batch)
        probs = torch.softmax(x, dim=-1)  # [batch_size, vocab_size]

        noise = torch.ones_like(probs)  # [batch_size, vocab_size]; 1 on greedy rows: no draw
        greedy = batch.greedy_rows
        unseeded = [row for row, g in enumerate(batch.generators)
                    if g is None and not greedy[row]]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), batch.vocab_size,
                                          device=probs.device).exponential_()
        for row, generator in enumerate(batch.generators):
            if generator is not None and not greedy[row]:
                noise[row].exponential_(generator=generator)
        # Exp(1) can be 0 in principle; 0 / 0 would be NaN, and argmax ranks NaN first, which
        # could pick a filtered-out token.
        noise.clamp_min_(torch.finfo(torch.float32).tiny)
        return (probs / noise).argmax(dim=-1)  # [batch_size]

    @staticmethod
    def _filter(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Top-k, then top-p, then min-p on temperature-scaled logits, from one ascending sort."""
        vocab_size = batch.vocab_size
        values, order = x.sort(dim=-1)  # [batch_size, vocab_size] each, ascending
        remove = torch.zeros_like(values, dtype=torch.bool)  # [batch_size, vocab_size]
        if batch.top_k is not None:
            # Ties with the k-th largest value are kept (as vLLM does): no index order to prefer.
            kth = values.gather(1, (vocab_size - batch.top_k).unsqueeze(1))  # [batch_size, 1]
            remove |= values < kth
        if batch.top_p is not None:
            probs = torch.softmax(values.masked_fill(remove, float("-inf")), dim=-1)
            # Ascending cumsum: token i goes when the tokens above it already hold >= top_p, which
            # keeps the smallest top set whose mass reaches top_p.
            below = probs.cumsum(dim=-1)  # [batch_size, vocab_size]
            top_p_remove = below <= (1.0 - batch.top_p).unsqueeze(1)
            top_p_remove[:, -1] = False  # the likeliest token always stays
            remove |= top_p_remove
        if batch.min_p is not None:
            # p_i / p_max = exp(x_i - x_max): compare in log space, no softmax needed, and the ratio
            # is the same before or after the other filters renormalise.
            threshold = values[:, -1:] + torch.log(batch.min_p).unsqueeze(1)  # [batch_size, 1]
            remove |= values < threshold
        values = values.masked_fill(remove, float("-inf"))
        return torch.empty_like(x).scatter_(1, order, values)


def check_stop(
    token_id: int,
    num_output_tokens: int,
    params: SamplingParams,
    eos_token_ids: tuple[int, ...],
) -> str | None:
    """Finish reason after ``token_id`` was appended as output token number ``num_output_tokens``.

    Returns ``"stop"`` for an eos token (unless ``ignore_eos``) or a ``stop_token_ids`` member,
    but never while ``num_output_tokens < min_tokens``; ``"length"`` once ``max_tokens`` tokens
    are out; ``None`` to keep going. A stop token on the last allowed step reports ``"stop"``.
    """
    if num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token_id in eos_token_ids:
            return "stop"
    if num_output_tokens >= params.max_tokens:
        return "length"
    return None
