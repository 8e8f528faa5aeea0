"""Shared fixtures: a `device` parameter that covers CPU always and CUDA under the `gpu` marker."""

import pytest
import torch

CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> torch.device:
    """Run a test on CPU, and on CUDA when the `gpu` tests run on a machine that has one."""
    return torch.device(request.param)
