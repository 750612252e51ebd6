"""One DP-SGD step (or its non-private counterpart) of each engine, built on one model and one batch.

Every adapter takes a Case (the model, the B images with their K views, labels, clip C, noise multiplier sigma, lr)
and returns a Runner: `step()` runs one whole step (per-example gradients, clipping, noise, SGD update), `params()`
reads the parameters back by the model's names, `reference` is a copy of the model as the step found it (for the
noise-free check against a per-example loop). An engine that cannot run here raises NotRun with the reason.
`unit` says what one clipped gradient is: an example (mean, or sum, of its K views' gradients) or a single view
(engines that clip rows of the batch and know nothing of views: Opacus ghost clipping, fastDP).
"""

from __future__ import annotations

import contextlib
import copy
import os
import secrets
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache, partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BENCHMARKS = Path(__file__).resolve().parent
for _path in (BENCHMARKS.parent, BENCHMARKS):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from fidelity_step import fixed_views  # noqa: E402
from throughput import make_nonprivate_step, step_nested_vmap  # noqa: E402
from wrn import WideResNet, jax_forward  # noqa: E402

from equiconvert.privacy.backends import PRECISIONS  # noqa: E402

EXAMPLE_MEAN = "example (mean of its K views)"
EXAMPLE_SUM = "example (sum of its K views)"
VIEW = "view (each of the B*K rows)"
NONPRIVATE = "none (non-private)"


class NotRun(Exception):
    """This engine cannot run on this model or machine; the message says why and what would make it run."""


@dataclass
class Case:
    model_name: str
    model: nn.Module  # fresh, on the device, in train mode
    images: torch.Tensor  # (B, C, H, W)
    labels: torch.Tensor  # (B,)
    aug_mult: int
    clip: float
    noise: float
    lr: float
    device: torch.device
    fastdp: str | None = None
    released: str | None = None

    @property
    def views(self) -> torch.Tensor:
        return fixed_views(self.images, self.aug_mult)


@dataclass
class Runner:
    step: Callable[[], Any]
    params: Callable[[], dict[str, torch.Tensor]]
    reference: nn.Module
    unit: str
    precision: str = "fp32"
    sync: Callable[[Any], None] = field(default=lambda _: None)
    peak_memory: Callable[[], tuple[float | None, str]] | None = None  # (GiB or None, how it was measured)


def _torch_params(model: nn.Module) -> Callable[[], dict[str, torch.Tensor]]:
    return lambda: {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _torch_runner(model: nn.Module, reference: nn.Module, step: Callable[[], Any], unit: str, precision: str = "fp32"):
    device = next(model.parameters()).device
    sync = (lambda _: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda _: None)
    return Runner(step, _torch_params(model), reference, unit, precision, sync)


def _flat(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    return case.views.flatten(0, 1), case.labels.repeat_interleave(case.aug_mult)


def nonprivate(case: Case, precision: str) -> Runner:
    """Forward/backward on the B*K views and an SGD step (throughput.py's), under bf16 autocast if asked."""
    return _nonprivate(case.model, copy.deepcopy(case.model), case, precision)


def _nonprivate(model: nn.Module, reference: nn.Module, case: Case, precision: str) -> Runner:
    optimizer = torch.optim.SGD(model.parameters(), lr=case.lr)
    step, views = make_nonprivate_step(PRECISIONS[precision]), case.views
    return _torch_runner(model, reference, lambda: step(model, optimizer, views, case.labels), NONPRIVATE, precision)


def dptrainer(case: Case, precision: str, method: str = "bookkeeping", cuda_graph: bool = False) -> Runner:
    """equiconvert's DPTrainer.train_step with the per_sample_method `method` (book-keeping by default): the whole
    batch is one Poisson draw at q = 1, one physical batch; its augment hook makes the same K views as the other
    engines get. cuda_graph: that physical batch replays a captured CUDA graph (DPConfig.cuda_graph)."""
    from equiconvert.training.trainer import DPTrainer

    reference = copy.deepcopy(case.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPTrainer(
            case.model,
            device=case.device,
            progress=False,
            augment=fixed_views,
            aug_mult=case.aug_mult,
            batch_size=len(case.images),
            physical_batch_size=len(case.images),
            max_grad_norm=case.clip,
            noise_multiplier=case.noise or 1.0,
            target_epsilon=None,
            lr=case.lr,
            ema_decay=None,
            epsilon_every=2**31,  # the accountant's epsilon is bookkeeping, not part of the step timed
            normalize_mean=0.0,
            normalize_std=1.0,
            per_sample_method=method,
            precision=precision,
            cuda_graph=cuda_graph,
        )
        trainer._prepare_privacy(len(case.images))
    trainer.noise_multiplier = case.noise  # sigma 0 (the noise-free check) is refused by the config, not the step
    runner = _torch_runner(
        trainer.model, reference, lambda: trainer.train_step(case.images, case.labels), EXAMPLE_MEAN, precision
    )
    if cuda_graph and case.device.type == "cuda":
        runner.peak_memory = partial(_reserved_memory, case.device)
    return runner


def _reserved_memory(device: torch.device) -> tuple[float, str]:
    """A captured graph's activations live in its private pool, reserved at the capture and never allocated again,
    so the timed replays' allocation peak misses them; what the caching allocator holds counts them."""
    return (
        torch.cuda.memory_reserved(device) / 2**30,
        "torch.cuda.memory_reserved after the timed steps (the CUDA graph's private pool is reserved, not allocated "
        "by a replay; an upper bound)",
    )


def make_private(case: Case, precision: str, grad_sample_mode: str = "hooks") -> Runner:
    """equiconvert.privacy.make_private around the model and SGD, the user's own loop: zero_grad, forward on the
    (B, K, ...) views, loss.backward(), optimizer.step(); its loader (one batch of B) sets the expected batch size.
    grad_sample_mode="ghost": ghost clipping, the loss from the criterion make_private returns (as Opacus')."""
    from equiconvert.privacy.engine import make_private as wrap

    reference = copy.deepcopy(case.model)
    batch = len(case.images)
    views = case.views if case.aug_mult > 1 else case.images  # make_private takes (B, ...) without aug_mult
    made = wrap(
        module=case.model,
        optimizer=torch.optim.SGD(case.model.parameters(), lr=case.lr),
        data_loader=DataLoader(TensorDataset(torch.arange(batch)), batch_size=batch),
        noise_multiplier=case.noise or 1.0,
        max_grad_norm=case.clip,
        aug_mult=case.aug_mult,
        grad_sample_mode=grad_sample_mode,
    )
    module, optimizer = made[0], made[1]
    criterion = made[2] if len(made) == 4 else F.cross_entropy
    optimizer.noise_multiplier = case.noise  # sigma 0 (the noise-free check) is refused by make_private, not the step
    labels = case.labels.repeat_interleave(case.aug_mult)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        criterion(module(views), labels).backward()
        optimizer.step()

    return _torch_runner(case.model, reference, step, EXAMPLE_MEAN)


def _forward(module: nn.Module, images: torch.Tensor, precision: str) -> torch.Tensor:
    """The logits in fp32, the forward under autocast in `precision`'s dtype (Opacus >= 1.5.4 computes per-sample
    gradients under autocast: its hooks and ghost clipping take the layers' bf16 operands)."""
    dtype = PRECISIONS[precision]
    with torch.autocast(images.device.type, dtype=dtype, enabled=dtype is not None):
        logits = module(images)
    return logits.float()


def _opacus(case: Case, rows: int, **kwargs: Any) -> tuple:
    from opacus import PrivacyEngine

    import equiconvert.privacy.opacus_interop  # noqa: F401  (Opacus samplers for equiconvert's steerable layers)

    loader = DataLoader(TensorDataset(torch.arange(rows)), batch_size=rows)  # sets the expected batch size only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PrivacyEngine(accountant="rdp").make_private(
            module=case.model,
            optimizer=torch.optim.SGD(case.model.parameters(), lr=case.lr),
            data_loader=loader,
            noise_multiplier=case.noise,
            max_grad_norm=case.clip,
            poisson_sampling=False,
            **kwargs,
        )


def opacus_hooks(case: Case, precision: str) -> Runner:
    """Opacus' PrivacyEngine, grad_sample_mode="hooks": per-row gradients of the B*K views from its hooks, averaged
    over each example's views before its DPOptimizer clips, noises and divides by B (the usual augmentation
    multiplicity recipe on Opacus)."""
    reference = copy.deepcopy(case.model)
    module, optimizer, _ = _opacus(case, len(case.images), grad_sample_mode="hooks")
    (flat, labels), batch, views = _flat(case), len(case.images), case.aug_mult

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(_forward(module, flat, precision), labels).backward()
        for p in case.model.parameters():
            if p.grad_sample is not None:
                p.grad_sample = p.grad_sample.reshape(batch, views, *p.shape).mean(1)
        optimizer.step()

    return _torch_runner(case.model, reference, step, EXAMPLE_MEAN, precision)


def opacus_ghost(case: Case, precision: str) -> Runner:
    """Opacus 1.6 ghost clipping (make_private(..., grad_sample_mode="ghost", criterion=...): per-row gradient norms
    without per-row gradients, then a second backward of the reweighted loss. It clips each of the B*K rows."""
    reference = copy.deepcopy(case.model)
    rows = len(case.images) * case.aug_mult
    module, optimizer, criterion, _ = _opacus(case, rows, grad_sample_mode="ghost", criterion=nn.CrossEntropyLoss())
    flat, labels = _flat(case)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        criterion(_forward(module, flat, precision), labels).backward()
        optimizer.step()

    return _torch_runner(case.model, reference, step, VIEW, precision)


def fastdp(case: Case, precision: str) -> Runner:
    """fastDP (awslabs/fast-differential-privacy) from the user's checkout: its PrivacyEngine attached to SGD,
    hybrid book-keeping (clipping_mode="MixOpt"), Abadi clipping C / (norm + 1e-6) of the whole gradient
    (clipping_style="all-layer"), the standard training loop. It clips each of the B*K rows."""
    if not case.fastdp:
        raise NotRun("needs --fastdp DIR: a checkout of github.com/awslabs/fast-differential-privacy")
    root = Path(case.fastdp)
    if not (root / "fastDP" / "privacy_engine.py").is_file():
        raise NotRun(
            f"--fastdp {root}: fastDP/privacy_engine.py missing; give a checkout of awslabs/fast-differential-privacy"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        from fastDP import PrivacyEngine
        from fastDP.supported_layers_grad_samplers import _supported_layers_norm_sample_AND_clipping as supported
    except ImportError as error:
        raise NotRun(f"fastDP at {root} does not import here: {error}") from error
    unsupported = sorted(
        {type(m).__name__ for m in case.model.modules() if any(True for _ in m.parameters(recurse=False))}
        - {t.__name__ for t in supported}
    )
    if unsupported:
        raise NotRun(f"fastDP has no per-sample rule for {unsupported}: it would leave their parameters untrained")
    reference = copy.deepcopy(case.model)
    optimizer = torch.optim.SGD(case.model.parameters(), lr=case.lr)
    rows = len(case.images) * case.aug_mult
    with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):  # its progress prints
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(
            case.model,
            batch_size=rows,
            sample_size=rows,
            epochs=1,
            noise_multiplier=case.noise,
            max_grad_norm=case.clip,
            clipping_fn="Abadi",
            clipping_mode="MixOpt",
            clipping_style="all-layer",
        )
        engine.attach(optimizer)
    flat, labels = _flat(case)

    def step() -> None:
        F.cross_entropy(case.model(flat), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _torch_runner(case.model, reference, step, VIEW)


def _released_pair(case: Case) -> tuple[nn.Module, nn.Module]:
    """A fresh released model and a copy of it (the check's reference), on the device."""
    if not case.released:
        raise NotRun("needs --released DIR: a checkout of github.com/hlzl/equivariant at 3dd7cd0")
    if case.model_name != "paper":
        raise NotRun("the released code builds only its Equivariant-ResNet9 (--models paper)")
    from released_code import moved_everywhere

    prototype = _released_prototype(case.released)
    return tuple(moved_everywhere(copy.deepcopy(prototype), case.device) for _ in range(2))


@cache
def _released_prototype(root: str) -> nn.Module:
    """The released model, built once per process (its code builds its bases anew for each model: minutes) on the
    CPU, in train mode: in eval mode its escnn modules keep expanded filters, non-leaf tensors that deepcopy refuses.
    Its modules keep bases and indices in plain dicts, so the pair moves to the device with moved_everywhere."""
    from released_code import released_dir, released_model

    return released_model(released_dir(root)).train()


def released(case: Case, precision: str) -> Runner:
    """The paper's released code: its own EquivariantResNet9 (built by the checkout), stepped as its training code
    computes the step (throughput.py's nested_vmap: vmap over examples of vmap over views of grad, the K view
    gradients summed, clipped, noised, divided by B)."""
    model, reference = _released_pair(case)
    optimizer = torch.optim.SGD(model.parameters(), lr=case.lr)
    views, step = case.views, partial(step_nested_vmap, clip=case.clip, noise_multiplier=case.noise)
    return _torch_runner(model, reference, lambda: step(model, optimizer, views, case.labels), EXAMPLE_SUM)


def released_nonprivate(case: Case, precision: str) -> Runner:
    """The released model's non-private step (forward/backward on the B*K views, SGD)."""
    model, reference = _released_pair(case)
    return _nonprivate(model, reference, case, precision)


def _jax(case: Case):
    if not isinstance(case.model, WideResNet):
        raise NotRun("the plain-JAX network exists for the WRN only (the equivariant network is torch code)")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave the card's memory to the torch engines
    try:
        import jax
    except ImportError as error:
        raise NotRun(f"jax does not import here ({error}); pip install 'jax[cuda12]'") from error
    platform = jax.devices()[0].platform
    if case.device.type == "cuda" and platform != "gpu":
        raise NotRun(f"jax sees no GPU (platform {platform}): install jax with CUDA support, pip install 'jax[cuda12]'")
    return jax


def _jax_runner(jax, case: Case, make_update: Callable, unit: str) -> Runner:
    import numpy as np

    reference = copy.deepcopy(case.model)
    params = {n: jax.numpy.asarray(p.detach().cpu().numpy()) for n, p in case.model.named_parameters()}
    views = jax.numpy.asarray(case.views.cpu().numpy())
    labels = jax.numpy.asarray(case.labels.cpu().numpy())
    update = jax.jit(make_update(jax, jax_forward(case.model)), donate_argnums=0)
    state = {"params": params, "key": jax.random.key(secrets.randbits(32))}

    def step():
        state["key"], key = jax.random.split(state["key"])
        state["params"] = update(state["params"], key, views, labels)
        return state["params"]

    def peak() -> tuple[float | None, str]:
        stats = jax.devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" not in stats:
            return None, "JAX reports no memory statistics on this platform"
        return stats["peak_bytes_in_use"] / 2**30, "JAX allocator peak_bytes_in_use since the process started"

    return Runner(
        step,
        lambda: {n: torch.from_numpy(np.array(v)) for n, v in state["params"].items()},
        reference,
        unit,
        "fp32",
        jax.block_until_ready,
        peak,
    )


def _cross_entropy(jax, logits, labels):
    return -jax.numpy.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1).mean()


def jax_dp(case: Case, precision: str) -> Runner:
    """De et al.'s DP step in plain JAX: jax.vmap over examples of jax.grad of the example's loss averaged over its
    K views, clipping to C, Gaussian noise sigma C, sum / B, SGD; the whole step one jit-compiled function."""
    jax = _jax(case)
    clip, noise, lr, batch = case.clip, case.noise, case.lr, len(case.images)

    def make_update(jax, apply):
        jnp = jax.numpy

        def example_loss(params, views, label):
            return _cross_entropy(jax, apply(params, views), jnp.broadcast_to(label, views.shape[:1]))

        per_example = jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0))

        def update(params, key, views, labels):
            grads = per_example(params, views, labels)
            norms = jnp.sqrt(sum(jnp.sum(g.reshape(batch, -1) ** 2, axis=1) for g in grads.values()))
            factors = jnp.minimum(1.0, clip / (norms + 1e-6))
            keys = dict(zip(params, jax.random.split(key, len(params))))
            return {
                n: p
                - lr
                * (jnp.tensordot(factors, grads[n], axes=1) + noise * clip * jax.random.normal(keys[n], p.shape))
                / batch
                for n, p in params.items()
            }

        return update

    return _jax_runner(jax, case, make_update, EXAMPLE_MEAN)


def jax_nonprivate(case: Case, precision: str) -> Runner:
    """The same network's non-private step in JAX: grad of the mean loss over the B*K views, SGD, jit-compiled."""
    jax = _jax(case)
    lr = case.lr

    def make_update(jax, apply):
        def loss(params, views, labels):
            flat = views.reshape(-1, *views.shape[2:])
            return _cross_entropy(jax, apply(params, flat), jax.numpy.repeat(labels, views.shape[1]))

        def update(params, key, views, labels):
            grads = jax.grad(loss)(params, views, labels)
            return {n: p - lr * grads[n] for n, p in params.items()}

        return update

    return _jax_runner(jax, case, make_update, NONPRIVATE)


@dataclass(frozen=True)
class Engine:
    build: Callable[[Case, str], Runner]
    baseline: str | None  # the engine whose step is this one's non-private counterpart; None for a baseline
    precisions: tuple[str, ...] = ("fp32",)


ENGINES: dict[str, Engine] = {
    "nonprivate": Engine(nonprivate, None, tuple(PRECISIONS)),
    "dptrainer": Engine(dptrainer, "nonprivate", tuple(PRECISIONS)),
    "dptrainer_graph": Engine(partial(dptrainer, cuda_graph=True), "nonprivate", tuple(PRECISIONS)),
    "make_private": Engine(make_private, "nonprivate"),
    "opacus_hooks": Engine(opacus_hooks, "nonprivate", tuple(PRECISIONS)),
    "opacus_ghost": Engine(opacus_ghost, "nonprivate", tuple(PRECISIONS)),
    "fastdp": Engine(fastdp, "nonprivate"),
    "released_nonprivate": Engine(released_nonprivate, None),
    "released": Engine(released, "released_nonprivate"),
    "jax_nonprivate": Engine(jax_nonprivate, None),
    "jax": Engine(jax_dp, "jax_nonprivate"),
}
