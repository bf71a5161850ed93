import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model (float32) and its tokenizer, loaded once per session."""
    from pagedkv import load_model

    return load_model("default")


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true", help="skip the long SmolLM2 equality runs (marked slow)")


def pytest_configure(config):
    pytest.run_slow = not config.getoption("--quick")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--quick"):
        skip = pytest.mark.skip(reason="--quick given")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
