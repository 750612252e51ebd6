"""Differentially private training of converted models."""
from .trainer import DPConfig, DPTrainer

__all__ = ["DPConfig", "DPTrainer"]
