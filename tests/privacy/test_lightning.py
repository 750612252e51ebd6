"""PyTorch Lightning: DPLightningCallback trains on Poisson batches with secret noise and reports the accountant's
epsilon; Opacus' recipe (make_private inside configure_optimizers, Lightning's own loader) is refused."""

from __future__ import annotations

import importlib
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from equiconvert.lightning import DPLightningCallback
from equiconvert.privacy import make_private
from equiconvert.privacy.accounting import compute_epsilon
from equiconvert.privacy.dp_loader import DPDataLoader
from equiconvert.privacy.lightning_guard import LightningIntegrationError
from tests.support.paths import REPO_ROOT

N, BATCH, DELTA = 64, 8, 1e-3  # 8 Poisson batches an epoch at q = 1/8


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 1, 8, 8, generator=generator), torch.randint(0, 3, (N,), generator=generator))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.conv(x)).mean((2, 3)))


class Classifier(LightningModule):
    """The plain LightningModule the documented snippet trains: the network is its attribute `model`."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Net()
        self.batch_sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.batch_sizes.append(len(y))
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=BATCH, shuffle=True)


def _trainer(callbacks=(), **settings) -> Trainer:
    quiet = dict(enable_progress_bar=False, logger=False, enable_checkpointing=False, enable_model_summary=False)
    return Trainer(accelerator="cpu", devices=1, callbacks=list(callbacks), **{**quiet, "max_steps": 8, **settings})


def _callback(**options) -> DPLightningCallback:
    return DPLightningCallback(noise_multiplier=1.0, max_grad_norm=1.0, target_delta=DELTA, **options)


def test_the_callback_trains_on_poisson_batches_and_reports_the_accountants_epsilon():
    lit, callback = Classifier(), _callback(accountant="rdp")
    trainer = _trainer([callback], max_steps=16)
    trainer.fit(lit)
    assert isinstance(trainer.train_dataloader, DPDataLoader)  # the loader Lightning iterated
    assert len(set(lit.batch_sizes)) > 1  # Poisson: sizes vary (a fixed-size loader always gives 8)
    assert callback.optimizer.steps == trainer.global_step == len(lit.batch_sizes) == 16
    expected = compute_epsilon("rdp", 1.0, BATCH / N, 16, DELTA)
    assert expected > 0 and callback.get_epsilon() == pytest.approx(expected, rel=1e-12)
    assert float(trainer.callback_metrics["epsilon"]) == pytest.approx(expected, rel=1e-6)  # logged at epoch end
    assert type(lit.model) is Net  # the plain network is back after the fit: its state_dict keys are unchanged


def test_target_epsilon_is_calibrated_for_the_trainers_max_steps():
    callback = DPLightningCallback(target_epsilon=4.0, target_delta=DELTA, max_grad_norm=1.0, accountant="rdp")
    _trainer([callback], max_steps=8).fit(Classifier())
    assert callback.optimizer.planned_steps == 8
    assert 3.9 <= callback.get_epsilon() <= 4.0


def _weights_after_fit(callback: DPLightningCallback) -> torch.Tensor:
    torch.manual_seed(0)  # the same initial weights, shuffling and any torch-global draw in both runs
    lit = Classifier()
    _trainer([callback], max_steps=2).fit(lit)
    return torch.cat([p.detach().flatten() for p in lit.parameters()])


def test_noise_and_sampling_are_not_seeded_by_torch_manual_seed():
    first, second = _weights_after_fit(_callback()), _weights_after_fit(_callback())
    assert not torch.allclose(first, second)  # secret noise and batches: the public seed does not fix them
    with pytest.warns(UserWarning, match="NOT differentially private"):
        seeded = [_weights_after_fit(_callback(debug_seed=3)) for _ in range(2)]
    assert torch.equal(seeded[0], seeded[1])  # all else in the fit is reproducible: the difference above is the DP


class OpacusRecipe(Classifier):
    """Opacus' Lightning example with equiconvert's make_private: Lightning keeps iterating its own loader."""

    def __init__(self, whole_module: bool) -> None:
        super().__init__()
        self.whole_module = whole_module

    def configure_optimizers(self):
        module = self if self.whole_module else self.model
        self.private, optimizer, self.dp_loader = make_private(
            module=module,
            optimizer=torch.optim.SGD(self.parameters(), lr=0.5),
            data_loader=self.train_dataloader(),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
        return optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        output = self.private(x) if not self.whole_module else self.private._module.model(x)
        return F.cross_entropy(output, y)


def test_make_private_on_a_lightning_module_is_refused_before_training():
    lit = OpacusRecipe(whole_module=True)
    with pytest.raises(
        LightningIntegrationError, match="make_private was given a LightningModule.*DPLightningCallback"
    ):
        _trainer().fit(lit)


def test_a_step_on_lightnings_own_loader_is_refused_at_the_first_step():
    lit = OpacusRecipe(whole_module=False)
    before = [p.detach().clone() for p in lit.parameters()]
    with pytest.raises(LightningIntegrationError, match="drawn only 0 batch.*DPLightningCallback"):
        _trainer().fit(lit)
    assert all(torch.equal(b, p) for b, p in zip(before, lit.parameters()))  # no update was released


def test_a_closure_step_needs_a_batch_drawn_from_the_poisson_loader():
    model = Net()
    private, optimizer, loader = make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(_data(), batch_size=BATCH),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    x, y = _data().tensors

    def closure(batch=(x[:BATCH], y[:BATCH])):
        loss = F.cross_entropy(private(batch[0]), batch[1])
        loss.backward()
        return loss

    with pytest.raises(LightningIntegrationError, match="drawn only 0 batch"):
        optimizer.step(closure)
    poisson_batch = next(iter(loader))
    optimizer.step(lambda: closure(poisson_batch))
    assert optimizer.steps == 1


class ManualOptimization(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class AlreadyPrivate(Classifier):
    def configure_optimizers(self):
        self.model, optimizer, _ = make_private(
            module=self.model,
            optimizer=torch.optim.SGD(self.parameters(), lr=0.5),
            data_loader=self.train_dataloader(),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
        return optimizer


@pytest.mark.parametrize(
    "module, callback, settings, match",
    [
        (Classifier, {}, {"accumulate_grad_batches": 2}, r"Trainer\(accumulate_grad_batches=...\)"),
        (Classifier, {}, {"gradient_clip_val": 1.0}, r"Trainer\(gradient_clip_val=...\)"),
        (Classifier, {}, {"overfit_batches": 1}, r"Trainer\(overfit_batches=...\): .*not be Poisson"),
        (Classifier, {}, {"precision": "bf16-mixed"}, r"Trainer\(precision=...\)"),
        (Classifier, {"module": "net"}, {}, r"module='net'.*no such nn.Module attribute"),
        (ManualOptimization, {}, {}, "automatic optimization"),
        (AlreadyPrivate, {}, {}, "already made private"),
    ],
)
def test_settings_that_would_break_the_accounting_are_refused_before_any_step(module, callback, settings, match):
    lit = module()
    before = [p.detach().clone() for p in lit.parameters()]
    with pytest.raises(LightningIntegrationError, match=match):
        _trainer([_callback(**callback)], **settings).fit(lit)
    assert all(torch.equal(b, p) for b, p in zip(before, lit.parameters()))


class SwapsTheLoaderBack(Callback):
    """Stands for a Lightning whose fit loop no longer iterates the loader the callback hands it."""

    def on_fit_start(self, trainer, pl_module):
        trainer.fit_loop._data_source.instance = pl_module.train_dataloader()


def test_a_fit_loop_iterating_another_loader_than_the_poisson_one_is_refused():
    lit = Classifier()
    with pytest.raises(LightningIntegrationError, match="not the Poisson loader"):
        _trainer([_callback(), SwapsTheLoaderBack()]).fit(lit)
    assert lit.batch_sizes == []  # refused before the first batch


class Validating(Classifier):
    def validation_step(self, batch, batch_idx):
        return F.cross_entropy(self.model(batch[0]), batch[1])

    def val_dataloader(self):
        return DataLoader(_data(), batch_size=BATCH)


def test_a_resumed_fit_a_second_fit_and_unknown_options_are_refused(tmp_path):
    plain = _trainer(max_steps=1)
    plain.fit(Classifier())
    plain.save_checkpoint(tmp_path / "last.ckpt")
    with pytest.raises(LightningIntegrationError, match=r"fit\(ckpt_path=...\): .*step 0"):
        _trainer([_callback()]).fit(Classifier(), ckpt_path=tmp_path / "last.ckpt")
    _trainer([_callback()]).validate(Validating(), ckpt_path=tmp_path / "last.ckpt")  # evaluating one is fine
    callback, lit = _callback(), Classifier()
    _trainer([callback], max_steps=2).fit(lit)
    with pytest.raises(LightningIntegrationError, match="already accounted a fit"):
        _trainer([callback], max_steps=4).fit(lit)
    with pytest.raises(LightningIntegrationError, match=r"does not take \['noise_generator'\]"):
        _callback(noise_generator=torch.Generator())


def test_a_missing_lightning_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.delitem(sys.modules, "equiconvert.lightning")
    with pytest.raises(ImportError, match=r"pip install -e '\.\[lightning\]'"):
        importlib.import_module("equiconvert.lightning")


def test_the_documented_snippet_runs_and_reports_epsilon(capsys):
    guide = (REPO_ROOT / "docs" / "guides" / "lightning.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", guide, flags=re.DOTALL).group(1)
    exec(compile(snippet, "docs/guides/lightning.md", "exec"), {"__name__": "snippet"})
    epsilon = float(re.search(r"epsilon (\S+) at delta 1e-4", capsys.readouterr().out).group(1))
    assert 0 < epsilon < 100
