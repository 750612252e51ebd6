"""Differentially private training of converted models."""
