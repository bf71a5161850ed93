"""transformers integration: paged cache vs DynamicCache, token for token, on real and tiny models."""

import warnings

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import pagedkv
from pagedkv import PagedKVCache, install_paged_kv_cache
from pagedkv.hf import cache_kwarg
from pagedkv.ops import PagedKVFallbackWarning

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "List three primary colors.",
    "How do plants make food from sunlight?",
]


def chat_ids(tok, prompt):
    return tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)["input_ids"]


def greedy(model, ids, cache, n, attention_mask=None):
    out = model.generate(ids, attention_mask=attention_mask if attention_mask is not None else torch.ones_like(ids),
                         max_new_tokens=n, do_sample=False, output_scores=True, return_dict_in_generate=True,
                         pad_token_id=0, min_new_tokens=n, **{cache_kwarg(model): cache})
    logprobs = torch.stack([s.float().log_softmax(-1) for s in out.scores], dim=1)  # [B, n, vocab]
    return out.sequences, logprobs


def max_diff(a, b):
    """Largest |a - b| over finite entries; both must mask the same tokens (-inf from logits processors)."""
    finite = torch.isfinite(a)
    assert torch.equal(finite, torch.isfinite(b))
    return (a[finite] - b[finite]).abs().max().item()


def tiny_model(kind):
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, head_dim=16)
    if kind == "qwen3":
        cfg = AutoConfig.for_model("qwen3", **common)
    elif kind == "mistral":
        cfg = AutoConfig.for_model("mistral", sliding_window=7, **common)
    elif kind == "gemma2":
        cfg = AutoConfig.for_model("gemma2", sliding_window=6, attn_logit_softcapping=3.0,
                                   final_logit_softcapping=None, query_pre_attn_scalar=16, **common)
    else:
        raise AssertionError(kind)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    return model


def test_transformers_version_is_in_declared_range():
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    assert (major, minor) >= (5, 17) and major == 5


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_128_tokens_equal_dynamic_cache_on_smollm2(smollm2, prompt):
    model, tok = smollm2
    ids = chat_ids(tok, prompt)
    with torch.inference_mode():
        ref_seq, ref_lp = greedy(model, ids, DynamicCache(), 128)
        paged_model = model  # switching is per model; the reference ran first on the same weights
        cache = install_paged_kv_cache(paged_model)
        seq, lp = greedy(paged_model, ids, cache, 128)
    assert torch.equal(seq, ref_seq)
    assert max_diff(lp, ref_lp) <= 1e-3
    stats = cache.paged_stats()
    assert stats["paged_attention_calls"] == 30 * 128
    assert stats["tokens"] == ids.shape[1] + 127  # the last sampled token is never fed back


def test_padded_batch_of_three_equals_dynamic_cache_on_smollm2(smollm2):
    model, tok = smollm2
    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in ["Hi!", "Give me a long list of fruits and their colors.", PROMPTS[2]]]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert len(set(enc.attention_mask.sum(1).tolist())) == 3  # three different lengths
    n = 128 if pytest.run_slow else 24
    with torch.inference_mode():
        ref_seq, ref_lp = greedy(model, enc.input_ids, DynamicCache(), n, enc.attention_mask)
        cache = install_paged_kv_cache(model)
        seq, lp = greedy(model, enc.input_ids, cache, n, enc.attention_mask)
    assert torch.equal(seq, ref_seq)
    assert max_diff(lp, ref_lp) <= 1e-3
    # padding never occupies page slots
    real = enc.attention_mask.sum(1).tolist()
    assert [cache.seq_len(s) for s in cache.batch_seq_ids] == [r + n - 1 for r in real]


def test_step_by_step_forward_matches_dynamic_cache(smollm2):
    model, tok = smollm2
    ids = chat_ids(tok, PROMPTS[0])
    key = cache_kwarg(model)
    with torch.inference_mode():
        caches = {"dynamic": DynamicCache(), "paged": None}
        logits = {}
        for name in caches:
            cache = caches[name] if name == "dynamic" else install_paged_kv_cache(model, block_size=8, num_blocks=64)
            out = model(ids, **{key: cache})
            steps = [out.logits[:, -1]]
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(6):
                out = model(token, **{key: cache})
                steps.append(out.logits[:, -1])
                token = out.logits[:, -1:].argmax(-1)
            logits[name] = torch.cat(steps)
    assert (logits["paged"] - logits["dynamic"]).abs().max().item() < 1e-3


@pytest.mark.parametrize("kind", ["qwen3", "mistral", "gemma2"])
def test_tiny_models_match_dynamic_cache(kind):
    model = tiny_model(kind)
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding in row 1
    with torch.inference_mode():
        ref_seq, ref_lp = greedy(model, ids, DynamicCache(config=model.config), 20, mask)
        cache = install_paged_kv_cache(model, block_size=4, num_blocks=64)
        seq, lp = greedy(model, ids, cache, 20, mask)
    assert torch.equal(seq, ref_seq)
    assert max_diff(lp, ref_lp) <= 1e-4
    assert cache.paged_stats()["paged_attention_calls"] == 3 * 20


def test_sliding_window_and_softcap_reach_the_paged_attention():
    """Gemma-2's layers pass a sliding window and a softcap; with them ignored, outputs would differ."""
    model = tiny_model("gemma2")
    ids = torch.randint(3, 128, (1, 30))
    with torch.inference_mode():
        ref = model(ids, **{cache_kwarg(model): DynamicCache(config=model.config)}).logits
        cache = install_paged_kv_cache(model, block_size=4, num_blocks=64)
        got = model(ids, **{cache_kwarg(model): cache}).logits
        model.config.sliding_window = 1000
        for layer in model.model.layers:
            layer.self_attn.sliding_window = 1000 if layer.self_attn.sliding_window else None
        cache2 = install_paged_kv_cache(model, block_size=4, num_blocks=64)
        no_window = model(ids, **{cache_kwarg(model): cache2}).logits
    assert (got - ref).abs().max().item() < 1e-4
    assert (no_window - ref).abs().max().item() > 1e-3


def test_unswitched_model_gets_dense_fallback_with_warning():
    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (1, 9))
    with torch.inference_mode():
        ref_seq, ref_lp = greedy(model, ids, DynamicCache(config=model.config), 8)
        cache = PagedKVCache(block_size=4, num_blocks=32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            seq, lp = greedy(model, ids, cache, 8)
    assert torch.equal(seq, ref_seq)
    assert max_diff(lp, ref_lp) <= 1e-4
    assert any(issubclass(w.category, PagedKVFallbackWarning) and "not switched" in str(w.message) for w in caught)
    stats = cache.paged_stats()
    assert stats["fallback_attention_calls"] == 3 * 8
    assert stats["paged_attention_bailouts_by_phase_reason"]["decode:model_not_switched"] == 3 * 7
    assert stats["paged_attention_calls"] == 0


def test_switched_model_still_works_with_other_caches_and_without_one():
    model = tiny_model("mistral")
    ids = torch.randint(3, 128, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.inference_mode():
        ref_seq, ref_lp = greedy(model, ids, DynamicCache(config=model.config), 10, mask)
        ref_logits = model(ids, attention_mask=mask, use_cache=False).logits
        install_paged_kv_cache(model)
        seq, lp = greedy(model, ids, DynamicCache(config=model.config), 10, mask)
        logits = model(ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(seq, ref_seq) and max_diff(lp, ref_lp) <= 1e-4
    assert (logits - ref_logits)[mask.bool()].abs().max().item() < 1e-4


def test_generate_past_a_full_pool_raises_capacity_error_and_leaves_the_cache_as_it_was():
    model = tiny_model("qwen3")
    ids = torch.tensor([[5, 17, 33, 2, 9]])
    key = cache_kwarg(model)
    full = install_paged_kv_cache(model, block_size=4, num_blocks=2)  # 8 tokens: the prompt and 3 fed tokens
    with torch.inference_mode(), pytest.raises(pagedkv.CacheCapacityError, match="raise num_blocks"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, pad_token_id=0,
                       **{key: full})
    fits = install_paged_kv_cache(model, block_size=4, num_blocks=2)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                             min_new_tokens=4, pad_token_id=0, **{key: fits})
    assert out.shape[1] == 9
    assert full.paged_stats()["tokens"] == fits.paged_stats()["tokens"] == 8
    assert full.paged_stats()["used_blocks"] == 2
    full.pool.check()
    for pages, expected in zip(full.pages, fits.pages):  # the refused write left no trace in the pages
        assert pages.keys() == expected.keys()
        assert all(torch.equal(pages[name], expected[name]) for name in pages)
