"""Adapting models that keep their trained weights: exact invariance by canonicalisation."""

from .canonicalize import CanonicalizationError, CanonicalizedModel, canonicalize, pose_prior_loss

__all__ = ["CanonicalizationError", "CanonicalizedModel", "canonicalize", "pose_prior_loss"]
