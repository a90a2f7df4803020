"""SamplingParams validation, the batched Sampler and check_stop, on CPU."""

from __future__ import annotations

import json
import math
import pickle
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine import ggml_kernels
from tandem.engine.errors import InvalidRequestError
from tandem.engine.sampling import (
    SampleOutput,
    Sampler,
    SamplingBatch,
    SamplingParams,
    check_stop,
    make_generator,
)
from tandem.rpc.convert import sampling_from_proto, sampling_to_proto

EOS = (0,)


def _batch(
    params: list[SamplingParams],
    vocab_size: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    eos_token_ids: tuple[int, ...] = EOS,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators if generators is not None else [make_generator(p.seed) for p in params],
        eos_token_ids,
        vocab_size,
    )


def _sample(logits: torch.Tensor, params: list[SamplingParams], **kwargs: object) -> SampleOutput:
    return Sampler().sample(logits, _batch(params, logits.shape[1], **kwargs))  # type: ignore[arg-type]


def _draw_many(logits_row: torch.Tensor, params: SamplingParams, num_draws: int,
               seed: int) -> Counter[int]:
    """``num_draws`` tokens from one distribution: one row per draw, each with its own seed."""
    logits = logits_row.unsqueeze(0).expand(num_draws, -1).contiguous()  # [num_draws, vocab_size]
    generators = [make_generator(seed + i) for i in range(num_draws)]
    out = _sample(logits, [params] * num_draws, generators=generators)
    return Counter(out.token_ids)


def _logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()  # [vocab_size]


# ---------------------------------------------------------------- greedy and top-k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(6, 50, generator=make_generator(0)).to(dtype)
    out = _sample(logits, [SamplingParams(temperature=0.0)] * 6)
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_ignores_top_k_top_p_min_p() -> None:
    # The argmax token is 7; top_k=2 / top_p / min_p would still keep it, but a sampler that
    # applied them and then sampled with temperature 1 would not always return it.
    logits = torch.zeros(3, 10)
    logits[:, 7] = 1.0
    logits[:, 2] = 0.99
    params = [SamplingParams(temperature=0.0, top_k=2, top_p=0.5, min_p=0.9, seed=s) for s in range(3)]
    for _ in range(20):
        assert _sample(logits, params).token_ids == [7, 7, 7]


def test_top_k_1_equals_greedy_at_temperature_1() -> None:
    logits = torch.randn(8, 100, generator=make_generator(1))
    params = [SamplingParams(temperature=1.0, top_k=1, seed=i) for i in range(8)]
    assert _sample(logits, params).token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_never_samples_outside_the_k_largest() -> None:
    logits_row = torch.tensor([0.0, 3.0, 1.0, 2.9, 0.5, 2.8, -1.0])
    counts = _draw_many(logits_row, SamplingParams(top_k=3), num_draws=2000, seed=10)
    assert set(counts) == {1, 3, 5}


# ---------------------------------------------------------------- top-p and min-p


@pytest.mark.parametrize(
    ("top_p", "allowed"),
    [
        (0.45, {2}),  # the 0.5 token alone already reaches 0.45
        (0.75, {2, 4}),  # 0.5 + 0.3 = 0.8 >= 0.75, 0.5 < 0.75
        (0.85, {2, 4, 0}),  # 0.8 < 0.85 <= 0.95
        (1.0, {2, 4, 0, 1}),
    ],
)
def test_top_p_keeps_smallest_set_with_mass_at_least_p(top_p: float, allowed: set[int]) -> None:
    logits_row = _logits_from_probs([0.15, 0.05, 0.5, 0.0, 0.3])  # token 3 has probability 0
    counts = _draw_many(logits_row, SamplingParams(top_p=top_p), num_draws=3000, seed=100)
    assert set(counts) == allowed


def test_top_p_applies_after_top_k() -> None:
    # top_k=2 leaves {0.5, 0.3} -> renormalised {0.625, 0.375}; top_p=0.6 then keeps only 0.625.
    logits_row = _logits_from_probs([0.15, 0.05, 0.5, 0.3])
    counts = _draw_many(logits_row, SamplingParams(top_k=2, top_p=0.6), num_draws=1000, seed=5)
    assert set(counts) == {2}


def test_min_p_drops_tokens_below_fraction_of_the_top_probability() -> None:
    # min_p=0.45 -> threshold 0.45 * 0.5 = 0.225: 0.25 stays, 0.2 goes.
    logits_row = _logits_from_probs([0.2, 0.5, 0.05, 0.25])
    counts = _draw_many(logits_row, SamplingParams(min_p=0.45), num_draws=3000, seed=7)
    assert set(counts) == {1, 3}
    counts = _draw_many(logits_row, SamplingParams(min_p=0.0), num_draws=3000, seed=7)
    assert set(counts) == {0, 1, 2, 3}


def test_filters_on_one_row_do_not_touch_another() -> None:
    logits = _logits_from_probs([0.4, 0.35, 0.25]).unsqueeze(0).expand(2000, -1).contiguous()
    params = [SamplingParams(top_k=1 if i % 2 else 2) for i in range(2000)]
    torch.manual_seed(3)
    out = _sample(logits, params)
    assert set(out.token_ids[1::2]) == {0}
    assert set(out.token_ids[0::2]) == {0, 1}


# ---------------------------------------------------------------- the distribution itself


def test_sample_frequencies_match_softmax() -> None:
    logits_row = torch.tensor([1.0, 0.0, -0.5])
    temperature = 0.7
    expected = torch.softmax(logits_row / temperature, dim=-1).tolist()
    num_draws = 5000
    logits = logits_row.unsqueeze(0).expand(num_draws, -1).contiguous()
    torch.manual_seed(1234)  # unseeded rows draw from the shared default generator
    out = _sample(logits, [SamplingParams(temperature=temperature)] * num_draws)
    counts = Counter(out.token_ids)
    for token_id, p in enumerate(expected):
        # 4.5 standard deviations of a binomial frequency; at most ~0.0075 here.
        tolerance = 4.5 * math.sqrt(p * (1 - p) / num_draws)
        assert abs(counts[token_id] / num_draws - p) < tolerance, (token_id, counts, expected)


def test_seeded_draws_from_one_generator_follow_the_distribution() -> None:
    # One request drawing 3000 times from its own generator, one step at a time.
    logits = torch.tensor([[0.0, math.log(3.0)]])  # probs 0.25, 0.75
    params = SamplingParams(seed=99)
    generator = make_generator(params.seed)
    batch = SamplingBatch.build([params], [[]], [[]], [generator], EOS, 2)
    sampler = Sampler()
    ones = sum(sampler.sample(logits, batch).token_ids[0] for _ in range(3000))
    assert abs(ones / 3000 - 0.75) < 4.5 * math.sqrt(0.75 * 0.25 / 3000)


# ---------------------------------------------------------------- seeded reproducibility


def _run_steps(
    slot: int,
    neighbours: list[SamplingParams],
    params: SamplingParams,
    step_logits: list[torch.Tensor],
) -> list[int]:
    """Tokens of ``params`` when decoded at batch position ``slot`` among ``neighbours``."""
    vocab_size = step_logits[0].shape[0]
    batch_params = neighbours[:slot] + [params] + neighbours[slot:]
    generators = [make_generator(p.seed) for p in batch_params]
    outputs: list[list[int]] = [[] for _ in batch_params]
    prompts = [[1, 2, 3] for _ in batch_params]
    noise_gen = make_generator(12345)
    sampler = Sampler()
    tokens: list[int] = []
    for logits_row in step_logits:
        # Neighbours get unrelated logits; the tracked row always gets the same ones.
        logits = torch.randn(len(batch_params), vocab_size, generator=noise_gen)
        logits[slot] = logits_row
        batch = SamplingBatch.build(batch_params, prompts, outputs, generators, EOS, vocab_size)
        out = sampler.sample(logits, batch)
        for row, token_id in enumerate(out.token_ids):
            outputs[row].append(token_id)
        tokens.append(out.token_ids[slot])
    return tokens


def test_seeded_request_is_independent_of_batch_composition_and_position() -> None:
    vocab_size = 200
    step_gen = make_generator(2024)
    step_logits = [torch.randn(vocab_size, generator=step_gen) * 2 for _ in range(30)]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=777,
                            repetition_penalty=1.1, frequency_penalty=0.2)
    alone = _run_steps(0, [], params, step_logits)
    neighbours = [
        SamplingParams(temperature=1.3),  # unseeded: consumes the shared generator
        SamplingParams(temperature=0.0),
        SamplingParams(seed=777, min_p=0.1),  # same seed, own generator object
        SamplingParams(seed=1, top_k=5, presence_penalty=1.0),
    ]
    torch.manual_seed(0)
    assert _run_steps(2, neighbours, params, step_logits) == alone
    torch.manual_seed(1)
    assert _run_steps(4, neighbours, params, step_logits) == alone
    assert _run_steps(1, neighbours[:1], params, step_logits) == alone
    # The seed matters: another seed gives another sequence (30 draws from ~50 tokens).
    other = SamplingParams(**{**params.to_dict(), "seed": 778})
    assert _run_steps(0, [], other, step_logits) != alone


# ---------------------------------------------------------------- penalties


LOGITS_6 = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]


def _processed(params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    logits = torch.tensor([LOGITS_6])
    batch = _batch([params], 6, prompts=[prompt], outputs=[output], eos_token_ids=())
    return Sampler.process_logits(logits, batch)[0].tolist()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_logit_bias_adds_to_each_rows_own_tokens_only(data: st.DataObject) -> None:
    vocab_size = data.draw(st.integers(2, 40))
    rows = data.draw(st.integers(1, 5))
    logits = torch.tensor(data.draw(st.lists(st.lists(st.floats(-20, 20), min_size=vocab_size, max_size=vocab_size),
                                             min_size=rows, max_size=rows)), dtype=torch.float32)
    biases = [data.draw(st.dictionaries(st.integers(0, vocab_size - 1), st.floats(-100, 100), max_size=6))
              for _ in range(rows)]
    params = [SamplingParams(temperature=0.0, logit_bias=tuple(b.items())) for b in biases]
    batch = _batch(params, vocab_size, eos_token_ids=())
    got = Sampler.process_logits(logits, batch)
    want = logits.clone()
    for row, bias in enumerate(biases):
        for token_id, value in bias.items():
            want[row, token_id] += value
    assert torch.equal(got, want)
    out = Sampler().sample(logits, batch)
    assert out.token_ids == want.argmax(dim=-1).tolist()  # greedy takes the biased argmax


def test_logit_bias_bans_and_forces_but_logprobs_stay_raw() -> None:
    logits = torch.tensor([LOGITS_6, LOGITS_6])
    params = [SamplingParams(temperature=0.0, logit_bias=((3, -100.0),), logprobs=1),
              SamplingParams(temperature=1.0, seed=5, logit_bias=((4, 100.0),), logprobs=1)]
    out = _sample(logits, params, eos_token_ids=())
    assert out.token_ids == [0, 4]  # 3 was the argmax; 4 the least likely
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.logprobs == pytest.approx([raw[0].item(), raw[4].item()])
    assert out.top_logprobs is not None and out.top_logprobs[1][0][0] == 3  # the model's own top token
    drawn = _draw_many(torch.tensor(LOGITS_6), SamplingParams(logit_bias=((1, -100.0), (4, -100.0))), 400, seed=0)
    assert drawn.keys() <= {0, 2, 3, 5} and len(drawn) == 4


def test_logit_bias_comes_before_the_repetition_penalty() -> None:
    got = _processed(SamplingParams(repetition_penalty=2.0, logit_bias=((1, 3.0), (2, -1.0))), prompt=[1, 2], output=[])
    # token 1: (-1 + 3) / 2; token 2: (0.5 - 1) * 2
    assert got == pytest.approx([2.0, 1.0, -1.0, 3.0, -2.0, 1.0], abs=0)


def test_repetition_penalty_hf_semantics_over_prompt_and_output() -> None:
    got = _processed(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[1, 3, 3])
    # seen = {0, 1, 3}, each once however often: positive / 2, negative * 2.
    assert got == pytest.approx([1.0, -2.0, 0.5, 1.5, -2.0, 1.0], abs=0)


def test_repetition_penalty_matches_transformers() -> None:
    import transformers
    logits = torch.randn(2, 30, generator=make_generator(3))
    prompt, output = [[1, 5, 5, 9], [0, 2]], [[9, 11], [29, 2, 2]]
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(repetition_penalty=0.7)]
    got = Sampler.process_logits(logits, _batch(params, 30, prompts=prompt, outputs=output,
                                                eos_token_ids=()))
    for row, p in enumerate(params):
        processor = transformers.RepetitionPenaltyLogitsProcessor(p.repetition_penalty)
        ids = torch.tensor([prompt[row] + output[row]])
        want = processor(ids, logits[row:row + 1].clone())
        torch.testing.assert_close(got[row:row + 1], want, rtol=0, atol=0)


def test_presence_and_frequency_penalties_over_output_only() -> None:
    params = SamplingParams(presence_penalty=0.25, frequency_penalty=0.5)
    got = _processed(params, prompt=[0, 5], output=[1, 3, 3])
    # token 1 once: -1 - 0.5 - 0.25; token 3 twice: 3 - 2 * 0.5 - 0.25; prompt tokens 0, 5 untouched.
    assert got == pytest.approx([2.0, -1.75, 0.5, 1.75, -2.0, 1.0], abs=1e-7)


def test_negative_presence_and_frequency_penalties_reward_repeats() -> None:
    got = _processed(SamplingParams(presence_penalty=-1.0, frequency_penalty=-2.0),
                     prompt=[], output=[4, 4, 4])
    assert got == pytest.approx([2.0, -1.0, 0.5, 3.0, -2.0 + 6.0 + 1.0, 1.0], abs=1e-7)


def test_repetition_then_frequency_then_presence() -> None:
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.25, frequency_penalty=0.5)
    got = _processed(params, prompt=[0], output=[3, 3, 4])
    assert got == pytest.approx(
        [1.0, -1.0, 0.5, 1.5 - 1.0 - 0.25, -4.0 - 0.5 - 0.25, 1.0], abs=1e-7)


def test_penalties_are_per_row_and_change_the_greedy_choice() -> None:
    logits = torch.tensor([LOGITS_6, LOGITS_6])
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0), SamplingParams(temperature=0.0)]
    out = _sample(logits, params, outputs=[[3], [3]], eos_token_ids=())
    # Row 0: token 3 drops to 1.0 so token 0 (2.0) wins; row 1 has no penalty.
    assert out.token_ids == [0, 3]


def test_sampler_does_not_modify_caller_logits() -> None:
    logits = torch.tensor([LOGITS_6])
    before = logits.clone()
    _sample(logits, [SamplingParams(repetition_penalty=2.0, min_tokens=2, temperature=0.5)],
            prompts=[[0, 3]], outputs=[[3]])
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[10.0, 1.0, 2.0, 3.0, 4.0, 9.0]] * 3)  # eos 0 best, stop id 5 second
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(5,))
    out = _sample(logits, [params] * 3, outputs=[[1, 1], [1, 1, 1], []])
    assert out.token_ids == [4, 0, 4]


def test_min_tokens_masks_sampled_rows_too() -> None:
    logits = torch.tensor([[5.0, 5.0, 5.0, 5.0]]).expand(500, -1).contiguous()
    torch.manual_seed(0)
    out = _sample(logits, [SamplingParams(min_tokens=1, stop_token_ids=(2,))] * 500,
                  eos_token_ids=(0, 3))
    assert set(out.token_ids) == {1}


def test_min_tokens_with_ignore_eos_leaves_eos_sampleable() -> None:
    logits = torch.tensor([[10.0, 1.0, 2.0, 3.0, 4.0, 9.0]])
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(5,), ignore_eos=True)
    assert _sample(logits, [params]).token_ids == [0]
    # An out-of-vocabulary stop id can never be sampled, so it is simply not masked.
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(5, 1000))
    assert _sample(logits, [params]).token_ids == [4]


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_with_ordered_top_n() -> None:
    logits = torch.randn(4, 40, generator=make_generator(5))
    params = [
        SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.5, seed=1),
        SamplingParams(),
        SamplingParams(logprobs=0, temperature=0.0),
        SamplingParams(logprobs=20, seed=2),
    ]
    out = _sample(logits, params, prompts=[[1, 2], [], [], []])
    want = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for row, token_id in enumerate(out.token_ids):
        assert out.logprobs[row] == pytest.approx(want[row, token_id].item(), abs=1e-6)
    assert [len(t) for t in out.top_logprobs] == [5, 0, 0, 20]
    for row in (0, 3):
        top = out.top_logprobs[row]
        values, ids = want[row].topk(len(top))
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-6)
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))
    assert out.token_ids[2] == logits[2].argmax().item()


def test_logprobs_from_bf16_logits() -> None:
    logits = torch.randn(2, 16, generator=make_generator(8)).to(torch.bfloat16)
    out = _sample(logits, [SamplingParams(temperature=0.0, logprobs=3)] * 2)
    want = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs == pytest.approx(want.max(dim=-1).values.tolist(), abs=1e-6)


# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
        ("temperature", "1.0"), ("temperature", True),
        ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", float("nan")),
        ("top_k", -2), ("top_k", 1.5), ("top_k", True), ("top_k", "5"),
        ("min_p", -0.01), ("min_p", 1.01),
        ("seed", 1.0), ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", "7"),
        ("presence_penalty", 2.01), ("presence_penalty", -2.01),
        ("frequency_penalty", 2.5), ("frequency_penalty", -3),
        ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
        ("max_tokens", 0), ("max_tokens", 1.0), ("max_tokens", None),
        ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 2.0),
        ("stop_token_ids", (-1,)), ("stop_token_ids", ("a",)), ("stop_token_ids", "12"),
        ("stop_token_ids", 5), ("stop_token_ids", (True,)), ("stop_token_ids", tuple(range(100_000))),
        ("ignore_eos", 1), ("ignore_eos", "yes"),
        ("logprobs", -1), ("logprobs", 21), ("logprobs", 2.0), ("logprobs", False),
        ("logit_bias", {1: 100.5}), ("logit_bias", {-1: 1.0}), ("logit_bias", {1: float("nan")}),
        ("logit_bias", {True: 1.0}), ("logit_bias", {"1": 1.0}), ("logit_bias", ((1, 1.0), (1, 2.0))),
        ("logit_bias", ((1, 1.0, 2.0),)), ("logit_bias", "12"), ("logit_bias", {i: 1.0 for i in range(1025)}),
    ],
)
def test_invalid_parameter_names_itself(name: str, value: object) -> None:
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams(**{name: value})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams.from_dict({name: value})


def test_min_tokens_above_max_tokens_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


def test_boundary_values_are_accepted() -> None:
    for kwargs in [
        {"temperature": 0}, {"top_p": 1.0}, {"top_p": 1e-6}, {"top_k": 0}, {"top_k": -1},
        {"top_k": 1}, {"min_p": 0.0}, {"min_p": 1.0}, {"presence_penalty": -2},
        {"presence_penalty": 2.0}, {"frequency_penalty": -2.0}, {"repetition_penalty": 1e-3},
        {"max_tokens": 1}, {"logprobs": 0}, {"logprobs": 20}, {"seed": 0}, {"seed": -1},
        {"seed": 2**64 - 1}, {"stop_token_ids": [3, 4]},
    ]:
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_from_dict_refuses_unknown_keys_and_non_dicts() -> None:
    with pytest.raises(InvalidRequestError, match="top_q"):
        SamplingParams.from_dict({"top_q": 0.5})
    with pytest.raises(InvalidRequestError, match="dict"):
        SamplingParams.from_dict([("top_p", 0.5)])  # type: ignore[arg-type]


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy
    assert not SamplingParams().is_greedy


def test_round_trips_through_pickle_dict_and_json() -> None:
    params = SamplingParams(temperature=0.3, top_p=0.9, top_k=40, min_p=0.05, seed=2**63,
                            presence_penalty=-0.5, frequency_penalty=1.5, repetition_penalty=1.2,
                            max_tokens=100, min_tokens=3, stop_token_ids=(7, 9), ignore_eos=True,
                            logprobs=4, logit_bias=((9, -100.0), (3, 2.5)))
    assert params.logit_bias == ((3, 2.5), (9, -100.0))  # sorted by token
    assert pickle.loads(pickle.dumps(params)) == params
    assert SamplingParams.from_dict(params.to_dict()) == params
    via_json = SamplingParams.from_dict(json.loads(json.dumps(params.to_dict())))
    assert via_json == params
    assert isinstance(via_json.stop_token_ids, tuple)
    assert hash(via_json) == hash(params)
    assert SamplingParams.from_dict({}) == SamplingParams()


def test_numbers_are_normalised_to_floats() -> None:
    params = SamplingParams(temperature=1, top_p=1, presence_penalty=-2)
    assert isinstance(params.temperature, float) and isinstance(params.top_p, float)
    assert params == SamplingParams(temperature=1.0, top_p=1.0, presence_penalty=-2.0)


# ---------------------------------------------------------------- batch building and misc


def test_make_generator() -> None:
    assert make_generator(None) is None
    a, b = make_generator(42), make_generator(42)
    assert a is not None and b is not None
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))


def test_build_rejects_mismatched_lists_and_bad_token_ids() -> None:
    with pytest.raises(ValueError, match="length"):
        SamplingBatch.build([SamplingParams()], [[]], [], [None], EOS, 10)
    with pytest.raises(InvalidRequestError, match="token ids"):
        SamplingBatch.build([SamplingParams(repetition_penalty=1.1)], [[10]], [[]], [None], EOS, 10)
    with pytest.raises(InvalidRequestError, match="token ids"):
        SamplingBatch.build([SamplingParams(presence_penalty=1)], [[]], [[-1]], [None], EOS, 10)


def test_sample_rejects_logits_of_the_wrong_shape() -> None:
    batch = _batch([SamplingParams()], 10)
    with pytest.raises(ValueError, match="shape"):
        Sampler().sample(torch.zeros(1, 11), batch)
    with pytest.raises(ValueError, match="shape"):
        Sampler().sample(torch.zeros(2, 10), batch)


def test_top_k_larger_than_vocab_is_off() -> None:
    counts = _draw_many(torch.zeros(4), SamplingParams(top_k=1000), num_draws=400, seed=0)
    assert set(counts) == {0, 1, 2, 3}


# ---------------------------------------------------------------- check_stop


@pytest.mark.parametrize(
    ("token_id", "num_output_tokens", "params", "expected"),
    [
        (5, 1, SamplingParams(), None),
        (0, 1, SamplingParams(), "stop"),  # eos
        (2, 1, SamplingParams(), "stop"),  # second eos id
        (0, 1, SamplingParams(ignore_eos=True), None),
        (0, 16, SamplingParams(ignore_eos=True), "length"),
        (7, 3, SamplingParams(stop_token_ids=(7,)), "stop"),
        (7, 3, SamplingParams(stop_token_ids=(7,), ignore_eos=True), "stop"),
        (7, 2, SamplingParams(stop_token_ids=(7,), min_tokens=3), None),  # before min_tokens
        (0, 2, SamplingParams(min_tokens=3), None),
        (0, 3, SamplingParams(min_tokens=3), "stop"),  # exactly min_tokens reached
        (5, 4, SamplingParams(max_tokens=4), "length"),
        (5, 3, SamplingParams(max_tokens=4), None),
        (0, 4, SamplingParams(max_tokens=4), "stop"),  # stop wins on the last step
        (5, 1, SamplingParams(max_tokens=1), "length"),
    ],
)
def test_check_stop(token_id: int, num_output_tokens: int, params: SamplingParams,
                    expected: str | None) -> None:
    assert check_stop(token_id, num_output_tokens, params, (0, 2)) == expected


def test_generator_state_round_trip_continues_the_same_draws() -> None:
    """A seeded request handed to another process continues its random stream exactly."""
    from tandem.engine.sampling import generator_state, restore_generator

    params = SamplingParams(seed=7)
    original = make_generator(7)
    assert original is not None
    torch.rand(5, generator=original)
    copy = restore_generator(params, generator_state(original))
    assert copy is not None
    assert torch.equal(torch.rand(3, generator=original), torch.rand(3, generator=copy))
    assert generator_state(None) == b"" and restore_generator(SamplingParams(), b"") is None


@settings(max_examples=40, deadline=None)
@given(bias=st.dictionaries(st.integers(0, 2**32 - 1), st.floats(-100, 100, width=32), max_size=8),
       seed=st.none() | st.integers(0, 2**64 - 1), logprobs=st.none() | st.integers(0, 20))
def test_params_round_trip_through_the_proto(bias: dict[int, float], seed: int | None, logprobs: int | None) -> None:
    params = SamplingParams(temperature=0.5, seed=seed, logprobs=logprobs, logit_bias=tuple(bias.items()),
                            stop_token_ids=(3,))
    assert sampling_from_proto(sampling_to_proto(params)) == params


# ---------------------------------------------------------------- greedy rows in C


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 40), vocab=st.integers(1, 3000), ties=st.integers(0, 3), masked=st.booleans(),
       scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]), logprobs=st.sampled_from([None, 0]), seed=st.integers(0, 2**31))
def test_plain_greedy_rows_in_c_equal_torch(rows: int, vocab: int, ties: int, masked: bool, scale: float,
                                            logprobs: int | None, seed: int) -> None:
    """Greedy rows nothing processes go to ``Kernels.greedy_rows``: the first largest logit (ties
    at the top of a row too) and its raw log-softmax, as torch's argmax and log_softmax give them,
    over rows of any length, -inf entries and magnitudes from 1e-3 to 1e4."""
    kernels = ggml_kernels.require()
    gen = make_generator(seed)
    logits = torch.randn(rows, vocab, generator=gen) * scale
    for row in range(rows):
        top = logits[row].max()
        for col in torch.randint(0, vocab, (ties,), generator=gen).tolist():
            logits[row, col] = top
        if masked and vocab > 1:
            logits[row, torch.randint(0, vocab, (vocab // 3,), generator=gen)] = float("-inf")
            logits[row, int(logits[row].argmax())] = top  # one finite value at least
    want_ids = logits.argmax(dim=-1)
    want_lp = torch.log_softmax(logits, dim=-1).gather(1, want_ids.unsqueeze(1)).squeeze(1)
    chosen = kernels.greedy_rows(logits, logprobs is not None)
    assert chosen is not None
    assert chosen[0] == want_ids.tolist()
    out = _sample(logits, [SamplingParams(temperature=0.0, logprobs=logprobs)] * rows)
    assert out.token_ids == want_ids.tolist()
    if logprobs is None:
        assert chosen[1] is None and out.logprobs is None and out.top_logprobs is None
    else:
        assert chosen[1] == pytest.approx(want_lp.tolist(), rel=1e-5, abs=1e-5)
        assert out.logprobs == pytest.approx(want_lp.tolist(), rel=1e-5, abs=1e-5)
        assert out.top_logprobs == [[] for _ in range(rows)]


def test_a_nan_row_leaves_the_batch_to_torch() -> None:
    kernels = ggml_kernels.require()
    logits = torch.randn(3, 64, generator=make_generator(4))
    logits[1, 17] = float("nan")
    assert kernels.greedy_rows(logits, True) is None
    out = _sample(logits, [SamplingParams(temperature=0.0, logprobs=0)] * 3)
    assert out.token_ids == logits.argmax(dim=-1).tolist()  # torch's argmax takes the NaN
    assert out.token_ids[1] == 17


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, logit_bias=((3, 5.0),)),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, frequency_penalty=0.5),
    SamplingParams(temperature=0.0, presence_penalty=0.5),
    SamplingParams(temperature=0.0, min_tokens=4),
    SamplingParams(temperature=0.0, logprobs=2),
    SamplingParams(temperature=0.7, seed=3),
])
def test_rows_something_processes_stay_on_torch(params: SamplingParams, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bias, a penalty, a ``min_tokens`` mask, top logprobs or a random row: the C call is
    never made (it would answer the raw logits' argmax)."""
    ggml_kernels.require()

    def refuse(*args: object) -> None:
        raise AssertionError("greedy_rows called for a batch it cannot answer")

    monkeypatch.setattr(ggml_kernels.Kernels, "greedy_rows", refuse)
    logits = torch.randn(2, 32, generator=make_generator(9))
    out = _sample(logits, [params, SamplingParams(temperature=0.0)], prompts=[[1, 2], [3]], outputs=[[4], [5]])
    assert len(out.token_ids) == 2
