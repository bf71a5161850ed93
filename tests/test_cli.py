"""`pagedkv generate`: bad input gets one clear line and exit code 2; good input streams an answer."""

import os
import subprocess
import sys

import pytest


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "pagedkv", *args], input=stdin, capture_output=True, text=True,
                          timeout=600)


def assert_clean_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("pagedkv: error:")]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0]


def test_unknown_model_path():
    assert_clean_error(run_cli("generate", "--model", "/no/such/model", "hi"), "/no/such/model", "config.json")


def test_bad_quantization_value_lists_accepted_forms():
    assert_clean_error(run_cli("generate", "--paged-kv-quantization", "q5", "hi"), "q5", "accepted forms")


def test_block_size_zero():
    assert_clean_error(run_cli("generate", "--block-size", "0", "hi"), "block_size")


def test_prompt_longer_than_context_window():
    proc = run_cli("generate", "--no-chat", stdin="word " * 9000)
    assert_clean_error(proc, "context window", "8192")


@pytest.mark.slow
def test_generate_streams_a_coherent_answer_with_stats():
    proc = run_cli("generate", "--max-new-tokens", "24", "--stats", "What is the capital of France?")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert '"paged_attention_calls"' in proc.stderr


def stopped_line(proc, setting):
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("pagedkv: stopped")]
    assert len(lines) == 1, proc.stderr
    assert setting in lines[0] and "--" in lines[0], lines[0]
    return int(lines[0].split("stopped after ")[1].split()[0])


@pytest.mark.slow
def test_generate_ends_cleanly_at_the_context_window_and_at_a_full_pool():
    prompt = "Tell me about rivers."
    env = dict(os.environ, MTPLX_DYNAMIC_PAGED_KV="1", MTPLX_CONTEXT_WINDOW_TOKENS="96")
    window = subprocess.run([sys.executable, "-m", "pagedkv", "generate", "--num-blocks", "2", "--max-new-tokens",
                             "100", prompt], capture_output=True, text=True, timeout=600, env=env)
    num_window = stopped_line(window, "context_window_tokens=96")
    assert 30 < num_window < 96
    # the same text as a generation that ends at --max-new-tokens
    plain = run_cli("generate", "--max-new-tokens", str(num_window), prompt)
    assert plain.returncode == 0 and "pagedkv: stopped" not in plain.stderr
    assert window.stdout == plain.stdout and len(plain.stdout.split()) > 20
    pool = run_cli("generate", "--num-blocks", "4", "--max-new-tokens", "100", prompt)  # 64 tokens, no growth
    num_pool = stopped_line(pool, "num_blocks=4")
    assert num_pool == num_window - 32
    assert pool.stdout.strip() and plain.stdout.startswith(pool.stdout.rstrip("\n"))
