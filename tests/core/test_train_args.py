"""tests/support/train_args.py builds the argument list the CLI tests train with: what `train` parses from it."""

from __future__ import annotations

from equiconvert.cli import _parser
from equiconvert.cli.train import train_recipe
from equiconvert.recipes.recipe import Recipe
from tests.support.train_args import tiny_train_args


def test_tiny_train_args_is_the_tiny_run_with_flags_replaced_dropped_and_appended(tmp_path):
    tiny = train_recipe(_parser().parse_args(tiny_train_args(tmp_path)))
    run, t = tiny.run, tiny.trainer
    assert (tiny.data.dataset, run.out, run.device, run.progress) == ("synthetic", str(tmp_path), "cpu", False)
    assert (t.steps, t.batch_size, t.aug_mult, t.physical_batch_size) == (1, 8, 1, 8)

    args = tiny_train_args(tmp_path, "--resume", "--set", "schedule.lr=0.5", steps=3, aug_mult=None, model_kwargs="x=1")
    assert args[-3:] == ["--resume", "--set", "schedule.lr=0.5"] and args.count("--steps") == 1
    changed = train_recipe(_parser().parse_args(args))
    assert changed.trainer.steps == 3 and changed.trainer.aug_mult == Recipe().trainer.aug_mult  # dropped: the default
    assert changed.model.kwargs == {"x": 1} and changed.run.resume and changed.trainer.lr == 0.5
