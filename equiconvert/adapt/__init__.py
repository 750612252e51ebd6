"""Adapting models that keep their trained weights: exact invariance by canonicalisation (canonicalize), or pretrained
weights carried into a converted model (carry.carry_weights)."""

from .canonicalize import CanonicalizationError, CanonicalizedModel, canonicalize, pose_prior_loss
from .upright_pose import teach_upright_pose

__all__ = ["CanonicalizationError", "CanonicalizedModel", "canonicalize", "pose_prior_loss", "teach_upright_pose"]
