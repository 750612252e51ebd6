"""The per-example gradient back-end registry (backends.py): what DPTrainer and make_private run, by (method, precision)."""

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from equiconvert.errors import EquiconvertError
from equiconvert.privacy.backends import (
    AUTO,
    AUTO_ORDER,
    BACKENDS,
    PRECISIONS,
    UnknownBackendError,
    backend_for,
    register_backend,
)
from equiconvert.training.dp_config import PER_SAMPLE_METHODS
from equiconvert.privacy.engine import make_private
from equiconvert.training.trainer import DPTrainer

OPTIONS = dict(
    target_epsilon=None,
    noise_multiplier=1.0,
    batch_size=8,
    steps=1,
    aug_mult=2,
    progress=False,
    device="cpu",
    physical_batch_size=8,
    insecure_seeded_noise=True,
    ema_decay=None,
)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)
    )


def _data(n=16):
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=generator), torch.arange(n) % 2


def _spied(monkeypatch, key, field):
    """Replace the registered back-end of `key` by one whose `field` counts its calls (and still computes)."""
    calls = []
    backend = BACKENDS[key]
    original = getattr(backend, field)

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setitem(BACKENDS, key, dataclasses.replace(backend, **{field: spy}))
    return calls


def _step_field(key):
    """What a DP step of the back-end calls: its own clipped sum (ghost clipping), else its per-example gradients."""
    return "compute" if BACKENDS[key].clipped_sum is None else "clipped_sum"


@pytest.mark.parametrize("method, precision", [*sorted(BACKENDS), *((AUTO, p) for p in PRECISIONS)])
def test_the_trainer_computes_with_the_registered_backend_of_its_method_and_precision(monkeypatch, method, precision):
    chosen = (AUTO_ORDER[0] if method == AUTO else method, precision)  # this model passes book-keeping's checks
    calls = _spied(monkeypatch, chosen, _step_field(chosen))
    others = {key: _spied(monkeypatch, key, _step_field(key)) for key in BACKENDS if key != chosen}
    trainer = DPTrainer(_model(), per_sample_method=method, precision=precision, **OPTIONS)
    trainer.fit(_data())
    assert trainer.per_sample_method == chosen[0]
    assert calls, f"the back-end registered for {chosen} did not run"
    assert not any(others.values()), {key: len(c) for key, c in others.items()}


def test_make_private_forms_gradients_with_the_registered_bookkeeping_rules(monkeypatch):
    calls = _spied(monkeypatch, ("bookkeeping", "fp32"), "layer_gradients")
    model = _model()
    images, labels = _data(8)
    with pytest.warns(UserWarning, match="NOT differentially private"):
        private, _, _ = make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(images.float() / 255, labels), batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            debug_seed=0,
        )
    nn.functional.cross_entropy(private(images[:4].float() / 255), labels[:4]).backward()
    grads = private.per_sample_gradients()
    assert len(calls) == 4 and {tuple(g.shape) for g in grads.values()} >= {(4, 4, 3, 3, 3), (4, 2, 4)}


def test_an_unknown_method_and_precision_pair_lists_the_registered_ones():
    with pytest.raises(UnknownBackendError, match="'nosuch' with precision 'fp32'") as caught:
        backend_for("nosuch", "fp32")
    for method, precision in BACKENDS:
        assert f"({method!r}, {precision!r})" in str(caught.value)
    assert isinstance(caught.value, EquiconvertError) and isinstance(caught.value, ValueError)
    with pytest.raises(UnknownBackendError, match="'vmap' with precision 'bf16'.*\\('vmap', 'fp32'\\)"):
        DPTrainer(_model(), per_sample_method="vmap", precision="bf16", **OPTIONS)
    assert PER_SAMPLE_METHODS == (AUTO, *dict.fromkeys(m for m, _ in BACKENDS))


def test_register_backend_refuses_a_taken_pair_and_an_unknown_precision():
    with pytest.raises(ValueError, match="already registered"):
        register_backend("vmap", "fp32")(lambda precision: BACKENDS[("vmap", "fp32")])
    with pytest.raises(ValueError, match="precision must be one of"):
        register_backend("vmap", "fp16")(lambda precision: BACKENDS[("vmap", "fp32")])
    assert ("vmap", "fp16") not in BACKENDS
