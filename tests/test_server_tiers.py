"""`pagedkv serve --kv-cache-dir`: a server restarted on the same directory answers a repeated long prompt
from disk (counted by the tier hit counter in /metrics) with the same completion."""

import subprocess
import time

import httpx
import pytest

from test_server import metrics, start_server

PROMPT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
          "want of a wife. However little known the feelings or views of such a man may be on his first entering "
          "a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
          "considered the rightful property of some one or other of their daughters. ") * 5


def start_kv_server(kv_cache_dir) -> tuple[subprocess.Popen, str]:
    return start_server(["--num-blocks", "128", "--max-model-len", "1024", "--device", "cpu", "--kv-cache-dir",
                         str(kv_cache_dir)])


def complete(base: str) -> dict:
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=300).json()


@pytest.mark.slow
def test_restarted_server_answers_a_repeated_prompt_from_disk(tmp_path):
    proc, base = start_kv_server(tmp_path)
    try:
        first = complete(base)
        num_blocks = first["usage"]["prompt_tokens"] // 16
        assert num_blocks >= 20
        deadline = time.time() + 60  # the writer runs while the server is idle
        while metrics(base)["pagedkv_tier_disk_writes_total"] < num_blocks and time.time() < deadline:
            time.sleep(0.2)
        assert metrics(base)["pagedkv_tier_disk_hits_total"] == 0
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert len(list((tmp_path / "blocks").rglob("*.safetensors"))) >= num_blocks

    proc, base = start_kv_server(tmp_path)
    try:
        second = complete(base)
        m = metrics(base)
        # every full block but the one holding the last prompt token comes from disk
        assert m["pagedkv_tier_disk_hits_total"] >= num_blocks - 1
        assert m["pagedkv_prefix_cache_hit_tokens_total"] == 16 * m["pagedkv_tier_disk_hits_total"]
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.slow
def test_two_servers_on_one_directory_do_not_corrupt_it(tmp_path):
    import json
    import struct
    from concurrent.futures import ThreadPoolExecutor

    from pagedkv.tiers import DiskTier

    servers = [start_kv_server(tmp_path) for _ in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:  # the same blocks written by both at once
            answers = list(pool.map(complete, [base for _, base in servers]))
        assert answers[0]["choices"][0]["text"] == answers[1]["choices"][0]["text"]
        usage = answers[0]["usage"]
        num_blocks = (usage["prompt_tokens"] + usage["completion_tokens"] - 1) // 16  # full computed blocks
        deadline = time.time() + 60
        while time.time() < deadline and min(metrics(base)["pagedkv_tier_disk_blocks"] for _, base in servers) < num_blocks:
            time.sleep(0.2)
    finally:
        for proc, _ in servers:
            proc.terminate()
        for proc, _ in servers:
            proc.wait(timeout=60)
    files = list((tmp_path / "blocks").rglob("*.safetensors"))
    assert len(files) == num_blocks and not list((tmp_path / "tmp").iterdir())
    data = files[0].read_bytes()
    identity = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])["__metadata__"]["identity"]
    disk = DiskTier(tmp_path, 1 << 30, identity)
    assert len(disk) == num_blocks
    assert all(disk.read(h) is not None for h in list(disk._index)) and disk.num_bad_files == 0
    disk.close()
