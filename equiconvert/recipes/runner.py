"""One private training run from names: the engine behind `equiconvert train`.

Builds the model (build_model.py), pads the images to a size at which the converted network is exactly
equivariant, optionally fits the steps to a time budget (step_plan.py), trains with DPTrainer and writes
OUT/result.json (result_record.py) and OUT/model.pt.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..check import check_equivariance
from ..convert import EquivariantModel
from ..errors import ParameterError
from ..conversion_options import INVARIANT_HEAD
from ..nn.conv import SteerableConv2d
from ..training import distributed
from ..privacy.accounting import refuse_delta
from ..training.dp_config import DPConfig
from ..training.inputs import InvalidDataError
from ..training.run_folder import prepare_out
from ..training.run_lock import hold_run_folder
from ..training.trainer import DPTrainer
from ..saved_model import library_versions, save_trained
from . import step_plan
from .adapt_model import adapt_model, adapts
from .build_model import (
    blocks_of,
    build_model,
    count_parameters,
    head_of,
    pad_images,
    preset_of,
    padded_size,
)
from .recipe import Recipe
from .result_record import trainer_record
from .recipe_checks import check_recipe
from .run_spec import BASELINE_GROUP, RunSpec


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
            raise ParameterError(
                f"{out} holds a run of another network (its {record.name} has {first[0].strip()!r} where "
                f"this one has {first[1].strip()!r}); refusing to resume: repeat the run's own options, "
                "or give another out="
            )
        return
    if writes:
        out.mkdir(parents=True, exist_ok=True)
        record.write_text(description)


def _refuse_impossible_sizes(config: DPConfig, num_examples: int) -> None:
    """Options that depend on the training set's size, checked before the model is built."""
    if config.batch_size > num_examples:
        raise ParameterError(
            f"batch_size={config.batch_size} exceeds the {num_examples} training examples: the Poisson "
            "sample rate batch_size / N must be <= 1"
        )
    if config.delta is not None:
        refuse_delta(config.delta, num_examples)


def run_recipe(recipe: Recipe) -> dict[str, Any]:
    """Train as the recipe says: checked once (recipe_checks.check_recipe), then run_checked.

    Args:
        recipe: the run's description.

    Returns:
        The result record (also written to run.out/result.json by rank 0), beside run.out/model.pt.
    """
    return run_checked(*check_recipe(recipe))


def run_checked(spec: RunSpec, config: DPConfig) -> dict[str, Any]:
    """Train one model with DP-SGD on one data set, as check_recipe returned it.

    Under torchrun (WORLD_SIZE > 1) this process is one rank of a data-parallel job (distributed.py).

    Args:
        spec: the run's model, data, output folder and device.
        config: the trainer's options.

    Returns:
        The result record (also written to spec.out/result.json by rank 0).
    """
    context, device = distributed.from_environment(spec.device)
    out = Path(spec.out) if context.is_main else None  # rank 0 alone writes the outputs
    try:
        with hold_run_folder(out, create=not spec.resume):  # one job per output folder
            return _run_training(spec, context, device, config)
    except RuntimeError as error:
        lost = distributed.lost_worker(error) if context.enabled else None
        if lost is None:
            raise
        raise lost from None
    finally:
        if context.enabled:
            distributed.shutdown()


def _run_training(
    spec: RunSpec, context: distributed.DistributedContext, device: str | None, config: DPConfig
) -> dict[str, Any]:
    from ..data import load_dataset, select_classes

    preset = preset_of(spec)
    if context.is_main:  # rank 0 alone writes the outputs
        prepare_out(Path(spec.out), resume=spec.resume, overwrite=spec.overwrite)
    start = time.perf_counter()
    with context.main_first():  # rank 0 fills the decoded-data cache the other ranks read
        train = select_classes(load_dataset(spec.dataset, spec.data_dir, split="train"), spec.classes, "data.classes")
        _refuse_impossible_sizes(config, len(train))
        test = select_classes(load_dataset(spec.dataset, spec.data_dir, split="test"), spec.classes, "data.classes")
    if len(test) == 0:
        raise InvalidDataError(
            f"the test split of {spec.dataset!r} is empty: the run could not be evaluated; give a data "
            "set (or data_dir=) with test examples"
        )
    channels, size = train.images.shape[1], train.images.shape[-1]
    result: dict[str, Any] = {
        "model": spec.model,
        "group": spec.group,
        "dataset": spec.dataset,
        "width": spec.width,
        "activation": None if preset is None else preset.activation,
    }
    # the model's initial weights come from the run's seed too, so one seed gives one run
    torch.manual_seed(config.seed)
    loss_fn = None
    if adapts(spec):
        adapted = adapt_model(spec, config, len(train.classes), channels, size, device)
        model, params_before, loss_fn = adapted.model, adapted.params_before, adapted.loss_fn
        result["adaptation"] = adapted.record
    else:
        model, params_before = build_model(spec, len(train.classes), channels, size)
    if spec.group.lower() == BASELINE_GROUP:
        input_size = size
    else:
        # a canonicalised model is invariant at any square size; a converted one at its valid sizes
        input_size = padded_size(model, size) if isinstance(model, EquivariantModel) else size
        result["init_gain"] = next((m.init_gain for m in model.modules() if isinstance(m, SteerableConv2d)), None)
        check = check_equivariance(model, input_size=input_size, batch_size=1)
        result["max_equivariance_error"] = check.max_error
        # the paper's head (AdaptiveAvgPool2d(2) + Flatten + Linear) is equivariant up to the head, not invariant
        result["invariant_head"] = head_of(spec) == INVARIANT_HEAD
    _refuse_resuming_another_model(Path(spec.out), model, spec.resume, writes=context.is_main)
    images_train, images_test = pad_images(train.images, input_size), pad_images(test.images, input_size)
    result["step_probe"] = None
    if spec.plan_steps and spec.time_limit_s is not None and not spec.resume:
        if context.world_size > 1:
            raise ParameterError("run.plan_steps times one process; drop it for a multi-process run")
        probe = step_plan.plan_steps(
            model, tuple(images_train.shape[1:]), len(train.classes), device, config, spec.time_limit_s
        )
        config = dataclasses.replace(config, steps=probe["planned_steps"])
        result["step_probe"] = probe
    trainer = DPTrainer(
        model,
        device=device,
        out_dir=spec.out,
        progress=spec.progress,
        distributed=context,
        loggers=spec.loggers,
        loss_fn=loss_fn,
        config=config,
    )
    trainer.fit(
        (images_train, train.labels),
        eval_set=(images_test, test.labels),
        resume=spec.resume,
        time_limit_s=spec.time_limit_s,
    )
    result.update(
        **trainer_record(trainer, Path(spec.out) / "log.jsonl" if context.is_main else None),
        params=count_parameters(model),
        params_before=params_before,
        input_size=input_size,
        train_examples=len(train),
        test_examples=len(test),
        norm_groups=None if preset is None else preset.norm_groups,
        **blocks_of(preset),
        wall_time_s=time.perf_counter() - start,
        world_size=context.world_size,
        versions=library_versions(),
    )
    if context.is_main:
        Path(spec.out).mkdir(parents=True, exist_ok=True)
        save_trained(
            trainer, Path(spec.out) / "model.pt", batch_norm_to_group_norm=spec.group.lower() == BASELINE_GROUP
        )
        (Path(spec.out) / "result.json").write_text(json.dumps(result, indent=2))
    return result
