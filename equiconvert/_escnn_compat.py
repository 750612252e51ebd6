"""Make escnn 1.0.11 (the optional `escnn` extra) usable on today's stacks, for cross-checks only.

equiconvert builds its bases without escnn; escnn serves as the reference they
are checked against and gives the coordinates of standardization_coordinates="escnn". Three defects are handled:

* escnn imports lie_learn (for SO(3) Wigner matrices only) when it is imported;
  lie_learn has no NumPy 2 release. Without lie_learn installed we register a
  stand-in package whose `wigner_D_matrix` raises, so the planar (2D) code works
  and any SO(3) use fails loudly instead of computing something else.

* With scikit-learn >= 1.2 installed, escnn's `null()` hands an `np.matrix`
  to `sklearn.utils.extmath.randomized_svd`, which now refuses it
  (`TypeError: np.matrix is not supported`). We disable that code path so
  escnn uses its exact dense SciPy SVD, which is also deterministic.
* escnn keeps a joblib cache of Clebsch-Gordan coefficients inside its own
  package folder, which is read-only for non-root users. We point it at the
  user cache directory instead (nowhere when the disk cache is off, cache.disk_cache_enabled).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from .cache import cache_root, disk_cache_enabled

_patched = False


def _redirect_joblib_caches(modules: list[ModuleType], location: Path | None) -> None:
    from joblib import Memory
    from joblib.memory import MemorizedFunc

    memory = Memory(None if location is None else str(location), verbose=0)  # None: joblib caches nothing
    for module in modules:
        for name, value in vars(module).copy().items():
            if isinstance(value, MemorizedFunc):
                setattr(module, name, memory.cache(value.func, ignore=value.ignore))


LIE_LEARN_STANDIN = "lie_learn.representations.SO3.wigner_d"


def _wigner_d_unavailable(*args, **kwargs):
    raise ImportError(
        "escnn needs lie_learn for SO(3) Wigner matrices; equiconvert registered a stand-in because lie_learn is "
        "not installed (it has no NumPy 2 release). equiconvert never uses SO(3); install lie_learn to use it."
    )


def install_lie_learn_standin() -> bool:
    """Register the SO(3)-only stand-in for lie_learn when it is missing; True if registered."""
    if "lie_learn" in sys.modules or importlib.util.find_spec("lie_learn") is not None:
        return False
    parts = LIE_LEARN_STANDIN.split(".")
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        module = ModuleType(name, "equiconvert's stand-in for lie_learn: raises if SO(3) is used")
        module.__path__ = []  # a package, so the next level imports
        sys.modules[name] = module
        if depth > 1:
            setattr(sys.modules[".".join(parts[: depth - 1])], parts[depth - 1], module)
    sys.modules[LIE_LEARN_STANDIN].wigner_D_matrix = _wigner_d_unavailable
    return True


def import_escnn() -> ModuleType:
    """Import escnn with the patches above applied exactly once."""
    global _patched
    if importlib.util.find_spec("escnn") is not None:
        install_lie_learn_standin()
    try:
        import escnn
        import escnn.group._clebsh_gordan as clebsch_gordan
        import escnn.group._numerical as numerical
        import escnn.group.irrep as irrep
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"escnn is needed only to cross-check equiconvert's bases against escnn and to standardize in its "
            f"coordinates (standardization_coordinates='escnn') ({exc}). Install the extra with "
            "`pip install -e '.[escnn]'` in the clone (NumPy 1, builds py3nj with a Fortran compiler), or without "
            "compiling: "
            "`pip install --no-deps escnn==1.0.11 && pip install scipy joblib` (see docs/bases.md)."
        ) from exc
    if not _patched:
        numerical.randomized_svd = None
        location = cache_root() / f"escnn-{escnn.__version__}-joblib" if disk_cache_enabled() else None
        _redirect_joblib_caches([clebsch_gordan, irrep], location)
        _patched = True
    return escnn
