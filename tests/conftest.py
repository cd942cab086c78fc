"""Fixtures: a per-test seeded torch.Generator, the cpu/cuda `device` parametrization, the CUDA
engine held to its multi-launch pipeline (pipeline_only)."""
import zlib

import pytest
import torch

import moe_ext

CUDA = moe_ext.cuda_available()
_NO_CUDA = "needs the CUDA engine and a GPU (moe_ext.cuda_available() is False)"

# Use as @pytest.mark.parametrize("device", DEVICES) or through the `device` fixture: numerics
# tests run on "cpu" and, marked gpu and skipped without a GPU, on "cuda".
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA,
                                                                            reason=_NO_CUDA)]),
]


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason=_NO_CUDA)
    for item in items:
        if "gpu" in item.keywords and not CUDA:
            item.add_marker(skip)


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture
def pipeline_only():
    """The CUDA engine's multi-launch pipeline at every M: the one-launch decode forward
    (test_gpu_decode_fused.py) stays off while the test runs."""
    from helpers import decode_fused
    with decode_fused(False):
        yield


@pytest.fixture
def gen(request):
    """A CPU torch.Generator seeded from the test id: fresh inputs per test, reproducible."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g
