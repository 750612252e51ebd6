"""Conversion of standard torchvision and timm CNNs."""
