"""Per-sample gradients with augmentation multiplicity (clipping: dp_step.py).

torch.func computes the gradient of each example's loss in one vectorised pass:
`vmap(grad(loss))` over examples, each example being its K augmented views, so
the per-sample gradient is the average over views before clipping (De et al.,
Hölzl et al.). Parameters of steerable convs are basis coefficients, so the
clipping norm is the norm in coefficient space, as DP-SGD requires.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch._C._functorch import is_functorch_wrapped_tensor
from torch.func import functional_call, grad_and_value, vmap
from torch.overrides import TorchFunctionMode

from .validate import PrivacyValidationError

Gradients = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def per_sample_gradients(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    views: torch.Tensor,
    labels: torch.Tensor,
    loss_fn: LossFn = F.cross_entropy,
) -> tuple[Gradients, torch.Tensor]:
    """Each example's gradient of its mean loss over its K views, and that loss.

    views (B, K, C, H, W) -> ({name: (B, *shape)}, (B,)). The model's frozen parameters and buffers enter the call as
    aliases: a forward that rebinds one (`.data = ...`) is refused (`_RefuseRebinding`), never the model's own tensor.
    """
    frozen = {name: p for name, p in model.named_parameters() if name not in params}
    held = {name: tensor.detach() for name, tensor in {**frozen, **buffers}.items()}

    def example_loss(p: dict[str, torch.Tensor], example_views: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, (p, held), (example_views,))
        return loss_fn(logits, label.expand(example_views.shape[0]))

    with _RefuseRebinding({id(tensor): name for name, tensor in {**params, **held}.items()}):
        return vmap(grad_and_value(example_loss), in_dims=(None, 0, 0), randomness="different")(params, views, labels)


class StateRebindingError(PrivacyValidationError, RuntimeError):
    """A forward rebinds a tensor's `.data` while torch.func computes per-example gradients."""


_DATA = torch._C.TensorBase.__dict__["data"]  # the `.data` property; its setter is what the mode below watches


class _RefuseRebinding(TorchFunctionMode):
    """Refuse `tensor.data = value` for a value made inside torch.func's transforms (any value the forward computes
    there, a constant included): torch crashes the process (SIGSEGV) on that assignment, and a value computed from
    the batch would be kept outside the DP step. names: id of each tensor of the call -> its name, for the message."""

    def __init__(self, names: dict[int, str]) -> None:
        super().__init__()
        self.names = names

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if (
            getattr(func, "__self__", None) is _DATA
            and func.__name__ == "__set__"
            and is_functorch_wrapped_tensor(args[1])
        ):
            name = self.names.get(id(args[0]), "a tensor")
            raise StateRebindingError(
                f"the model's forward rebinds {name!r} (`.data = ...`) under per-example gradients, which torch.func "
                "cannot run, and a value computed from the batch would be kept without clipping or noise: use the "
                "value in the forward without storing it, or set the tensor before training"
            )
        return func(*args, **(kwargs or {}))
