"""Conversion tests run with no cache at all: no basis on disk, none in memory from tests outside this package.

So every basis a conversion needs is built inside it, under whatever device the pass
uses (width="params" counts parameters under torch.device("meta")), as on a fresh install.
"""

from collections.abc import Iterator

import pytest

from equiconvert import basis
from equiconvert.cache import NO_CACHE_VARIABLE


@pytest.fixture(scope="package", autouse=True)
def _no_basis_cache() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(NO_CACHE_VARIABLE, "1")
        basis.clear_memory_cache()
        yield
    basis.clear_memory_cache()
