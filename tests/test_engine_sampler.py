"""Sampling: top-k and top-p masks, seeds, and greedy rows, on hand-made logits."""

import pytest
import torch

from pagedkv.engine.sampler import Sampler, apply_top_k_top_p
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.sequence import Sequence
from pagedkv.errors import ConfigError

LOGITS = torch.log(torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15]))  # probabilities, in vocabulary order


def kept(mask_logits: torch.Tensor) -> list[int]:
    return torch.isfinite(mask_logits).nonzero().flatten().tolist()


def test_top_k_keeps_the_k_most_likely_tokens():
    assert kept(apply_top_k_top_p(LOGITS, 2, 1.0)) == [1, 3]
    assert kept(apply_top_k_top_p(LOGITS, 0, 1.0)) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("top_p, expected", [(0.4, [1]), (0.5, [1, 3]), (0.7, [1, 3]), (0.71, [1, 3, 4]), (1.0, [0, 1, 2, 3, 4])])
def test_top_p_keeps_the_smallest_nucleus_reaching_p(top_p, expected):
    assert kept(apply_top_k_top_p(LOGITS, 0, top_p)) == expected


def seq(params: SamplingParams, i: int = 0) -> Sequence:
    return Sequence(f"r{i}", i, [1, 2, 3], params)


def test_seeded_rows_repeat_and_greedy_rows_take_the_argmax():
    logits = torch.stack([LOGITS, LOGITS, LOGITS])
    sampler = Sampler()
    draws = []
    for _ in range(2):
        seqs = [seq(SamplingParams(temperature=1.0, seed=7), 0), seq(SamplingParams(), 1),
                seq(SamplingParams(temperature=1.0, seed=8), 2)]
        draws.append([sampler.sample(logits, seqs).tolist() for _ in range(20)])
    assert draws[0] == draws[1]  # same seeds, same draws
    assert all(row[1] == 1 for row in draws[0])  # greedy
    assert len({row[0] for row in draws[0]}) > 1  # sampled rows do vary from step to step


def test_sampled_frequencies_follow_the_tempered_distribution():
    s = seq(SamplingParams(temperature=2.0, seed=0))
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[int(Sampler().sample(LOGITS[None], [s])[0])] += 1
    expected = torch.softmax(LOGITS / 2.0, -1)
    assert torch.allclose(counts / counts.sum(), expected, atol=0.03)


def test_bad_sampling_values_are_refused():
    for kwargs in ({"temperature": -0.1}, {"top_p": 1.5}, {"top_k": -2}, {"max_tokens": 0}, {"stop": [""]}):
        with pytest.raises(ConfigError):
            SamplingParams(**kwargs)
    assert SamplingParams(stop="x").stop == ("x",)


@pytest.mark.parametrize("top_p", [1e-300, 5e-324])
def test_a_top_p_below_float32_keeps_the_most_likely_token(top_p):
    assert kept(apply_top_k_top_p(LOGITS, 0, top_p)) == [1]


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-6])
def test_a_temperature_too_small_to_divide_by_samples_greedily(temperature):
    logits = torch.stack([LOGITS * 30, LOGITS])  # large logits overflow first
    tokens = Sampler().sample(logits, [seq(SamplingParams(temperature=temperature), i) for i in range(2)])
    assert tokens.tolist() == [1, 1]


@pytest.mark.parametrize("seed", [-2**63, 2**64 - 1])
def test_every_64_bit_seed_draws(seed):
    assert Sampler().sample(LOGITS[None], [seq(SamplingParams(temperature=1.0, seed=seed))]).shape == (1,)


@pytest.mark.parametrize("seed", [-2**63 - 1, 2**64, -183659161599 * 10**9])
def test_a_seed_past_64_bits_is_refused(seed):
    with pytest.raises(ConfigError, match="seed"):
        SamplingParams(seed=seed)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf")])
def test_a_temperature_that_is_not_a_finite_number_is_refused(temperature):
    with pytest.raises(ConfigError, match="temperature"):
        SamplingParams(temperature=temperature)
