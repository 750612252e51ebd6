"""Rule registries: one conversion rule per module type, function or tensor method.

A rule takes (context, node) and returns the FieldType of the node's output
(None for non-tensor values such as sizes). Module rules match the exact type:
a subclass may override forward, so it needs its own rule.
"""
from __future__ import annotations

from typing import Callable

import torch.fx as fx

from .context import ConversionContext
from .fields import FieldType

Rule = Callable[[ConversionContext, fx.Node], "FieldType | None"]

MODULE_RULES: dict[type, Rule] = {}
FUNCTION_RULES: dict[object, Rule] = {}
METHOD_RULES: dict[str, Rule] = {}


def register_module_rule(*module_types: type) -> Callable[[Rule], Rule]:
    def decorate(rule: Rule) -> Rule:
        for module_type in module_types:
            MODULE_RULES[module_type] = rule
        return rule

    return decorate


def register_function_rule(*targets: object) -> Callable[[Rule], Rule]:
    """Register a rule for call_function targets (callables) and call_method targets (names)."""

    def decorate(rule: Rule) -> Rule:
        for target in targets:
            if isinstance(target, str):
                METHOD_RULES[target] = rule
            else:
                FUNCTION_RULES[target] = rule
        return rule

    return decorate


def find_rule(ctx: ConversionContext, node: fx.Node) -> Rule | None:
    if node.op == "call_module":
        return MODULE_RULES.get(type(ctx.module(node)))
    if node.op == "call_function":
        return FUNCTION_RULES.get(node.target)
    if node.op == "call_method":
        return METHOD_RULES.get(str(node.target))
    return None
