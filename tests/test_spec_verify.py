"""Speculative decoding's parts on their own: n-gram lookup, settings, adaptive k, and verification.

The statistical test draws 20,000 two-token outputs through `verify` from a target over a 5-token
vocabulary whose second token depends on the first, and compares their joint distribution with the
target's by a chi-square test; a deliberately wrong acceptance rule must fail the same test.
"""

import pytest
import torch

from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.spec import Draft, SpeculativeConfig
from pagedkv.engine.spec import verify as verify_module
from pagedkv.engine.spec.controller import AdaptiveK, expected_tokens
from pagedkv.engine.spec.ngram import lookup
from pagedkv.engine.spec.speculator import pad
from pagedkv.errors import ConfigError

V = 5


def test_ngram_lookup_takes_the_latest_match_of_the_longest_suffix():
    assert lookup([1, 2, 3, 4, 5, 1, 2, 3], 3, 2, 4) == [4, 5, 1]
    assert lookup([7, 1, 2, 8, 9, 1, 2, 6, 3, 1, 2], 2, 1, 2) == [6, 3]  # the latest of two matches
    assert lookup([1, 2, 3, 9, 2, 3], 4, 3, 3) == []  # no earlier run of the last 3 tokens
    assert lookup([1, 2, 3, 9, 2, 3], 4, 2, 3) == [9, 2, 3]  # falls back to n = 2
    assert lookup([4, 4], 3, 1, 2) == [4]  # the proposal stops where the tokens end


def test_speculative_config_parses_strings_and_names_bad_values():
    assert SpeculativeConfig.build("ngram:k=6,min=1,max=3") == SpeculativeConfig(
        "ngram", num_speculative_tokens=6, prompt_lookup_min=1, prompt_lookup_max=3)
    draft = SpeculativeConfig.build("draft:model=default,layers=8,adaptive=off")
    assert (draft.draft_model, draft.draft_layers, draft.adaptive) == ("default", 8, False)
    assert SpeculativeConfig.build({"method": "ngram", "num_speculative_tokens": 2}).num_speculative_tokens == 2
    for bad, message in [("medusa", "unknown"), ("ngram:k=0", "positive"), ("ngram:min=4,max=2", "larger"),
                         ("draft", "needs a draft model"), ("ngram:foo=1", "KEY=VALUE"), ("ngram:k=x", "number"),
                         ({"method": "ngram", "k": 3}, "unknown speculative option")]:
        with pytest.raises(ConfigError, match=message):
            SpeculativeConfig.build(bad)


def test_adaptive_k_drafts_more_when_acceptance_is_high_and_pauses_under_load():
    adaptive = AdaptiveK(SpeculativeConfig(num_speculative_tokens=8, max_batch_size=32))
    ks = {}
    for a in (0.05, 0.5, 0.95):
        adaptive.acceptance[1] = a
        ks[a] = adaptive.num_tokens(1, batch_size=1)
    assert ks[0.05] <= 1 < ks[0.5] < ks[0.95] == 8
    adaptive.acceptance[1] = 0.95
    assert adaptive.num_tokens(1, batch_size=32) == 0  # max_batch_size: nobody drafts
    assert adaptive.num_tokens(1, batch_size=16) < 8  # verify tokens cost more in a larger batch
    adaptive.acceptance[2] = 0.0
    assert adaptive.num_tokens(2, 8) == 0 and adaptive.acceptance[2] > 0  # paused, drifting back to probe
    adaptive.record(3, 4, 4)
    assert adaptive.acceptance[3] > 0.6
    # a draft model as costly as 0.8 of the target pays only at very high acceptance
    costly = AdaptiveK(SpeculativeConfig(num_speculative_tokens=4), draft_token_cost=0.8)
    costly.acceptance.update({1: 0.6, 2: 0.98})
    assert costly.num_tokens(1, 1) == 0 and costly.num_tokens(2, 1) > 0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75) and expected_tokens(1.0, 3) == 4


def test_greedy_verify_keeps_the_matching_prefix_and_the_target_token():
    logits = torch.full((4, V), -1.0)
    for row, best in enumerate([2, 3, 0, 4]):
        logits[row, best] = 1.0
    greedy = SamplingParams(temperature=0)
    assert verify_module.verify(logits, Draft([2, 3, 1]), greedy, None) == [2, 3, 0]
    assert verify_module.verify(logits, Draft([2, 3, 0]), greedy, None) == [2, 3, 0, 4]
    assert verify_module.verify(logits, Draft([1, 3, 0]), greedy, None) == [2]
    assert verify_module.verify(logits[:1], Draft([]), greedy, None) == [2]


def test_padding_a_draft_adds_deterministic_tokens():
    probs = torch.tensor([[0.5, 0.5, 0, 0, 0]])
    padded = pad(Draft([1], probs), 3, last_token=4)
    assert padded.token_ids == [1, 1, 1] and padded.probs[1:, 1].tolist() == [1.0, 1.0]
    assert pad(Draft([]), 2, last_token=4).token_ids == [4, 4]


# ------------------------------------------------------------------------------------------------
# exactness of rejection sampling
TARGET_FIRST = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
DRAFT_FIRST = torch.tensor([0.3, 0.1, 0.3, 0.1, 0.2])


def target_second(first: int) -> torch.Tensor:
    """The target's distribution of the second token after `first` (a different one for each)."""
    return torch.roll(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]), first)


def draft_second(first: int) -> torch.Tensor:
    return torch.roll(torch.tensor([0.1, 0.1, 0.4, 0.2, 0.2]), 2 * first)


def sample_pairs(num_samples: int, deterministic: bool, generator: torch.Generator) -> torch.Tensor:
    """num_samples two-token outputs of one verify step each; returns counts [V, V] of (first, second)."""
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(V, V)
    for _ in range(num_samples):
        if deterministic:  # an n-gram's guess: a fixed draft, probability 1
            tokens, probs = [1, 1], None
        else:  # a draft model samples from its own distribution
            first = int(torch.multinomial(DRAFT_FIRST, 1, generator=generator))
            second = int(torch.multinomial(draft_second(first), 1, generator=generator))
            tokens, probs = [first, second], torch.stack([DRAFT_FIRST, draft_second(first)])
        # the target's rows after the context, after draft[:1] and after draft[:2]
        logits = torch.stack([TARGET_FIRST, target_second(tokens[0]), torch.full((V,), 0.2)]).log()
        out = verify_module.verify(logits, Draft(tokens, probs), params, generator)
        if len(out) == 1:  # the first drafted token was rejected: the second token comes from the next step
            out.append(int(torch.multinomial(target_second(out[0]), 1, generator=generator)))
        counts[out[0], out[1]] += 1
    return counts


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat.double() / 2))


def joint_target() -> torch.Tensor:
    return torch.stack([TARGET_FIRST[f] * target_second(f) for f in range(V)])


@pytest.fixture
def one_thread():
    """Tens of thousands of tiny tensor ops: a second thread only adds hand-over latency."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("deterministic", [False, True], ids=["draft-model", "ngram"])
def test_rejection_sampling_outputs_follow_the_target_distribution(deterministic):
    counts = sample_pairs(20_000, deterministic, torch.Generator().manual_seed(0))
    assert chi_square_p_value(counts, joint_target()) > 0.01


@pytest.mark.usefixtures("one_thread")
def test_a_wrong_acceptance_rule_fails_the_same_test(monkeypatch):
    # keeping a drafted token with probability p(x), as if every draft were deterministic, ignores q
    monkeypatch.setattr(verify_module, "acceptance_probability", lambda p_x, q_x: p_x)
    counts = sample_pairs(20_000, False, torch.Generator().manual_seed(0))
    assert chi_square_p_value(counts, joint_target()) < 0.01
