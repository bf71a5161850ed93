"""Snapshots and cache files: bit-exact round trips for every page format and length; refusals that leave
the cache as it was."""

import json
import struct

import pytest
import torch

from pagedkv import PagedKVCache
from pagedkv.errors import CacheCapacityError, SnapshotError

FORMATS = ["off", "q8", "q6", "q4", "turboquant", "turboquant:k=q4_0,v=q3_0,rotate_keys"]
LENGTHS = [1, 15, 16, 17, 1000]
MODEL = {"architecture": "TestForCausalLM", "num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "weights": "a" * 64}


def make_cache(kv_format="off", block_size=16, num_blocks=160, model=MODEL, **options):
    return PagedKVCache(num_blocks=num_blocks, block_size=block_size, kv_format=kv_format, num_layers=2,
                        model_identity=model, **options)


def write_sequence(cache, num_tokens, seed=0):
    """A new sequence with `num_tokens` random keys/values in both layers, written in two steps."""
    gen = torch.Generator().manual_seed(seed)
    seq_id = cache.add_sequence()
    for n in (num_tokens // 2, num_tokens - num_tokens // 2):
        if n == 0:
            continue
        cache.begin_step([seq_id], [n])
        for layer in range(2):
            cache.write(layer, torch.randn(n, 2, 64, generator=gen), torch.randn(n, 2, 64, generator=gen))
        cache.end_forward()
    return seq_id


def raw_tokens(cache, seq_id):
    """Every page tensor's bytes of the sequence's tokens, per layer: {name: [num_tokens, H, width]}."""
    from pagedkv.ops.reference import gather_sequence

    ids = torch.tensor(cache.block_table(seq_id), dtype=torch.long)
    return [gather_sequence(pages, ids, cache.seq_len(seq_id)) for pages in cache.pages]


def assert_same_tokens(a, b):
    assert len(a) == len(b)
    for la, lb in zip(a, b):
        assert la.keys() == lb.keys()
        for name in la:
            assert la[name].dtype == lb[name].dtype and torch.equal(la[name].view(torch.uint8), lb[name].view(torch.uint8))


def state(cache):
    """What a refused operation must leave unchanged."""
    return ({s: (cache.block_table(s), cache.seq_len(s)) for s in cache.seqs}, cache.pool.num_used,
            {s: raw_tokens(cache, s) for s in cache.seqs})


def assert_state(cache, before):
    seqs, used, tokens = state(cache)
    assert (seqs, used) == before[:2]
    for s in seqs:
        assert_same_tokens(tokens[s], before[2][s])


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("num_tokens", LENGTHS)
def test_snapshot_restore_is_bit_exact(kv_format, num_tokens):
    cache = make_cache(kv_format)
    seq = write_sequence(cache, num_tokens)
    snap = cache.snapshot(seq)
    assert snap.num_tokens == num_tokens and snap.layers[0]["k"].device.type == "cpu"
    cache.free(seq)  # a fork across time: the original is gone
    restored = cache.restore(snap)
    assert cache.seq_len(restored) == num_tokens
    assert_same_tokens(raw_tokens(cache, restored), snap.layers)
    k, v = cache.read(restored, 1)
    assert k.shape == (num_tokens, 2, 64) and torch.isfinite(k).all() and torch.isfinite(v).all()


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("num_tokens", LENGTHS)
def test_save_load_is_bit_exact_into_a_fresh_cache(tmp_path, kv_format, num_tokens):
    cache = make_cache(kv_format)
    a, b = write_sequence(cache, num_tokens, seed=1), write_sequence(cache, 3, seed=2)
    path = cache.save(tmp_path / "kv.safetensors", [a, b])
    fresh = make_cache(kv_format)
    loaded = fresh.load(path)
    assert [fresh.seq_len(s) for s in loaded] == [num_tokens, 3]
    assert_same_tokens(raw_tokens(fresh, loaded[0]), raw_tokens(cache, a))
    assert_same_tokens(raw_tokens(fresh, loaded[1]), raw_tokens(cache, b))
    for layer in range(2):
        assert all(torch.equal(x, y) for x, y in zip(fresh.read(loaded[0], layer), cache.read(a, layer)))


def test_file_is_safetensors_with_an_identity_header(tmp_path):
    from safetensors import safe_open

    cache = make_cache("turboquant")
    path = cache.save(tmp_path / "kv.safetensors", [write_sequence(cache, 20)])
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    identity = json.loads(meta["identity"])
    assert meta["format"] == "pagedkv-snapshot" and meta["version"] == "1"
    assert identity["model"] == MODEL and identity["block_size"] == 16
    layer = identity["layers"][0]
    assert layer["format"] == "turboquant:k=q8_0,v=q3_0" and len(layer["format_fingerprint"]) == 64
    assert layer["num_kv_heads"] == 2 and layer["head_dim"] == 64 and layer["dtype"] == "float32"


@pytest.fixture
def saved(tmp_path):
    source = make_cache("q8")
    path = source.save(tmp_path / "kv.safetensors", [write_sequence(source, 40)])
    target = make_cache("q8")
    write_sequence(target, 21, seed=5)  # the target already holds a sequence, which must survive a refusal
    return path, target


@pytest.mark.parametrize("other, needle", [
    (dict(model={**MODEL, "weights": "b" * 64}), "model.weights"),
    (dict(model={**MODEL, "architecture": "OtherForCausalLM"}), "model.architecture: file TestForCausalLM"),
    (dict(kv_format="q4"), "kv_format: file q8, cache q4"),
    (dict(kv_format="turboquant"), "kv_format"),
    (dict(block_size=32), "block_size: file 16, cache 32"),
])
def test_file_of_another_model_format_or_block_size_is_refused(saved, other, needle):
    path, _ = saved
    options = {"kv_format": "q8", **other}
    cache = make_cache(**options)
    write_sequence(cache, 21, seed=5)
    before = state(cache)
    with pytest.raises(SnapshotError, match="saved for another model or cache configuration") as err:
        cache.load(path)
    assert needle in str(err.value)
    assert_state(cache, before)


def test_models_given_the_same_name_are_compared_by_name(tmp_path):
    named = {**MODEL, "name": "my-model"}
    source = make_cache(model=named)
    path = source.save(tmp_path / "kv.safetensors", [write_sequence(source, 5)])
    assert make_cache(model={**named, "weights": "c" * 64}).load(path) == [0]
    with pytest.raises(SnapshotError, match="model.name: file my-model, cache other"):
        make_cache(model={**named, "name": "other"}).load(path)


def _rewrite_header(path, change):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    change(header["__metadata__"])
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def test_file_of_another_version_is_refused(saved):
    path, cache = saved
    _rewrite_header(path, lambda meta: meta.update(version="2"))
    before = state(cache)
    with pytest.raises(SnapshotError, match="file version 2, but this pagedkv reads version 1"):
        cache.load(path)
    assert_state(cache, before)


@pytest.mark.parametrize("cut", [4, 100, -1, -300])
def test_truncated_file_is_refused(saved, cut):
    path, cache = saved
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    before = state(cache)
    with pytest.raises(SnapshotError, match="truncated|corrupted"):
        cache.load(path)
    assert_state(cache, before)


@pytest.mark.parametrize("where", ["data_start", "data_middle", "data_end", "header"])
def test_bit_flipped_file_is_refused(saved, where):
    path, cache = saved
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    offset = {"data_start": 8 + n, "data_middle": 8 + n + (len(data) - 8 - n) // 2, "data_end": len(data) - 1,
              "header": 8 + n // 2}[where]
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))
    before = state(cache)
    with pytest.raises(SnapshotError, match="corrupted|saved for another"):
        cache.load(path)
    assert_state(cache, before)


def test_tampered_checksum_list_is_refused(saved):
    path, cache = saved
    _rewrite_header(path, lambda meta: meta.update(checksums=json.dumps({"0.0.k": "0" * 64})))
    with pytest.raises(SnapshotError, match="checksum"):
        cache.load(path)


def test_restore_that_does_not_fit_raises_and_leaves_the_cache_as_it_was():
    cache = make_cache(num_blocks=4)
    seq = write_sequence(cache, 40)  # 3 of the 4 blocks
    snap = cache.snapshot(seq)
    before = state(cache)
    with pytest.raises(CacheCapacityError):
        cache.restore(snap)
    assert_state(cache, before)
    cache.pool.check()


def test_load_is_all_or_nothing(tmp_path):
    source = make_cache()
    path = source.save(tmp_path / "kv.safetensors", [write_sequence(source, 40), write_sequence(source, 40)])
    cache = make_cache(num_blocks=5)  # room for one of the two sequences only
    with pytest.raises(CacheCapacityError):
        cache.load(path)
    assert cache.seqs == {} and cache.pool.num_used == 0


def test_snapshot_of_a_cache_without_pages_is_refused_with_advice():
    cache = make_cache()
    seq = cache.add_sequence()
    with pytest.raises(SnapshotError, match="run a forward pass"):
        cache.snapshot(seq)
