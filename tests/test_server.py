"""`pagedkv serve` through the official OpenAI client and raw HTTP: streaming, errors, disconnects, metrics."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

MAX_MODEL_LEN = 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics").text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}


def start_server(args: list[str], threads: int = 2) -> tuple[subprocess.Popen, str]:
    """`pagedkv serve --port <free> *args` in a subprocess, once /health answers: (process, base URL)."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.Popen([sys.executable, "-m", "pagedkv", "serve", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pagedkv serve exited: {proc.stdout.read().decode()}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("pagedkv serve did not come up in time")


@pytest.fixture(scope="module")
def server():
    proc, base = start_server(["--num-blocks", "256", "--max-model-len", str(MAX_MODEL_LEN), "--device", "cpu"])
    yield base
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


def test_openai_client_streams_a_chat_completion(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    stream = client.chat.completions.create(model="default", messages=messages, stream=True, max_tokens=12,
                                            temperature=0, stream_options={"include_usage": True})
    pieces, finish, usage, roles = [], None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    text = "".join(pieces)
    assert roles[0] == "assistant"
    assert len([p for p in pieces if p]) >= 2 and "Paris" in text
    assert finish in ("stop", "length")
    assert usage.completion_tokens >= 2 and usage.prompt_tokens > 5
    whole = client.chat.completions.create(model="default", messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == text  # greedy: streamed and whole replies agree
    assert whole.choices[0].finish_reason == finish


def test_completions_and_models(client):
    assert [m.id for m in client.models.list().data] == ["default"]
    out = client.completions.create(model="default", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    assert "Paris" in out.choices[0].text
    stopped = client.completions.create(model="default", prompt="The capital of France is", max_tokens=8,
                                        temperature=0, stop=["."])
    assert stopped.choices[0].finish_reason == "stop" and "." not in stopped.choices[0].text


@pytest.mark.parametrize("body, message", [
    (b'{"model": "default", "prompt": "hi", ', "not valid JSON"),
    (json.dumps({"model": "gpt-4", "prompt": "hi"}).encode(), "does not exist"),
    (json.dumps({"model": "default", "prompt": "hi", "max_tokens": -5}).encode(), "max_tokens"),
    (json.dumps({"model": "default", "prompt": "word " * (MAX_MODEL_LEN + 10)}).encode(), "context window"),
    (json.dumps({"model": "default", "prompt": "hi", "temperature": -1}).encode(), "temperature"),
    (json.dumps({"model": "default"}).encode(), "prompt"),
])
def test_bad_requests_get_400_with_an_openai_error_body(server, body, message):
    for route in ("/v1/completions", "/v1/chat/completions"):
        if route.endswith("chat/completions"):
            try:
                obj = json.loads(body)
                obj["messages"] = [{"role": "user", "content": obj.pop("prompt", "")}] if "prompt" in obj else None
                if obj["messages"] is None:
                    obj.pop("messages")
                payload = json.dumps(obj).encode()
            except json.JSONDecodeError:
                payload = body
            if message == "prompt":
                message = "messages"
        else:
            payload = body
        r = httpx.post(f"{server}{route}", content=payload, headers={"content-type": "application/json"})
        assert r.status_code == 400, (route, r.text)
        error = r.json()["error"]
        assert message in error["message"] and error["type"] == "invalid_request_error"
    assert httpx.get(f"{server}/health").status_code == 200


def test_openai_client_sees_bad_request_errors(client):
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="context window"):
        client.completions.create(model="default", prompt="word " * (MAX_MODEL_LEN + 10), max_tokens=2)


async def _stream_one(base: str, i: int, disconnect: bool) -> dict:
    body = {"model": "default", "messages": [{"role": "user", "content": f"Count from {i} to {i + 20}."}],
            "stream": True, "temperature": 0, "max_tokens": 200 if disconnect else 6, "ignore_eos": disconnect}
    chunks = []
    async with httpx.AsyncClient(timeout=300) as http:
        async with http.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return {"done": True, "chunks": chunks}
                chunks.append(json.loads(line[6:]))
                if disconnect and any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chunks):
                    return {"done": False, "chunks": chunks}  # leaving the block closes the connection
    return {"done": False, "chunks": chunks}


def test_fifty_concurrent_streams_with_ten_disconnects(server):
    async def main():
        return await asyncio.gather(*(_stream_one(server, i, disconnect=i % 5 == 0) for i in range(50)))

    results = asyncio.run(main())
    completed = [r for i, r in enumerate(results) if i % 5 != 0]
    assert len(completed) == 40
    for r in completed:
        assert r["done"]
        finishes = [c["choices"][0]["finish_reason"] for c in r["chunks"] if c["choices"]]
        assert finishes[-1] in ("stop", "length")
    deadline = time.time() + 120
    while time.time() < deadline:
        m = metrics(server)
        if m["pagedkv_requests_running"] == 0 and m["pagedkv_requests_waiting"] == 0:
            break
        time.sleep(0.5)
    # the disconnected requests (200 tokens each, ignoring EOS) were aborted, not run to the end
    assert m["pagedkv_requests_running"] == 0 and m["pagedkv_requests_waiting"] == 0
    assert m["pagedkv_kv_blocks_used"] == 0 and m["pagedkv_kv_block_usage"] == 0
    assert m["pagedkv_generation_tokens_total"] < 40 * 6 + 10 * 100
    assert httpx.get(f"{server}/health").status_code == 200
    r = httpx.post(f"{server}/v1/completions", json={"model": "default", "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200


def test_metrics_are_prometheus_text(server):
    r = httpx.get(f"{server}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = metrics(server)
    for name in ("pagedkv_requests_running", "pagedkv_requests_waiting", "pagedkv_kv_blocks_used",
                 "pagedkv_kv_block_usage", "pagedkv_prefix_cache_hit_rate", "pagedkv_generation_tokens_total"):
        assert name in m
    assert "# TYPE pagedkv_generation_tokens_total counter" in r.text
    assert m["pagedkv_generation_tokens_total"] > 0


@pytest.mark.parametrize("field, value", [("best_of_luck", 3), ("response_format", {"type": "json_object"}),
                                          ("tools", [{"type": "function", "function": {"name": "f"}}])])
def test_a_field_the_server_does_not_implement_gets_400_naming_it(server, field, value):
    bodies = {"/v1/completions": {"model": "default", "prompt": "hi", "max_tokens": 1},
              "/v1/chat/completions": {"model": "default", "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 1}}
    for route, body in bodies.items():
        r = httpx.post(f"{server}{route}", json={**body, field: value})
        assert r.status_code == 400, (route, r.text)
        error = r.json()["error"]
        assert field in error["message"] and error["param"] == field and error["type"] == "invalid_request_error"
    r = httpx.post(f"{server}/v1/chat/completions", json={**bodies["/v1/chat/completions"],
                                                          "messages": [{"role": "user", "content": "hi", "x": 1}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.x"


def test_fields_clients_send_by_default_are_accepted(client):
    out = client.completions.create(model="default", prompt="Hi", max_tokens=1, user="u-1", presence_penalty=0,
                                    frequency_penalty=0, logit_bias=None, stream=False)
    assert out.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi", "name": "me"}],
                                          max_tokens=1, user="u-1", stream=True,
                                          stream_options={"include_usage": True}, tool_choice="none")
    assert any(c.usage is not None for c in chat)


def _reference_logprobs(smollm2, token_ids: list[int]):
    """[len(token_ids) - 1, vocab]: transformers' own log-softmax (float32, CPU) predicting token_ids[1:]."""
    import torch

    with torch.no_grad():
        return smollm2[0](torch.tensor([token_ids])).logits[0, :-1].float().log_softmax(-1)


def test_echo_logprobs_of_the_prompt_equal_transformers_log_softmax(server, smollm2):
    tokenizer = smollm2[1]
    text = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = tokenizer(text).input_ids
    ref = _reference_logprobs(smollm2, ids)
    for prompt in (text, ids):  # a string, and token ids as lm-evaluation-harness sends them
        r = httpx.post(f"{server}/v1/completions", json={"model": "default", "prompt": prompt, "max_tokens": 0,
                                                         "echo": True, "logprobs": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"] == text and r.json()["usage"]["completion_tokens"] == 0
        assert lp["tokens"] == [tokenizer.decode([t]) for t in ids] and "".join(lp["tokens"]) == text
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(ids))]
        for i, t in enumerate(ids[1:]):
            assert abs(lp["token_logprobs"][i + 1] - ref[i, t].item()) < 1e-4
            top = ref[i].topk(2)
            expected = {tokenizer.decode([j]): v for j, v in zip(top.indices.tolist(), top.values.tolist())}
            expected.setdefault(tokenizer.decode([t]), ref[i, t].item())
            got = lp["top_logprobs"][i + 1]
            assert got.keys() == expected.keys() and all(abs(got[k] - expected[k]) < 1e-4 for k in got)


def test_completion_logprobs_through_the_openai_client(client, smollm2):
    out = client.completions.create(model="default", prompt="The capital of France is", max_tokens=3, temperature=0,
                                    logprobs=1, echo=True)
    choice = out.choices[0]
    prompt_ids = smollm2[1]("The capital of France is").input_ids
    assert choice.text.startswith("The capital of France is") and out.usage.completion_tokens == 3
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt_ids) + 3 and lp.token_logprobs[0] is None
    ids = prompt_ids + [smollm2[1].convert_tokens_to_ids(smollm2[1].tokenize(t))[0] for t in lp.tokens[-3:]]
    ref = _reference_logprobs(smollm2, ids)
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) < 1e-4
    # greedy: each generated token is the most likely one, so it is its own top-1 alternative
    assert all(max(top, key=top.get) == tok for top, tok in zip(lp.top_logprobs[-3:], lp.tokens[-3:]))
    # streamed, the same request's logprobs arrive piece by piece and equal the whole answer's. (Against the echo
    # answer above only to 1e-4: with echo the prefill keeps a logits row per prompt token, and a matrix product
    # over more rows may round the first new token's row differently in float32.)
    plain = client.completions.create(model="default", prompt="The capital of France is", max_tokens=3,
                                      temperature=0, logprobs=1).choices[0].logprobs
    assert plain.tokens == lp.tokens[-3:]
    assert all(abs(a - b) < 1e-4 for a, b in zip(plain.token_logprobs, lp.token_logprobs[-3:]))
    streamed = client.completions.create(model="default", prompt="The capital of France is", max_tokens=3,
                                         temperature=0, logprobs=1, stream=True)
    pieces = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for p in pieces for t in p.tokens] == plain.tokens
    assert [x for p in pieces for x in p.token_logprobs] == plain.token_logprobs


def test_chat_logprobs_and_top_logprobs(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = client.chat.completions.create(model="default", messages=messages, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token  # greedy
        assert abs(c.top_logprobs[0].logprob - c.logprob) < 1e-6 and c.bytes == list(c.token.encode())
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob >= c.top_logprobs[2].logprob
    plain = client.chat.completions.create(model="default", messages=messages, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == out.choices[0].message.content
    streamed = client.chat.completions.create(model="default", messages=messages, max_tokens=5, temperature=0,
                                              logprobs=True, stream=True)
    tokens = [c.token for ch in streamed if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert tokens == [c.token for c in content]


@pytest.mark.parametrize("route, extra, param", [
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"echo": True, "stream": True}, "echo"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
])
def test_bad_logprobs_requests_get_400(server, route, extra, param):
    body = {"model": "default", "prompt": "hi"} if route == "/v1/completions" else \
        {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{server}{route}", json={**body, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_n_samples_on_both_endpoints_and_in_streams(client):
    prompts = ["The capital of France is", "Once upon a time"]
    out = client.completions.create(model="default", prompt=prompts, n=2, max_tokens=4, temperature=1.0, seed=3)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3] and out.usage.completion_tokens == 16
    by_index = {c.index: c.text for c in out.choices}
    single = client.completions.create(model="default", prompt=prompts[1], max_tokens=4, temperature=1.0, seed=4)
    assert by_index[3] == single.choices[0].text  # prompt 1, sample 1: seed 3 + 1
    streamed = client.completions.create(model="default", prompt=prompts[0], n=2, max_tokens=4, temperature=1.0,
                                         seed=3, stream=True)
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
            finishes[c.index] = c.finish_reason or finishes.get(c.index)
    assert texts == {0: by_index[0], 1: by_index[1]} and finishes == {0: "length", 1: "length"}
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model="default", messages=messages, n=3, max_tokens=5, temperature=1.0,
                                          seed=9)
    assert [c.index for c in chat.choices] == [0, 1, 2] and 3 <= chat.usage.completion_tokens <= 15
    streamed = client.chat.completions.create(model="default", messages=messages, n=3, max_tokens=5,
                                              temperature=1.0, seed=9, stream=True)
    replies = {0: "", 1: "", 2: ""}
    for chunk in streamed:
        for c in chunk.choices:
            replies[c.index] += c.delta.content or ""
    assert replies == {c.index: c.message.content for c in chat.choices}


def test_penalties_and_logit_bias_reach_the_sampler(server):
    body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    plain = httpx.post(f"{server}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    biased = httpx.post(f"{server}/v1/completions", json={**body, "logit_bias": {"42": 100}, "echo": False,
                                                          "presence_penalty": 0.5, "frequency_penalty": 0.5}, timeout=120)
    assert biased.status_code == 200 and biased.json()["choices"][0]["text"] != plain
    chat = httpx.post(f"{server}/v1/chat/completions", json={
        "model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "min_tokens": 3,
        "repetition_penalty": 1.1}, timeout=120)
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 3
    for field, value in (("presence_penalty", 3), ("logit_bias", {"x": 1}), ("logit_bias", {"999999": 1})):
        r = httpx.post(f"{server}/v1/completions", json={**body, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
