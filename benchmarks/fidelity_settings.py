"""Everything around the DP step, read from the released code (value and file:line) and from ours (the paper preset
and the released-settings recipe), one row per aspect."""

from __future__ import annotations

import ast
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "benchmarks"):  # the package and the sibling modules, also when loaded by path
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from fidelity_model import RELEASED_RECIPE  # noqa: E402
from released_code import locate, released_config  # noqa: E402

from equiconvert.recipes.recipe import load_recipe  # noqa: E402
from equiconvert.recipes.run_spec import spec_of, trainer_options  # noqa: E402

PRESET = "cifar10_paper_d4_eps8"
SETUP = "conf/setup/eqresnet9-cifar10.yaml"  # the released CIFAR-10 setup
TRAIN_SIZE = 50_000  # CIFAR-10's training set, the whole of it in both (the released config: train_subset 1.0)
STAGE_FIELDS = (6, 13, 39, 39)  # the D4 model's fields: stem, res1 stage, conv3 stage, restricted last stage


@dataclass(frozen=True)
class Side:
    """One value of a setting and where it is set."""

    value: Any
    where: str


@dataclass(frozen=True)
class Released:
    """The released code's settings, read from its checkout: the composed config and the source lines."""

    root: Path
    config: dict[str, Any]

    def at(self, relpath: str, pattern: str) -> tuple[re.Match, str]:
        return locate(self.root, relpath, pattern)

    def setting(self, *path: str) -> Side:
        """A value of the composed config (keys from its root), at the line of the setup file that sets it."""
        value: Any = self.config
        for key in path:
            value = value[key]
        _, where = self.at(SETUP, rf"^\s*{path[-1]}:")
        return Side(value, where)

    @property
    def full_batches(self) -> int:
        return TRAIN_SIZE // int(self.config["params"]["bs"])

    @property
    def epochs(self) -> int:
        return int(self.config["params"]["update_steps"] / (TRAIN_SIZE / self.config["params"]["bs"]))

    def noise_multiplier(self) -> float:
        from opacus.accountants.utils import get_noise_multiplier

        dp = self.config["dp"]
        return get_noise_multiplier(
            target_epsilon=dp["target_epsilon"],
            target_delta=float(dp["target_delta"]),
            sample_rate=self.config["params"]["bs"] / TRAIN_SIZE,
            epochs=self.epochs,
            accountant=self.at("train.py", r'accountant="(\w+)"')[0].group(1),
        )


@dataclass(frozen=True)
class Ours:
    """Our settings for one shipped recipe: the trainer's options and the model's keyword arguments."""

    recipe: str
    options: dict[str, Any]
    model_kwargs: dict[str, Any]

    @classmethod
    def of(cls, recipe: str) -> Ours:
        loaded = load_recipe(recipe)
        return cls(recipe, trainer_options(loaded), dict(spec_of(loaded).model_kwargs))


@dataclass(frozen=True)
class Aspect:
    """One setting: how to read it in the released code, how in ours, where ours is set, and what to say."""

    name: str
    released: Callable[[Released], Side]
    ours: Callable[[Ours], Any]
    ours_where: str
    note: str = ""
    equal: Callable[[Any, Any], bool] | None = None


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def _ws(o: Ours) -> str:
    scope = o.model_kwargs.get("weight_standardization", True)
    return {True: "per output field, eps 1e-5 on the variance", "layer": "whole layer, eps 1e-5 on the std"}[scope]


def _groups(o: Ours) -> list[int]:
    from equiconvert.convert.norm_groups import norm_group_rule

    rule = norm_group_rule(o.model_kwargs.get("norm_group_rule", "at_most"))
    return [rule(fields, 8) for fields in STAGE_FIELDS]


def _released_groups(r: Released) -> Side:
    sys.path.insert(0, str(r.root))
    try:
        from utils import closest_divisor  # the released code's rule, for the field counts of its D4 model
    finally:
        sys.path.remove(str(r.root))
    _, where = r.at("equivariant/nn/modules/normalization/group_norm.py", r"closest_divisor\(self\.channels")
    asked = r.config["network"]["num_groups"][0]
    return Side([asked if fields % asked == 0 else closest_divisor(fields, asked) for fields in STAGE_FIELDS], where)


def _stated(relpath: str, pattern: str, value: Any) -> Callable[[Released], Side]:
    """A setting the released code states on one line: the value as that line sets it, found by its pattern (a
    checkout where the line reads otherwise is refused)."""
    return lambda r: Side(value, r.at(relpath, pattern)[1])


def _views(r: Released) -> Side:
    _, where = r.at("data/augmentation.py", r"torch\.stack\(\[x\] \+")
    k = int(r.config["params"]["aug_mult"])
    return Side(f"{k}: the image + {k - 1} crops/flips", where)


def _crop(r: Released) -> Side:
    match, where = r.at("data/augmentation.py", r'RandomCrop\(crop_size, padding, padding_mode="(\w+)"\)')
    pad, _ = r.at("data/augmentation.py", r"padding: int = (\d+)")
    return Side(f"pad {pad.group(1)} ({match.group(1)}), uniform crop", where)


def _norm(r: Released) -> Side:
    match, where = r.at("data/dataloader.py", r"Normalize\((\([^)]*\)), (\([^)]*\))\)")
    return Side([list(ast.literal_eval(match.group(1))), list(ast.literal_eval(match.group(2)))], where)


def _q(r: Released) -> Side:
    _, where = r.at("data/dataloader.py", r"DPDataLoader\.from_data_loader")
    return Side(1 / r.full_batches, where)


def _accounted_q(r: Released) -> Side:
    _, where = r.at("train.py", r"sample_rate=bs / len")
    return Side(r.config["params"]["bs"] / TRAIN_SIZE, where)


def _steps(r: Released) -> Side:
    _, where = r.at("train.py", r"epochs = int\(")
    return Side(r.epochs * r.full_batches, where)


def _sigma(r: Released) -> Side:
    _, where = r.at("train.py", r"noise = get_noise_multiplier\(")
    return Side(r.noise_multiplier(), where)


def _accountant(r: Released) -> Side:
    match, where = r.at("train.py", r'accountant="(\w+)"')
    return Side(match.group(1), where)


def _divisor(r: Released) -> Side:
    _, where = r.at("train.py", r"expected_batch_size=bs")
    return Side(r.config["params"]["bs"], where)


def _ema_per_step(r: Released) -> Side:
    _, where = r.at("train.py", r"ema\.update\(\)")
    physical = r.config["hardware"]["bs_physical"] // r.config["params"]["aug_mult"]
    return Side(f"0.999 per physical batch of {physical}", where)


def _lr_schedule(r: Released) -> Side:
    match, where = r.at("conf/setup/optim/sgd.yaml", r"lr_reduceonplateau:\s*(\w+)")
    return Side("constant" if match.group(1) == "False" else "reduce on plateau", where)


def _optimizer(r: Released) -> Side:
    match, where = r.at("conf/setup/optim/sgd.yaml", r"_target_:\s*([\w.]+)")
    return Side("sgd" if match.group(1) == "torch.optim.SGD" else match.group(1), where)


def _width(r: Released) -> Side:
    match, where = r.at("networks/equivariant_resnet9.py", r"fix_constant = ([\d.]+)")
    return Side(float(match.group(1)), where)


def _data(r: Released) -> Side:
    match, where = r.at("conf/setup/dataset/cifar10.yaml", r"_target_:\s*([\w.]+)")
    return Side(f"{match.group(1)} (the original images)", where)


def _setting(*path: str) -> Callable[[Released], Side]:
    """A number of the released setup, as a float (YAML reads 1e-5 as a string)."""

    def read(r: Released) -> Side:
        side = r.setting(*path)
        return Side(float(side.value), side.where)

    return read


def _our_sigma(o: Ours) -> float:
    """The recipe's noise multiplier, or the one our trainer calibrates to its epsilon."""
    from equiconvert.privacy.accounting import calibrate_noise_multiplier

    t = o.options
    if t["noise_multiplier"] is not None:
        return t["noise_multiplier"]
    q = t["batch_size"] / TRAIN_SIZE
    return calibrate_noise_multiplier(t["target_epsilon"], t["delta"], q, t["steps"], t["accountant"])


def _our_q(o: Ours) -> float:
    return o.options["batch_size"] / TRAIN_SIZE


def _same_rate(released: float, ours: float) -> bool:
    """Sampling rates equal up to the whole-number batch: 8333/50000 against 1/6."""
    return math.isclose(released, ours, rel_tol=1e-4)


TRAINER = "equiconvert.training.trainer.DPTrainer"
ASPECTS: tuple[Aspect, ...] = (
    Aspect(
        "data",
        _data,
        lambda o: "equiconvert.data.cifar (a JPEG copy)",
        "equiconvert.data.cifar",
        "our copy of CIFAR-10 is JPEG-compressed; the released code reads torchvision's original images",
    ),
    Aspect(
        "augmentation: views per example (K)",
        _views,
        lambda o: f"{o.options['aug_mult']}: the image + {o.options['aug_mult'] - 1} crops/flips",
        "equiconvert.training.augment.augment_views",
    ),
    Aspect(
        "augmentation: crop",
        _crop,
        lambda o: f"pad {o.options['augment_padding']} (reflect), uniform crop",
        "equiconvert.training.augment.augmentation_params",
    ),
    Aspect(
        "augmentation: horizontal flip",
        lambda r: Side(0.5, r.at("data/augmentation.py", r"= RandomHorizontalFlip\(\)")[1]),
        lambda o: 0.5 if o.options["augment_flip"] else 0.0,
        "equiconvert.training.augment.augmentation_params",
    ),
    Aspect(
        "view gradients",
        _stated("train.py", r"grad_sample = grad_sample\.sum\(0\)", "sum, then clip at C"),
        lambda o: "mean, then clip at C",
        TRAINER,
        "sum of K clipped at C = K x (mean clipped at C/K): the released recipe uses clip C/K and lr x K",
    ),
    Aspect(
        "normalisation (mean, std)",
        _norm,
        lambda o: [list(_triple(o.options["normalize_mean"])), list(_triple(o.options["normalize_std"]))],
        "equiconvert.training.normalization.Normalize",
    ),
    Aspect(
        "expected batch",
        _setting("params", "bs"),
        lambda o: o.options["batch_size"],
        "dp.batch_size",
        "the released loader's expected batch is N q = 8333.3",
    ),
    Aspect(
        "sampling rate q (Poisson)",
        _q,
        _our_q,
        "equiconvert.privacy.sampling.PoissonSampler",
        "Opacus' DPDataLoader samples at 1 / (full batches per epoch); 8333/50000 is 4e-5 below 1/6 (relative)",
        equal=_same_rate,
    ),
    Aspect(
        "sampling rate the accountant is given",
        _accounted_q,
        _our_q,
        "equiconvert.privacy.accounting.PrivacyLedger",
        "the released code accounts for q = 8192/50000 but samples at 1/6: its run spends epsilon 8.08, not 8",
        equal=_same_rate,
    ),
    Aspect(
        "steps",
        _steps,
        lambda o: o.options["steps"],
        "schedule.steps",
        "update_steps 2160 in whole epochs of 6 steps: 353 x 6",
    ),
    Aspect("noise multiplier", _sigma, _our_sigma, "dp.noise_multiplier (or calibrated to dp.epsilon)"),
    Aspect("accountant", _accountant, lambda o: o.options["accountant"], "dp.accountant"),
    Aspect(
        "target epsilon",
        _setting("dp", "target_epsilon"),
        lambda o: o.options["target_epsilon"],
        "dp.epsilon",
        "the released recipe states the 8.08 its schedule spends",
    ),
    Aspect("delta", _setting("dp", "target_delta"), lambda o: o.options["delta"], "dp.delta"),
    Aspect(
        "clipping norm C (of the view reduction above)",
        _setting("dp", "clip_norm"),
        lambda o: o.options["max_grad_norm"],
        "dp.max_grad_norm",
        "the released recipe's C/K = 0.5 on the mean is the released C = 2 on the sum",
    ),
    Aspect(
        "clip factor",
        lambda r: Side("min(1, C / (norm + 1e-6)) (Opacus)", r.at("train.py", r"optim = DPOptimizer\(")[1]),
        lambda o: "min(1, C / (norm + 1e-6)) (Opacus)",
        "equiconvert.privacy.dp_step.clip_factors",
    ),
    Aspect(
        "noisy sum divided by",
        _divisor,
        lambda o: o.options["batch_size"],
        TRAINER,
        "the released recipe divides by 8333 and scales the lr by 8333/8192 instead",
    ),
    Aspect("optimizer", _optimizer, lambda o: f"{o.options['optimizer']}", "schedule.optimizer"),
    Aspect(
        "momentum",
        lambda r: Side(0.0, r.at("conf/setup/optim/sgd.yaml", r"_target_")[1]),
        lambda o: o.options["momentum"],
        "schedule.momentum",
    ),
    Aspect(
        "learning rate",
        _setting("optim", "optimizer", "lr"),
        lambda o: o.options["lr"],
        "schedule.lr",
        "the released recipe's 8.1377 = 2 x K x 8333/8192 is the same step (rows above)",
    ),
    Aspect("learning-rate schedule", _lr_schedule, lambda o: o.options["lr_schedule"], "schedule.lr_schedule"),
    Aspect(
        "EMA",
        _ema_per_step,
        lambda o: f"{o.options['ema_decay']} per step",
        "equiconvert.training.ema",
        "16-17 physical batches a step: 0.999^17 = 0.9831 per step is close, not exact "
        "(tests/recipes/test_released_recipe.py)",
    ),
    Aspect(
        "EMA warm-up",
        lambda r: Side("min(d, (1 + n) / (10 + n)), n = updates (torch_ema)", r.at("requirements.yml", "torch-ema")[1]),
        lambda o: "min(d, (1 + n) / (10 + n)), n = steps",
        "equiconvert.training.ema.warmup_cap",
        "counted over physical batches there, over steps here",
        equal=lambda r, o: False,
    ),
    Aspect(
        "evaluation",
        _stated("train.py", r"with ema\.average_parameters\(\):", "EMA weights, test set, after the last step"),
        lambda o: "EMA weights, test set, after the last step",
        TRAINER,
    ),
    Aspect(
        "precision",
        _stated("train.py", r"per_sample_grads = compute_per_sample_grads\(", "fp32"),
        lambda o: o.options["precision"],
        "dp.precision",
        "the results page's runs use bf16 autocast (its 'setting' column)",
    ),
    Aspect(
        "initialisation",
        _stated(
            "equivariant/nn/modules/conv/r2convolution.py",
            r"generalized_he_init\(self\.weights",
            "escnn's generalized He (gain 1) on escnn's coefficients",
        ),
        lambda o: "N(0, (1/sqrt 2)^2 / fan-in) on our orthonormal coefficients",
        "equiconvert.models.equivariant_resnet9.PRESET_INIT_GAIN",
    ),
    Aspect(
        "coefficient coordinates",
        _stated(
            "networks/equivariant_layers.py",
            r"frequencies_cutoff=lambda r: 3 \* r",
            "band limit 3r, escnn's basis (coordinates)",
        ),
        lambda o: "band limit 3r, orthonormal basis (coordinates)",
        "equiconvert.basis",
        "the same filters (the model comparison's span residuals); clipping, "
        "standardization and initialisation act on the coordinates",
    ),
    Aspect("width constant", _width, lambda o: 1.5, "equiconvert.convert.width.RELEASED_CODE_KAPPA"),
    Aspect(
        "weight standardization",
        _stated(
            "equivariant/nn/modules/conv/rd_convolution.py",
            r"std_mean\(self\.weights, dim=\(0\)",
            "whole layer, eps 1e-5 on the std",
        ),
        _ws,
        "model.kwargs.weight_standardization",
    ),
    Aspect("GroupNorm groups by stage (8 asked)", _released_groups, _groups, "model.kwargs.norm_group_rule"),
    Aspect(
        "conv bias",
        _stated(
            "equivariant/nn/modules/conv/rd_convolution.py",
            r"_bias = self\.bias_expansion @ self\.bias",
            "bias / sqrt(field size)",
        ),
        lambda o: "bias / sqrt(field size)" if o.model_kwargs.get("unit_norm_bias") else "bias on every channel",
        "model.kwargs.unit_norm_bias",
    ),
)


def _triple(value: Any) -> tuple[float, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else (float(value),) * 3


def settings_rows(root: Path | None) -> list[dict[str, Any]]:
    """One row per aspect: the released value and its file:line (None without a checkout), ours in the preset and in
    the released recipe, and whether each equals the released."""
    preset, recipe = Ours.of(PRESET), Ours.of(RELEASED_RECIPE)
    released = Released(root, released_config(root)) if root is not None else None
    rows = []
    for aspect in ASPECTS:
        mine, theirs = aspect.ours(preset), aspect.ours(recipe)
        row: dict[str, Any] = {
            "aspect": aspect.name,
            "ours": {"value": mine, "where": aspect.ours_where},
            "ours_released_recipe": {"value": theirs, "where": aspect.ours_where},
        }
        if released is not None:
            side = aspect.released(released)
            same = aspect.equal or _close
            row["released"] = {"value": side.value, "where": side.where}
            row["equal"] = bool(same(side.value, mine))
            row["equal_in_released_recipe"] = bool(same(side.value, theirs))
        row["note"] = aspect.note
        rows.append(row)
    return rows
