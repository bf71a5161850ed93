"""`pagedkv eval`: format lists, measurement helpers, and one small end-to-end run on the default model."""

import json
from pathlib import Path

import pytest
import torch

from pagedkv import ConfigError, KVFormat
from pagedkv.cli import main
from pagedkv.evaluate import EvalFormat, bytes_per_token_per_head, parse_formats, position_buckets
from pagedkv.passkey import passkey_trial

TEXT = Path(__file__).parent / "data" / "pride-and-prejudice-opening.txt"


def test_format_lists_keep_turboquant_options_with_their_format_and_put_off_first():
    fmts = parse_formats(["q8,turboquant:k=q4_0,v=q4_0,rotate_keys,boundary_layers=2", "turboquant,off"])
    assert [f.label for f in fmts] == [
        "off", "q8", "turboquant:k=q4_0,v=q4_0,rotate_keys,boundary_layers=2", "turboquant:k=q8_0,v=q3_0"]
    assert fmts[2] == EvalFormat(KVFormat(kind="turboquant", k_quant="q4_0", v_quant="q4_0", rotate_keys=True), 2)


def test_the_boundary_option_applies_to_quantized_formats_that_give_none():
    fmts = parse_formats("off,q4,q8:boundary_layers=1", boundary_layers=3)
    assert [(f.label, f.boundary_layers) for f in fmts] == [("off", 0), ("q4:boundary_layers=3", 3),
                                                            ("q8:boundary_layers=1", 1)]


@pytest.mark.parametrize("bad", ["q9", "rotate_keys,q8", "turboquant:k=q3_0", "q8:boundary_layers=x"])
def test_bad_format_lists_raise_config_errors(bad):
    with pytest.raises(ConfigError):
        parse_formats(bad)


def test_bytes_per_token_average_over_layers_with_dense_boundary_layers():
    tq = EvalFormat(KVFormat.parse("turboquant"))
    assert bytes_per_token_per_head(tq, 30, 128, torch.bfloat16) == 200
    bounded = EvalFormat(KVFormat.parse("turboquant"), boundary_layers=2)
    # 4 dense bfloat16 layers (2 x 128 x 2 bytes) and 26 TurboQuant layers
    assert bytes_per_token_per_head(bounded, 30, 128, torch.bfloat16) == pytest.approx((4 * 512 + 26 * 200) / 30)


def test_position_buckets_double_up_to_the_length():
    assert position_buckets(3000) == [(0, 256), (256, 512), (512, 1024), (1024, 2048), (2048, 3000)]
    assert position_buckets(100) == [(0, 100)]


def test_passkey_prompts_have_about_the_asked_length_and_hide_the_key_at_the_depth(smollm2):
    _, tokenizer = smollm2
    for depth in (0.0, 0.5, 1.0):
        trial = passkey_trial(tokenizer, 1024, depth, seed=3)
        assert 1024 - 30 <= trial.prompt_ids.shape[0] + trial.answer_ids.shape[0] <= 1024
        text = tokenizer.decode(trial.prompt_ids)
        key = tokenizer.decode(trial.answer_ids).strip()
        assert len(key) == 5 and key.isdigit()
        where = text.index(f"The pass key is {key}") / len(text)
        assert abs(where - depth) < 0.1
        assert text.endswith("What is the pass key? The pass key is")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pagedkv.ops.PagedKVFallbackWarning")
def test_eval_writes_a_table_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "q.json", tmp_path / "q.png"
    rc = main(["eval", "--model", "default", "--text", str(TEXT), "--formats", "off,q8,turboquant",
               "--window", "256", "--max-tokens", "512", "--profile-tokens", "300", "--passkey-lengths", "200",
               "--passkey-depths", "0.5", "--json", str(out_json), "--plot", str(out_png), "--no-progress"])
    assert rc == 0
    report = json.loads(out_json.read_text())
    assert report["complete"] is True
    assert report["command"].startswith("pagedkv eval --model default --text ") and "--window 256" in report["command"]
    assert report["scored_tokens"] == 256 and report["num_windows"] == 2
    res = report["formats"]
    assert list(res) == ["off", "q8", "turboquant:k=q8_0,v=q3_0"]
    off, q8, tq = res.values()
    assert off["kl"] == 0 and off["top1"] == 1 and off["ppl_increase_pct"] == 0 and off["ppl_increase_se_pct"] == 0
    # the paired standard error of the increase: none for off itself, growing with the distortion
    assert 0 < q8["ppl_increase_se_pct"] < tq["ppl_increase_se_pct"] < 10
    assert 1 < off["ppl"] < 100
    assert 0 < q8["kl"] < tq["kl"] < 0.2 and q8["top1"] > 0.9
    assert [r["bytes_per_token_per_head"] for r in res.values()] == [512, 136, 100]  # float32 model, head_dim 64
    assert [r["bytes_per_token_per_head_d128"] for r in res.values()] == [1024, 264, 200]
    assert off["profile"]["buckets"] == [[0, 256], [256, 300]] and len(off["profile"]["ppl"]) == 2
    assert set(off["passkey"]) == {"200"} and off["passkey"]["200"] in (0.0, 1.0)
    assert off["passkey_by_depth"] == {"200": {"0.5": int(off["passkey"]["200"])}}
    table = capsys.readouterr().out
    assert "| `turboquant:k=q8_0,v=q3_0` | 100 | 200 |" in table
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_reports_a_bad_format_without_a_traceback(capsys):
    assert main(["eval", "--text", str(TEXT), "--formats", "off,q5"]) == 2
    err = capsys.readouterr().err
    assert "unknown page format 'q5'" in err and "accepted forms" in err and "Traceback" not in err


def test_passkey_lengths_accept_k_suffixes():
    from pagedkv.evaluate import _ints

    assert _ints("1k,2K, 3000,") == (1024, 2048, 3000)


def make_tiny_runner(dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedkv.evaluate import Runner
    from pagedkv.hf import cache_kwarg, switch_model

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         max_position_embeddings=512)).to(dtype).eval()
    switch_model(model)
    return Runner(model, cache_kwarg(model))


@pytest.fixture(scope="module")
def tiny_runner():
    return make_tiny_runner()


@pytest.mark.filterwarnings("ignore::pagedkv.ops.PagedKVFallbackWarning")
def test_scoring_in_block_steps_matches_one_prefill_for_off(tiny_runner):
    from pagedkv.evaluate import profile_scores

    ids = torch.randint(0, 97, (70,), generator=torch.Generator().manual_seed(1))
    off = parse_formats("off")[0]
    whole = tiny_runner.forward(tiny_runner.cache(off), ids[None, :-1], step=1024)
    expected = -whole.gather(-1, ids[1:, None]).squeeze(-1).double()
    nll, kl = profile_scores(tiny_runner, [off], ids)[off]
    torch.testing.assert_close(nll, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(kl, torch.zeros(69, dtype=torch.float64))


@pytest.fixture
def forward_sizes(tiny_runner, monkeypatch):
    """The number of tokens of every forward of the tiny model, in order."""
    seen = []
    forward = type(tiny_runner.model).forward

    def counting(self, input_ids=None, **kw):
        seen.append(input_ids.shape[1])
        return forward(self, input_ids=input_ids, **kw)

    monkeypatch.setattr(type(tiny_runner.model), "forward", counting)
    return seen


@pytest.mark.filterwarnings("ignore::pagedkv.ops.PagedKVFallbackWarning")
def test_the_profile_steps_a_window_format_one_block_per_forward(tiny_runner, forward_sizes, monkeypatch):
    import pagedkv.evaluate as evaluate

    monkeypatch.setattr(evaluate, "PROFILE_CHUNK", 32)
    fmts = parse_formats("off,q4,q4:recent_tokens=16")
    evaluate.measure_profile(tiny_runner, fmts, torch.arange(40) % 97)
    # lockstep chunks of 32 tokens (then the last 7): off and q4 in one forward each, the window format by blocks
    assert forward_sizes == [32, 32, 16, 16, 7, 7, 7]


@pytest.mark.filterwarnings("ignore::pagedkv.ops.PagedKVFallbackWarning")
def test_the_profile_of_a_format_without_a_window_equals_block_steps(monkeypatch):
    """Without a dense window, a chunk in one forward writes every token before attending, as block steps
    do: the same scores up to float rounding. In float64: in float32, a forward of 21 rows and one of 5
    round a row's log-softmax differently (1 ulp), as much as this model's KL (~1e-7)."""
    import pagedkv.evaluate as evaluate

    tiny_runner = make_tiny_runner(torch.float64)
    ids = torch.randint(0, 97, (150,), generator=torch.Generator().manual_seed(3))
    fmts = parse_formats("off,q4")
    chunked = evaluate.profile_scores(tiny_runner, fmts, ids)
    monkeypatch.setattr(evaluate, "PROFILE_CHUNK", 16)
    stepped = evaluate.profile_scores(tiny_runner, fmts, ids)
    for f in fmts:
        torch.testing.assert_close(chunked[f][0], stepped[f][0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(chunked[f][1], stepped[f][1], rtol=1e-6, atol=1e-9)
    q4_vs_off = (chunked[fmts[1]][0] - chunked[fmts[0]][0]).abs().max()
    assert float(q4_vs_off) > 1e-3   # q4 scores differ from off's far beyond the tolerance: the test can fail


@pytest.mark.filterwarnings("ignore::pagedkv.ops.PagedKVFallbackWarning")
def test_windows_score_a_recent_window_format_in_block_steps(tiny_runner, forward_sizes):
    """The perplexity windows: one forward for the scored half of a format without a dense recent window,
    block steps for one with it (each token then reads the window it would read in generation)."""
    from pagedkv.evaluate import window_logprobs

    ids = torch.arange(80) % 97
    _, plain, windowed = parse_formats("q4,q4:recent_tokens=16")   # ("off" comes first)
    window_logprobs(tiny_runner, plain, ids)
    assert forward_sizes == [40, 39]
    forward_sizes.clear()
    lp = window_logprobs(tiny_runner, windowed, ids)
    assert forward_sizes == [40, 16, 16, 7] and lp.shape[0] == 40


@pytest.mark.filterwarnings("ignore::pagedkv.ops.PagedKVFallbackWarning")
def test_the_profile_reports_increase_se_and_kl_against_off(tiny_runner):
    from pagedkv.evaluate import measure_profile

    ids = torch.randint(0, 97, (300,), generator=torch.Generator().manual_seed(2))
    fmts = parse_formats("off,q4")
    prof = measure_profile(tiny_runner, fmts, ids)
    off, q4 = prof[fmts[0]], prof[fmts[1]]
    assert off["buckets"] == [[0, 256], [256, 300]]
    assert off["ppl_increase_pct"] == [0, 0] and off["ppl_increase_se_pct"] == [0, 0] and off["kl"] == [0, 0]
    assert all(k > 0 for k in q4["kl"]) and all(e > 0 for e in q4["ppl_increase_se_pct"])
    assert len(q4["ppl"]) == len(q4["ppl_increase_pct"]) == 2
