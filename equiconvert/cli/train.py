"""`equiconvert train`: run a recipe, changed by the flags and `--set`, and print its result."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable

from ..group_names import GROUP_NAMES
from ..privacy.accountant_names import ACCOUNTANTS
from .recipe_flags import TRAIN_FLAGS, add_recipe_options, apply_flags, check_recipe, check_recipe_names, recipe_flag
from .commands import SUBCOMMANDS


def train_recipe(args: argparse.Namespace):
    """The recipe `train` runs: --recipe (or the defaults), then the flags given, then --model-kwargs and --set."""
    from ..recipes.recipe import Recipe, apply_overrides, load_recipe

    recipe = load_recipe(args.recipe) if getattr(args, "recipe", None) else Recipe()
    apply_flags(recipe, args, TRAIN_FLAGS)
    recipe.model.kwargs.update(getattr(args, "model_kwargs", {}))
    return apply_overrides(recipe, getattr(args, "set", []))


def _cmd_train(args: argparse.Namespace) -> int:
    recipe = train_recipe(args)  # an unknown recipe name is refused here, before torch loads
    check_recipe_names(recipe)  # and a mistyped logger name
    import torch

    from ..recipes.runner import run_checked
    from .launch import launch_train

    spec, config = check_recipe(recipe)  # the run's one check: each worker of a launched job checks its own copy
    if getattr(args, "nproc_per_node", None) is not None:
        return launch_train(args, recipe.run.device)
    if recipe.run.threads is not None:
        torch.set_num_threads(recipe.run.threads)
    result = run_checked(spec, config)
    if os.environ.get("RANK", "0") == "0":  # one printout per job (torchrun numbers its workers in RANK)
        print(json.dumps(result, indent=2))
    return 0


def add_parser(sub) -> None:
    from ..recipes.recipe import parse_kwargs

    train = sub.add_parser(
        "train",
        help=SUBCOMMANDS["train"],
        description="Train as a recipe says (equiconvert/recipes/files/*.toml, or your own TOML file), changed by "
        "the flags given and then by --set KEY=VALUE. Defaults: training.dp_config.DPConfig and the recipe "
        "dataclasses (equiconvert.recipes.recipe).",
    )
    g = train.add_argument_group("model")
    recipe_flag(
        g,
        "--model",
        "a registry name (equiconvert.models.list_models()): resnet9, equivariant_resnet9 "
        "(Hölzl et al.'s model for --group), torchvision:<name>, timm:<name>",
    )
    g.add_argument(
        "--model-kwargs",
        type=_model_kwargs(parse_kwargs),
        default=argparse.SUPPRESS,
        metavar="K=V,...",
        help="the model's keyword arguments, e.g. widths=16,32,64 (equiconvert:resnet9) or "
        "activation=relu,norm_groups=4,res2=false,pool_after_res2=true (equivariant_resnet9); "
        "a model that does not take one refuses it [model.kwargs; default: the model's own]",
    )
    recipe_flag(
        g,
        "--group",
        f"{GROUP_NAMES}, or 'none' for the unconverted baseline (conversion.width/head/init_gain: --set)",
    )
    g = train.add_argument_group("data")
    recipe_flag(
        g,
        "--dataset",
        "fashion-mnist, cifar10, rotated-mnist, imagenet32, imagefolder, synthetic (required, by the recipe or here)",
    )
    recipe_flag(g, "--data-dir", "the data set's folder")
    g = train.add_argument_group("privacy")
    recipe_flag(g, "--epsilon", "target epsilon (the noise is calibrated to spend it)", type=float)
    recipe_flag(
        g,
        "--delta",
        "target delta (none: from the number N of training examples, by equiconvert.privacy.accounting.default_delta)",
        type=float,
    )
    recipe_flag(g, "--accountant", "privacy accountant", choices=ACCOUNTANTS)
    recipe_flag(g, "--batch-size", "expected logical (Poisson) batch size", type=int)
    recipe_flag(g, "--aug-mult", "augmented views per example, averaged before clipping", type=int)
    recipe_flag(g, "--max-grad-norm", "per-example clipping norm", type=float)
    g = train.add_argument_group("optimisation")
    recipe_flag(g, "--steps", "DP-SGD steps", type=int)
    recipe_flag(g, "--lr", "learning rate (schedule.lr_schedule, .momentum, .optimizer, .ema_decay: --set)", type=float)
    g = train.add_argument_group("run and output")
    g.add_argument(
        "--recipe",
        default=argparse.SUPPRESS,
        metavar="NAME|FILE",
        help="a shipped recipe's name (equiconvert recipes) or a TOML file [default: none, the defaults]",
    )
    add_recipe_options(g)
    recipe_flag(
        g, "--out", "output folder (log.jsonl, checkpoint.pt, model.pt, result.json); required, by the recipe or here"
    )
    recipe_flag(g, "--device", "cpu, cuda, cuda:1 (none: cuda if available)")
    recipe_flag(
        g,
        "--logger",
        "where the log records go: jsonl (OUT/log.jsonl, always written), csv (OUT/log.csv), tensorboard "
        "(OUT/tensorboard), wandb (OUT/wandb, offline unless WANDB_MODE says otherwise); repeatable or "
        "comma-separated; each gets the records log.jsonl gets and nothing more",
        type=lambda text: [name.strip() for name in text.split(",") if name.strip()],
        action="extend",
        metavar="NAME[,NAME]",
    )
    recipe_flag(
        g,
        "--time-limit",
        "stop training after this many seconds, with a checkpoint; --resume continues",
        type=float,
        metavar="SECONDS",
    )
    recipe_flag(g, "--resume", "continue from OUT/checkpoint.pt (which must exist)", action="store_true")
    recipe_flag(
        g,
        "--overwrite",
        "replace the earlier run in OUT (otherwise an OUT holding a run's files is refused)",
        action="store_true",
    )
    g = train.add_argument_group("advanced")
    recipe_flag(g, "--physical-batch-size", "examples per forward/backward pass (memory, not privacy)", type=int)
    recipe_flag(g, "--seed", "initial weights, augmentation and data order (never the DP noise or sampling)", type=int)
    recipe_flag(g, "--threads", "CPU threads of this process (none: PyTorch's, one per core)", type=int)
    recipe_flag(
        g,
        "--insecure-seeded-noise",
        "NOT PRIVATE: seed the DP noise and batch sampling from --seed (tests, "
        "debugging); result.json records private: false",
        action="store_true",
    )
    g.add_argument(
        "--nproc-per-node",
        type=int,
        default=argparse.SUPPRESS,
        metavar="N",
        help="train on N local processes (GPUs) at once, as torchrun --standalone --nproc-per-node N "
        "would (docs/multi-gpu.md) [default: one process]",
    )
    train.set_defaults(func=_cmd_train)


def _model_kwargs(parse: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    def parse_flag(text: str) -> dict[str, Any]:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse_flag
