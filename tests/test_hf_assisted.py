"""transformers' assisted generation (prompt lookup, assistant_model) over a PagedKVCache.

After each verification transformers calls `cache.crop(-num_rejected)` on the target's cache, which
is `crop(0)` whenever every drafted token was accepted (and at every step of its deferred stop
check on some devices). `crop(0)` must remove nothing: a cache that read it as "keep the first 0
tokens" emptied itself after the first fully accepted draft, and generation went on from nothing.
"""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from pagedkv import PagedKVCache, install_paged_kv_cache
from pagedkv.hf import cache_kwarg

FORMATS = ["off", "q8", "q6", "q4", "turboquant", "turboquant:k=q4_0,v=q3_0,rotate_keys"]
# two of them make the model repeat text from its prompt, where prompt lookup drafts long runs
PROMPTS = [
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank.",
    "Copy the list: apples, pears, plums, cherries, grapes, melons, lemons.",
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
]


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def first_layers(model, num_layers: int):
    """A draft model: `model`'s first `num_layers` decoder layers, final norm and head (weights shared)."""
    config = model.config.__class__.from_dict({**model.config.to_dict(), "num_hidden_layers": num_layers})
    with torch.device("meta"):
        draft = type(model)(config)
    draft.model.embed_tokens = model.model.embed_tokens
    draft.model.layers = model.model.layers[:num_layers]
    draft.model.norm, draft.model.rotary_emb, draft.lm_head = model.model.norm, model.model.rotary_emb, model.lm_head
    draft.generation_config = model.generation_config
    return draft.eval()


@pytest.mark.parametrize("kv_format", FORMATS)
def test_crop_after_a_verify_forward_leaves_the_cache_as_if_only_accepted_tokens_were_fed(kv_format):
    """The calls assisted generation makes, checked one by one against what DynamicCache reports."""
    model = tiny_llama()
    key = cache_kwarg(model)
    prompt, draft = torch.arange(3, 14)[None], torch.tensor([[20, 21, 22, 23, 24]])
    with torch.inference_mode():
        paged = install_paged_kv_cache(model, kv_format=kv_format, block_size=4, num_blocks=32)
        dense = DynamicCache(config=model.config)
        for cache in (paged, dense):
            model(prompt, **{key: cache})
            model(draft, **{key: cache})  # verify 5 drafted tokens
            cache.crop(0)  # every token accepted
            assert cache.get_seq_length() == 16
        assert paged.paged_stats()["used_blocks"] == 4
        for cache in (paged, dense):
            cache.crop(-3)  # the last 3 rejected
            assert cache.get_seq_length() == 13
        assert paged.seq_len(paged.batch_seq_ids[0]) == 13 and paged.paged_stats()["used_blocks"] == 4
        paged.crop(-2)  # back across a block boundary: the emptied block goes back to the pool
        dense.crop(-2)
        assert paged.get_seq_length() == 11 and paged.paged_stats()["used_blocks"] == 3
        after = model(torch.tensor([[30, 31]]), **{key: paged}).logits
        dense_after = model(torch.tensor([[30, 31]]), **{key: dense}).logits
        fresh = install_paged_kv_cache(model, kv_format=kv_format, block_size=4, num_blocks=32)
        expected = model(torch.cat([prompt, torch.tensor([[30, 31]])], 1), **{key: fresh}).logits[:, -2:]
    assert paged.get_seq_length() == dense.get_seq_length() == 13
    assert torch.allclose(after, expected, atol=1e-5, rtol=0)  # the rolled-back tokens left no trace
    if kv_format == "off":
        assert torch.allclose(after, dense_after, atol=1e-4, rtol=0)


def test_crop_keeps_the_legacy_absolute_length_form():
    """transformers 5.17 still accepts crop(positive) as "keep this many tokens"; so does the cache."""
    model = tiny_llama()
    with torch.inference_mode():
        cache = install_paged_kv_cache(model, block_size=4, num_blocks=32)
        model(torch.arange(3, 13)[None], **{cache_kwarg(model): cache})
    assert cache.crop(7) == 3 and cache.get_seq_length() == 7
    assert cache.crop(9) == 0 and cache.crop(0) == 0 and cache.get_seq_length() == 7


def generate(model, tok, prompt, cache, **assist):
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                             **{cache_kwarg(model): cache}, **assist)
    return out[0, ids.shape[1]:].tolist()


def assistant_of(model):
    draft = first_layers(model, 6)
    draft.generation_config = type(model.generation_config).from_dict(
        {**model.generation_config.to_dict(), "num_assistant_tokens": 4, "num_assistant_tokens_schedule": "constant"})
    return draft


class RecordingCache(PagedKVCache):
    """Records the arguments of every crop() call."""

    def crop(self, max_length, seq_id=None):
        self.crops = getattr(self, "crops", []) + [max_length]
        return super().crop(max_length, seq_id)


@pytest.mark.parametrize("kv_format", FORMATS)
def test_prompt_lookup_and_assistant_model_equal_plain_greedy_on_smollm2(smollm2_f64, kv_format):
    """In float64 (see the fixture): in float32 a quantized format's greedy tokens can already differ between
    a prefill of the prompt alone and one of the prompt with drafted tokens after it."""
    model, tok = smollm2_f64
    install_paged_kv_cache(model)
    assistant = assistant_of(model)
    crops = []
    for prompt in PROMPTS:
        plain = generate(model, tok, prompt, PagedKVCache(kv_format=kv_format))
        caches = [RecordingCache(kv_format=kv_format) for _ in range(2)]
        lookup = generate(model, tok, prompt, caches[0], prompt_lookup_num_tokens=8)
        assisted = generate(model, tok, prompt, caches[1], assistant_model=assistant)
        assert lookup == plain, (prompt, tok.decode(lookup), tok.decode(plain))
        assert assisted == plain, (prompt, tok.decode(assisted), tok.decode(plain))
        crops += [c for cache in caches for c in getattr(cache, "crops", [])]
    # both kinds of rollback happened: whole drafts accepted (crop(0)) and tails rejected
    assert crops.count(0) >= 3 and sum(c < 0 for c in crops) >= 3, crops
