"""One registry of model names, for the library, the CLI, the training runner and the benchmarks.

Names: equiconvert's own models (`resnet9`, `equivariant_resnet9`, ...; `equiconvert:<name>` is the same),
`torchvision:<name>` and `timm:<name>` (imported only when such a model is asked for). A bare name that is
not equiconvert's own is looked up in torchvision, then in timm: `resnet18` is torchvision's; write
`timm:resnet18` for timm's.
"""

from __future__ import annotations

import difflib
import fnmatch
import inspect
from dataclasses import dataclass
from typing import Any, Callable, TypeVar, overload

from torch import nn

from ..errors import ModelNameError
from ..build_recipe import registry_recipe, remember_recipe

SOURCES = ("equiconvert", "torchvision", "timm")  # also the order in which a bare name is looked up
ModelFactory = Callable[..., nn.Module]
F = TypeVar("F", bound=ModelFactory)


@dataclass(frozen=True)
class ModelEntry:
    """A registered factory; `equivariant` ones take the group as their first argument and return a converted model.

    A preset (an equivariant factory with its own plain network) also names `baseline`, the registered factory of
    the unconverted network that a run with group "none" trains, and `preset`, the options both factories are built
    with (a class whose `resolve(**choices)` fills the preset's own defaults): the training runner reads them here
    instead of knowing each preset by name."""

    name: str
    factory: ModelFactory
    equivariant: bool = False
    baseline: str | None = None
    preset: Any = None

    @property
    def default_head(self) -> str | None:
        """The head the factory builds when none is asked for (its `head` keyword's default), None without one."""
        head = inspect.signature(self.factory).parameters.get("head")
        return None if head is None or head.default is inspect.Parameter.empty else head.default


_MODELS: dict[str, ModelEntry] = {}


@overload
def register_model(factory: F) -> F: ...
@overload
def register_model(
    *, name: str | None = None, equivariant: bool = False, baseline: str | None = None, preset: Any = None
) -> Callable[[F], F]: ...
def register_model(
    factory: F | None = None,
    *,
    name: str | None = None,
    equivariant: bool = False,
    baseline: str | None = None,
    preset: Any = None,
) -> Any:
    """Register a model factory under its function name (or `name`): `@register_model` or
    `@register_model(equivariant=True)` for factories that take `group` and return an EquivariantModel.

    Args:
        factory: the factory, when used as a bare decorator.
        name: the registry name; None for the factory's function name.
        equivariant: the factory takes `group` and returns an EquivariantModel.
        baseline: for a preset, the registry name of its unconverted network (what group "none" trains).
        preset: for a preset, the options class (`resolve(**choices)`) it and `baseline` are built with.

    Returns:
        The factory unchanged, or (without `factory`) a decorator that registers one.

    Raises:
        ModelNameError: the name has a ':' or is taken.
    """

    def decorate(fn: F) -> F:
        key = name or fn.__name__
        if ":" in key or key in _MODELS:
            raise ModelNameError(
                f"cannot register model {key!r}: " + ("names have no ':'" if ":" in key else "that name is taken")
            )
        if (baseline is None) != (preset is None) or (baseline is not None and not equivariant):
            raise ModelNameError(
                f"cannot register model {key!r}: a preset is equivariant and names both baseline= and preset="
            )
        _MODELS[key] = ModelEntry(key, fn, equivariant, baseline, preset)
        return fn

    return decorate(factory) if factory is not None else decorate


def _torchvision_names() -> list[str]:
    import torchvision

    return list(torchvision.models.list_models())


def _timm_names() -> list[str]:
    try:
        import timm
    except ImportError:
        return []
    return list(timm.list_models())


_CATALOGUES: dict[str, Callable[[], list[str]]] = {
    "equiconvert": lambda: sorted(_MODELS),
    "torchvision": _torchvision_names,
    "timm": _timm_names,
}


def list_models(pattern: str | None = None) -> list[str]:
    """Model names to pass to create_model.

    Args:
        pattern: a shell pattern of equiconvert's own names; with a source prefix ("torchvision:*",
            "timm:resnet*") it lists that library's models, as "source:name". None lists all of equiconvert's own.

    Returns:
        The matching names, sorted.

    Raises:
        ModelNameError: an unknown source prefix.
    """
    source, sep, rest = (pattern or "").rpartition(":")
    if sep and source in ("torchvision", "timm"):
        return [f"{source}:{n}" for n in sorted(_CATALOGUES[source]()) if fnmatch.fnmatchcase(n, rest or "*")]
    if sep and source != "equiconvert":
        raise ModelNameError(f"unknown model source {source!r} in {pattern!r}; sources: {', '.join(SOURCES)}")
    names = sorted(_MODELS)
    return [n for n in names if fnmatch.fnmatchcase(n, rest)] if rest else names


def _bare_source(name: str) -> str:
    """Where a bare name comes from: equiconvert's own first, then torchvision, then timm."""
    if name in _MODELS:
        return "equiconvert"
    for source in ("torchvision", "timm"):
        if name in _CATALOGUES[source]():
            return source
    own = sorted(_MODELS)
    close = difflib.get_close_matches(name, own + _torchvision_names(), n=5)
    hint = f"; close names: {', '.join(close)}" if close else ""
    raise ModelNameError(
        f"unknown model {name!r}: not equiconvert's own ({', '.join(own)}), nor torchvision's, "
        f"nor timm's{hint}. Bare names are looked up in that order; list_models('torchvision:*') "
        "and list_models('timm:*') list the others"
    )


def resolve_model_name(name: str) -> str:
    """The full name "source:name" of `name` ("resnet9" -> "equiconvert:resnet9", "resnet18" ->
    "torchvision:resnet18"); a prefixed name is checked only for equiconvert's own models."""
    source, sep, model = name.partition(":")
    if not sep:
        return f"{_bare_source(name)}:{name}"
    if source not in SOURCES or not model:
        raise ModelNameError(
            f"cannot parse model {name!r}: give a name, or one of {', '.join(f'{s}:<name>' for s in SOURCES)}"
        )
    if source == "equiconvert" and model not in _MODELS:
        close = difflib.get_close_matches(model, list(_MODELS), n=5)
        raise ModelNameError(
            f"unknown equiconvert model {model!r}; known: {', '.join(sorted(_MODELS))}"
            + (f" (close: {', '.join(close)})" if close else "")
        )
    return name


def model_entry(name: str) -> ModelEntry | None:
    """The registry entry of one of equiconvert's own models, None for torchvision's and timm's."""
    source, _, model = resolve_model_name(name).partition(":")
    return _MODELS[model] if source == "equiconvert" else None


def preset_names() -> list[str]:
    """The full names of the registered presets (ModelEntry.preset), e.g. "equiconvert:equivariant_resnet9"."""
    return [f"equiconvert:{name}" for name, entry in sorted(_MODELS.items()) if entry.preset is not None]


def is_equivariant_model(name: str) -> bool:
    """Whether `name` builds an already converted model (it takes the group; do not convert it again)."""
    entry = model_entry(name)
    return entry is not None and entry.equivariant


def _check_keywords(full_name: str, factory: ModelFactory, kwargs: dict[str, Any]) -> None:
    parameters = inspect.signature(factory).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    unknown = sorted(set(kwargs) - set(parameters))
    if unknown:
        raise ModelNameError(
            f"{full_name} takes no keyword argument {', '.join(map(repr, unknown))}; it takes {', '.join(parameters)}"
        )


def _create_torchvision(name: str, kwargs: dict[str, Any]) -> nn.Module:
    import torchvision

    in_channels = kwargs.pop("in_channels", 3)
    if in_channels != 3:
        raise ModelNameError(
            f"torchvision models take 3 input channels; in_channels={in_channels} needs a timm: or equiconvert model"
        )
    if name not in torchvision.models.list_models():
        close = difflib.get_close_matches(name, torchvision.models.list_models(), n=5)
        raise ModelNameError(
            f"unknown torchvision model {name!r} (see torchvision.models.list_models())"
            + (f"; close names: {', '.join(close)}" if close else "")
        )
    pretrained = kwargs.pop("pretrained", False)
    try:
        model = torchvision.models.get_model(name, **kwargs)
    except TypeError as exc:
        raise ModelNameError(f"cannot build torchvision:{name} with {sorted(kwargs)}: {exc}") from exc
    if not pretrained:
        return model
    weights = "DEFAULT" if pretrained is True else str(pretrained)
    return _with_weights_of(model, torchvision.models.get_model(name, weights=weights))


def _with_weights_of(model: nn.Module, trained: nn.Module) -> nn.Module:
    """`model` with every tensor of `trained` whose name and shape match (a head for other classes stays fresh)."""
    own = model.state_dict()
    model.load_state_dict(
        {k: v for k, v in trained.state_dict().items() if k in own and own[k].shape == v.shape}, strict=False
    )
    return model


def _create_timm(name: str, kwargs: dict[str, Any]) -> nn.Module:
    try:
        import timm
    except ImportError as exc:
        raise ModelNameError(
            f"timm is not installed, so 'timm:{name}' cannot be built; install it with `pip install timm`"
        ) from exc
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=5)
        raise ModelNameError(
            f"unknown timm model {name!r} (see timm.list_models())"
            + (f"; close names: {', '.join(close)}" if close else "")
        )
    if "in_channels" in kwargs:
        kwargs["in_chans"] = kwargs.pop("in_channels")
    if isinstance(kwargs.get("pretrained"), str):
        raise ModelNameError(
            f"timm takes its pretrained weights' tag in the model name (timm:{name}.<tag>), not "
            f"pretrained={kwargs['pretrained']!r}"
        )
    try:
        return timm.create_model(name, **{"pretrained": False, **kwargs})
    except TypeError as exc:
        raise ModelNameError(f"cannot build timm:{name} with {sorted(kwargs)}: {exc}") from exc


def create_model(name: str, **kwargs: Any) -> nn.Module:
    """The model `name`, built with `kwargs`; it remembers how it was built, so equiconvert.save/load rebuild it.

    Args:
        name: equiconvert's own ("resnet9"), or "torchvision:NAME" / "timm:NAME"; a bare name is looked up in
            that order (see the module docstring and list_models).
        **kwargs: the model's keyword arguments; None values are dropped, so unset options keep the model's
            defaults. `num_classes` and `in_channels` (or timm's `in_chans`) work for every source; `pretrained`
            (True, or a torchvision weights name) loads torchvision/timm weights, a classifier for another number
            of classes keeping its fresh ones.

    Returns:
        The model.

    Raises:
        ModelNameError: an unknown name, keyword arguments the model does not take, or pretrained weights asked
            of a model that has none.
    """
    kwargs = _in_channels_named_once({key: value for key, value in kwargs.items() if value is not None})
    return remember_recipe(_create_model(name, kwargs), registry_recipe(name, kwargs))


def _in_channels_named_once(kwargs: dict[str, Any]) -> dict[str, Any]:
    """timm's `in_chans` is `in_channels` for every source, so a timm-style call builds any model."""
    if "in_chans" not in kwargs:
        return kwargs
    if "in_channels" in kwargs:
        raise ModelNameError("give in_channels or in_chans (timm's name for it), not both")
    kwargs["in_channels"] = kwargs.pop("in_chans")
    return kwargs


def _create_model(name: str, kwargs: dict[str, Any]) -> nn.Module:
    source, _, model = resolve_model_name(name).partition(":")
    if source == "torchvision":
        return _create_torchvision(model, kwargs)
    if source == "timm":
        return _create_timm(model, kwargs)
    entry = _MODELS[model]
    if kwargs.pop("pretrained", False):
        raise ModelNameError(f"equiconvert:{model} has no pretrained weights; load your own checkpoint into it instead")
    _check_keywords(f"equiconvert:{model}", entry.factory, kwargs)
    return entry.factory(**kwargs)
