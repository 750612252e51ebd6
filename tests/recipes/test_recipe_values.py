"""Every recipe value is checked against the type of the field it sets (recipes/value_types.py)."""

import pytest

from equiconvert.recipes.recipe import Recipe, RecipeError, apply_overrides, recipe_from_dict


@pytest.mark.parametrize(
    "assignment, message",
    [
        ("dp.insecure_seeded_noise=no", r"dp.insecure_seeded_noise takes true or false, got 'no'"),
        ("data.augment_flip=no", r"data.augment_flip takes true or false, got 'no'"),
        ("dp.epsilon=abc", r"dp.target_epsilon takes a number, got 'abc'"),
        ("dp.epsilon=nan", r"dp.target_epsilon takes a number, got nan"),
        ('schedule.steps="1"', r"schedule.steps takes an integer, got '1'"),
        ("schedule.steps=true", r"schedule.steps takes an integer, got True"),
        ("dp.batch_size=2.5", r"dp.batch_size takes an integer, got 2.5"),
        ("conversion.group=4", r"conversion.group takes a string"),
        ('data.normalize_mean=[0.5,"x"]', r"data.normalize_mean takes a number or a list of numbers"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_the_key(assignment, message):
    with pytest.raises(RecipeError, match=rf"^assignments={assignment.split('=')[0]}=.*{message}"):
        apply_overrides(Recipe(), [assignment])


def test_a_string_for_a_bool_never_switches_seeded_noise_on():
    recipe = apply_overrides(Recipe(), ["dp.insecure_seeded_noise=false"])
    assert recipe.trainer.insecure_seeded_noise is False
    with pytest.raises(RecipeError):
        recipe_from_dict({"dp": {"insecure_seeded_noise": "no"}})


def test_values_of_the_right_type_are_kept_as_the_field_keeps_them():
    recipe = apply_overrides(
        Recipe(),
        ["dp.epsilon=3", "data.normalize_mean=[0.5, 0.5, 0.5]", "conversion.width=kappa", "run.time_limit_s=60"],
    )
    assert recipe.trainer.target_epsilon == 3.0 and isinstance(recipe.trainer.target_epsilon, float)
    assert recipe.trainer.normalize_mean == (0.5, 0.5, 0.5)
    assert recipe.conversion.width == "kappa" and recipe.run.time_limit_s == 60.0
    assert apply_overrides(Recipe(), ["conversion.width=1.5"]).conversion.width == 1.5


def test_a_rank_that_does_not_write_the_log_never_reads_it(tmp_path):
    """result.json's evaluations come from rank 0's log; another rank could read a half-written line."""
    from equiconvert.recipes.result_record import eval_history

    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 2, "eval": {"accuracy": 0.5}}\n{"step": 3, "ev')  # rank 0 is mid-write
    assert eval_history(None) == []
    assert eval_history(tmp_path / "absent.jsonl") == []
