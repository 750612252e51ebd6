"""How many groups of whole fields a converted norm gets, from its field count and the groups the plain norm asked.

"at_most" (the default): the groups asked, at most one per field; groups of uneven size where they do not divide
the fields (nn/norm.py's FieldGroupNorm allows it).
"released": the rule of Hölzl et al.'s released code (hlzl/equivariant, utils/utils.py `closest_divisor`, applied
by its GroupNorm when the groups do not divide the fields): the groups asked where they divide the fields, else the
divisor of the field count nearest to them, the second nearest where the nearest leaves groups of at most three
fields, and one group where that one does too. The paper's D4 network asks 8 and gets 1, 1, 3, 3 for its 6, 13,
27 and 39 fields.
"""

from __future__ import annotations

from typing import Callable

from ..errors import ParameterError

NormGroupRule = Callable[[int, int], int]


def at_most(fields: int, groups: int) -> int:
    """The groups asked, at most one per field."""
    return min(fields, groups)


def released(fields: int, groups: int) -> int:
    """The released code's rule (module docstring); ties in distance go to the smaller divisor."""
    if fields % groups == 0:
        return groups
    divisors = sorted((d for d in range(1, fields + 1) if fields % d == 0), key=lambda d: (abs(d - groups), d))
    for candidate in divisors[:2]:
        if fields // candidate > 3:
            return candidate
    return 1


NORM_GROUP_RULES: dict[str, NormGroupRule] = {"at_most": at_most, "released": released}


def norm_group_rule(name: str) -> NormGroupRule:
    """The rule of ConversionConfig.norm_group_rule, with a clear error for an unknown name."""
    if name not in NORM_GROUP_RULES:
        raise ParameterError(f"norm_group_rule must be one of {sorted(NORM_GROUP_RULES)}, got {name!r}")
    return NORM_GROUP_RULES[name]
