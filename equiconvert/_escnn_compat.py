"""Make escnn 1.0.11 usable on today's stacks, at conversion time only.

Two defects are patched, both by replacing module attributes after import:

* With scikit-learn >= 1.2 installed, escnn's `null()` hands an `np.matrix`
  to `sklearn.utils.extmath.randomized_svd`, which now refuses it
  (`TypeError: np.matrix is not supported`). We disable that code path so
  escnn uses its exact dense SciPy SVD, which is also deterministic.
* escnn keeps a joblib cache of Clebsch-Gordan coefficients inside its own
  package folder, which is read-only for non-root users. We point it at the
  user cache directory instead.
"""
from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

_patched = False


def cache_root() -> Path:
    """User cache directory of equiconvert (overridable with EQUICONVERT_CACHE_DIR)."""
    explicit = os.environ.get("EQUICONVERT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "equiconvert"


def _redirect_joblib_caches(modules: list[ModuleType], location: Path) -> None:
    from joblib import Memory
    from joblib.memory import MemorizedFunc

    memory = Memory(str(location), verbose=0)
    for module in modules:
        for name, value in vars(module).copy().items():
            if isinstance(value, MemorizedFunc):
                setattr(module, name, memory.cache(value.func, ignore=value.ignore))


def import_escnn() -> ModuleType:
    """Import escnn with the patches above applied exactly once."""
    global _patched
    try:
        import escnn
        import escnn.group._clebsh_gordan as clebsch_gordan
        import escnn.group._numerical as numerical
        import escnn.group.irrep as irrep
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "equiconvert needs escnn==1.0.11 to build steerable kernel bases "
            f"(conversion time only): {exc}. Install it with `pip install escnn==1.0.11` "
            "(its dependency py3nj needs a Fortran compiler: `apt-get install gfortran`)."
        ) from exc
    if not _patched:
        numerical.randomized_svd = None
        location = cache_root() / f"escnn-{escnn.__version__}-joblib"
        _redirect_joblib_caches([clebsch_gordan, irrep], location)
        _patched = True
    return escnn
