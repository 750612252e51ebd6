"""The cross-example probe at every physical batch shape training runs, the first time it runs it.

dp_safety's probe runs before training at the largest batch a forward takes. Training also runs other shapes
(DPTrainer's last, smaller chunk of each step; make_private's Poisson batches, larger or smaller than the data
loader's batch size), and a module may mix examples at some sizes only: each new shape is probed (on one copy of the
model, given its current tensors, with secret random inputs) before the model trains on a batch of it.
"""

from __future__ import annotations

import torch
from torch import nn

from .dp_safety import ExamplesApartProbe


class BatchShapeProbe:
    """Runs dp_safety.ExamplesApartProbe on `model` at each input shape `check` sees for the first time.

    probed: the input shape (rows, ...) the full probe already ran at.
    """

    def __init__(self, model: nn.Module, probed: tuple[int, ...]) -> None:
        self._model = model
        self._seen: set[tuple[int, ...]] = {tuple(probed)}
        self._probe: ExamplesApartProbe | None = None  # its copy of the model is made at the first new shape

    def check(self, inputs: torch.Tensor) -> None:
        """Refuse (PrivacyValidationError) a model that mixes the examples of a batch shaped like `inputs`; a
        non-float input is left to the run-time guard (the probe draws float inputs)."""
        shape = tuple(inputs.shape)
        if shape in self._seen or not inputs.is_floating_point():
            return
        if self._probe is None:
            self._probe = ExamplesApartProbe(self._model, inputs)
        self._probe.check(shape)
        self._seen.add(shape)
