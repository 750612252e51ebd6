"""One private training run from names: the engine behind `equiconvert train`.

Builds the model, converts it (or keeps it, for the "none" baseline), pads the
images to a size at which the converted network is exactly equivariant, trains
with DPTrainer and writes OUT/result.json.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..check import check_equivariance
from ..convert import make_equivariant
from ..nn.conv import SteerableConv2d
from ..privacy import distributed
from ..privacy.accounting import refuse_delta
from ..privacy.dp_config import DPConfig, check_config
from ..privacy.filter_gradients import fastest_choices
from ..privacy.run_folder import prepare_out
from ..privacy.trainer import DPTrainer
from .recipe import Recipe, RecipeError
from ..saved_model import library_versions, save_trained

BASELINE_GROUP = "none"


@dataclass
class RunSpec:
    """What `equiconvert train` was asked to do."""

    model: str
    group: str
    dataset: str
    data_dir: str | None
    out: str
    width: str | float | None = None
    # the model's keyword arguments (create_model's, e.g. widths); the paper preset also takes PRESET_KEYS
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    device: str | None = None
    resume: bool = False
    overwrite: bool = False  # replace an earlier run's files in `out` (otherwise a non-empty `out` is refused)
    progress: bool = True
    time_limit_s: float | None = None  # stop (with a checkpoint) after this much training time; --resume continues
    init_gain: float | None = None  # ConversionConfig.init_gain; None keeps the model's default
    head: str | None = None  # "keep" or "invariant"; None: the paper preset's own head, "invariant" for other models
    plan_steps: bool = False  # fit the steps to time_limit_s by a timing probe before the noise is calibrated

    def preset(self, key: str) -> Any:
        """A paper-preset keyword argument as given (None: the preset's own)."""
        return self.model_kwargs.get(key)

    def passed_kwargs(self) -> dict[str, Any]:
        """The keyword arguments create_model receives as they are (the preset's own ones are built separately)."""
        return {k: v for k, v in self.model_kwargs.items() if k not in PRESET_KEYS}

    def conversion_kwargs(self) -> dict[str, Any]:
        """The model keyword arguments that are ConversionConfig fields (e.g. weight_standardization): the paper
        preset passes them to its conversion, so its plain network is built without them."""
        from ..convert.context import ConversionConfig

        names = {f.name for f in dataclasses.fields(ConversionConfig)}
        return {k: v for k, v in self.passed_kwargs().items() if k in names}


# the paper preset's keyword arguments (its conv -> activation -> norm blocks and last stage), refused for other
# models: activation (a PAPER_ACTIVATIONS name; default mish), norm_groups (default 8), res2 (default true: the last
# residual block kept), pool_after_res2 (default false: res2 at 4x4)
PRESET_KEYS = ("activation", "norm_groups", "res2", "pool_after_res2")


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _replace_batch_norm(model: nn.Module) -> nn.Module:
    """For the unconverted baseline: BatchNorm (batch statistics) -> GroupNorm, as Opacus' ModuleValidator.fix does."""
    from opacus.validators import ModuleValidator

    return ModuleValidator.fix(model)


PAPER_MODEL = "equiconvert:equivariant_resnet9"


def _is_paper_model(spec: RunSpec) -> bool:
    """Whether spec.model names the paper's preset (under any of its registry names)."""
    from ..models._registry import resolve_model_name

    return resolve_model_name(spec.model) == PAPER_MODEL


def _paper_model(spec: RunSpec, activation: str, num_classes: int, channels: int) -> tuple[nn.Module, int]:
    """Hölzl et al.'s Equivariant-ResNet9 for spec.group (its own widths and head), or, for "none", the plain
    network it is converted from, with `activation` (a PAPER_ACTIVATIONS name); also the plain network's size."""
    from ..models import create_model

    if "widths" in spec.model_kwargs:
        raise ValueError(
            f"{PAPER_MODEL} has the paper's layout (16, 32, 64); the keyword widths does not apply to "
            "it (conversion.width / --set conversion.width=... changes its conversion's width rule)"
        )
    norm_groups = _norm_groups(spec)
    try:
        plain = create_model(
            "plain_paper_resnet9",
            num_classes=num_classes,
            in_channels=channels,
            act=activation,
            norm_groups=norm_groups,
            **_blocks(spec),
            **{k: v for k, v in spec.passed_kwargs().items() if k not in spec.conversion_kwargs()},
        )
    except ValueError as exc:
        raise ValueError(f"norm_groups {spec.preset('norm_groups')}: {exc}") from exc
    if spec.group.lower() == BASELINE_GROUP:
        return plain, _count(plain)
    width = {} if spec.width is None else {"width": spec.width}
    model = create_model(
        PAPER_MODEL,
        group=spec.group,
        num_classes=num_classes,
        in_channels=channels,
        head=_head(spec),
        act=activation,
        **width,
        norm_groups=norm_groups,
        **_blocks(spec),
        **_conversion_options(spec),
        **spec.passed_kwargs(),
    )
    return model, _count(plain)


def _activation(spec: RunSpec) -> str | None:
    """The paper preset's activation, by name: as asked, else the paper's Mish; None for other models (their own)."""
    from ..models.equivariant_resnet9 import PAPER_ACTIVATIONS

    if not _is_paper_model(spec):
        return None
    activation = spec.preset("activation")
    if activation is not None and activation not in PAPER_ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {sorted(PAPER_ACTIVATIONS)}")
    return activation or "mish"


def _norm_groups(spec: RunSpec) -> int | None:
    """The paper preset's GroupNorm groups as built (None for other models: their own norms)."""
    from ..models.equivariant_resnet9 import PAPER_NORM_GROUPS

    if not _is_paper_model(spec):
        return None
    return PAPER_NORM_GROUPS if spec.preset("norm_groups") is None else spec.preset("norm_groups")


def _blocks(spec: RunSpec) -> dict[str, bool | None]:
    """The paper preset's last-stage choices as built (res2 kept, pooled before it unless asked); None for others."""
    if not _is_paper_model(spec):
        return {"res2": None, "pool_after_res2": None}
    return {"res2": spec.preset("res2") is not False, "pool_after_res2": bool(spec.preset("pool_after_res2"))}


def _final_ema_decay(trainer: DPTrainer) -> float | None:
    """The decay the EMA's last update used (the warm-up may keep it under the one asked for); None without one."""
    return trainer.ema.decay_at(trainer.step - 1) if trainer.ema is not None and trainer.step else None


def _head(spec: RunSpec) -> str:
    """The converted model's head: as asked, else the paper preset's own (its 2x2 grid), else global pooling."""
    return spec.head or ("keep" if _is_paper_model(spec) else "invariant")


# options that only a converted model has, and what each sets: refused for the unconverted baseline
_CONVERSION_FLAGS = {
    "init_gain": ("conversion.init_gain", "the steerable filters' initial scale"),
    "head": ("conversion.head", "the converted model's head"),
    "width": ("conversion.width", "the conversion's width rule"),
}


def _refuse_preset_options_for_other_models(spec: RunSpec) -> None:
    if _is_paper_model(spec):
        return
    for key in PRESET_KEYS:
        if spec.preset(key) is not None:
            raise ValueError(
                f"the model keyword {key} applies to {PAPER_MODEL} only (its conv -> activation -> norm "
                f"blocks), not {spec.model!r}: drop it, or train {PAPER_MODEL}"
            )


def _refuse_conversion_options_for_baseline(spec: RunSpec) -> None:
    if spec.group.lower() != BASELINE_GROUP:
        return
    if _is_paper_model(spec) and spec.conversion_kwargs():  # its plain network is built without them
        raise ValueError(
            f"model.kwargs {sorted(spec.conversion_kwargs())} are conversion options; the unconverted baseline "
            "(--group none) has no conversion: drop them, or pick a group"
        )
    for name, (flag, what) in _CONVERSION_FLAGS.items():
        if getattr(spec, name) is not None:
            raise ValueError(
                f"{flag} sets {what}; the unconverted baseline (--group none) has none: drop {flag}, or pick a group"
            )


def _conversion_options(spec: RunSpec) -> dict[str, Any]:
    return {} if spec.init_gain is None else {"init_gain": spec.init_gain}


def _refuse_resuming_another_model(out: Path, model: nn.Module, resume: bool, writes: bool) -> None:
    """A checkpoint restores parameters by name and shape, so a change without parameters (another activation)
    would resume silently into another network: OUT/model.txt keeps the architecture the run started with."""
    record, description = out / "model.txt", repr(model)
    if resume and record.exists():
        saved = record.read_text()
        if saved != description:
            first = next(
                (pair for pair in zip(saved.splitlines(), description.splitlines()) if pair[0] != pair[1]),
                ("...", "..."),
            )
            raise ValueError(
                f"{out} holds a run of another network (its {record.name} has {first[0].strip()!r} where "
                f"this one has {first[1].strip()!r}); refusing to resume: repeat the run's own options, "
                "or give a new --out"
            )
        return
    if writes:
        out.mkdir(parents=True, exist_ok=True)
        record.write_text(description)


def _eval_history(log: Path) -> list[dict[str, Any]]:
    """Every periodic evaluation of the run, from its log (which a resumed run appends to)."""
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    by_step = {r["step"]: {"step": r["step"], **r["eval"]} for r in records if "eval" in r}
    return [by_step[step] for step in sorted(by_step)]


def _device_name(device: torch.device) -> str:
    """'cuda (NVIDIA H200)' rather than 'cuda', so results say which card produced them."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def padded_size(model: Any, size: int) -> int:
    """Smallest valid input size >= size reachable by symmetric padding (same parity as size)."""
    for candidate in model.report.valid_input_sizes:
        if candidate >= size and (candidate - size) % 2 == 0:
            return candidate
    raise ValueError(f"no valid input size >= {size} with the parity of {size}: {model.report.valid_input_rule}")


_RESULT_METRIC_NAMES = {"accuracy": "test_accuracy", "loss": "test_loss", "brier": "brier", "ece": "ece"}


def _final_metrics(final: dict[str, float]) -> dict[str, float]:
    """The final evaluation under result.json's names; shift-averaged ones (DPConfig.test_shifts) get a suffix."""
    plain = {name: final[key] for key, name in _RESULT_METRIC_NAMES.items()}
    averaged = {
        f"{name}_shift_averaged": final[f"shift_averaged_{key}"]
        for key, name in _RESULT_METRIC_NAMES.items()
        if f"shift_averaged_{key}" in final
    }
    return {**plain, **averaged}


PROBE_STEPS = 3  # timed steps, after one untimed warm-up step
PLAN_SHARE = 0.8  # of the time budget the planned steps may take: a margin for steps slower than the probe's


def probe_seconds_per_step(
    model: nn.Module,
    image_shape: tuple[int, ...],
    num_classes: int,
    device: str | None,
    options: dict[str, Any],
    steps: int = PROBE_STEPS,
) -> float:
    """Seconds per DP-SGD step of a copy of `model` with the run's batch options on this machine, timed on random
    images of the run's shape (one batch of batch_size examples a step; no data of the run is read)."""
    import copy

    batch = options.get("batch_size", DPConfig.batch_size)
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (batch, *image_shape), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, num_classes, (batch,), generator=generator)
    timing = {
        **options,
        "steps": steps + 1,
        "target_epsilon": None,
        "noise_multiplier": 1.0,
        "eval_every": None,
        "checkpoint_every": None,
        "epsilon_every": 1,
        "delta": None,
        "ema_decay": None,
    }
    trainer = DPTrainer(copy.deepcopy(model), device=device, out_dir=None, progress=False, **timing)
    trainer.fit((images, labels))
    times = [r["time_s"] for r in trainer.history if "time_s" in r]
    return (times[-1] - times[0]) / steps


def plan_steps(
    model: nn.Module,
    image_shape: tuple[int, ...],
    num_classes: int,
    device: str | None,
    options: dict[str, Any],
    time_budget_s: float,
) -> dict[str, Any]:
    """How many of the requested steps fit PLAN_SHARE of the time budget at the probe's pace (at least one); the
    noise is then calibrated for those steps, so the run spends its whole epsilon within the budget."""
    seconds = probe_seconds_per_step(model, image_shape, num_classes, device, options)
    requested = options.get("steps", DPConfig.steps)
    fitting = int(PLAN_SHARE * time_budget_s / seconds) if seconds > 0 else requested
    return {
        "probe_steps": PROBE_STEPS,
        "seconds_per_step": seconds,
        "time_budget_s": time_budget_s,
        "plan_share": PLAN_SHARE,
        "requested_steps": requested,
        "planned_steps": max(1, min(requested, fitting)),
    }


def pad_images(images: torch.Tensor, size: int) -> torch.Tensor:
    """Zero-pad square images symmetrically to `size` (the converted model's valid input size)."""
    margin = (size - images.shape[-1]) // 2
    return images if margin == 0 else F.pad(images, (margin,) * 4)


def _refuse_impossible_sizes(options: dict[str, Any], num_examples: int) -> None:
    """Options that depend on the training set's size, checked before the model is built."""
    batch_size = options.get("batch_size", DPConfig.batch_size)
    if batch_size > num_examples:
        raise ValueError(
            f"--batch-size {batch_size} exceeds the {num_examples} training examples: the Poisson "
            "sample rate batch_size / N must be <= 1"
        )
    if options.get("delta") is not None:
        refuse_delta(options["delta"], num_examples, flag="--delta")


def spec_of(recipe: Recipe) -> RunSpec:
    """The RunSpec of a recipe; data.dataset and run.out must be set (by the recipe file or the flags)."""
    for key, value in (("data.dataset", recipe.data.dataset), ("run.out", recipe.run.out)):
        if value is None:
            raise RecipeError(
                f"{key} is not set: give it in the recipe, by its flag (--dataset, --out) or by --set {key}=..."
            )
    m, c, r = recipe.model, recipe.conversion, recipe.run
    return RunSpec(
        model=m.name,
        group=c.group,
        dataset=recipe.data.dataset,
        data_dir=recipe.data.data_dir,
        out=r.out,
        width=c.width,
        model_kwargs=dict(m.kwargs),
        device=r.device,
        resume=r.resume,
        overwrite=r.overwrite,
        progress=r.progress,
        time_limit_s=r.time_limit_s,
        init_gain=c.init_gain,
        head=c.head,
        plan_steps=r.plan_steps,
    )


def trainer_options(recipe: Recipe) -> dict[str, Any]:
    """The recipe's DPConfig as run_training's keyword arguments (an EMA decay of 0: no EMA)."""
    options = dataclasses.asdict(recipe.trainer)
    options["ema_decay"] = options["ema_decay"] or None
    return options


def run_recipe(recipe: Recipe) -> dict[str, Any]:
    """Train as the recipe says (run_training); returns the result record."""
    return run_training(spec_of(recipe), **trainer_options(recipe))


def run_training(spec: RunSpec, **trainer_options: Any) -> dict[str, Any]:
    """Train one model with DP-SGD on one data set; returns (and, on rank 0, writes) the result record.

    Under torchrun (WORLD_SIZE > 1) this process is one rank of a data-parallel job (distributed.py).
    """
    from ..data import resolve_name

    check_config(DPConfig(**trainer_options))  # every option before any data is read
    resolve_name(spec.dataset)
    _refuse_conversion_options_for_baseline(spec)
    _refuse_preset_options_for_other_models(spec)
    context, device = distributed.from_environment(spec.device)
    try:
        return _run_training(spec, context, device, trainer_options)
    finally:
        if context.enabled:
            distributed.shutdown()


def _run_training(
    spec: RunSpec, context: distributed.DistributedContext, device: str | None, trainer_options: dict[str, Any]
) -> dict[str, Any]:
    from ..models import create_model
    from ..data import load_dataset

    activation = _activation(spec)
    if context.is_main:  # rank 0 alone writes the outputs
        prepare_out(Path(spec.out), resume=spec.resume, overwrite=spec.overwrite)
    start = time.perf_counter()
    with context.main_first():  # rank 0 fills the decoded-data cache the other ranks read
        train = load_dataset(spec.dataset, spec.data_dir, split="train")
        _refuse_impossible_sizes(trainer_options, len(train))
        test = load_dataset(spec.dataset, spec.data_dir, split="test")
    if len(test) == 0:
        raise ValueError(
            f"the test split of {spec.dataset!r} is empty: the run could not be evaluated; give a data "
            "set (or --data-dir) with test examples"
        )
    channels, size = train.images.shape[1], train.images.shape[-1]
    result: dict[str, Any] = {
        "model": spec.model,
        "group": spec.group,
        "dataset": spec.dataset,
        "width": spec.width,
        "activation": activation,
    }
    # the model's initial weights come from the run's seed too, so one seed gives one run
    torch.manual_seed(trainer_options.get("seed", DPConfig.seed))
    if _is_paper_model(spec):
        model, params_before = _paper_model(spec, activation, len(train.classes), channels)
    else:
        model = create_model(spec.model, num_classes=len(train.classes), in_channels=channels, **spec.passed_kwargs())
        params_before = _count(model)
        if spec.group.lower() == BASELINE_GROUP:
            model = _replace_batch_norm(model)
        else:
            model = make_equivariant(
                model, spec.group, width=spec.width, head=_head(spec), config=_conversion_options(spec)
            )
    if spec.group.lower() == BASELINE_GROUP:
        input_size = size
    else:
        input_size = padded_size(model, size)
        result["init_gain"] = next((m.init_gain for m in model.modules() if isinstance(m, SteerableConv2d)), None)
        check = check_equivariance(model, input_size=input_size, batch_size=1)
        result["max_equivariance_error"] = check.max_error
        # the paper's head (AdaptiveAvgPool2d(2) + Flatten + Linear) is equivariant up to the head, not invariant
        result["invariant_head"] = _head(spec) == "invariant"
    _refuse_resuming_another_model(Path(spec.out), model, spec.resume, writes=context.is_main)
    images_train, images_test = pad_images(train.images, input_size), pad_images(test.images, input_size)
    result["step_probe"] = None
    if spec.plan_steps and spec.time_limit_s is not None and not spec.resume:
        if context.world_size > 1:
            raise ValueError("run.plan_steps times one process; drop it for a multi-process run")
        probe = plan_steps(
            model, tuple(images_train.shape[1:]), len(train.classes), device, trainer_options, spec.time_limit_s
        )
        trainer_options = {**trainer_options, "steps": probe["planned_steps"]}
        result["step_probe"] = probe
    trainer = DPTrainer(
        model, device=device, out_dir=spec.out, progress=spec.progress, distributed=context, **trainer_options
    )
    trainer.fit(
        (images_train, train.labels),
        eval_set=(images_test, test.labels),
        resume=spec.resume,
        time_limit_s=spec.time_limit_s,
    )
    final = trainer.history[-1]["final_eval"]
    c = trainer.config
    result.update(
        **_final_metrics(final),
        private=trainer.private,
        log_nonprivate_stats=c.log_nonprivate_stats,
        epsilon=trainer.epsilon,
        delta=trainer.delta,
        target_epsilon=c.target_epsilon,
        accountant=c.accountant,
        noise_multiplier=trainer.noise_multiplier,
        steps=trainer.step,
        batch_size=c.batch_size,
        aug_mult=c.aug_mult,
        max_grad_norm=c.max_grad_norm,
        lr=c.lr,
        ema_decay=c.ema_decay,
        ema_final_decay=_final_ema_decay(trainer),
        params=_count(model),
        params_before=params_before,
        input_size=input_size,
        train_examples=len(train),
        test_examples=len(test),
        device=_device_name(trainer.device),
        lr_schedule=c.lr_schedule,
        per_sample_method=trainer.per_sample_method,
        precision=c.precision,
        seed=c.seed,
        filter_gradients=c.filter_gradients,
        filter_gradient_kernels=fastest_choices(),  # what "fastest" chose in this process (one run per `train`)
        requested_steps=c.steps,
        stopped_reason=trainer.stopped_reason,
        normalize_mean=c.normalize_mean,
        normalize_std=c.normalize_std,
        augment_padding=c.augment_padding,
        augment_flip=c.augment_flip,
        norm_groups=_norm_groups(spec),
        **_blocks(spec),
        test_shifts=c.test_shifts,
        evals=_eval_history(Path(spec.out) / "log.jsonl"),
        train_time_s=max((r["time_s"] for r in trainer.history if "time_s" in r), default=0.0),  # this call's
        wall_time_s=time.perf_counter() - start,
        world_size=context.world_size,
        versions=library_versions(),
    )
    if c.log_nonprivate_stats:  # a noise-free statistic of the training data: written only when asked for
        result["nonfinite_gradients"] = trainer.nonfinite_gradients
    if context.is_main:
        Path(spec.out).mkdir(parents=True, exist_ok=True)
        save_trained(
            trainer, Path(spec.out) / "model.pt", batch_norm_to_group_norm=spec.group.lower() == BASELINE_GROUP
        )
        (Path(spec.out) / "result.json").write_text(json.dumps(result, indent=2))
    return result
