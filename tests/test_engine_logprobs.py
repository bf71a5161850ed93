"""Log-probabilities from the engine: the model's own log-softmax of each prompt and generated token, whatever
the chunking of the prefill, the sampling settings or the prefix cache."""

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.errors import ConfigError

PROMPT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
          "want of a wife.")


def reference_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids) - 1, vocab]: transformers' own log-softmax predicting token_ids[1:]."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, :-1].float()
    return logits.log_softmax(-1)


@pytest.fixture(scope="module")
def llm(smollm2):
    model, tokenizer = smollm2
    # chunks of 8 tokens: a prompt's log-probabilities come from several forward passes
    return LLM(model, tokenizer=tokenizer, max_num_batched_tokens=8, num_blocks=64, block_size=4)


def assert_entries_match(entries, token_ids, ref, num_top):
    assert [e.token_id for e in entries] == token_ids
    for e, row in zip(entries, ref):
        assert abs(e.logprob - row[e.token_id].item()) < 1e-4
        top = row.topk(num_top)
        assert [t for t, _ in e.top] == top.indices.tolist()
        assert torch.allclose(torch.tensor([lp for _, lp in e.top]), top.values, atol=1e-4)


def test_prompt_and_output_logprobs_equal_transformers_log_softmax(llm, smollm2):
    params = SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2, temperature=0.7, top_k=5, seed=1)
    (out,) = llm.generate(PROMPT, params)
    prompt_ids, output_ids = out.prompt_token_ids, out.outputs[0].token_ids
    assert len(prompt_ids) > 16 and len(output_ids) == 6
    ref = reference_logprobs(smollm2[0], prompt_ids + output_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt_ids)
    assert_entries_match(out.prompt_logprobs[1:], prompt_ids[1:], ref[:len(prompt_ids) - 1], 2)
    # temperature and top-k change which token is drawn, not the log-probabilities reported
    assert_entries_match(out.outputs[0].logprobs, output_ids, ref[len(prompt_ids) - 1:], 3)


def test_prompt_logprobs_are_computed_even_when_the_prefix_is_cached(llm):
    plain = SamplingParams(max_tokens=1)
    llm.generate(PROMPT, plain)  # its full blocks now sit in the prefix cache
    hits = llm.stats()["prefix_cache_hits"]
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert llm.stats()["prefix_cache_hits"] == hits
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[1].top == []
    assert out.outputs[0].logprobs is None
    assert llm.stats()["blocks_used"] == 0


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_out_of_range_are_refused(field):
    for value in (-1, 21, 1.5):
        with pytest.raises(ConfigError, match=field):
            SamplingParams(**{field: value})
