"""Steerable convolution as plain tensors: filter = coefficients x basis, then F.conv2d."""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ..bases.canonical import BasisMismatchError, basis_fingerprint
from ..errors import ParameterError

_FINGERPRINT_KEY = "_extra_state"  # torch's key suffix for get_extra_state

# Weight standardization scopes: the coefficient dimensions of weight (out, in, basis) each mean and variance span.
# "field": per output field, eps added to the variance (a layer norm of each field's coefficients).
# "layer": over the layer's whole coefficient vector, eps added to the standard deviation (the released code of
# Hölzl et al., hlzl/equivariant, standardizes its R2Conv weights this way).
STANDARDIZATION_DIMS: dict[str, tuple[int, ...]] = {"field": (1, 2), "layer": (0, 1, 2)}


def standardization_scope(weight_standardization: bool | str) -> str | None:
    """The scope of a weight_standardization option: False/None -> None, True -> "field", or a STANDARDIZATION_DIMS
    name; anything else is refused by name."""
    if weight_standardization is None or weight_standardization is False:
        return None
    if weight_standardization is True:
        return "field"
    if weight_standardization not in STANDARDIZATION_DIMS:
        raise ParameterError(
            f"weight_standardization must be a bool or one of {sorted(STANDARDIZATION_DIMS)}, "
            f"got {weight_standardization!r}"
        )
    return weight_standardization


def coordinate_change(matrix: torch.Tensor | None, num_basis: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A and A^-1 as float32 constants for SteerableConv2d(standardization_coordinates=A); anything but a finite,
    invertible (num_basis, num_basis) matrix is refused by name."""
    if matrix is None:
        return None, None
    if tuple(matrix.shape) != (num_basis, num_basis):
        raise ParameterError(
            f"standardization_coordinates must be a ({num_basis}, {num_basis}) matrix for a basis of {num_basis} "
            f"filters, got shape {tuple(matrix.shape)}"
        )
    exact = matrix.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(exact).all()) or not float(torch.linalg.cond(exact)) <= 1e6:  # nan: singular
        raise ParameterError("standardization_coordinates must be a finite, invertible matrix")
    return exact.float(), torch.linalg.inv(exact).float()


def apply_to_constants(module: nn.Module, fn, names: tuple[str, ...]) -> None:
    """Move/cast the tensor attributes `names` (None allowed) as `nn.Module._apply` does buffers.

    Layers keep such tensors as constants, not buffers: Opacus refuses trainable modules
    with buffers (make_private would fail), and they are no state to save.
    torch.func / Opacus functorch run a meta copy with only the parameters swapped back
    in, so a meta result is not kept.
    """
    for name in names:
        value = getattr(module, name)
        moved = None if value is None else _applied(fn, value)
        if moved is not None and not moved.is_meta:
            setattr(module, name, moved)


def _applied(fn, value: torch.Tensor) -> torch.Tensor | None:
    """fn(value); a 5-D constant (the basis) goes through fn as 4-D and comes back in its shape, since
    `Module.to(memory_format=torch.channels_last)` hands fn's `.to` every 5-D tensor and `.to` takes that format
    for 4-D ones only. A constant's layout is internal: only its values, device and dtype matter."""
    if value.dim() != 5:
        return fn(value)
    moved = fn(value.flatten(0, 1))
    return None if moved is None else moved.reshape(value.shape)


def filter_from_coefficients(coefficients: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """The (out_fields * out_size, in_fields * in_size, k, k) filter of coefficients (out_fields, in_fields,
    num_basis) in `basis` (num_basis, out_size, in_size, k, k), channels field-major."""
    out_f, in_f, nb = coefficients.shape
    _, out_size, in_size, k, _ = basis.shape
    flat = coefficients.reshape(out_f * in_f, nb) @ basis.reshape(nb, -1)
    flat = flat.reshape(out_f, in_f, out_size, in_size, k, k).permute(0, 2, 1, 3, 4, 5)
    return flat.reshape(out_f * out_size, in_f * in_size, k, k)


class SteerableConv2d(nn.Module):
    """A 2D convolution whose filter is constrained to an equivariant linear span.

    `basis` has shape (num_basis, out_size, in_size, k, k): the equivariant
    filters from one input field to one output field. `weight` holds one
    coefficient vector per (output field, input field of its group), so the
    parameters live in coefficient space, which is where DP-SGD clips them.
    Channels are laid out field-major (field f owns channels f*size..(f+1)*size-1).

    `standardization_coordinates`, a (num_basis, num_basis) matrix A, makes the weight standardization act on the
    coordinates weight @ A of another basis of the same filters (escnn's R2Conv basis:
    equiconvert.bases.escnn_reference.escnn_coordinates), as the paper's released code standardizes escnn's
    coefficients: coefficients = standardize(weight @ A) @ A^-1. None: on the coefficients of `basis`.
    """

    def __init__(
        self,
        basis: torch.Tensor,
        in_fields: int,
        out_fields: int,
        *,
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] | str = 0,  # 'same'/'valid' become numbers (odd kernels)
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        weight_standardization: bool | str = False,
        standardization_coordinates: torch.Tensor | None = None,
        eps: float = 1e-5,
        bias_channels: tuple[int, ...] | None = None,
        init_gain: float = math.sqrt(2.0),
        bias_scale: float = 1.0,
    ) -> None:
        super().__init__()
        if not init_gain > 0:
            raise ParameterError(f"init_gain must be positive, got {init_gain}")
        if not bias_scale > 0:
            raise ParameterError(f"bias_scale must be positive, got {bias_scale}")
        if basis.ndim != 5 or basis.shape[0] == 0:
            raise ParameterError(f"basis must have shape (num_basis>0, out, in, k, k), got {tuple(basis.shape)}")
        if in_fields % groups or out_fields % groups:
            raise ParameterError(f"groups={groups} must divide in_fields={in_fields} and out_fields={out_fields}")
        self.in_fields, self.out_fields, self.groups = in_fields, out_fields, groups
        self.out_size, self.in_size = int(basis.shape[1]), int(basis.shape[2])
        self.kernel_size = int(basis.shape[-1])
        self.in_channels = in_fields * self.in_size
        self.out_channels = out_fields * self.out_size
        if isinstance(padding, str):  # odd kernels: "same" is symmetric, so store it as numbers
            if padding not in ("same", "valid"):
                raise ParameterError(f"padding must be 'same', 'valid' or numbers, got {padding!r}")
            d = dilation if isinstance(dilation, int) else dilation[0]
            padding = d * (self.kernel_size - 1) // 2 if padding == "same" else 0
        self.stride, self.padding, self.dilation = stride, padding, dilation
        self.padding_mode = padding_mode
        self.weight_standardization = standardization_scope(weight_standardization)  # None, "field" or "layer"
        if standardization_coordinates is not None and self.weight_standardization is None:
            raise ParameterError("standardization_coordinates needs weight_standardization: nothing would use them")
        # constants like the basis (see there): A and A^-1, computed once in float64
        self.standardization_coordinates, self.standardization_coordinates_inverse = coordinate_change(
            standardization_coordinates, int(basis.shape[0])
        )
        self.eps = eps
        self.init_gain = init_gain
        # A constant, not a buffer: Opacus refuses trainable modules with buffers (make_private
        # would fail), and it is no state to save. `_apply` moves and casts it with the module.
        self.basis = basis.detach().clone().float()
        # Coefficients mean nothing without their basis: the state_dict carries its fingerprint.
        self.basis_fingerprint = basis_fingerprint(self.basis)
        self.weight = nn.Parameter(torch.empty(out_fields, in_fields // groups, basis.shape[0]))
        # Regular/trivial fields: one bias per field on all its channels (the all-ones vector is
        # invariant). Irrep fields: a constant is invariant only on trivial channels, so
        # `bias_channels` lists them and each gets its own bias, shape (out_fields, len).
        self.bias_channels = None if bias_channels is None else tuple(bias_channels)
        self.bias_index = None
        if bias_channels is not None:
            self.bias_index = torch.tensor(self.bias_channels)  # not a buffer either (see basis)
        bias_shape = (out_fields,) if bias_channels is None else (out_fields, len(self.bias_channels))
        self.bias = nn.Parameter(torch.zeros(bias_shape)) if bias else None
        # what one unit of bias adds to each channel it reaches: 1, or 1/sqrt(field size) (unit_norm_bias), as escnn's
        # R2Conv adds a regular field's bias along the unit-norm constant vector; a reparametrisation that sets how
        # fast the bias learns under SGD (its gradient scales by bias_scale, its step in the output by bias_scale^2)
        self.bias_scale = float(bias_scale)
        self.reset_parameters()

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        apply_to_constants(
            self, fn, ("basis", "bias_index", "standardization_coordinates", "standardization_coordinates_inverse")
        )
        return self

    def get_extra_state(self) -> torch.Tensor:
        """The basis fingerprint as a uint8 tensor, so state_dicts stay all-tensor and weights_only-loadable."""
        return torch.tensor(list(bytes.fromhex(self.basis_fingerprint)), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        """Checked in _load_from_state_dict, where the layer's name is known."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors):
        key = prefix + _FINGERPRINT_KEY
        if key not in state_dict:
            warnings.warn(
                f"{prefix.rstrip('.') or 'SteerableConv2d'}: the state_dict has no basis fingerprint (saved before "
                "equiconvert fingerprinted its canonical bases); its coefficients are read as coefficients of "
                "this layer's basis. If they were trained against another basis, convert them with "
                "equiconvert.nn.reexpress.reexpress_state_dict (docs/bases.md).",
                stacklevel=4,
            )
            state_dict[key] = self.get_extra_state()
        else:
            saved = state_dict[key]
            found = bytes(saved.tolist()).hex() if isinstance(saved, torch.Tensor) else repr(saved)
            if found != self.basis_fingerprint:
                raise BasisMismatchError(
                    f"{prefix.rstrip('.') or 'SteerableConv2d'}: the state_dict was saved with a kernel basis of "
                    f"fingerprint {found}, this layer's basis is {self.basis_fingerprint}: its coefficients would "
                    "describe other filters (another network). Load it with the equiconvert version, group, "
                    "kernel size, dilation and basis cutoff it was saved with, or re-express its coefficients "
                    "with equiconvert.nn.reexpress.reexpress_state_dict given the old bases (docs/bases.md)."
                )
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors)

    @property
    def num_basis(self) -> int:
        return int(self.basis.shape[0])

    def reset_parameters(self) -> None:
        """Expanded filter with std init_gain/sqrt(fan-in) per output channel (sqrt(2): He; 1: escnn's scale).

        Under weight standardization the forward pass ignores this scale (up to eps), but the gradient goes as 1/scale:
        it sets how fast the filters learn and how much of a clipped per-sample gradient they get.
        """
        energy = self.basis.pow(2).sum(dim=(0, 2, 3, 4)).mean()  # per output channel, one input field
        fan_in_fields = self.in_fields // self.groups
        std = self.init_gain / math.sqrt(fan_in_fields * float(energy))
        with torch.no_grad():
            self.weight.normal_(0.0, std)
            if self.bias is not None:
                self.bias.zero_()

    def coefficients(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The basis coefficients of `weight` (default: self.weight), standardized over the scope asked for (in
        standardization_coordinates where given, then mapped back to this basis)."""
        weight = self.weight if weight is None else weight
        if self.weight_standardization is None:
            return weight
        coordinates = self.standardization_coordinates
        if coordinates is None:
            return self._standardized(weight)
        return self._standardized(weight @ coordinates) @ self.standardization_coordinates_inverse

    def _standardized(self, weight: torch.Tensor) -> torch.Tensor:
        dims = STANDARDIZATION_DIMS[self.weight_standardization]
        var, mean = torch.var_mean(weight, dim=dims, keepdim=True, unbiased=False)
        if self.weight_standardization == "layer":
            return (weight - mean) / (var.sqrt() + self.eps)
        return (weight - mean) / torch.sqrt(var + self.eps)

    def weight_gradients(self, coefficient_grads: torch.Tensor) -> torch.Tensor:
        """Gradients of self.weight from gradients of its coefficients, for a batch (..., out, in, basis) of them.

        The VJP of the standardization in closed form (a layer norm's backward, means over the scope), a few passes
        over per-example gradients where vmap of autograd's VJP makes about ten; tests compare the two.
        In coordinates A (standardization_coordinates) it is g -> VJP_{weight @ A}(g @ A^-T) @ A^T.
        """
        if self.weight_standardization is None:
            return coefficient_grads
        weight = self.weight.detach()
        coordinates = self.standardization_coordinates
        if coordinates is None:
            return self._standardization_vjp(weight, coefficient_grads)
        grads = coefficient_grads @ self.standardization_coordinates_inverse.T
        return self._standardization_vjp(weight @ coordinates, grads) @ coordinates.T

    def _standardization_vjp(self, weight: torch.Tensor, coefficient_grads: torch.Tensor) -> torch.Tensor:
        """The VJP of _standardized at `weight`. "field": rstd (g - mean g - w_hat mean(g w_hat)). "layer",
        y = u / (s + eps) with u = w - mean w and s = std w: (g - mean g) / (s + eps) - u mean(g u) / (s (s + eps)^2).
        """
        dims = STANDARDIZATION_DIMS[self.weight_standardization]
        grad_dims = tuple(d - 3 for d in dims)  # the same dimensions counted from the end of the batch
        var, mean = torch.var_mean(weight, dim=dims, keepdim=True, unbiased=False)
        grad_mean = coefficient_grads.mean(dim=grad_dims, keepdim=True)
        if self.weight_standardization == "layer":
            std = var.sqrt()
            centred_weight = weight - mean
            grad_dot = (coefficient_grads * centred_weight).mean(dim=grad_dims, keepdim=True)
            scale = 1.0 / (std + self.eps)
            return (coefficient_grads - grad_mean) * scale - centred_weight * (grad_dot * scale.pow(2) / std)
        rstd = torch.rsqrt(var + self.eps)
        standardized = (weight - mean) * rstd
        grad_dot = (coefficient_grads * standardized).mean(dim=grad_dims, keepdim=True)
        centred = torch.addcmul(-grad_mean * rstd, coefficient_grads, rstd)
        return torch.addcmul(centred, standardized, -grad_dot * rstd)

    def expand_filter(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The (out_channels, in_channels/groups, k, k) filter used by F.conv2d, from `weight` (default: self.weight).

        A pure function of `weight`, so per-sample filter gradients map to coefficient gradients by its VJP.
        """
        return filter_from_coefficients(self.coefficients(weight), self.basis)

    def expand_bias(self, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """The per-channel bias from `bias` (default: self.bias); None without a bias."""
        bias = self.bias if bias is None else bias
        if bias is None:
            return None
        if self.bias_scale != 1.0:
            bias = bias * self.bias_scale
        if self.bias_channels is None:  # a constant per field is invariant for trivial and regular fields
            return bias.repeat_interleave(self.out_size)
        full = bias.new_zeros(self.out_fields, self.out_size)
        return full.index_copy(1, self.bias_index, bias).flatten()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.expand_filter(), self.expand_bias()
        if self.padding_mode != "zeros":
            pad = self.padding if isinstance(self.padding, tuple) else (self.padding, self.padding)
            x = F.pad(x, (pad[1], pad[1], pad[0], pad[0]), mode=self.padding_mode)
            return F.conv2d(x, weight, bias, self.stride, 0, self.dilation, self.groups)
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self) -> str:
        return (
            f"fields {self.in_fields}x{self.in_size} -> {self.out_fields}x{self.out_size}, "
            f"kernel={self.kernel_size}, num_basis={self.num_basis}, stride={self.stride}, "
            f"padding={self.padding}, dilation={self.dilation}, groups={self.groups}, "
            f"bias={self.bias is not None}, weight_standardization={self._standardization_repr()}"
            + (f", bias_scale={self.bias_scale:.6g}" if self.bias_scale != 1.0 else "")
            + (", standardization_coordinates=given" if self.standardization_coordinates is not None else "")
        )

    def _standardization_repr(self) -> str:
        """False / True for none / "field" (the form runs record in OUT/model.txt and compare on resume), else the name."""
        return {None: "False", "field": "True"}.get(self.weight_standardization, repr(self.weight_standardization))
