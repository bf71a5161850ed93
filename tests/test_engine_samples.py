"""Parallel sampling (SamplingParams.n): the samples fork from the prompt after its prefill and share its blocks
by reference count; each draws with its own seed, so sample i equals a request of n=1 seeded with seed + i."""

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.errors import ConfigError

PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"


@pytest.fixture(scope="module")
def llm(smollm2):
    model, tokenizer = smollm2
    return LLM(model, tokenizer=tokenizer, num_blocks=64, block_size=4, prefix_caching=False)


def test_four_samples_hold_the_prompt_blocks_once(llm):
    engine, pool = llm.engine, llm.engine.cache.pool
    num_prompt = len(llm.tokenizer(PROMPT).input_ids)
    assert num_prompt % 4, "the prompt ends in a partial block: the samples copy it on their first write"
    params = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    engine.add_request(PROMPT, params, request_id="four")
    while len(engine.scheduler.running) < 4:
        engine.step()
    samples = engine.scheduler.running
    tables = [engine.cache.block_table(s.seq_id) for s in samples]
    # forked: one set of prompt blocks, each referenced by the four samples
    assert all(t == tables[0] for t in tables) and len(tables[0]) == -(-num_prompt // 4)
    assert pool.num_used == len(tables[0]) and all(pool.ref_cnt[b] == 4 for b in tables[0])
    engine.step()  # each sample writes its first token
    tables = [engine.cache.block_table(s.seq_id) for s in samples]
    full = num_prompt // 4
    assert all(t[:full] == tables[0][:full] for t in tables) and all(pool.ref_cnt[b] == 4 for b in tables[0][:full])
    assert len({t[full] for t in tables}) == 4  # the partial block: the original and three copies
    assert pool.num_used == full + 4 * (-(-(num_prompt + 1) // 4) - full) < 4 * len(tables[0])
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert pool.num_used == 0 and engine.cache.seqs == {}
    (out,) = outs
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and all(c.finish_reason == "length" for c in out.outputs)
    singles = llm.generate([PROMPT] * 4, [params.for_sample(i) for i in range(4)])
    assert [c.text for c in out.outputs] == [s.text for s in singles]
    assert len({c.text for c in out.outputs}) > 1  # the seeds differ, and so do the samples


def test_samples_stop_on_their_own_and_abort_together(llm):
    engine = llm.engine
    (out,) = llm.generate(PROMPT, SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5, stop=[","]))
    assert len(out.outputs) == 3 and all("," not in c.text for c in out.outputs)
    assert all(c.finish_reason == "length" or c.stop_reason == "," for c in out.outputs)
    engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=30, ignore_eos=True), request_id="gone")
    for _ in range(4):
        engine.step()
    assert len(engine.scheduler.running) == 3
    aborted = engine.abort("gone")
    assert [c.finish_reason for c in aborted.outputs] == ["abort"] * 3 and aborted.finished
    assert engine.cache.pool.num_used == 0 and not engine.has_unfinished()


def test_n_out_of_range_is_refused():
    for n in (0, -1, 129, 2.0):
        with pytest.raises(ConfigError, match="n="):
            SamplingParams(n=n)
