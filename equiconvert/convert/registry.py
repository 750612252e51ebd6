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
HEAD_TRANSPARENT: set[Rule] = set()  # rules of ops a classifier conv may pass through to the output


def head_transparent(rule: Rule) -> Rule:
    """Mark a rule's ops (activations, pooling, flattening) as transparent between a classifier conv and the output."""
    HEAD_TRANSPARENT.add(rule)
    return rule


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


def is_classifier_conv(ctx: ConversionContext, node: fx.Node) -> bool:
    """True if every path from `node` reaches the model output through transparent ops only.

    Such a conv produces the logits (SqueezeNet's final 1x1 conv), so it must map to
    invariant (trivial) fields with its original channel count.
    """
    for user in node.users:
        if user.op == "output":
            continue
        rule = find_rule(ctx, user)
        if rule not in HEAD_TRANSPARENT or not is_classifier_conv(ctx, user):
            return False
    return bool(node.users)


def find_rule(ctx: ConversionContext, node: fx.Node) -> Rule | None:
    if node.op == "call_module":
        return MODULE_RULES.get(type(ctx.module(node)))
    if node.op == "call_function":
        return FUNCTION_RULES.get(node.target)
    if node.op == "call_method":
        return METHOD_RULES.get(str(node.target))
    return None
