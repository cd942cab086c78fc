"""The DLPack bridge: exchange-API and __dlpack__ paths give the same results and errors."""
import pytest
import torch

import moe_ext
from moe_ext import _C, _bridge


@pytest.fixture
def dlpack_fallback():
    """Forces the __dlpack__ path for one test, then restores the exchange API."""
    _bridge.register(exchange_api=False)
    yield
    _bridge.register()


def _layer(gen):
    layer = moe_ext.FusedMoE(6, 2, 40, 24, params_dtype=torch.float32, has_bias=True)
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return layer


def test_exchange_api_found():
    assert _C.has_exchange_api() == hasattr(torch.Tensor, "__dlpack_c_exchange_api__")


def test_fallback_matches_exchange_api(dlpack_fallback):
    gen = torch.Generator().manual_seed(11)
    layer = _layer(gen)
    x, logits = torch.randn(9, 40, generator=gen), torch.randn(9, 6, generator=gen)
    assert not _C.has_exchange_api()
    slow = layer(x, logits)
    _bridge.register()
    fast = layer(x, logits)
    assert torch.equal(slow, fast)
    assert torch.isfinite(fast).all()


def test_fallback_errors_and_loading(dlpack_fallback):
    gen = torch.Generator().manual_seed(12)
    layer = _layer(gen)
    with pytest.raises(TypeError, match="hidden_states"):
        layer(torch.randn(3, 40, dtype=torch.float64), torch.randn(3, 6))
    with pytest.raises(ValueError, match="hidden_states"):
        layer(torch.randn(40, 3).t(), torch.randn(3, 6))
    w = torch.randn(24, 40, generator=gen)
    layer.weight_loader(layer.w13_weight, w, "experts.w13_weight", shard_id="w3", expert_id=4)
    assert torch.equal(layer.w13_weight[4, 24:], w)


def test_non_tensor_argument_named():
    layer = _layer(torch.Generator().manual_seed(13))
    with pytest.raises(TypeError, match="router_logits"):
        layer(torch.randn(2, 40), [[0.0] * 6] * 2)
