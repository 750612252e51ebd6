"""The differential-privacy mechanism: per-example gradients, clipping, noise, accounting and their safety checks.

It never imports equiconvert.training, the training loop built on it (DPTrainer, DPConfig). The public names load
on first use, so importing a submodule (e.g. opacus_interop) does not pull in the rest. `check_dp_safe(model,
example_input)` refuses models that DP-SGD cannot train privately (by layer names and by behaviour).
"""

from .._lazy import lazy_exports

_EXPORTS = {
    "check_dp_safe": "dp_safety",
    "make_private": "engine",
    "PrivacyEngine": "engine",
    "BatchMemoryManager": "dp_loader",
}
__all__ = list(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
