"""Engine steps of a given shape for the in-process kernel benchmarks (``bench/hybrid_rows.py``,
``bench/x8_kernel.py``): decode rows beside an optional prompt chunk, on the engine's own pool."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.runner import ModelRunner, SeqInput


def step_batch(runner: ModelRunner, allocator: BlockAllocator, decode_rows: int, chunk_tokens: int,
               cached_tokens: int, context: int) -> tuple[list[SeqInput], list[Sequence[int]]]:
    """A step of ``decode_rows`` decode rows (contexts spread over 0.5-1.5x ``context``, each
    computed once as its prompt) and, with ``chunk_tokens``, one prompt chunk after
    ``cached_tokens`` of its prompt (computed first, as chunked prefill leaves it); and the block
    tables it holds, for ``free_tables``."""
    lens = [int(context * (0.5 + j / max(decode_rows, 1))) for j in range(decode_rows)]
    tables: list[Sequence[int]] = []
    for j, length in enumerate(lens):
        table = allocator.allocate(list(range(100 + j, 101 + j + length))).block_ids
        runner.forward([SeqInput(list(range(100 + j, 100 + j + length)), 0, table)])
        tables.append(table)
    batch = [SeqInput((5,), length, table) for length, table in zip(lens, tables, strict=True)]
    if chunk_tokens:
        prompt = list(range(2000, 2000 + cached_tokens + chunk_tokens))
        table = allocator.allocate(prompt).block_ids
        if cached_tokens:
            runner.forward([SeqInput(prompt[:cached_tokens], 0, table)])
        batch.append(SeqInput(prompt[cached_tokens:], cached_tokens, table))
        tables.append(table)
    return batch, tables


def free_tables(allocator: BlockAllocator, tables: list[Sequence[int]]) -> None:
    for table in tables:
        allocator.free(table)
