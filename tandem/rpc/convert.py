"""proto ↔ dataclass conversions that more than one service needs."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from tandem.protocol import SamplingParams
from tandem.rpc.v1 import common_pb2

_N = TypeVar("_N", int, float)

_FINISH: dict[str | None, common_pb2.FinishReason] = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}
_FINISH_NAMES: dict[int, str | None] = {v: k for k, v in _FINISH.items()}


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, max_tokens=p.max_tokens, min_tokens=p.min_tokens,
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos, logit_bias=dict(p.logit_bias),
        grammar=p.grammar,
    )
    if p.seed is not None:
        msg.seed = p.seed % (1 << 64)
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Raises InvalidRequestError for out-of-range values, like the dataclass itself."""
    return SamplingParams(
        temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k, min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty, max_tokens=msg.max_tokens, min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        logit_bias=tuple(msg.logit_bias.items()), grammar=msg.grammar,
    )


def finish_to_proto(reason: str | None) -> common_pb2.FinishReason:
    return _FINISH[reason]


def finish_from_proto(value: int) -> str | None:
    return _FINISH_NAMES.get(value)


RETRY_COUNT_KEY = "tandem-retry-count"
"""gRPC metadata: how many times the SDK sent this request before (absent on the first send),
as ``x-stainless-retry-count`` says it over HTTP; the router admits such a retry of a request it
refused against the deadline of the first send (``router.retries``)."""


def retry_after_metadata(retry_after_s: float | None) -> tuple[tuple[str, str], ...]:
    """A RESOURCE_EXHAUSTED answer's retry hint as gRPC trailing metadata (``retry-after``, in
    seconds); none without a hint."""
    return () if retry_after_s is None else (("retry-after", f"{retry_after_s:.3f}"),)


def _metadata_number(metadata: Iterable[tuple[str, str | bytes]] | None, key: str,
                     parse: Callable[[str | bytes], _N]) -> _N | None:
    """The first value under ``key`` in gRPC metadata, parsed; None when absent or unreadable."""
    for name, value in metadata or ():
        if name == key:
            try:
                return parse(value)
            except (TypeError, ValueError):
                return None
    return None


def retry_after_from(metadata: Iterable[tuple[str, str | bytes]] | None) -> float | None:
    """The ``retry-after`` hint of gRPC trailing metadata (seconds), None when absent or unreadable."""
    seconds = _metadata_number(metadata, "retry-after", float)
    return seconds if seconds is not None and seconds >= 0 else None


KV_FREED_KEY = "tandem-kv-freed"


def kv_freed_metadata(num_blocks_freed: int) -> tuple[tuple[str, str], ...]:
    """The agent's count of KV blocks ever given back to its pool, as trailing metadata of an
    Allocate it refused: a caller waiting for blocks tells a busy pool (the count moves) from a
    wedged one."""
    return ((KV_FREED_KEY, str(num_blocks_freed)),)


def kv_freed_from(metadata: Iterable[tuple[str, str | bytes]] | None) -> int | None:
    """The count ``kv_freed_metadata`` wrote; None when absent or unreadable."""
    return _metadata_number(metadata, KV_FREED_KEY, int)


def token_to_proto(token_id: int, logprob: float | None, top: list[tuple[int, float]] | None) -> common_pb2.GeneratedToken:
    msg = common_pb2.GeneratedToken(
        token_id=token_id, top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top or []]
    )
    if logprob is not None:
        msg.logprob = logprob
    return msg
