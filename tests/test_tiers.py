"""The host and disk tiers under the prefix cache, on a bare cache: bit-exact offload and load, hashes stable
across processes, the disk tier's files (atomic, reconciled at startup, LRU from chain tails, refused paths,
damaged files, a full disk, two processes on one directory)."""

import errno
import json
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

from pagedkv import PagedKVCache
from pagedkv.errors import TierPathError
from pagedkv.ops.reference import gather_sequence
from pagedkv.tiers import DiskTier, HostTier, TieredPrefixCache, TierSettings
from pagedkv.tiers import prefix as tiers_prefix
from pagedkv.tiers.disk import _Entry
from pagedkv.tiers.layout import copy_runs, runs

MODEL = {"architecture": "TestForCausalLM", "num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "weights": "a" * 64}
BS = 4


def make_tiered(kv_format="off", num_blocks=12, model=MODEL, **settings):
    cache = PagedKVCache(num_blocks=num_blocks, block_size=BS, kv_format=kv_format, num_layers=2, model_identity=model)
    cache.init_layers(2, 2, 64, torch.float32, "cpu")
    return cache, TieredPrefixCache(cache, TierSettings(**settings))


def run_sequence(cache, prefix, tokens, seed=0, seq_id=None):
    """Admit `tokens` through the prefix cache (as sequence `seq_id`: a preempted one coming back), write the
    uncached rest, register its full blocks."""
    hashes = prefix.block_hashes([], tokens)
    free = cache.pool.num_free if cache.pool.num_blocks else None  # what the scheduler passes
    cached = prefix.match(hashes, (len(tokens) - 1) // BS, free_blocks=free)
    seq = cache.add_sequence(seq_id, prefix_block_ids=cached)
    n = len(tokens) - len(cached) * BS
    gen = torch.Generator().manual_seed(seed)
    cache.begin_step([seq], [n])
    for layer in range(2):
        cache.write(layer, torch.randn(n, 2, 64, generator=gen), torch.randn(n, 2, 64, generator=gen))
    cache.end_forward()
    prefix.register(seq, hashes, len(cached), len(tokens))
    return seq, hashes, len(cached)


def full_blocks(cache, seq):
    ids = torch.tensor(cache.block_table(seq), dtype=torch.long)
    n = cache.seq_len(seq) // BS * BS
    return [{k: v.clone() for k, v in gather_sequence(pages, ids, n).items()} for pages in cache.pages]


def evict_device(cache):
    """Reuse every free block, dropping the device's cached copies."""
    cache.pool.decref(cache.pool.allocate(cache.pool.num_free))


def assert_same(a, b, num_tokens):
    for la, lb in zip(a, b):
        for name in la:
            assert torch.equal(la[name][:num_tokens].view(torch.uint8), lb[name][:num_tokens].view(torch.uint8)), name


TOKENS = list(range(100, 114))  # 3 full blocks of 4 and 2 tokens


@pytest.mark.parametrize("kv_format", ["off", "q8", "q4", "turboquant"])
def test_blocks_come_back_bit_exact_from_the_host_tier(kv_format):
    cache, prefix = make_tiered(kv_format, cpu_cache_gb=0.01)
    seq, _, _ = run_sequence(cache, prefix, TOKENS)
    original = full_blocks(cache, seq)
    prefix.release(seq)
    assert len(prefix.host) == 3 and prefix.offloaded_blocks == 3
    evict_device(cache)
    again, _, num_cached = run_sequence(cache, prefix, TOKENS, seed=1)
    assert num_cached == 3 and prefix.loaded_blocks["host"] == 3
    assert_same(full_blocks(cache, again), original, 12)
    prefix.release(again)
    cache.pool.check()
    assert cache.pool.num_used == 0


def test_a_conversation_comes_back_whole_from_the_host_after_another_filled_the_pool():
    # the pool holds one conversation (as in bench/tiers.py): the other one's offload must not keep device blocks
    cache, prefix = make_tiered(num_blocks=4, cpu_cache_gb=0.01)
    seq, _, _ = run_sequence(cache, prefix, TOKENS)
    original = full_blocks(cache, seq)
    prefix.release(seq)
    assert cache.pool.num_used == 0
    other, _, num_cached = run_sequence(cache, prefix, [7] + TOKENS, seed=1)
    assert num_cached == 0 and cache.pool.num_free == 0
    prefix.release(other)
    assert cache.pool.num_used == 0  # at once: no block waits for its copy to the host
    again, _, num_cached = run_sequence(cache, prefix, TOKENS, seed=2)
    assert num_cached == 3 and prefix.loaded_blocks["host"] == 3 and prefix.as_dict()["tier_load_gbps"] > 0
    assert_same(full_blocks(cache, again), original, 12)


def test_host_slots_of_a_chain_are_consecutive_and_its_stored_blocks_stay():
    host = HostTier(6 * 8, 8, pin=False)
    a, b, c = ([bytes([k, i]) for i in range(3)] for k in range(3))
    assert host.allocate(a) == [0, 1, 2] and host.allocate(b) == [3, 4, 5]
    host.touch(reversed(b))
    host.touch(reversed(a))  # a used last: b is evicted, from its tail
    assert host.allocate(a[:1] + c[:2]) == [0, 4, 5]  # a's first block keeps its slot; b's tail's, ascending
    assert host.num_evictions == 2 and list(host._slots) == [b[0], a[2], a[1], a[0], c[0], c[1]]
    assert host.allocate([bytes([9, i]) for i in range(8)]) == list(range(6))  # too long: its first blocks


def test_held_blocks_are_never_evicted():
    host = HostTier(4 * 8, 8, pin=False)
    a, b = ([bytes([k, i]) for i in range(2)] for k in range(2))
    host.allocate(a)
    host.allocate(b)
    host.hold(a)
    host.touch(reversed(b))  # b used last: a would go first, but it is held
    c = [bytes([2, i]) for i in range(3)]
    assert host.allocate(c) == [2, 3]  # only b's slots are free to take: a prefix of the chain
    assert all(h in host for h in a) and host.num_held == 2
    host.hold(a[:1])
    host.unhold(a)
    assert host.num_held == 1  # held twice, released once
    assert host.allocate([bytes([3, 0])]) == [1]  # a[1] is no longer held: it goes; a[0] stays
    assert a[0] in host and a[1] not in host


def test_a_swapped_out_request_keeps_its_blocks_until_it_is_back():
    # a host tier of 3 blocks: a preempted request's 3 blocks stay there while a finished request's offload
    # finds no room; once the request is back and registered, they may be evicted again
    block_bytes = 2 * 2 * 2 * BS * 64 * 4  # layers x (keys, values) x heads x slots x head_dim x float32
    cache, prefix = make_tiered(cpu_cache_gb=3 * block_bytes / 2**30, swap_on_preemption=True)
    seq, hashes, _ = run_sequence(cache, prefix, TOKENS)
    prefix.release(seq, preempted=True)
    assert prefix.as_dict()["tier_host_held_blocks"] == 3
    other, other_hashes, _ = run_sequence(cache, prefix, [7] + TOKENS, seed=1)
    prefix.release(other)  # finished: the prefix cache would keep it, but there is no room that is not held
    assert all(h in prefix.host for h in hashes[:3]) and not any(h in prefix.host for h in other_hashes[:3])
    evict_device(cache)
    again, _, num_cached = run_sequence(cache, prefix, TOKENS, seed=2, seq_id=seq)
    assert num_cached == 3 and prefix.loaded_blocks["host"] == 3  # loaded back, not recomputed
    assert prefix.as_dict()["tier_host_held_blocks"] == 0  # back: registered, no longer held
    prefix.release(again)
    third, third_hashes, _ = run_sequence(cache, prefix, [8] + TOKENS, seed=3)
    prefix.release(third)
    assert all(h in prefix.host for h in third_hashes[:3])  # evicted the request's blocks this time


def test_a_swapped_out_request_that_is_aborted_lets_its_blocks_go():
    block_bytes = 2 * 2 * 2 * BS * 64 * 4
    cache, prefix = make_tiered(cpu_cache_gb=3 * block_bytes / 2**30, swap_on_preemption=True)
    seq, _, _ = run_sequence(cache, prefix, TOKENS)
    prefix.release(seq, preempted=True)
    prefix.forget(seq)  # what the scheduler does when a waiting request is aborted
    assert prefix.as_dict()["tier_host_held_blocks"] == 0


def test_copies_go_by_runs_of_consecutive_rows():
    assert runs([0, 1, 2, 5, 6], [4, 5, 9, 10, 11]) == [(0, 4, 2), (2, 9, 1), (5, 10, 2)]
    src = torch.arange(6 * 16, dtype=torch.uint8).view(6, 16)
    dst = torch.zeros(4, 16, dtype=torch.uint8)
    copy_runs(dst, [3, 0, 1], src, [5, 2, 3])
    assert torch.equal(dst, torch.stack([src[2], src[3], torch.zeros(16, dtype=torch.uint8), src[5]]))


def test_a_chain_moves_between_the_device_and_the_host_in_one_copy(monkeypatch):
    copies = []

    def counted(dst, dst_index, src, src_index):
        copies.append(len(runs(dst_index, src_index)))
        copy_runs(dst, dst_index, src, src_index)

    monkeypatch.setattr(tiers_prefix, "copy_runs", counted)
    cache, prefix = make_tiered(num_blocks=4, cpu_cache_gb=0)
    prefix.host = HostTier(6 * prefix.layout.block_bytes, prefix.layout.block_bytes, pin=False)  # two chains
    for k in range(3):  # the third chain evicts the first, tail first, and takes its slots in order
        seq, hashes, _ = run_sequence(cache, prefix, [k] + TOKENS[1:], seed=k)
        original = full_blocks(cache, seq)
        prefix.release(seq)
    assert copies == [1, 1, 1] and prefix.host.num_evictions == 3
    assert [prefix.host.slot(h) for h in hashes[:3]] == [0, 1, 2]
    evict_device(cache)
    again, _, num_cached = run_sequence(cache, prefix, [2] + TOKENS[1:], seed=9)
    assert num_cached == 3 and copies == [1, 1, 1, 1]
    assert_same(full_blocks(cache, again), original, 12)


def test_disk_tier_keeps_blocks_across_a_restart(tmp_path):
    cache, prefix = make_tiered("turboquant", kv_cache_dir=str(tmp_path))
    seq, hashes, _ = run_sequence(cache, prefix, TOKENS)
    original = full_blocks(cache, seq)
    prefix.release(seq)
    prefix.close()
    files = sorted(p.name for p in (tmp_path / "blocks").rglob("*.safetensors"))
    assert files == sorted(f"{h.hex()}.safetensors" for h in hashes[:3])
    assert not list((tmp_path / "tmp").iterdir())  # written to tmp/, renamed into place

    cache2, prefix2 = make_tiered("turboquant", kv_cache_dir=str(tmp_path))  # "another process"
    assert prefix2.identity_digest == prefix.identity_digest and len(prefix2.disk) == 3
    seq2, _, num_cached = run_sequence(cache2, prefix2, TOKENS, seed=1)
    assert num_cached == 3 and prefix2.loaded_blocks["disk"] == 3
    assert_same(full_blocks(cache2, seq2), original, 12)


def test_a_chain_split_between_host_and_disk_loads_whole_and_its_disk_part_is_promoted(tmp_path):
    cache, prefix = make_tiered(kv_cache_dir=str(tmp_path))
    prefix.host = HostTier(2 * prefix.layout.block_bytes, prefix.layout.block_bytes, pin=False)  # 2 of 3 blocks
    seq, hashes, _ = run_sequence(cache, prefix, TOKENS)
    original = full_blocks(cache, seq)
    prefix.release(seq)
    prefix.disk.flush()
    assert [h in prefix.host for h in hashes] == [True, True, False] and len(prefix.disk) == 3
    prefix.host.allocate([b"x"])  # another block takes the chain's second slot: host, disk, disk
    evict_device(cache)
    again, _, num_cached = run_sequence(cache, prefix, TOKENS, seed=1)
    assert num_cached == 3 and prefix.loaded_blocks == {"host": 1, "disk": 2}
    assert_same(full_blocks(cache, again), original, 12)
    assert [h in prefix.host for h in hashes] == [True, True, False]  # promoted as far as the host holds


def test_block_hashes_are_the_same_in_another_process_and_differ_with_the_identity():
    _, prefix = make_tiered("turboquant")
    here = [h.hex() for h in prefix.block_hashes([], TOKENS)]
    code = ("import torch, sys; sys.path.insert(0, 'tests'); from test_tiers import make_tiered, TOKENS; "
            "_, p = make_tiered('turboquant'); print(','.join(h.hex() for h in p.block_hashes([], TOKENS)))")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=os.path.dirname(os.path.dirname(__file__))).stdout.split()[-1].split(",")
    assert there == here
    for other in (make_tiered("q8")[1], make_tiered("turboquant", model={**MODEL, "weights": "b" * 64})[1],
                  make_tiered("turboquant:k=q8_0,v=q4_0")[1]):
        assert [h.hex() for h in other.block_hashes([], TOKENS)][0] != here[0]


def _disk(tmp_path, capacity=1 << 20, **kw):
    return DiskTier(tmp_path, capacity, "f" * 64, busy=lambda: True, **kw)  # busy: writes wait for flush()


def _block(i, nbytes=1024):
    return torch.full((nbytes,), i % 251, dtype=torch.uint8)


def _hex(i):
    return f"{i:064x}"


def test_disk_index_is_reconciled_with_the_files_at_startup(tmp_path):
    disk = _disk(tmp_path)
    for i in range(4):
        disk.put(_hex(i), _hex(i - 1) if i else "", _block(i))
    disk.close()
    (tmp_path / "blocks" / "00" / f"{_hex(2)}.safetensors").unlink()  # gone behind the index's back
    stale, fresh = tmp_path / "tmp" / "x.1.1.tmp", tmp_path / "tmp" / "y.2.2.tmp"
    stale.write_bytes(b"half a block")
    fresh.write_bytes(b"another process is writing this")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    other = _disk(tmp_path)  # a file the index does not know: written by another process
    other.put(_hex(9), _hex(3), _block(9))
    other.flush()
    index = json.loads((tmp_path / "index.json").read_text())
    index["blocks"] = [e for e in index["blocks"] if e[0] != _hex(9)]
    (tmp_path / "index.json").write_text(json.dumps(index))
    restarted = _disk(tmp_path)
    assert sorted(restarted._index) == [_hex(0), _hex(1), _hex(3), _hex(9)]
    assert restarted._index[_hex(9)].parent == _hex(3)
    assert not stale.exists() and fresh.exists()
    assert torch.equal(restarted.read(_hex(9)), _block(9))
    (tmp_path / "index.json").write_text("{not json")
    with pytest.warns(RuntimeWarning, match="unreadable"):
        assert len(_disk(tmp_path)) == 4


def test_disk_eviction_removes_chains_from_their_tails(tmp_path):
    size = len(__import__("safetensors.torch").torch.save({"block": _block(0)}, metadata={
        "format": "pagedkv-block", "version": "1", "hash": _hex(0), "parent": _hex(0), "identity": "f" * 64,
        "crc32": "00000000"}))
    disk = _disk(tmp_path, capacity=4 * size)
    chain = [_hex(i) for i in range(3)]
    for i, h in enumerate(chain):
        disk.put(h, chain[i - 1] if i else "", _block(i))
    disk.put(_hex(10), "", _block(10))
    disk.flush()
    disk.touch(reversed(chain))  # the chain was used after block 10: its root is the most recent block
    disk.put(_hex(11), "", _block(11))
    disk.put(_hex(12), "", _block(12))
    disk.flush()
    assert list(disk._index) == [chain[1], chain[0], _hex(11), _hex(12)]  # block 10, then the chain's tail went
    assert disk.num_evictions == 2
    assert not (tmp_path / "blocks" / "00" / f"{chain[2]}.safetensors").exists()


def test_paths_outside_the_directory_are_refused_and_never_read(tmp_path):
    root, outside = tmp_path / "kv", tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret"
    secret.write_bytes(b"not a block")
    disk = _disk(root)
    for bad in ("../../outside/secret", "..", "0" * 63 + "/", "../" + "0" * 61):
        with pytest.raises(TierPathError, match="not a block hash"):
            disk.path(bad)
    link = root / "blocks" / "ab" / f"{'ab' * 32}.safetensors"
    link.parent.mkdir()
    link.symlink_to(secret)
    (root / "blocks" / "cd").symlink_to(outside, target_is_directory=True)
    with pytest.raises(TierPathError, match="outside kv_cache_dir"):
        disk.path("ab" * 32)
    with pytest.raises(TierPathError, match="outside kv_cache_dir"):
        disk.path("cd" * 32)
    disk.close()
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        restarted = _disk(root)
    assert len(restarted) == 0 and restarted.num_refused_paths == 2
    restarted._index["ab" * 32] = _Entry("", 11, 0.0)  # as if a tampered index.json listed it
    with pytest.warns(RuntimeWarning, match="outside kv_cache_dir"):
        assert restarted.read("ab" * 32) is None
    assert "ab" * 32 not in restarted._index
    assert secret.read_bytes() == b"not a block" and link.is_symlink()


def test_a_damaged_block_file_is_a_miss_and_is_removed(tmp_path):
    cache, prefix = make_tiered(kv_cache_dir=str(tmp_path))
    seq, hashes, _ = run_sequence(cache, prefix, TOKENS)
    prefix.release(seq)
    prefix.disk.flush()
    damaged = prefix.disk.path(hashes[1].hex())
    data = bytearray(damaged.read_bytes())
    data[-10] ^= 1
    damaged.write_bytes(bytes(data))
    evict_device(cache)
    with pytest.warns(RuntimeWarning, match="unusable"):
        _, _, num_cached = run_sequence(cache, prefix, TOKENS, seed=1)
    assert num_cached == 1  # the chain ends before the damaged block
    assert prefix.disk.num_bad_files == 1 and not damaged.exists()


def test_a_full_disk_turns_the_disk_tier_off_with_one_warning(tmp_path, monkeypatch):
    cache, prefix = make_tiered(kv_cache_dir=str(tmp_path), cpu_cache_gb=0.01)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            seq, _, _ = run_sequence(cache, prefix, [i] + TOKENS, seed=i)
            prefix.release(seq)
            prefix.disk.flush()
    messages = [str(w.message) for w in caught if "disk tier" in str(w.message)]
    assert len(messages) == 1 and "disk tier off: the disk is full" in messages[0]
    assert prefix.as_dict()["tier_disk_enabled"] is False
    assert len(prefix.host) == 9  # the host tier goes on
    assert not list((tmp_path / "tmp").iterdir())


WRITER = """
import sys, torch
sys.path.insert(0, 'tests')
from test_tiers import _disk, _block, _hex
from pathlib import Path
import time
disk = _disk(Path(sys.argv[1]), capacity=int(sys.argv[2]))
(Path(sys.argv[1]) / f"ready.{sys.argv[3]}").touch()
while len(list(Path(sys.argv[1]).glob("ready.*"))) < 2:  # both processes write at the same time
    time.sleep(0.01)
for i in range(int(sys.argv[3]), int(sys.argv[3]) + 60):
    disk.put(_hex(i), _hex(i - 1), _block(i, 4096))
    if i % 7 == 0:
        disk.flush()
        disk.read(_hex(i - 3))
disk.close()
"""


def test_two_processes_on_one_directory_do_not_corrupt_it(tmp_path):
    root = os.path.dirname(os.path.dirname(__file__))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(40 * 4400), str(start)], cwd=root,
                              stderr=subprocess.PIPE) for start in (0, 30)]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read().decode()
    disk = _disk(tmp_path, capacity=1 << 30)
    assert 0 < len(disk) <= 90
    for h in list(disk._index):
        assert torch.equal(disk.read(h), _block(int(h, 16), 4096)), h
    assert disk.num_bad_files == 0
    assert not list((tmp_path / "tmp").iterdir())
