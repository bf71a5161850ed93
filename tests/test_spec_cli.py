"""Speculative decoding from the outside: `pagedkv generate/serve --speculative`, and /metrics."""

import json

import pytest
from test_cli import assert_clean_error, run_cli

from pagedkv import LLM


def test_bad_speculative_values_get_one_clear_line():
    assert_clean_error(run_cli("generate", "--speculative", "medusa", "hi"), "medusa", "ngram")
    assert_clean_error(run_cli("generate", "--speculative", "ngram", "--num-speculative-tokens", "0", "hi"),
                       "num_speculative_tokens")
    assert_clean_error(run_cli("generate", "--num-speculative-tokens", "3", "hi"), "--speculative")
    assert_clean_error(run_cli("serve", "--speculative", "draft", "--port", "1"), "draft model")


@pytest.mark.slow
def test_generate_with_ngram_speculation_streams_the_answer_and_reports_acceptance():
    prompt = "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank."
    proc = run_cli("generate", "--speculative", "ngram", "--num-speculative-tokens", "6", "--max-new-tokens", "24",
                   "--stats", prompt)
    assert proc.returncode == 0, proc.stderr
    assert "quick brown fox jumps over the lazy dog" in proc.stdout
    stats = json.loads(proc.stderr[proc.stderr.index("{"):])
    assert stats["spec_accepted_tokens"] > 0 and stats["accepted_tokens_per_step"] > 0
    assert stats["paged_attention_calls_by_phase"]["verify"] > 0


def test_metrics_report_acceptance(smollm2):
    from fastapi.testclient import TestClient

    from pagedkv.engine.server import build_app

    model, tok = smollm2
    llm = LLM(model, tokenizer=tok, speculative="ngram:k=4,adaptive=0")
    with TestClient(build_app(llm, ["default"])) as client:
        # a prompt whose greedy continuation repeats it, so n-gram drafts are accepted whatever ran before
        r = client.post("/v1/completions", json={
            "model": "default", "max_tokens": 24, "temperature": 0,
            "prompt": "one two three four five six seven eight. " * 6 + "one two three"})
        assert r.status_code == 200, r.text
        text = client.get("/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert values["pagedkv_spec_accepted_tokens_total"] > 0
    assert values["pagedkv_spec_draft_tokens_total"] >= values["pagedkv_spec_accepted_tokens_total"]
    assert 0 < values["pagedkv_spec_acceptance_rate"] <= 1
