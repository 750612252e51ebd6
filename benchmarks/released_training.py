"""The paper's released code (hlzl/equivariant) trained on a data set given here, resumable, one process per seed.

Its `train.py` is a hydra entry point that downloads CIFAR-10, draws unseeded batches and cannot resume, so it is not
run as it stands. What runs is the checkout's own model (`networks.EquivariantResNet9` and its escnn fork, built by
released_code.released_model with the configuration its hydra files compose) and its own augmentation
(`data/augmentation.py`'s `AugMult.de_et_al`: the image itself and K-1 reflect-padded crops with flips), stepped as
its `train.py` steps them:
- Poisson sampling at rate 1 / (N // bs) (Opacus' DPDataLoader over a loader of batch bs that drops the last);
- each logical batch cut into ceil(n / physical) near-equal physical batches (Opacus' BatchSplittingSampler);
- per-example gradients by vmap over examples of vmap over views of grad, each example's K view gradients summed;
- each example's sum clipped at C (factor C / (norm + 1e-6), at most 1), the clipped sums added, Gaussian noise of
  std sigma * C added once, the sum divided by bs (DPOptimizer with expected_batch_size=bs, loss_reduction "mean");
- plain SGD at lr (conf/setup/optim/sgd.yaml: no momentum);
- the EMA of the parameters updated after every physical batch (torch_ema: decay min(decay, (1 + n) / (10 + n)) at
  its n-th update) and evaluated on the test split at the end, as train.py tests it.
Nothing of the checkout is copied: it is imported at run time (released_code.py).

The seed fixes the initialisation (torch and numpy, as released_model builds it) and the augmentations; batches and
noise come from generators seeded by the operating system, as the released code's unseeded ones, and are never
written: a checkpoint holds the step, the weights, the EMA and the state of torch's main generator (from which the
augmentations draw), owner-only.
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from equiconvert.privacy import checkpoint
from equiconvert.privacy.accounting import compute_epsilon
from equiconvert.privacy.dp_step import clip_and_sum
from equiconvert.training.ema import warmup_cap
from released_code import moved_everywhere, released_model
from throughput import view_summed_gradients

CHECKPOINT = "checkpoint.pt"
RESULT = "result.json"
EVAL_BATCH = 1000
Part = tuple[torch.Tensor, torch.Tensor] | None  # one physical batch: views (B, K, C, H, W) and labels; None if empty


@dataclass(frozen=True)
class ReleasedSettings:
    """The released recipe at a chosen schedule: its batch bs, views, clip C, lr, EMA decay, physical batch, and the
    noise multiplier and step count both arms share."""

    steps: int
    batch_size: int
    aug_mult: int
    max_grad_norm: float
    lr: float
    ema_decay: float
    physical_batch_size: int
    noise_multiplier: float
    delta: float
    normalize_mean: tuple[float, float, float]
    normalize_std: tuple[float, float, float]
    checkpoint_every: int = 50

    def sample_rate(self, examples: int) -> float:
        """Opacus' DPDataLoader rate: one over the number of full batches of bs in an epoch."""
        return 1.0 / (examples // self.batch_size)


def released_augmentation(root: Path, aug_mult: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The checkout's `AugMult(k=aug_mult).de_et_al`: one normalised image (C, H, W) -> its views (K, C, H, W).
    Loaded from its file: the checkout's `data` package imports hydra and Opacus, which the augmentation does not use."""
    spec = importlib.util.spec_from_file_location("released_augmentation", root / "data" / "augmentation.py")
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.AugMult(k=aug_mult, crop_size=32).de_et_al


def normalised(images: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """uint8 (N, C, H, W) -> float as the released ToTensor and Normalize make them."""
    mean_t, std_t = torch.tensor(mean).view(1, -1, 1, 1), torch.tensor(std).view(1, -1, 1, 1)
    return (images.float() / 255.0 - mean_t) / std_t


class ParameterEMA:
    """torch_ema's ExponentialMovingAverage as train.py uses it: parameters only, warm-up by update count."""

    def __init__(self, model: nn.Module, decay: float, updates: int = 0, shadow: dict | None = None) -> None:
        self.decay, self.updates = decay, updates
        self.shadow = shadow or {n: p.detach().clone() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        decay = min(self.decay, warmup_cap(self.updates))
        for name, param in model.named_parameters():
            self.shadow[name].lerp_(param.detach(), 1.0 - decay)


@torch.no_grad()
def test_accuracy(
    model: nn.Module, weights: dict[str, torch.Tensor], images: torch.Tensor, labels: torch.Tensor, device: torch.device
) -> float:
    """Share correct of `model` with `weights` in place of its parameters (restored afterwards)."""
    params = dict(model.named_parameters())
    kept = {n: p.detach().clone() for n, p in params.items()}
    for name, value in weights.items():
        params[name].copy_(value)
    model.eval()
    correct = 0
    for start in range(0, len(labels), EVAL_BATCH):
        logits = model(images[start : start + EVAL_BATCH].to(device))
        correct += int((logits.argmax(-1).cpu() == labels[start : start + EVAL_BATCH]).sum())
    model.train()
    for name, value in kept.items():
        params[name].copy_(value)
    return correct / len(labels)


class AugmentedImages(Dataset):
    """The training images as the released transform hands them over: normalised, then AugMult's views."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, augment: Callable[[torch.Tensor], torch.Tensor]):
        self.images, self.labels, self.augment = images, labels, augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.augment(self.images[index]), self.labels[index]


def _stacked(items: list[tuple[torch.Tensor, torch.Tensor]]) -> Part:
    """A physical batch (views B x K x C x H x W, labels), or None for the empty logical batch Poisson sampling draws."""
    if not items:
        return None
    views, labels = zip(*items)
    return torch.stack(views), torch.stack(labels)


def physical_batches(
    examples: int, s: ReleasedSettings, steps: int, sampling: torch.Generator, parts_per_step: deque[int]
) -> Iterator[list[int]]:
    """Index lists of `steps` logical batches, each Poisson-sampled and cut into near-equal physical batches (one empty
    list for an empty batch); the number of parts of each step goes to `parts_per_step` as it is drawn."""
    rate = s.sample_rate(examples)
    for _ in range(steps):
        chosen = (torch.rand(examples, generator=sampling) < rate).nonzero().flatten()
        parts = torch.tensor_split(chosen, max(1, math.ceil(len(chosen) / s.physical_batch_size)))
        parts_per_step.append(len(parts))
        yield from (part.tolist() for part in parts)


def released_step(
    model: nn.Module,
    ema: ParameterEMA,
    parts: list[Part],
    s: ReleasedSettings,
    noise: torch.Generator,
    device: torch.device,
) -> None:
    """One logical batch, given as its physical batches, as train.py runs it: clipped view sums, one noisy step."""
    params = dict(model.named_parameters())
    summed = {n: torch.zeros_like(p) for n, p in params.items()}
    for number, part in enumerate(parts, start=1):
        if part is not None:
            views, labels = part
            grads = view_summed_gradients(model, views.to(device), labels.to(device))
            clipped, _ = clip_and_sum(grads, s.max_grad_norm)
            for name, value in clipped.items():
                summed[name] += value
        if number == len(parts):  # DPOptimizer skips the step until the logical batch's last physical batch
            with torch.no_grad():
                for name, param in params.items():
                    noise_draw = torch.randn(param.shape, generator=noise, device=device, dtype=param.dtype)
                    grad = (summed[name] + s.noise_multiplier * s.max_grad_norm * noise_draw) / s.batch_size
                    param.sub_(s.lr * grad)
        ema.update(model)


def secret_generator(device: torch.device) -> torch.Generator:
    """A generator seeded by the operating system (never written anywhere)."""
    generator = torch.Generator(device=device)
    generator.seed()
    return generator


def train_released(
    root: Path,
    train,
    test,
    seed: int,
    s: ReleasedSettings,
    run_dir: Path,
    device: torch.device,
    time_limit: float | None = None,
    loader_workers: int = 0,
) -> dict:
    """Train the released model for s.steps (resuming run_dir's checkpoint), then write and return its result.

    The views are made in `loader_workers` processes, as the released DataLoader makes them (0: in this one).
    Stops early, checkpointed, once `time_limit` seconds have passed in this call; result.json then records
    stopped_reason "time_limit" and a later call continues. Its fields are named as `equiconvert train`'s result.json
    names them (test_accuracy a share, wall_time_s this call's)."""
    start = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint.remove_stale_temporaries(run_dir / CHECKPOINT)
    model = moved_everywhere(released_model(root, seed).train(), device)
    built_s = time.perf_counter() - start
    ema = ParameterEMA(model, s.ema_decay)
    step = 0
    torch.manual_seed(seed)
    if (run_dir / CHECKPOINT).is_file():
        state = checkpoint.load(run_dir / CHECKPOINT)
        step = int(state["step"])
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(state["params"][name])
        ema = ParameterEMA(
            model, s.ema_decay, int(state["ema_updates"]), {n: t.to(device) for n, t in state["ema"].items()}
        )
        torch.set_rng_state(state["main_rng"])
    dataset = AugmentedImages(
        normalised(train.images, s.normalize_mean, s.normalize_std),
        train.labels,
        released_augmentation(root, s.aug_mult),
    )
    rate = s.sample_rate(len(train.labels))
    sampling, noise = secret_generator(torch.device("cpu")), secret_generator(device)
    parts_per_step: deque[int] = deque()
    sampler = physical_batches(len(train.labels), s, s.steps - step, sampling, parts_per_step)
    batches = iter(DataLoader(dataset, batch_sampler=sampler, num_workers=loader_workers, collate_fn=_stacked))
    stopped = None
    while step < s.steps:
        first = next(batches)  # drawn with its step's part count, so that count is in the queue now
        parts = [first, *(next(batches) for _ in range(parts_per_step.popleft() - 1))]
        released_step(model, ema, parts, s, noise, device)
        step += 1
        out_of_time = time_limit is not None and time.perf_counter() - start > time_limit
        if step % s.checkpoint_every == 0 or step == s.steps or out_of_time:
            _save(run_dir, step, model, ema)
        if out_of_time and step < s.steps:
            stopped = "time_limit"
            break
    accuracy = test_accuracy(
        model, ema.shadow, normalised(test.images, s.normalize_mean, s.normalize_std), test.labels, device
    )
    result = {
        "arm": "released",
        "seed": seed,
        "test_accuracy": accuracy,
        "epsilon": compute_epsilon("rdp", s.noise_multiplier, rate, step, s.delta) if step else 0.0,
        "delta": s.delta,
        "noise_multiplier": s.noise_multiplier,
        "sample_rate": rate,
        "steps": step,
        "requested_steps": s.steps,
        "stopped_reason": stopped,
        "wall_time_s": time.perf_counter() - start,
        "model_build_s": built_s,
        "device": str(device),
    }
    (run_dir / RESULT).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _save(run_dir: Path, step: int, model: nn.Module, ema: ParameterEMA) -> None:
    state = {
        "step": step,
        "params": {n: p.detach().cpu() for n, p in model.named_parameters()},
        "ema": {n: t.cpu() for n, t in ema.shadow.items()},
        "ema_updates": ema.updates,
        "main_rng": torch.get_rng_state(),
    }
    checkpoint.save_atomic(state, run_dir / CHECKPOINT)
