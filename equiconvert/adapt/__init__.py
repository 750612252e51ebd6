"""Adapting models that keep their trained weights: exact invariance by canonicalisation (canonicalize), or pretrained
weights carried into a converted model (carry.carry_weights)."""

from .canonicalize import CanonicalizationError, CanonicalizedModel, canonicalize, pose_prior_loss

__all__ = ["CanonicalizationError", "CanonicalizedModel", "canonicalize", "pose_prior_loss"]
