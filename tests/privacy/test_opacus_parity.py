"""Opacus API parity: an Opacus script runs with only its import swapped; Opacus' other arguments are served or
refused by name; checkpoints carry no secret generator state."""

import contextlib
import io
import re

import pytest
import torch
from opacus.accountants import GaussianAccountant, PRVAccountant
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import equiconvert
from equiconvert.errors import EquiconvertError
from equiconvert.privacy import engine as engine_module
from equiconvert.privacy import PrivacyEngine, opacus_interop
from equiconvert.privacy.checkpoint import CheckpointError
from equiconvert.privacy.dp_loss import DPLoss
from equiconvert.privacy.opacus_parity import OpacusArgumentError
from equiconvert.privacy.optimizer_params import ForeignParametersError
from equiconvert.privacy.validate import PrivacyValidationError

OURS = "from equiconvert.privacy import PrivacyEngine"
THEIRS = "from opacus import PrivacyEngine"

# Opacus' README / tutorial loop, verbatim but for the import line ({IMPORT}) and the engine's arguments ({ENGINE})
TUTORIAL = """
{IMPORT}

privacy_engine = PrivacyEngine({ENGINE})
model, optimizer, train_loader = privacy_engine.make_private(
    module=model,
    optimizer=optimizer,
    data_loader=train_loader,
    noise_multiplier=1.1,
    max_grad_norm=1.0,
)
for epoch in range(EPOCHS):
    for images, target in train_loader:
        optimizer.zero_grad()
        output = model(images)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
epsilon = privacy_engine.get_epsilon(DELTA)
accountant_epsilon = privacy_engine.accountant.get_epsilon(delta=DELTA)
"""

# Opacus' ghost-clipping usage (its tutorials' grad_sample_mode="ghost"): the criterion comes back wrapped
GHOST = """
{IMPORT}

privacy_engine = PrivacyEngine({ENGINE})
model, optimizer, criterion, train_loader = privacy_engine.make_private(
    module=model,
    optimizer=optimizer,
    data_loader=train_loader,
    criterion=criterion,
    noise_multiplier=1.1,
    max_grad_norm=1.0,
    grad_sample_mode="ghost",{EXTRA}
)
for epoch in range(EPOCHS):
    for images, target in train_loader:
        optimizer.zero_grad()
        loss = criterion(model(images), target)
        loss.backward()
        optimizer.step()
epsilon = privacy_engine.get_epsilon(DELTA)
"""


def _setup() -> dict:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 6), torch.randint(0, 3, (32,)))
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    return {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "train_loader": DataLoader(data, batch_size=8),  # 4 batches an epoch: sample rate 1/4
        "criterion": nn.CrossEntropyLoss(),
        "EPOCHS": 1,
        "DELTA": 1e-5,
    }


def _run(script: str, import_line: str, engine: str = "", extra: str = "") -> dict:
    namespace = _setup()
    with pytest.warns(UserWarning) if "gdp" in engine or import_line == THEIRS else contextlib.nullcontext():
        exec(script.format(IMPORT=import_line, ENGINE=engine, EXTRA=extra), namespace)  # noqa: S102
    return namespace


@pytest.mark.parametrize("engine", ["", "accountant='gdp'"])
def test_opacus_tutorial_runs_with_the_import_swapped_and_reports_opacus_epsilon(engine):
    ours, theirs = _run(TUTORIAL, OURS, engine), _run(TUTORIAL, THEIRS, engine)
    assert isinstance(ours["privacy_engine"].accountant, GaussianAccountant if engine else PRVAccountant)
    assert ours["optimizer"].steps == 4
    assert ours["epsilon"] > 0
    assert ours["epsilon"] == pytest.approx(theirs["epsilon"], rel=1e-9)
    assert ours["accountant_epsilon"] == pytest.approx(theirs["accountant_epsilon"], rel=1e-9)
    assert ours["accountant_epsilon"] == pytest.approx(ours["epsilon"], rel=1e-9)


def test_opacus_ghost_clipping_usage_runs_with_the_import_swapped():
    ours, theirs = _run(GHOST, OURS), _run(GHOST, THEIRS)
    assert isinstance(ours["criterion"], DPLoss)
    assert ours["epsilon"] == pytest.approx(theirs["epsilon"], rel=1e-9)


def test_ghost_mode_takes_the_same_step_as_hooks_mode():
    """The ghost criterion reduces the loss as the plain one: same seed, same parameters after the run."""
    with pytest.warns(UserWarning, match="NOT differentially private"):
        ghost = _run(GHOST, OURS, extra="\n    debug_seed=3,")
    namespace = _setup()
    model = namespace["model"]
    with pytest.warns(UserWarning, match="NOT differentially private"):
        private, optimizer, loader = PrivacyEngine().make_private(
            module=model,
            optimizer=namespace["optimizer"],
            data_loader=namespace["train_loader"],
            noise_multiplier=1.1,
            max_grad_norm=1.0,
            debug_seed=3,
        )
    for images, target in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(private(images), target).backward()
        optimizer.step()
    for theirs, mine in zip(ghost["model"].parameters(), model.parameters()):
        torch.testing.assert_close(theirs, mine, rtol=0, atol=1e-6)


def test_ghost_criterion_reduces_sequences_and_checks_its_reduction():
    logits, targets = torch.randn(2 * 3, 5), torch.tensor([1, 2, -100, 0, -100, -100])
    criterion = DPLoss(nn.CrossEntropyLoss(ignore_index=-100), "mean")
    tokens = nn.functional.cross_entropy(logits, targets, reduction="none", ignore_index=-100).view(2, 3)
    expected = (tokens[0].sum() / 2 + tokens[1].sum() / 1) / 2  # each sequence averaged over its own tokens
    torch.testing.assert_close(criterion(logits, targets, shape=(2, 3, 5)), expected)
    with pytest.raises(OpacusArgumentError, match="criterion.reduction='mean' but loss_reduction='sum'"):
        DPLoss(nn.CrossEntropyLoss(), "sum")


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ew"])
def test_opacus_grad_sample_modes_map_to_bookkeeping(mode):
    namespace = _setup()
    made = PrivacyEngine().make_private(
        module=namespace["model"],
        optimizer=namespace["optimizer"],
        data_loader=namespace["train_loader"],
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        grad_sample_mode=mode,
        clipping="flat",
        batch_first=True,
        poisson_sampling=True,
        wrap_model=True,
        rand_on_empty=False,
        noise_generator=None,
        criterion=namespace["criterion"],
    )
    assert len(made) == 3 and made[0].method == "bookkeeping"


@pytest.mark.parametrize(
    "options, match",
    [
        ({"clipping": "per_layer"}, r"clipping='per_layer' is not supported: only flat clipping"),
        ({"clipping": "adaptive"}, r"clipping='adaptive' is not supported: only flat clipping"),
        ({"max_clipbound": 2.0}, r"max_clipbound: an option of clipping='adaptive'"),
        ({"max_grad_norm": [1.0, 1.0]}, r"max_grad_norm is a list"),
        ({"noise_generator": torch.Generator()}, r"noise_generator=.*seedable.*not be private"),
        ({"batch_first": False}, r"batch_first=False is not supported: .*first dimension"),
        ({"wrap_model": False}, r"wrap_model=False is not supported"),
        ({"rand_on_empty": True}, r"rand_on_empty=True is not supported"),
        ({"poisson_sampling": False}, r"poisson_sampling=False is not supported: the accountants assume"),
        ({"grad_sample_mode": "ghost_fsdp"}, r"grad_sample_mode='ghost_fsdp' is not supported: choose one of"),
    ],
)
def test_unsupported_opacus_arguments_are_refused_in_one_line(options, match):
    namespace = _setup()
    arguments = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, **options}
    with pytest.raises(OpacusArgumentError, match=match) as error:
        PrivacyEngine().make_private(
            module=namespace["model"],
            optimizer=namespace["optimizer"],
            data_loader=namespace["train_loader"],
            **arguments,
        )
    assert isinstance(error.value, (EquiconvertError, ValueError)) and "\n" not in str(error.value)


def test_make_private_with_epsilon_takes_total_steps_and_refuses_opacus_calibration_options(monkeypatch):
    planned = []
    monkeypatch.setattr(engine_module, "calibrate_noise_multiplier", lambda *args: planned.append(args[3]) or 1.0)
    namespace = _setup()
    arguments = {
        "module": namespace["model"],
        "optimizer": namespace["optimizer"],
        "data_loader": namespace["train_loader"],
        "target_epsilon": 5.0,
        "target_delta": 1e-5,
        "max_grad_norm": 1.0,
    }
    with pytest.raises(OpacusArgumentError, match="epsilon_tolerance: an option of Opacus' noise calibration"):
        PrivacyEngine().make_private_with_epsilon(**arguments, epochs=1, epsilon_tolerance=0.1)
    engine = PrivacyEngine(accountant="rdp")
    _, optimizer, _ = engine.make_private_with_epsilon(**arguments, total_steps=6)
    assert planned == [6] and optimizer.planned_steps == 6 and optimizer.budget.target_epsilon == 5.0


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _trained(steps: int = 2):
    namespace = _setup()
    engine = PrivacyEngine(accountant="rdp")
    private, optimizer, loader = engine.make_private(
        module=namespace["model"],
        optimizer=torch.optim.Adam(namespace["model"].parameters(), lr=0.01),
        data_loader=namespace["train_loader"],
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    for _, (images, target) in zip(range(steps), loader):
        optimizer.zero_grad()
        nn.functional.cross_entropy(private(images), target).backward()
        optimizer.step()
    return engine, private, optimizer


def test_checkpoint_round_trip_restores_model_optimizer_and_epsilon_without_generator_state(tmp_path):
    engine, private, optimizer = _trained()
    path = tmp_path / "engine.pt"
    engine.save_checkpoint(path=path, module=private, optimizer=optimizer, checkpoint_dict={"epoch": 1})
    state = torch.load(path, weights_only=True)
    assert set(state) == {
        "epoch",
        "module_state_dict",
        "privacy_accountant_state_dict",
        "optimizer_state_dict",
        "dp_optimizer_steps",
    }
    # generator states are uint8 tensors: none is in the file (the noise and the sampling stay secret)
    assert not [t for t in _tensors(state) if t.dtype == torch.uint8]
    assert path.stat().st_mode & 0o077 == 0  # owner-only

    fresh_engine, fresh_private, fresh_optimizer = _trained(steps=0)
    rest = fresh_engine.load_checkpoint(path=path, module=fresh_private, optimizer=fresh_optimizer)
    assert rest["epoch"] == 1
    assert fresh_engine.get_epsilon(1e-5) == engine.get_epsilon(1e-5) > 0
    assert fresh_optimizer.steps == optimizer.steps == 2
    for mine, saved in zip(fresh_private.parameters(), private.parameters()):
        assert torch.equal(mine, saved)
    assert fresh_optimizer.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()

    with pytest.raises(OpacusArgumentError, match="already recorded steps"):
        engine.load_checkpoint(path=path, module=private, optimizer=optimizer)
    with pytest.raises(OpacusArgumentError, match="weights_only is always True"):
        _trained(steps=0)[0].load_checkpoint(path=path, module=private, torch_load_kwargs={"weights_only": False})


class _Payload:
    def __reduce__(self):
        return (print, ("code ran",))


def test_load_checkpoint_never_unpickles_code():
    buffer = io.BytesIO()
    torch.save({"module_state_dict": _Payload(), "privacy_accountant_state_dict": {}}, buffer)
    buffer.seek(0)
    engine, private, _ = _trained(steps=0)
    with pytest.raises(CheckpointError, match="never unpickled unsafely") as info:
        engine.load_checkpoint(path=buffer, module=private)
    assert re.search("[Ww]eights only load failed|Unsupported global", str(info.value.__cause__))
    assert "weights_only" not in str(info.value).replace("weights_only=True", "")


def test_interop_optimizer_built_before_the_conversion_line_gets_our_message():
    """README's Opacus snippet with the optimizer built first: equiconvert's error, before Opacus is reached."""
    from opacus import PrivacyEngine as OpacusEngine

    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built from the unconverted model
    model = equiconvert.make_equivariant(model, group="C4", head="invariant")  # the one line
    loader = DataLoader(TensorDataset(torch.randn(8, 1, 8, 8), torch.randint(0, 2, (8,))), batch_size=4)
    with pytest.raises(ForeignParametersError, match="make_equivariant returns a new model: build the optimizer"):
        opacus_interop.make_private(
            OpacusEngine(),
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )


def test_validate_is_compatible_and_get_compatible_module():
    engine = PrivacyEngine()
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2))
    assert not engine.is_compatible(module=model, optimizer=None, data_loader=None)
    with pytest.raises(PrivacyValidationError, match="BatchNorm"):
        engine.validate(module=model, optimizer=None, data_loader=None)
    fixed = PrivacyEngine.get_compatible_module(model)
    assert isinstance(fixed[1], nn.GroupNorm)
    assert engine.is_compatible(module=fixed, optimizer=None, data_loader=None)


def _budgeted():
    namespace = _setup()
    engine = PrivacyEngine(accountant="rdp")
    private, optimizer, loader = engine.make_private_with_epsilon(
        module=namespace["model"],
        optimizer=namespace["optimizer"],
        data_loader=namespace["train_loader"],
        target_epsilon=5.0,
        target_delta=1e-5,
        max_grad_norm=1.0,
        total_steps=4,
    )
    return engine, private, optimizer, loader


def test_a_resumed_budget_counts_the_steps_taken_before_the_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_module, "calibrate_noise_multiplier", lambda *args: 1.0)  # not under test: fast
    engine, private, optimizer, loader = _budgeted()
    images, target = next(iter(loader))
    optimizer.zero_grad()
    nn.functional.cross_entropy(private(images), target).backward()
    optimizer.step()
    engine.save_checkpoint(path=tmp_path / "budget.pt", module=private, optimizer=optimizer)
    fresh_engine, fresh_private, fresh_optimizer, _ = _budgeted()
    fresh_engine.load_checkpoint(path=tmp_path / "budget.pt", module=fresh_private, optimizer=fresh_optimizer)
    assert fresh_optimizer.budget.steps == fresh_optimizer.steps == 1

    unbudgeted, plain_private, plain_optimizer = _trained(steps=1)
    unbudgeted.save_checkpoint(path=tmp_path / "plain.pt", module=plain_private, optimizer=plain_optimizer)
    fresh_engine, fresh_private, fresh_optimizer, _ = _budgeted()
    with pytest.raises(CheckpointError, match="no privacy budget state"):
        fresh_engine.load_checkpoint(path=tmp_path / "plain.pt", module=fresh_private, optimizer=fresh_optimizer)
