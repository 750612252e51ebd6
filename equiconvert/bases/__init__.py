"""Canonical steerable kernel bases for planar groups: own builder, canonical form, fingerprints."""

from .canonical import basis_fingerprint, canonical_basis, reexpress_coefficients
from .harmonic import BUILDER_VERSION, harmonic_span

__all__ = ["BUILDER_VERSION", "basis_fingerprint", "canonical_basis", "harmonic_span", "reexpress_coefficients"]
