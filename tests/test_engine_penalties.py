"""Penalties on the device (presence, frequency, repetition, min_tokens, logit_bias): the batched device code
equals a plain per-token reference, and the engine's greedy outputs equal a transformers loop applying it."""

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.engine.penalties import apply_penalties, record_tokens
from pagedkv.errors import ConfigError

EOS = 2


class Seq:  # what apply_penalties reads of an engine Sequence
    def __init__(self, prompt, output, params):
        self.prompt_token_ids, self.output_token_ids, self.params = prompt, output, params
        self.num_output_tokens, self.penalties = len(output), None


def reference(row: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    out = []
    for t, x in enumerate(row):
        n = output.count(t)
        if p.repetition_penalty != 1 and (n or t in prompt):
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        x -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
        x += dict(p.logit_bias).get(t, 0.0)
        if len(output) < p.min_tokens and (t in p.stop_token_ids or (t == EOS and not p.ignore_eos)):
            x = float("-inf")
        out.append(x)
    return out


def test_device_penalties_equal_the_per_token_reference():
    torch.manual_seed(0)
    vocab = 40
    params = [SamplingParams(),  # no penalty: its row is left alone
              SamplingParams(presence_penalty=0.7, frequency_penalty=-0.3, repetition_penalty=1.3,
                             logit_bias={5: 3.0, 7: -100}),
              SamplingParams(repetition_penalty=0.8, min_tokens=4, stop_token_ids=[9]),
              SamplingParams(min_tokens=2, ignore_eos=True, frequency_penalty=2)]
    prompts = [[1, 3], [3, 4, 5], [6, 6, 10], [11]]
    outputs = [[], [], [], []]
    seqs = [Seq(p, o, sp) for p, o, sp in zip(prompts, outputs, params)]
    for _ in range(5):  # five steps: the counts on the device follow the sampled tokens
        logits = torch.randn(4, vocab) * 3
        got = apply_penalties(logits, seqs, {EOS})
        expected = torch.tensor([reference(logits[i].tolist(), prompts[i], outputs[i], params[i]) for i in range(4)])
        assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
        assert torch.equal(got[0], logits[0])
        tokens = torch.randint(0, vocab, (4,))
        tokens[1] = 3  # a token of the prompt, again and again
        record_tokens(tokens, seqs)
        for i, t in enumerate(tokens.tolist()):
            outputs[i].append(t)
            seqs[i].num_output_tokens += 1


@pytest.fixture(scope="module")
def llm(smollm2):
    model, tokenizer = smollm2
    return LLM(model, tokenizer=tokenizer, num_blocks=64, block_size=8)


def test_engine_greedy_with_penalties_equals_a_transformers_loop(llm, smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("The cat sat on the mat. The cat sat on the").input_ids
    params = SamplingParams(max_tokens=8, presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.2,
                            logit_bias={tokenizer(" mat").input_ids[0]: -100})
    (out,) = llm.generate(ids, params)
    tokens = list(ids)
    eos = set(llm.engine.eos_token_ids)
    with torch.no_grad():
        for _ in range(8):
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
            row = reference(logits.tolist(), ids, tokens[len(ids):], params)
            tokens.append(max(range(len(row)), key=row.__getitem__))
            if tokens[-1] in eos:
                break
    assert out.outputs[0].token_ids == tokens[len(ids):]
    plain = llm.generate(ids, SamplingParams(max_tokens=8))[0]
    assert plain.outputs[0].token_ids != out.outputs[0].token_ids  # the penalties changed something


def test_min_tokens_holds_back_the_end_of_sequence(llm):
    eos = min(llm.engine.eos_token_ids)
    (out,) = llm.generate("Hello", SamplingParams(max_tokens=10, min_tokens=5, logit_bias={eos: 100}))
    assert out.outputs[0].token_ids == out.outputs[0].token_ids[:5] + [eos] and len(out.outputs[0].token_ids) == 6
    assert out.outputs[0].finish_reason == "stop"


def test_samples_keep_their_own_penalty_counts(llm):
    params = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=4, frequency_penalty=2)
    samples = llm.generate("Hello", params)
    singles = llm.generate(["Hello"] * 2, [params.for_sample(i) for i in range(2)])
    assert [c.token_ids for c in samples[0].outputs] == [s.outputs[0].token_ids for s in singles]


@pytest.mark.parametrize("field, value", [("presence_penalty", 3), ("frequency_penalty", -2.5),
                                          ("repetition_penalty", 0), ("min_tokens", -1),
                                          ("logit_bias", {1: 200}), ("logit_bias", {"x": 1})])
def test_bad_penalties_are_refused(field, value):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**{field: value})


def test_extreme_values_in_range_keep_the_logits_finite_and_sampling_defined():
    """A repetition penalty of 5e-324 and a temperature of 1e-300 are in range; dividing by them overflowed
    a logit to inf, the softmax to nan, and torch.multinomial raised inside the engine (found by the server
    fuzz test). The logits stay finite and a token is sampled."""
    from pagedkv.engine.sampler import Sampler

    torch.manual_seed(1)
    seqs = [Seq([1, 3], [], SamplingParams(repetition_penalty=5e-324, temperature=1e-300)),
            Seq([4], [], SamplingParams(repetition_penalty=5e-324, temperature=1.0))]
    logits = torch.randn(2, 16) * 3
    logits[0, 3] = logits[1, 4] = 5.0   # repeated (prompt) tokens with positive logits
    penalized = apply_penalties(logits, seqs, {EOS})
    assert torch.isfinite(penalized).all()
    for s in seqs:
        s.generator = None
        s.output_token_ids = []
    tokens = Sampler({EOS}).sample(logits, seqs)
    assert tokens.tolist() == [3, 4]   # the penalty made them overwhelmingly likely
