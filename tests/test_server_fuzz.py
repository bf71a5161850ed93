"""`pagedkv serve` fuzzed from its own OpenAPI schema (schemathesis): every generated request, valid or not,
gets a 2xx or a 4xx with the OpenAI error body, never a 5xx, and the server stays healthy.

A tiny random-weight Llama with the default model's tokenizer (and chat template) keeps each generation short.
"""

import json
import time

import httpx
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from pagedkv.models import resolve_model_dir
from test_server import metrics, start_server

MAX_EXAMPLES = 150  # per generation mode; the whole file runs in about a minute on two cores


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir("default")[0]))
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir):
    proc, base = start_server(["--model", str(tiny_model_dir), "--num-blocks", "64", "--max-model-len", "96",
                               "--device", "cpu", "--served-model-name", "tiny"], threads=1)
    yield base
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    assert b"Traceback" not in out, out.decode()[-4000:]


def assert_openai_answer(case, response) -> int:
    """Check one answer; returns its status."""
    where = f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text[:500]!r}"
    assert response.status_code < 500, where
    assert 200 <= response.status_code < 300 or 400 <= response.status_code < 500, where
    if response.status_code >= 400:
        if response.status_code in (404, 405):  # routing (FastAPI's own body), not an API request
            return response.status_code
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], where
        assert error["type"] == "invalid_request_error" and "param" in error and "code" in error, where
        return response.status_code
    if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        # schemathesis reads a stream's first chunks and hangs up (a client that disconnects): every whole
        # event it got is a chunk, never an error event
        events = response.text.split("\n\n")[:-1]
        assert events and all(e.startswith("data: ") for e in events), where
        chunks = [json.loads(e[len("data: "):]) for e in events if e != "data: [DONE]"]
        assert chunks and all("choices" in c and "error" not in c for c in chunks), where
    elif case.path.startswith("/v1/") and case.method == "POST":
        assert response.json()["choices"], where
    return response.status_code


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_every_generated_request_gets_2xx_or_an_openai_4xx(tiny_server, mode):
    schema = schemathesis.openapi.from_url(f"{tiny_server}/openapi.json")
    operations = schema.include(path_regex="^/v1/").as_strategy(generation_mode=mode)
    statuses = []

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operations)
    def check(case):
        statuses.append(assert_openai_answer(case, case.call(base_url=tiny_server, timeout=60)))

    check()
    ok = sum(200 <= s < 300 for s in statuses)
    # valid requests mostly generate; invalid ones are all refused
    assert (ok >= len(statuses) // 3) if mode == GenerationMode.POSITIVE else (ok <= len(statuses) // 10), statuses
    assert httpx.get(f"{tiny_server}/health", timeout=5).status_code == 200
    deadline = time.time() + 30  # disconnected streams are aborted at the next step boundary
    while metrics(tiny_server)["pagedkv_kv_blocks_used"] and time.time() < deadline:
        time.sleep(0.2)
    stats = metrics(tiny_server)
    assert stats["pagedkv_kv_blocks_used"] == 0
    assert stats["pagedkv_requests_running"] == 0 and stats["pagedkv_requests_waiting"] == 0
