"""Training converted models with DP-SGD: DPTrainer's loop, its options (DPConfig), data, logs and checkpoints.

It builds on equiconvert.privacy (the mechanism and its accounting), which never imports it. The public names load
on first use, so importing a submodule (e.g. distributed) does not pull in the trainer and its dependencies.
"""

from .._lazy import lazy_exports

_EXPORTS = {
    "DPConfig": "dp_config",
    "DPTrainer": "trainer",
}
__all__ = list(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
