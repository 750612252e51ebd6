"""The group names `parse_group` accepts, without torch: the command line's help shows them."""

from __future__ import annotations

MAX_ORDER = 16
GROUP_NAMES = f"C1..C{MAX_ORDER} (rotations), D1..D{MAX_ORDER} (rotations and reflections), SO2 or O2"
