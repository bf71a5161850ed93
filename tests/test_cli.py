"""`pagedkv generate`: bad input gets one clear line and exit code 2; good input streams an answer."""

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
