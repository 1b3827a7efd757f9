"""The PyTorch twins of benchmarks/torch_twins.py compute what mpidl computes: the same loss and
parameter gradients in float64 from mpidl's weights, given by ``load_weights`` (the pairing in
registration order that step.py and twins_torch.py use, so a wrong pairing of same-shaped
values fails here). Skipped without PyTorch, which is never a dependency of mpidl or of its
tests."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from torch_twins import twin_of  # noqa: E402

from mpidl.engine.backend import get_backend  # noqa: E402
from mpidl.engine.models import build_model  # noqa: E402
from mpidl.engine.nn import SoftmaxCrossEntropy  # noqa: E402

CASES = [("hsicnn", (6, 4, 4), {"channels": (4, 5), "hidden": 7}),
         ("hsicnn_bn", (6, 4, 4), {"channels": (4, 5), "hidden": 7}),
         ("resnet8", (3, 8, 8), {"widths": (4, 6, 8)}),
         ("mlp", (20, 5, 5), {}), ("spectral_lstm", (20, 5, 5), {"group": 6}),
         ("vit", (20, 5, 5), {"dim": 8, "heads": 2}), ("vit", (3, 8, 8), {"patch": 4, "dim": 8, "heads": 4})]


@pytest.mark.parametrize("name, shape, kwargs", CASES)
def test_twin_matches_mpidl_in_float64(name, shape, kwargs):
    model = build_model(name, shape, 3, backend=get_backend("cpu", "float64"), seed=2, **kwargs)
    # the twins are built in float32 (torch's default), so they take float32-rounded values:
    # round mpidl's the same way
    model.params.data[...] = model.params.data.astype(np.float32)
    net = twin_of(model).double()
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, *shape)), np.array([0, 1, 2, 1])
    loss_fn = SoftmaxCrossEntropy()
    loss = loss_fn.forward(model.forward(x), y)
    model.backward(loss_fn.backward())
    torch_loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y))
    torch_loss.backward()
    assert abs(loss - torch_loss.detach().item()) <= 1e-12 * abs(loss)
    torch_grad = np.concatenate([p.grad.numpy().ravel() for p in net.parameters()])
    np.testing.assert_allclose(model.params.grad, torch_grad, rtol=1e-9, atol=1e-12)
