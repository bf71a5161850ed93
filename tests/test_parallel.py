"""Tensor parallelism: 2 gloo ranks on the CPU generate exactly what one process generates, every rank holds
the pages of its own KV heads under the same block ids, and bad requests fail before any rank starts."""

import gc
import json
import os
import subprocess
import sys

import pytest
import torch

from pagedkv import PagedKVCache, install_paged_kv_cache
from pagedkv.errors import ConfigError
from pagedkv.parallel import (ShardedPagedKVCache, check_model, check_tensor_parallel, follow, install_sharded_cache,
                              launch, lead, load_sharded_model)

FORMATS = ["off", "q8", "q6", "q4", "turboquant", "turboquant:k=q4_0,v=q3_0,rotate_keys",
           "turboquant:k=q4_0,v=q3_0,recent_tokens=16"]
NUM_KV_HEADS = 4
CACHE = dict(block_size=4, num_blocks=1, dynamic=True, kernels="reference")  # small blocks, pool grows
PROMPTS = [[7, 12, 99, 3, 45, 200, 17, 18, 64, 31, 5], [40, 41, 42, 43, 250]]
MAX_NEW_TOKENS = 10
# the engine: a pool too small for all three requests at once (preemption), a shared 2-block prefix,
# prefill chunks of 8 tokens
ENGINE_CACHE = dict(kv_format="q4", block_size=4, num_blocks=9, kernels="reference")
ENGINE_PROMPTS = [PROMPTS[0], PROMPTS[0][:8] + [9, 9, 9, 9], PROMPTS[1]]


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="</s>")


def _save_tiny_llama(folder, num_kv_heads=NUM_KV_HEADS, num_heads=8, vocab_multiple=1):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _byte_tokenizer()
    torch.manual_seed(0)
    vocab = -(-len(tokenizer) // vocab_multiple) * vocab_multiple  # padded, as released models pad theirs
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=64,
                         max_position_embeddings=256, initializer_range=0.1, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A random Llama-architecture model (8 query heads, 4 KV heads, head_dim 64) with a byte tokenizer."""
    return str(_save_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def _batch():
    """PROMPTS left-padded into one batch: input_ids and attention_mask [2, 11]."""
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    return ids, mask


def _greedy(model, cache):
    ids, mask = _batch()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, cache=cache,
                             pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def _engine_style(model, cache):
    """Packed steps as an engine runs them: two sequences, then a fork in mid-block (copy-on-write), a free."""
    def step(seq_ids, tokens, positions):
        cache.begin_step(seq_ids, [len(t) for t in tokens])
        try:
            flat = [t for ts in tokens for t in ts]
            pos = [p for ps in positions for p in ps]
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([flat]), position_ids=torch.tensor([pos]), cache=cache).logits
        finally:
            cache.end_forward()
        ends = torch.tensor([len(t) for t in tokens]).cumsum(0) - 1
        return logits[0, ends].argmax(-1).tolist()

    a, b = cache.add_sequence(), cache.add_sequence()
    p, q = PROMPTS
    nxt = step([a, b], [p, q], [range(len(p)), range(len(q))])
    lengths = {a: len(p), b: len(q)}
    history = [nxt]
    c = cache.fork(b)  # b holds 5 tokens: its second block is partial and shared until written
    lengths[c] = lengths[b]
    live, nxt = [a, b, c], nxt + [nxt[1]]
    for i in range(4):
        if i == 2:
            cache.free(a)
            live, nxt = live[1:], nxt[1:]
        nxt = step(live, [[t] for t in nxt], [[lengths[s]] for s in live])
        for s in live:
            lengths[s] += 1
        history.append(nxt)
    return history


def _written_slots(cache):
    """Page slots holding tokens of live sequences (the rest of a block is uninitialised memory)."""
    bs = cache.block_size
    return torch.tensor([cache.block_table(s)[p // bs] * bs + p % bs for s in cache.seqs for p in range(cache.seq_len(s))])


def _llm(model, cache):
    """Greedy outputs of the engine over ENGINE_PROMPTS, and its stats."""
    from pagedkv import LLM, SamplingParams

    llm = LLM(model, cache=cache, max_num_batched_tokens=8, admission_lookahead_tokens=0)  # preempts
    outputs = llm.generate(ENGINE_PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    return [o.token_ids for o in outputs], llm.stats()


def _page_snapshot(cache):
    """Layer pages of a dense cache, and its pool size: {layer: {name: tensor}}, num_blocks."""
    return [{k: v.clone() for k, v in layer.items()} for layer in cache.pages], cache.pool.num_blocks


def _tp_work(group, folder):
    """On every rank: generate in every format, then engine-style steps; report tokens and the pages held."""
    model, _ = load_sharded_model(folder, group)
    if not group.is_leader:
        caches = follow(model, group)
        return {"pages": _page_snapshot(caches[0])[0], "heads": [c.formats[0].num_kv_heads for c in caches]}
    report, caches = {}, []
    with lead(model, group):
        for fmt in FORMATS:
            cache = install_sharded_cache(model, kv_format=fmt, **CACHE)
            report[fmt] = _greedy(model, cache)
            caches.append(cache)
        engine_cache = install_sharded_cache(model, **CACHE)
        report["engine"] = _engine_style(model, engine_cache)
        caches.append(engine_cache)
        report["llm"] = _llm(model, install_sharded_cache(model, **ENGINE_CACHE))
        gc.collect()  # the engine's cache is gone: the release tells the followers to drop theirs
    return {"tokens": report, "pages": _page_snapshot(caches[0])[0], "num_blocks": caches[0].pool.num_blocks,
            "block_tables": [caches[0].block_table(s) for s in caches[0].batch_seq_ids],
            "heads": [c.formats[0].num_kv_heads for c in caches]}


@pytest.fixture(scope="module")
def single_process(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tokens, dense = {}, None
    for fmt in FORMATS:
        cache = install_paged_kv_cache(model, kv_format=fmt, **CACHE)
        tokens[fmt] = _greedy(model, cache)
        dense = cache if dense is None else dense
    tokens["engine"] = _engine_style(model, install_paged_kv_cache(model, **CACHE))
    tokens["llm"] = _llm(model, install_paged_kv_cache(model, **ENGINE_CACHE))
    return tokens, dense


@pytest.fixture(scope="module")
def two_ranks(tiny_llama):
    return launch(_tp_work, 2, "cpu", tiny_llama)


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_rank_greedy_generation_equals_single_process(two_ranks, single_process, fmt):
    assert two_ranks[0]["tokens"][fmt] == single_process[0][fmt]


def test_formats_differ_so_the_comparison_can_fail(single_process):
    assert len({json.dumps(single_process[0][fmt]) for fmt in FORMATS}) > 1


def test_engine_style_steps_with_fork_and_free_equal_single_process(two_ranks, single_process):
    assert two_ranks[0]["tokens"]["engine"] == single_process[0]["engine"]


def test_engine_on_rank_0_with_preemption_and_prefix_hits_equals_single_process(two_ranks, single_process):
    (tokens, stats), (expected, expected_stats) = two_ranks[0]["tokens"]["llm"], single_process[0]["llm"]
    assert tokens == expected
    assert stats["preemptions"] == expected_stats["preemptions"] > 0
    assert stats["prefix_cache_hits"] == expected_stats["prefix_cache_hits"] > 0


def test_each_rank_holds_pages_of_its_own_kv_heads_and_drops_caches_the_leader_dropped(two_ranks):
    for rank in two_ranks:
        assert rank["heads"] == [NUM_KV_HEADS // 2] * (len(FORMATS) + 1)  # the engine's cache is gone
        for layer in rank["pages"]:
            assert all(page.shape[2] == NUM_KV_HEADS // 2 for page in layer.values())


def test_rank_pages_are_the_single_process_pages_split_by_head(two_ranks, single_process):
    """Same block ids on every rank: rank r's blocks hold heads [2r, 2r+2) of the single-process blocks."""
    dense = single_process[1]
    assert two_ranks[0]["num_blocks"] == dense.pool.num_blocks > 1  # the pool grew the same way
    assert two_ranks[0]["block_tables"] == [dense.block_table(s) for s in dense.batch_seq_ids]
    per_rank = NUM_KV_HEADS // 2
    slots = _written_slots(dense)
    for r, rank in enumerate(two_ranks):
        for layer, (rank_layer, full_layer) in enumerate(zip(rank["pages"], dense.pages)):
            for name, page in rank_layer.items():
                full = full_layer[name][:, :, r * per_rank:(r + 1) * per_rank].flatten(0, 1)
                torch.testing.assert_close(page.flatten(0, 1)[slots], full[slots], rtol=1e-4, atol=1e-5,
                                           msg=f"rank {r} layer {layer} {name}")


# ----------------------------------------------------------------------------------------------
# the leader's steps, applied to a follower cache in one process
def _write_step(cache, layer_kv):
    for layer, (k, v) in enumerate(layer_kv):
        cache.write(layer, k, v)


def test_follower_cache_mirrors_growth_copy_on_write_and_tables():
    torch.manual_seed(0)
    leader, follower = ShardedPagedKVCache(block_size=4, num_blocks=1, dynamic=True), ShardedPagedKVCache(
        block_size=4, num_blocks=1, dynamic=True)

    def step(seq_ids, counts):
        leader.begin_step(seq_ids, counts)
        msg = leader.export_step()
        follower.follow_step(msg, torch.device("cpu"))
        kv = [(torch.randn(sum(counts), 2, 8), torch.randn(sum(counts), 2, 8)) for _ in range(2)]
        _write_step(leader, kv)
        _write_step(follower, kv)
        torch.testing.assert_close(follower.plan.block_table, leader.plan.block_table, rtol=0, atol=0)
        leader.end_forward()
        follower.end_forward()
        return msg

    a = leader.add_sequence()
    step([a], [6])
    b = leader.fork(a)  # a's second block holds 2 of 4 tokens: writing to b copies it first
    msg = step([a, b], [1, 1])
    assert len(msg.copies) == 1 and msg.num_blocks == follower.pool.num_blocks > 1
    step([b], [5])
    slots = _written_slots(leader)
    for lp, fp in zip(leader.pages, follower.pages):
        for name in lp:
            torch.testing.assert_close(fp[name].flatten(0, 1)[slots], lp[name].flatten(0, 1)[slots], rtol=0, atol=0)


def test_sequence_events_reach_the_follower_mirror():
    leader = ShardedPagedKVCache(block_size=4, num_blocks=8)
    a = leader.add_sequence()
    leader.begin_step([a], [3])
    leader.export_step()
    leader.end_forward()
    leader.trim(1, seq_id=a)
    leader.free(a)
    b = leader.add_sequence()
    leader.begin_step([b], [1])
    assert [name for name, _ in leader.export_step().mirror_events] == ["trim", "forget"]


def test_leader_refuses_an_unsharded_cache(tiny_llama):
    """A one-rank group in this process: a plain PagedKVCache is refused with a message naming the fix."""
    import socket

    import torch.distributed as dist

    from pagedkv.parallel import init_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    group = init_group(0, 1, "cpu", f"tcp://127.0.0.1:{port}")
    try:
        model, _ = load_sharded_model(tiny_llama, group)
        with lead(model, group), pytest.raises(ConfigError, match="install_sharded_cache"):
            model(input_ids=torch.tensor([[1, 2, 3]]), cache=PagedKVCache(block_size=4))
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# checks before any rank starts
def test_kv_heads_not_divisible_names_the_counts_that_work():
    with pytest.raises(ConfigError, match=r"3 KV heads and 9 attention heads.*use one of 1, 3"):
        check_tensor_parallel(2, 3, 9, "cpu")


def test_more_ranks_than_cpu_cores_or_gpus_is_refused():
    cores = os.cpu_count()
    with pytest.raises(ConfigError, match=f"needs {cores + 1} CPU cores .* at most {cores}"):
        check_tensor_parallel(cores + 1, 8 * (cores + 1), 8 * (cores + 1), "cpu")
    gpus = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=f"needs {gpus + 1} GPUs"):
        check_tensor_parallel(gpus + 1, 8 * (gpus + 1), 8 * (gpus + 1), "cuda")


def test_an_indexed_device_is_refused_because_rank_r_runs_on_device_r():
    from pagedkv.parallel.commands import resolve_parallel_device

    assert resolve_parallel_device("cuda", 2) == "cuda" and resolve_parallel_device("cpu", 2) == "cpu"
    with pytest.raises(ConfigError, match="pass --device cuda"):
        resolve_parallel_device("cuda:1", 2)


def test_check_model_reads_the_heads_from_the_config(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(num_attention_heads=9, num_key_value_heads=3, hidden_size=576).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="3 KV heads"):
        check_model(tmp_path, 2, "cpu")
    check_model(tmp_path, 1, "cpu")


def test_an_uneven_vocabulary_is_refused_where_transformers_cannot_split_it(tmp_path, monkeypatch):
    from transformers import LlamaConfig

    import pagedkv.parallel.model as sharding

    LlamaConfig(num_attention_heads=8, num_key_value_heads=4, hidden_size=256, vocab_size=259).save_pretrained(tmp_path)
    monkeypatch.setattr(sharding, "_splits_lm_head_unevenly", lambda: False)
    with pytest.raises(ConfigError, match=r"vocabulary \(259 tokens\).*--tensor-parallel 1"):
        check_model(tmp_path, 2, "cpu")
    monkeypatch.setattr(sharding, "_splits_lm_head_unevenly", lambda: True)
    check_model(tmp_path, 2, "cpu")


# ----------------------------------------------------------------------------------------------
# the command
def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "pagedkv", "generate", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_tensor_parallel_2_prints_what_one_process_prints(tiny_llama):
    common = ["--model", tiny_llama, "--no-chat", "--max-new-tokens", "12", "--paged-kv-quantization", "q4",
              "--stats", "Hello there"]
    one, two = run_cli(*common), run_cli("--tensor-parallel", "2", *common)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert two.stdout == one.stdout and one.stdout.strip()
    stats = [json.loads(p.stderr[p.stderr.index("{"):]) for p in (one, two)]
    assert stats[1]["new_tokens"] == stats[0]["new_tokens"] == 12
    assert stats[1]["bytes"] * 2 == stats[0]["bytes"]  # rank 0 holds half of the KV heads


def test_generate_tensor_parallel_with_indivisible_heads_exits_2(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(num_attention_heads=9, num_key_value_heads=3, hidden_size=576).save_pretrained(tmp_path)
    proc = run_cli("--model", str(tmp_path), "--tensor-parallel", "2", "hi")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "pagedkv: error: --tensor-parallel 2: this model has 3 KV heads" in proc.stderr


def test_serve_tensor_parallel_2_answers_like_one_process_and_stops_on_ctrl_c(tiny_llama):
    import signal
    import socket
    import time
    import urllib.request

    from pagedkv import LLM, SamplingParams

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "pagedkv", "serve", "--model", tiny_llama, "--tensor-parallel", "2",
                               "--port", str(port), "--paged-kv-quantization", "q8"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, server.communicate()[1]
                time.sleep(0.5)
        body = json.dumps({"model": tiny_llama, "prompt": ["Hello there", "Paged caches"], "max_tokens": 12,
                           "temperature": 0}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body, {"content-type": "application/json"})
        answer = json.load(urllib.request.urlopen(request, timeout=60))
    finally:
        server.send_signal(signal.SIGINT)
        _, stderr = server.communicate(timeout=60)
    assert server.returncode == 0, stderr
    assert "cpu x 2 ranks" in stderr
    llm = LLM(tiny_llama, device="cpu", kv_format="q8")
    expected = [o.text for o in llm.generate(["Hello there", "Paged caches"], SamplingParams(max_tokens=12))]
    assert [c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])] == expected


# ----------------------------------------------------------------------------------------------
# the real default model: SmolLM2-135M has 3 KV heads, so it shards over 3 ranks (oversubscribed on 2 cores).
# It runs in float64: in float32 the row-parallel all-reduce sums in another order than one matmul (logits
# differ by ~5e-5), and over 30 layers a coarse format (q6, TurboQuant) turns one rounding flip into another
# greedy token, as a different CPU thread count does in one process. float64 leaves no such flip.
SMOLLM2_PROMPT = "The capital of France is"


def _smollm2_greedy(model, tokenizer, cache):
    ids = tokenizer(SMOLLM2_PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, cache=cache)
    return out[0, ids.shape[1]:].tolist()


def _smollm2_work(group, folder):
    model, tokenizer = load_sharded_model(folder, group, dtype=torch.float64)
    if not group.is_leader:
        return [c.formats[0].num_kv_heads for c in follow(model, group)]
    with lead(model, group):
        caches = {fmt: install_sharded_cache(model, kv_format=fmt) for fmt in FORMATS}
        return {fmt: _smollm2_greedy(model, tokenizer, cache) for fmt, cache in caches.items()}


@pytest.mark.slow
def test_smollm2_on_three_gloo_ranks_equals_single_process_for_every_format():
    from pagedkv import load_model
    from pagedkv.models import resolve_model_dir

    model, tokenizer = load_model("default", dtype=torch.float64)
    expected = {fmt: _smollm2_greedy(model, tokenizer, install_paged_kv_cache(model, kv_format=fmt)) for fmt in FORMATS}
    folder, _ = resolve_model_dir("default")
    leader, *followers = launch(_smollm2_work, 3, "cpu", str(folder))
    assert leader == expected
    assert "Paris" in tokenizer.decode(leader["off"])
    assert followers == [[1] * len(FORMATS)] * 2  # one of the 3 KV heads per rank


# ----------------------------------------------------------------------------------------------
# one rank, and ranks spread over hosts
def test_one_rank_loads_the_whole_model_onto_its_device(tiny_llama):
    """One rank has no collectives to shard through: transformers loads the model on the CPU and the rank moves it to
    its own device (here the meta device stands in for cuda:r)."""
    from pagedkv.parallel import TensorParallelGroup

    model, tokenizer = load_sharded_model(tiny_llama, TensorParallelGroup(0, 1, torch.device("meta"), None))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (NUM_KV_HEADS * 64, 128)  # unsharded
    assert tokenizer is not None


def test_ranks_on_other_hosts_do_not_count_against_this_hosts_devices():
    cores = os.cpu_count()
    check_tensor_parallel(2 * cores, 8 * cores, 8 * cores, "cpu", ranks_here=cores)  # the rest run elsewhere
    with pytest.raises(ConfigError, match=f"needs {cores + 1} CPU cores here .* fewer processes per node"):
        check_tensor_parallel(2 * cores + 2, 8 * cores + 8, 8 * cores + 8, "cpu", ranks_here=cores + 1)


def test_two_torchrun_nodes_generate_what_one_process_generates(tiny_llama):
    """The multi-node path on one host: two torchrun "nodes" of one CPU rank each meet at a master address (gloo)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = ["--model", tiny_llama, "--device", "cpu", "--no-chat", "--max-new-tokens", "12",
              "--paged-kv-quantization", "q4", "Hello there"]
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(i),
                               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "-m", "pagedkv", "generate", "--tensor-parallel", "2", *common],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
             for i in range(2)]
    try:
        outs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    one = run_cli(*common)
    assert [node.returncode for node in nodes] == [0, 0], outs[0][1] + outs[1][1]
    assert one.returncode == 0 and one.stdout.strip()
    assert outs[0][0] == one.stdout  # rank 0, on node 0, prints the answer
    assert outs[1][0] == ""  # the follower on node 1 prints nothing
