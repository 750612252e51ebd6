"""The public API's docstrings have Google-style sections, which mkdocstrings renders as tables."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import equiconvert


def _documented(obj: object) -> tuple[object, str]:
    """What takes the parameters (a function, or a class's own __init__) and the docstring that describes them."""
    if inspect.isclass(obj):
        return obj.__init__, inspect.getdoc(obj) or ""
    return obj, inspect.getdoc(obj) or ""


def _exempt(obj: object) -> bool:
    # an exception takes one message; a dataclass documents each field where it is declared
    return inspect.isclass(obj) and (issubclass(obj, BaseException) or dataclasses.is_dataclass(obj))


DOCUMENTED = sorted(name for name in equiconvert._EXPORTS if not _exempt(getattr(equiconvert, name)))


@pytest.mark.parametrize("name", DOCUMENTED)
def test_each_public_callable_documents_its_arguments_and_result(name):
    obj = getattr(equiconvert, name)
    target, doc = _documented(obj)
    signature = inspect.signature(target)
    parameters = [p for p in signature.parameters if p != "self"]
    if parameters:
        assert "\n\nArgs:\n" in doc, f"{name}: no Args: section"
        args = doc.split("\n\nArgs:\n", 1)[1].split("\n\n", 1)[0]
        for parameter in parameters:
            star = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
            label = star.get(signature.parameters[parameter].kind, "") + parameter
            assert f"\n    {label}: " in "\n" + args, f"{name}: Args: does not describe {label}"
    if inspect.isfunction(obj) and signature.return_annotation not in (None, "None", inspect.Signature.empty):
        assert "\n\nReturns:\n" in doc, f"{name}: no Returns: section"


def test_the_exemptions_are_only_exceptions_and_dataclasses():
    assert len(DOCUMENTED) == 21  # make_equivariant ... teach_upright_pose, convert_for_carrying, DPTrainer, ...
    assert sorted(set(equiconvert._EXPORTS) - set(DOCUMENTED)) == [
        "CanonicalizationError",
        "CarryReport",
        "ConversionConfig",
        "ConversionReport",
        "DPConfig",
        "EquivarianceResult",
        "EquivarianceWarning",
        "GroupSpec",
    ]
