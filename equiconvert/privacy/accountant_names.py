"""The accountants' names (DPConfig.accountant, --accountant), without opacus: the command line's choices and
DPConfig's default read them here (accounting.py maps each to its accountant)."""

from __future__ import annotations

RDP = "rdp"  # Rényi DP, over a wide range of orders
PRV = "prv"  # privacy random variables (numerical composition)
ACCOUNTANTS = (RDP, PRV)  # the one list of those there are
