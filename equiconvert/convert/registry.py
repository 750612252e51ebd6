"""Rule registries: one conversion rule per module type, function or tensor method.

A rule takes (context, node) and returns the FieldType of the node's output
(None for non-tensor values such as sizes). Module rules match the exact type:
a subclass may override forward, so it needs its own rule.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable

import torch.fx as fx

from .context import ConversionContext
from .fields import FieldType

Rule = Callable[[ConversionContext, fx.Node], "FieldType | None"]

MODULE_RULES: dict[type, Rule] = {}
# rules for classes of optional packages, "package.module:Class" -> rule: registered once that module is imported, so
# that registering them imports neither torchvision nor timm (a model holding such a class has imported its module)
LAZY_MODULE_RULES: dict[str, Rule] = {}
FUNCTION_RULES: dict[object, Rule] = {}
METHOD_RULES: dict[str, Rule] = {}
HEAD_TRANSPARENT: set[Rule] = set()  # rules of ops a classifier conv may pass through to the output
SUM_RULES: set[Rule] = set()  # rules that read a direct sum (fields.FieldSum); others see it lifted (direct_sum.py)
# module class (or "package.module:Class", resolved lazily) -> forward(module, *args) traced in place of the
# module's own (one with untraceable control flow)
TRACEABLE_FORMS: dict[type, Callable] = {}
LAZY_TRACEABLE_FORMS: dict[str, Callable] = {}
# "package.module:Class" of a module that folds space into channels -> its factor(module): a model whose first
# conv follows one takes in_channels / factor input channels (TResNet's space-to-depth stem)
LAZY_CHANNEL_FOLDS: dict[str, Callable] = {}
CHANNEL_FOLDS: dict[type, Callable] = {}


def head_transparent(rule: Rule) -> Rule:
    """Mark a rule's ops (activations, pooling, flattening) as transparent between a classifier conv and the output."""
    HEAD_TRANSPARENT.add(rule)
    return rule


def takes_direct_sums(rule: Rule) -> Rule:
    """Mark a rule as reading direct sums of field types (fields.FieldSum) itself: channel-blind ops, concatenations,
    slices, convolutions. Any other rule sees a direct sum lifted to regular fields first (convert/direct_sum.py)."""
    SUM_RULES.add(rule)
    return rule


def register_module_rule(*module_types: type | str) -> Callable[[Rule], Rule]:
    """Register a rule for module classes, given as types or as "package.module:Class" names (resolved lazily).

    Args:
        *module_types: the module classes the rule converts.

    Returns:
        A decorator that registers the rule and returns it unchanged.
    """

    def decorate(rule: Rule) -> Rule:
        _register(module_types, rule, MODULE_RULES, LAZY_MODULE_RULES)
        return rule

    return decorate


def module_rule(module_type: type) -> Rule | None:
    """The rule for instances of exactly `module_type`, registering lazy rules whose module is imported by now."""
    _resolve(LAZY_MODULE_RULES, MODULE_RULES)
    return MODULE_RULES.get(module_type)


def traceable_form(module_type: type) -> Callable | None:
    """The traceable forward registered for exactly `module_type`, if any."""
    _resolve(LAZY_TRACEABLE_FORMS, TRACEABLE_FORMS)
    return TRACEABLE_FORMS.get(module_type)


def channel_fold(module) -> int:
    """How many channels `module` makes of each input channel (1 unless registered in LAZY_CHANNEL_FOLDS)."""
    _resolve(LAZY_CHANNEL_FOLDS, CHANNEL_FOLDS)
    factor = CHANNEL_FOLDS.get(type(module))
    return factor(module) if factor is not None else 1


def _register(module_types, value: Callable, by_type: dict[type, Callable], by_name: dict[str, Callable]) -> None:
    for module_type in module_types:
        if isinstance(module_type, str):
            by_name[module_type] = value
        else:
            by_type[module_type] = value


def _resolve(lazy: dict[str, Callable], resolved: dict[type, Callable]) -> None:
    """Move the entries of `lazy` whose module is imported by now into `resolved`, keyed by their class."""
    for name in [n for n in lazy if n.partition(":")[0] in sys.modules]:
        module_name, _, class_name = name.partition(":")
        value = lazy.pop(name)
        found = getattr(importlib.import_module(module_name), class_name, None)
        if found is not None:
            resolved.setdefault(found, value)


def register_traceable_form(*module_types: type | str) -> Callable[[Callable], Callable]:
    """Trace `form(module, *args)` in place of these modules' forward (same result, no data-dependent branches).

    Types may be given as "package.module:Class" names, resolved once that module is imported.
    """

    def decorate(form: Callable) -> Callable:
        _register(module_types, form, TRACEABLE_FORMS, LAZY_TRACEABLE_FORMS)
        return form

    return decorate


def register_function_rule(*targets: object) -> Callable[[Rule], Rule]:
    """Register a rule for call_function targets (callables) and call_method targets (names).

    Args:
        *targets: the functions (torch.relu, operator.add) and method names ("view") the rule converts.

    Returns:
        A decorator that registers the rule and returns it unchanged.
    """

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
        return module_rule(type(ctx.module(node)))
    if node.op == "call_function":
        return FUNCTION_RULES.get(node.target)
    if node.op == "call_method":
        return METHOD_RULES.get(str(node.target))
    return None
