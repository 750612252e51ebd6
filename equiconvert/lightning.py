"""DP-SGD under PyTorch Lightning that keeps make_private's guarantee: `DPLightningCallback`.

    trainer = Trainer(max_epochs=3, callbacks=[DPLightningCallback(noise_multiplier=1.0, max_grad_norm=1.0,
                                                                   target_delta=1e-5)])

At fit start the callback runs make_private on the LightningModule's network (attribute `module`, "model" by
default) with the optimizer `configure_optimizers` returned and the DataLoader the fit would train on, puts the
private module and optimizer in their places and gives Lightning the Poisson loader to iterate: the batches Lightning
trains on are the ones the accountant assumes, and the noise comes from make_private's secret generators. It logs
"epsilon" each epoch and refuses (LightningIntegrationError, before the first batch) the Trainer settings under which
that would not hold. Needs the extra: pip install -e '.[lightning]' in the clone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ModuleNotFoundError as _missing:  # only a missing Lightning becomes this error; a broken one re-raises
    if _missing.name not in ("lightning", "lightning.pytorch"):
        raise
    raise ImportError(
        "equiconvert.lightning needs PyTorch Lightning: pip install -e '.[lightning]' in the clone of equiconvert "
        "(or pip install lightning)"
    ) from _missing

from torch import nn
from torch.utils.data import DataLoader

from .privacy.dp_loader import DPDataLoader
from .privacy.dp_optimizer import DPOptimizer
from .privacy.engine import make_private
from .privacy.lightning_guard import LightningIntegrationError
from .privacy.private_module import PrivateModule

# make_private's keywords the callback passes through (their defaults stay make_private's); it sets the others
OPTIONS = ("accountant", "aug_mult", "loss_reduction", "debug_seed", "verify")
PRECISIONS = ("32-true", "64-true")  # per-example gradients of an unscaled loss, in the model's own dtype

# Trainer settings a private fit cannot honour: Trainer argument -> (whether the trainer has it, why and what to do)
_TRAINER_REFUSALS: dict[str, tuple[Callable[[Trainer], bool], str]] = {
    "accumulate_grad_batches": (
        lambda trainer: trainer.accumulate_grad_batches != 1,
        "each optimizer step must take one Poisson batch and one noise draw; leave it 1 and raise the DataLoader's "
        "batch_size instead",
    ),
    "gradient_clip_val": (
        lambda trainer: bool(trainer.gradient_clip_val),
        "DP-SGD clips each example's gradient to max_grad_norm itself; leave gradient_clip_val unset",
    ),
    "devices": (
        lambda trainer: trainer.world_size > 1,
        "the callback trains in one process; for several GPUs use equiconvert's DP trainer (docs/multi-gpu.md)",
    ),
    "precision": (
        lambda trainer: trainer.precision not in PRECISIONS,
        f"DP-SGD needs the per-example gradients of an unscaled loss; use one of {PRECISIONS}",
    ),
    "overfit_batches": (
        lambda trainer: trainer.overfit_batches > 0,
        "it replaces the training sampler with a fixed one, so batches would not be Poisson; leave it 0",
    ),
}


class DPLightningCallback(Callback):
    """Make a Lightning fit DP-SGD with Poisson batches, secret noise and epsilon accounting (module docstring).

    Args:
        max_grad_norm: the per-example clipping norm.
        target_delta: the delta epsilon is reported at (and calibrated for).
        noise_multiplier: the noise standard deviation over max_grad_norm; give it or target_epsilon.
        target_epsilon: the budget the noise is calibrated for, over the Trainer's max_steps, else max_epochs.
        module: the LightningModule's attribute holding the network its training_step calls.
        **options: make_private's accountant, aug_mult, loss_reduction, debug_seed, verify.

    Raises:
        LightningIntegrationError: an option make_private does not take (here), or, when the fit starts, a
            Trainer setting or module that would break the accounting.
    """

    def __init__(
        self,
        *,
        max_grad_norm: float,
        target_delta: float,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        module: str = "model",
        **options: Any,
    ) -> None:
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise LightningIntegrationError(
                f"DPLightningCallback does not take {unknown}; its make_private options are {OPTIONS}"
            )
        self.max_grad_norm, self.target_delta = max_grad_norm, target_delta
        self.noise_multiplier, self.target_epsilon = noise_multiplier, target_epsilon
        self.module_name, self.options = module, options
        self.optimizer: DPOptimizer | None = None  # the DP optimizer of the fit, once it started
        self._loader: DPDataLoader | None = None
        self._restore: list[Callable[[], None]] = []

    # --- before configure_optimizers: the Trainer and the module ------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.optimizer is not None:
            raise LightningIntegrationError(
                "this DPLightningCallback has already accounted a fit; a second fit would restart its accountant "
                "at step 0: give the new fit a new callback and add up the epsilons of both"
            )
        for argument, (has_it, why) in _TRAINER_REFUSALS.items():
            if has_it(trainer):
                raise LightningIntegrationError(f"DPLightningCallback: Trainer({argument}=...): {why}")
        if not pl_module.automatic_optimization:
            raise LightningIntegrationError(
                "DPLightningCallback needs automatic optimization (one optimizer step per Poisson batch); leave "
                "LightningModule.automatic_optimization True"
            )
        if any(isinstance(m, PrivateModule) for m in pl_module.modules()):
            raise LightningIntegrationError(
                "the LightningModule already holds a module made private elsewhere; give the callback the plain "
                "model and optimizer, it calls make_private itself"
            )
        self._network(pl_module)

    def _network(self, pl_module: LightningModule) -> nn.Module:
        network = getattr(pl_module, self.module_name, None)
        if not isinstance(network, nn.Module):
            raise LightningIntegrationError(
                f"DPLightningCallback(module={self.module_name!r}): {type(pl_module).__name__} has no such "
                "nn.Module attribute; pass the name of the attribute holding the network training_step calls"
            )
        return network

    # --- after configure_optimizers, before the first batch: make the fit private --------------------------------
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.ckpt_path is not None:  # set once the checkpoint is read, before the training state is restored
            raise LightningIntegrationError(
                "DPLightningCallback: fit(ckpt_path=...): a resumed fit's accountant would start at step 0 and miss "
                "the steps before, so its epsilon would be too small; train from the start"
            )
        optimizer = self._single_optimizer(trainer)
        source = trainer.fit_loop._data_source  # where Lightning will ask for the training loader
        loader = source.dataloader()
        if not isinstance(loader, DataLoader) or isinstance(loader, DPDataLoader):
            raise LightningIntegrationError(
                "DPLightningCallback needs the training data as one torch DataLoader of a map-style dataset (from "
                f"train_dataloader() or fit(train_dataloaders=...)), got {type(loader).__name__}; the callback "
                "makes it Poisson itself"
            )
        network = self._network(pl_module)
        private, dp_optimizer, dp_loader = make_private(
            module=network,
            optimizer=optimizer,
            data_loader=loader,
            max_grad_norm=self.max_grad_norm,
            noise_multiplier=self.noise_multiplier,
            target_epsilon=self.target_epsilon,
            target_delta=self.target_delta,
            **self._plan(trainer),
            **self.options,
        )
        setattr(pl_module, self.module_name, private)
        trainer.strategy.optimizers = [dp_optimizer]
        original_source = source.instance
        source.instance = dp_loader
        self._restore = [
            lambda: setattr(pl_module, self.module_name, network),
            lambda: setattr(source, "instance", original_source),
        ]
        self.optimizer, self._loader = dp_optimizer, dp_loader

    def _single_optimizer(self, trainer: Trainer) -> Any:
        (optimizer,) = trainer.optimizers  # automatic optimization: Lightning refuses several optimizers itself
        if isinstance(optimizer, DPOptimizer):
            raise LightningIntegrationError(
                "configure_optimizers returned an optimizer already made private (make_private inside "
                "configure_optimizers, Opacus' recipe); return the plain optimizer, the callback calls make_private"
            )
        return optimizer

    def _plan(self, trainer: Trainer) -> dict[str, Any]:
        """The fit's length, for calibrating target_epsilon: max_steps where set, else max_epochs."""
        if self.target_epsilon is None:
            return {}
        if trainer.max_steps > 0:
            return {"steps": trainer.max_steps}
        if trainer.max_epochs is None or trainer.max_epochs < 1:
            raise LightningIntegrationError(
                "DPLightningCallback(target_epsilon=...) calibrates the noise for the fit's length: give the Trainer "
                "max_epochs or max_steps"
            )
        return {"epochs": trainer.max_epochs}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.train_dataloader is not self._loader:
            raise LightningIntegrationError(
                f"Lightning iterates {type(trainer.train_dataloader).__name__}, not the Poisson loader the callback "
                "gave it, so the epsilon would be wrong; this Lightning version is not supported by "
                "DPLightningCallback"
            )

    # --- during and after the fit ---------------------------------------------------------------------------------
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        pl_module.log("epsilon", self.get_epsilon(), prog_bar=True)

    def get_epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent by the fit's optimizer steps so far, at `delta` (target_delta by default)."""
        if self.optimizer is None:
            return 0.0
        return self.optimizer.get_epsilon(self.target_delta if delta is None else delta)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Put the plain network back (its state_dict keys unchanged) and the fit's own data source."""
        self._undo()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._undo()

    def _undo(self) -> None:
        for restore in self._restore:
            restore()
        self._restore = []
