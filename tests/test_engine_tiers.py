"""The engine's prefix cache over the host and disk tiers, with SmolLM2: greedy outputs are the same whichever
tier a prefix came from (the device, host memory, disk after a restart, or a recompute), for every page
format; preempted requests swap to the host tier; a full disk only turns the disk tier off."""

import errno
import os
import warnings

import pytest

from pagedkv import LLM, SamplingParams

PARAGRAPH = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
             "in want of a wife. However little known the feelings or views of such a man may be on his first "
             "entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that "
             "he is considered the rightful property of some one or other of their daughters. ")
CHUNK = 128  # the prefill chunk: a recompute splits the prompt where the cached prefix ends
PARAMS = SamplingParams(max_tokens=6)


@pytest.fixture(scope="module")
def prompts(model_and_tokenizer):
    ids = model_and_tokenizer[1](PARAGRAPH * 4).input_ids
    return ids[:CHUNK + 5], ids[40:40 + CHUNK + 5]  # 8 full blocks and 5 tokens each; no common prefix


def make_llm(model_and_tokenizer, **options):
    model, tokenizer = model_and_tokenizer
    return LLM(model, tokenizer=tokenizer, max_num_batched_tokens=CHUNK, **options)


def tier_hits(llm, before=None):
    stats = llm.stats()
    hits = {k: stats[f"tier_{k}_hits"] for k in ("gpu", "host", "disk")}
    return {k: v - (before or {}).get(k, 0) for k, v in hits.items()}


@pytest.mark.parametrize("kv_format", ["off", "q8", "q6", "q4", "turboquant"])
def test_greedy_output_is_the_same_from_every_tier(model_and_tokenizer, prompts, tmp_path, kv_format):
    prompt, other = prompts
    # 10 blocks: the other prompt's 9 evict all but one of the first prompt's blocks from the device
    llm = make_llm(model_and_tokenizer, kv_format=kv_format, num_blocks=10, cpu_cache_gb=0.05,
                   kv_cache_dir=str(tmp_path))
    recomputed = llm.generate(prompt, PARAMS)[0].token_ids
    assert tier_hits(llm) == {"gpu": 0, "host": 0, "disk": 0}

    from_device = llm.generate(prompt, PARAMS)[0].token_ids
    hits = tier_hits(llm)
    assert hits == {"gpu": 8, "host": 0, "disk": 0}

    llm.generate(other, PARAMS)
    from_host = llm.generate(prompt, PARAMS)[0].token_ids
    hits_host = tier_hits(llm, hits)
    assert hits_host["host"] >= 7 and hits_host["gpu"] + hits_host["host"] == 8 and hits_host["disk"] == 0
    llm.engine.prefix.close()  # what a server does on shutdown: the disk writes finish

    restarted = make_llm(model_and_tokenizer, kv_format=kv_format, num_blocks=10, kv_cache_dir=str(tmp_path))
    from_disk = restarted.generate(prompt, PARAMS)[0].token_ids
    assert tier_hits(restarted) == {"gpu": 0, "host": 0, "disk": 8}
    assert restarted.stats()["prefix_cache_hit_tokens"] == 8 * 16

    assert from_device == recomputed and from_host == recomputed and from_disk == recomputed
    assert llm.stats()["blocks_used"] == 0 and restarted.stats()["blocks_used"] == 0


def test_preempted_requests_swap_to_the_host_tier(model_and_tokenizer, prompts):
    short = [p[:24] for p in prompts]  # 2 blocks each
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    alone = [make_llm(model_and_tokenizer, num_blocks=32, prefix_caching=False).generate(p, params)[0].token_ids
             for p in short]
    # 6 blocks hold both prompts, not both requests at 64 tokens (4 blocks each): one is preempted and its
    # blocks go to the host tier, from where readmission loads those the other request reused meanwhile
    # (admitted without headroom, so that they grow into each other)
    llm = make_llm(model_and_tokenizer, num_blocks=6, cpu_cache_gb=0.05, swap_on_preemption=True,
                   admission_lookahead_tokens=0)
    outputs = [o.token_ids for o in llm.generate(short, params)]
    stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["tier_host_hits"] > 0
    assert outputs == alone
    assert stats["blocks_used"] == 0
    recomputing = make_llm(model_and_tokenizer, num_blocks=6, cpu_cache_gb=0.05,  # the option off
                           admission_lookahead_tokens=0)
    assert [o.token_ids for o in recomputing.generate(short, params)] == alone
    assert recomputing.stats()["preemptions"] > 0 and recomputing.stats()["tier_host_hits"] == 0


def test_a_full_disk_turns_the_disk_tier_off_and_serving_goes_on(model_and_tokenizer, prompts, tmp_path, monkeypatch):
    prompt, other = prompts
    llm = make_llm(model_and_tokenizer, num_blocks=32, kv_cache_dir=str(tmp_path))

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = llm.generate(prompt, PARAMS)[0]
        llm.engine.prefix.disk.flush()
        second = llm.generate([other, prompt], PARAMS)
        llm.engine.prefix.disk.flush()
    messages = [str(w.message) for w in caught if "disk tier" in str(w.message)]
    assert len(messages) == 1 and "the disk is full" in messages[0]
    assert llm.stats()["tier_disk_enabled"] is False
    assert first.outputs[0].finish_reason == "length"
    assert [o.outputs[0].finish_reason for o in second] == ["length", "length"]
    assert second[1].token_ids == first.token_ids
