"""Data loaders: formats, errors, cache, rotation; on format-exact small files and real data where present."""

from __future__ import annotations

import gzip
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import equiconvert.data.imagefolder as imagefolder_mod
from equiconvert.data import (
    DATASETS,
    DatasetFormatError,
    DatasetNotFoundError,
    ImageData,
    load_dataset,
    read_idx,
    rotate_images,
)
from equiconvert.data._base import resolve_name
from equiconvert.data.mnist import FASHION_MNIST_CLASSES, PUBLISHED_LABELS
from tests.support.idx import make_idx_dir, write_idx
from tests.support.paths import REPO_ROOT

# torchvision 0.29 deprecates its image decoders (the loader falls back to PIL when they go away)
pytestmark = pytest.mark.filterwarnings(
    "ignore:The image decoding and encoding capabilities of TorchVision:DeprecationWarning"
)

SHARED = next(
    (p for p in (REPO_ROOT.parent / "shared" / "data", Path("/work/shared/data")) if p.is_dir()),
    Path("/nonexistent/shared/data"),
)
CIFAR_TAR = SHARED / "cifar10-jpeg.tar.xz"
MNIST_NPZ = SHARED / "mnist-10k.npz"
DEBIAN_FMNIST = Path("/usr/share/datasets/fashion-mnist")


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("EQUICONVERT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("EQUICONVERT_DATA_DIR", raising=False)


# ----------------------------------------------------------------------------- registry and ImageData


def test_registry_and_name_aliases() -> None:
    assert {
        "cifar10",
        "mnist",
        "fashion_mnist",
        "rotated_mnist",
        "imagenet32",
        "imagenet64",
        "imagefolder",
        "synthetic",
    } <= set(DATASETS)
    assert resolve_name("Fashion-MNIST") == resolve_name("fmnist") == "fashion_mnist"
    assert resolve_name("CIFAR-10") == "cifar10" and resolve_name("ImageNet32") == "imagenet32"
    assert len(load_dataset("Synthetic", None, "test", num_examples=4)) == 4
    with pytest.raises(KeyError, match="dataset=nope: unknown data set; known: cifar10"):
        load_dataset("nope", None)
    with pytest.raises(ValueError, match="split must be one of"):
        load_dataset("synthetic", None, "validation")


def test_image_data_validates_and_unpacks() -> None:
    images = torch.zeros(3, 1, 4, 4, dtype=torch.uint8)
    labels = torch.tensor([0, 1, 1])
    d = ImageData(images, labels, ["a", "b"], "x")
    assert len(d) == 3 and d.num_classes == 2 and d.image_shape == (1, 4, 4)
    x, y = d.as_tuple()
    assert x is images and y is labels
    with pytest.raises(DatasetFormatError, match="uint8"):
        ImageData(images.float(), labels, ["a", "b"], "x")
    with pytest.raises(DatasetFormatError, match="int64"):
        ImageData(images, labels.int(), ["a", "b"], "x")
    with pytest.raises(DatasetFormatError, match=r"labels must lie in \[0, 1\)"):
        ImageData(images, labels, ["a"], "x")


def test_synthetic_is_deterministic_and_learnable() -> None:
    a = load_dataset("synthetic", None, "train", num_examples=64, image_size=8, channels=3, num_classes=4, seed=3)
    b = load_dataset("synthetic", None, "train", num_examples=64, image_size=8, channels=3, num_classes=4, seed=3)
    c = load_dataset("synthetic", None, "train", num_examples=64, image_size=8, channels=3, num_classes=4, seed=4)
    t = load_dataset("synthetic", None, "test", num_examples=32, image_size=8, channels=3, num_classes=4, seed=3)
    assert a.images.shape == (64, 3, 8, 8) and a.images.dtype == torch.uint8 and a.labels.dtype == torch.int64
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.images, c.images)
    assert torch.bincount(a.labels).tolist() == [16] * 4
    # nearest class mean (from train) classifies the test split: the classes are separable
    means = torch.stack([a.images[a.labels == k].float().mean(0) for k in range(4)])
    pred = ((t.images.float()[:, None] - means[None]) ** 2).flatten(2).sum(-1).argmin(1)
    assert (pred == t.labels).float().mean() > 0.9


# ----------------------------------------------------------------------------- IDX (MNIST, Fashion-MNIST)


def test_read_idx_header_magic_and_size(tmp_path) -> None:
    a = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    p = write_idx(tmp_path / "x-idx3-ubyte", a, compress=True)
    assert gzip.open(p).read(4) == bytes.fromhex("00000803")  # magic 2051 as in MNIST's image files
    np.testing.assert_array_equal(read_idx(p, expect_ndim=3), a)
    q = write_idx(tmp_path / "raw-idx3-ubyte", a, compress=False)
    np.testing.assert_array_equal(read_idx(q), a)

    with pytest.raises(DatasetFormatError, match="3 dimensions, expected 1"):
        read_idx(p, expect_ndim=1)
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x12\x34\x08\x01" + b"\x00" * 8)
    with pytest.raises(DatasetFormatError, match=r"bad: not an IDX file \(magic bytes 12340801"):
        read_idx(bad)
    short = tmp_path / "short"
    short.write_bytes(q.read_bytes()[:-5])
    with pytest.raises(DatasetFormatError, match=r"header says shape \(2, 3, 4\) \(24 bytes.*holds 19 bytes"):
        read_idx(short)


@pytest.mark.parametrize("layout", ["flat", "torchvision"])
def test_mnist_and_fashion_mnist_from_idx_files(tmp_path, layout) -> None:
    sub = tmp_path / "FashionMNIST" / "raw" if layout == "torchvision" else tmp_path
    arrays = make_idx_dir(sub, compress=(layout == "flat"))
    for split, n in (("train", 30), ("test", 10)):
        d = load_dataset("fashion_mnist", tmp_path, split)
        assert d.images.shape == (n, 1, 28, 28) and d.images.dtype == torch.uint8
        assert d.labels.dtype == torch.int64 and d.classes == FASHION_MNIST_CLASSES
        np.testing.assert_array_equal(d.images[:, 0].numpy(), arrays[split][0])
        np.testing.assert_array_equal(d.labels.numpy(), arrays[split][1])
    if layout == "torchvision":
        shutil.move(str(tmp_path / "FashionMNIST"), str(tmp_path / "MNIST"))
        assert len(load_dataset("mnist", tmp_path, "test")) == 10


def test_idx_missing_files_error_names_dir_and_files(tmp_path) -> None:
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("mnist", tmp_path / "nowhere", "train")
    msg = str(err.value)
    assert str(tmp_path / "nowhere") in msg and "does not exist" in msg
    for name in (
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
        "MNIST/raw",
    ):
        assert name in msg
    assert "data_dir" in msg and "nothing is downloaded" in msg

    # only the images: the error says which file of the split is there and which is not
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((2, 28, 28), np.uint8))
    with pytest.raises(DatasetNotFoundError, match=r"has train-images-idx3-ubyte but not all of the train files"):
        load_dataset("fashion_mnist", tmp_path, "train")
    with pytest.raises(DatasetNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion_mnist", tmp_path, "train")


def test_idx_image_label_count_mismatch(tmp_path) -> None:
    write_idx(tmp_path / "t10k-images-idx3-ubyte", np.zeros((5, 28, 28), np.uint8))
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(4, np.uint8))
    with pytest.raises(DatasetFormatError, match="holds 5 images but .* holds 4 labels"):
        load_dataset("mnist", tmp_path, "test")


def _write_test_split(d: Path, labels: np.ndarray) -> None:
    d.mkdir(parents=True, exist_ok=True)
    write_idx(d / "t10k-images-idx3-ubyte", np.zeros((len(labels), 28, 28), np.uint8), compress=False)
    write_idx(d / "t10k-labels-idx1-ubyte", labels, compress=False)


def test_a_published_size_split_must_hold_the_published_labels(tmp_path) -> None:
    mnist_counts = PUBLISHED_LABELS["mnist"]["test"].counts
    mnist_like = np.repeat(np.arange(10, dtype=np.uint8), mnist_counts)
    _write_test_split(tmp_path / "m", mnist_like)
    assert len(load_dataset("mnist", tmp_path / "m", "test")) == 10000
    with pytest.raises(DatasetFormatError) as err:
        load_dataset("fashion_mnist", tmp_path / "m", "test")
    message = str(err.value)
    assert str(tmp_path / "m") in message and "not fashion_mnist's (they hold mnist's labels)" in message
    assert "load them as 'mnist'" in message and "\n" not in message

    balanced = np.repeat(np.arange(10, dtype=np.uint8), 1000)  # Fashion-MNIST's counts, not its labels
    _write_test_split(tmp_path / "b", balanced)
    with pytest.raises(DatasetFormatError, match=r"b: the test files there are not mnist's \(examples per class"):
        load_dataset("mnist", tmp_path / "b", "test")
    with pytest.raises(DatasetFormatError, match="not fashion_mnist's"):
        load_dataset("fashion_mnist", tmp_path / "b", "test")


@pytest.mark.skipif(
    not (DEBIAN_FMNIST / "train-labels-idx1-ubyte.gz").is_file(),
    reason="Debian package dataset-fashion-mnist not installed (/usr/share/datasets/fashion-mnist)",
)
def test_fashion_mnist_files_given_as_mnist_are_refused(tmp_path) -> None:
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for path in DEBIAN_FMNIST.glob("*.gz"):
        (raw / path.name).symlink_to(path)
    for split in ("train", "test"):
        with pytest.raises(DatasetFormatError) as err:
            load_dataset("mnist", tmp_path, split)
        assert str(err.value) == (
            f"{raw}: the {split} files there are not mnist's (they hold fashion_mnist's labels); load them as "
            "'fashion_mnist', or point data_dir at mnist's IDX files"
        )


@pytest.mark.skipif(
    not (DEBIAN_FMNIST / "train-images-idx3-ubyte.gz").is_file(),
    reason="Debian package dataset-fashion-mnist not installed (/usr/share/datasets/fashion-mnist)",
)
def test_real_fashion_mnist_from_debian_package() -> None:
    train = load_dataset("fashion_mnist", None, "train")  # found without data_dir
    test = load_dataset("fashion_mnist", None, "test")
    assert train.images.shape == (60000, 1, 28, 28) and test.images.shape == (10000, 1, 28, 28)
    assert torch.bincount(train.labels).tolist() == [6000] * 10
    assert torch.bincount(test.labels).tolist() == [1000] * 10
    assert 60 < train.images.float().mean() < 85  # Fashion-MNIST's mean pixel is about 72.9


# ----------------------------------------------------------------------------- CIFAR-10


def write_cifar_pickle(d: Path, per_batch: int = 4, seed: int = 0) -> dict:
    d.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    out = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=per_batch).tolist()
        with open(d / name, "wb") as f:
            pickle.dump(
                {b"batch_label": name.encode(), b"labels": labels, b"data": data, b"filenames": [b"x.png"] * per_batch},
                f,
            )
        out[name] = (data, labels)
    with open(d / "batches.meta", "wb") as f:
        pickle.dump(
            {
                b"label_names": [
                    b"airplane",
                    b"automobile",
                    b"bird",
                    b"cat",
                    b"deer",
                    b"dog",
                    b"frog",
                    b"horse",
                    b"ship",
                    b"truck",
                ],
                b"num_vis": 3072,
            },
            f,
        )
    return out


def test_cifar10_pickle_layout(tmp_path) -> None:
    batches = write_cifar_pickle(tmp_path / "cifar-10-batches-py")
    for root in (tmp_path, tmp_path / "cifar-10-batches-py"):
        train = load_dataset("cifar10", root, "train")
        test = load_dataset("cifar10", root, "test")
        assert train.images.shape == (20, 3, 32, 32) and test.images.shape == (4, 3, 32, 32)
        assert train.classes[0] == "airplane" and train.classes[9] == "truck"
        data, labels = batches["data_batch_2"]
        # row layout: 1024 red, 1024 green, 1024 blue values, each plane row-major
        np.testing.assert_array_equal(train.images[4:8].numpy(), data.reshape(4, 3, 32, 32))
        np.testing.assert_array_equal(train.images[4, 1, 0, :5].numpy(), data[0, 1024:1029])
        assert train.labels[4:8].tolist() == labels
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(DatasetNotFoundError, match="Missing there: data_batch_3"):
        load_dataset("cifar10", tmp_path, "train")
    assert len(load_dataset("cifar10", tmp_path, "test")) == 4


def test_cifar10_missing_error_names_both_layouts(tmp_path) -> None:
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("cifar10", tmp_path, "train")
    msg = str(err.value)
    assert str(tmp_path) in msg and "cifar-10-batches-py/data_batch_1..5" in msg and "test_batch" in msg
    assert "train/<class>/" in msg


@pytest.fixture(scope="module")
def cifar_jpeg_subset(tmp_path_factory) -> Path:
    """Forty real CIFAR-10 JPEGs (cat and dog, 10 each per split) from the shared tarball."""
    if not CIFAR_TAR.is_file():
        pytest.skip(f"{CIFAR_TAR} not present")
    root = tmp_path_factory.mktemp("cifar_jpeg")
    members = [f"cifar10/{s}/{c}/000*" for s in ("train", "test") for c in ("cat", "dog")]
    subprocess.run(["tar", "-xJf", str(CIFAR_TAR), "-C", str(root), "--wildcards", *members], check=True)
    return root


def test_cifar10_imagefolder_real_jpegs(cifar_jpeg_subset) -> None:
    train = load_dataset("cifar10", cifar_jpeg_subset, "train")  # finds the cifar10/ sub-folder
    test = load_dataset("cifar10", cifar_jpeg_subset / "cifar10", "test")
    assert train.images.shape == (20, 3, 32, 32) and test.images.shape == (20, 3, 32, 32)
    assert train.classes == ["cat", "dog"] and train.labels.tolist() == [0] * 10 + [1] * 10
    assert train.meta["format"] == "imagefolder"
    first = cifar_jpeg_subset / "cifar10" / "test" / "cat" / "0000.jpg"
    expected = np.asarray(Image.open(first).convert("RGB")).transpose(2, 0, 1)
    np.testing.assert_array_equal(test.images[0].numpy(), expected)
    assert 40 < train.images.float().mean() < 200 and train.images.float().std() > 20  # real photos


def test_batched_jpeg_decoder_matches_pil(cifar_jpeg_subset, monkeypatch) -> None:
    files = sorted(str(p) for p in (cifar_jpeg_subset / "cifar10" / "train").rglob("*.jpg"))
    fast = imagefolder_mod.decode_images(files, num_workers=2)
    monkeypatch.setattr(imagefolder_mod, "decode_jpeg", None)  # PIL only
    pil = imagefolder_mod.decode_images(files, num_workers=1)
    assert fast.shape == (20, 3, 32, 32) and np.array_equal(fast, pil)


def test_grey_jpegs_fall_back_to_pil(tmp_path) -> None:
    rng = np.random.default_rng(0)
    for i in range(3):
        p = tmp_path / "train" / "g" / f"{i}.jpg"
        p.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (6, 6), dtype=np.uint8), mode="L").save(p)
    grey = load_dataset("imagefolder", tmp_path, "train")
    rgb = load_dataset("imagefolder", tmp_path, "train", channels=3)
    assert grey.images.shape == (3, 1, 6, 6) and rgb.images.shape == (3, 3, 6, 6)
    assert torch.equal(rgb.images[:, 0], grey.images[:, 0]) and torch.equal(rgb.images[:, 2], grey.images[:, 0])


def test_imagefolder_cache_is_used_and_invalidated(cifar_jpeg_subset, tmp_path, monkeypatch) -> None:
    root = tmp_path / "data"
    shutil.copytree(cifar_jpeg_subset / "cifar10", root)
    calls = []
    real = imagefolder_mod.decode_images

    def counting(files, **kw):
        calls.append(len(files))
        return real(files, **kw)

    monkeypatch.setattr(imagefolder_mod, "decode_images", counting)
    a = load_dataset("imagefolder", root, "train")
    assert calls == [20]
    assert list((tmp_path / "cache" / "datasets").glob("imagefolder-train-*.npz"))
    b = load_dataset("imagefolder", root, "train")
    assert calls == [20]  # second load: from the cache, nothing decoded
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels) and a.classes == b.classes
    load_dataset("imagefolder", root, "train", cache=False)
    assert calls == [20, 20]
    # adding a file changes its class folder's mtime: the cache key changes and the folder is decoded again
    shutil.copy(root / "train" / "cat" / "0000.jpg", root / "train" / "cat" / "0099.jpg")
    os.utime(root / "train" / "cat", ns=(0, 1))  # make the mtime change visible even on coarse clocks
    c = load_dataset("imagefolder", root, "train")
    assert calls == [20, 20, 21] and len(c) == 21


# ----------------------------------------------------------------------------- generic ImageFolder


def write_png(path: Path, size_hw: tuple[int, int], value: int, mode: str = "RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    shape = size_hw if mode == "L" else (*size_hw, 3)
    Image.fromarray(np.full(shape, value, dtype=np.uint8), mode=mode).save(path)


def test_imagefolder_requires_one_size_or_resizes(tmp_path) -> None:
    for i in range(3):
        write_png(tmp_path / "train" / "a" / f"{i}.png", (8, 6), 10 * i)
        write_png(tmp_path / "test" / "b" / f"{i}.png", (8, 6), 100)
    write_png(tmp_path / "train" / "b" / "odd.png", (9, 6), 200)
    with pytest.raises(DatasetFormatError) as err:
        load_dataset("imagefolder", tmp_path, "train", num_workers=2)
    msg = str(err.value)
    assert str(tmp_path / "train" / "b" / "odd.png") in msg and "9x6" in msg and "8x6" in msg
    assert "image_size=(H, W)" in msg

    d = load_dataset("imagefolder", tmp_path, "train", image_size=(4, 3))
    assert d.images.shape == (4, 3, 4, 3) and d.classes == ["a", "b"] and d.labels.tolist() == [0, 0, 0, 1]
    assert d.images[3].unique().tolist() == [200] and d.images[1].unique().tolist() == [10]
    t = load_dataset("imagefolder", tmp_path, "test")  # classes are the union, so labels agree with train
    assert t.classes == ["a", "b"] and t.labels.tolist() == [1, 1, 1] and t.images.shape == (3, 3, 8, 6)


def test_imagefolder_single_folder_split_and_grey(tmp_path) -> None:
    for c in range(3):
        for i in range(10):
            write_png(tmp_path / f"c{c}" / f"{i:02d}.png", (5, 5), 20 * c + i, mode="L")
    train = load_dataset("imagefolder", tmp_path, "train", test_fraction=0.3, seed=1)
    test = load_dataset("imagefolder", tmp_path, "test", test_fraction=0.3, seed=1)
    assert train.images.shape == (21, 1, 5, 5) and test.images.shape == (9, 1, 5, 5)
    assert torch.bincount(test.labels).tolist() == [3, 3, 3]  # stratified
    values = sorted(train.images[:, 0, 0, 0].tolist() + test.images[:, 0, 0, 0].tolist())
    assert values == sorted(20 * c + i for c in range(3) for i in range(10))  # disjoint and complete
    again = load_dataset("imagefolder", tmp_path, "test", test_fraction=0.3, seed=1)
    other = load_dataset("imagefolder", tmp_path, "test", test_fraction=0.3, seed=2)
    assert torch.equal(again.images, test.images) and not torch.equal(other.images, test.images)
    rgb = load_dataset("imagefolder", tmp_path, "train", test_fraction=0.3, seed=1, channels=3)
    assert rgb.images.shape == (21, 3, 5, 5)


def test_imagefolder_missing(tmp_path) -> None:
    with pytest.raises(DatasetNotFoundError, match="data_dir"):
        load_dataset("imagefolder", None)
    with pytest.raises(DatasetNotFoundError, match=str(tmp_path / "x")):
        load_dataset("imagefolder", tmp_path / "x")
    (tmp_path / "train" / "a").mkdir(parents=True)
    write_png(tmp_path / "train" / "a" / "0.png", (2, 2), 1)
    with pytest.raises(DatasetNotFoundError, match="a test/val/valid/validation folder"):
        load_dataset("imagefolder", tmp_path, "test")


# ----------------------------------------------------------------------------- downsampled ImageNet


def write_imagenet_npz(path: Path, n: int, res: int, seed: int, label_hi: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(n, 3 * res * res), dtype=np.uint8)
    labels = rng.integers(1, label_hi + 1, size=n)  # 1-based, as in the published files
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, data=data, labels=labels.tolist(), **({"mean": data.mean(0)} if "train" in path.name else {}))
    return data, labels


def test_imagenet32_npz_batches(tmp_path) -> None:
    d1, l1 = write_imagenet_npz(tmp_path / "Imagenet32_train_npz" / "train_data_batch_1.npz", 6, 32, 0)
    d2, l2 = write_imagenet_npz(tmp_path / "Imagenet32_train_npz" / "train_data_batch_2.npz", 5, 32, 1)
    d10, l10 = write_imagenet_npz(tmp_path / "Imagenet32_train_npz" / "train_data_batch_10.npz", 2, 32, 2)
    dv, lv = write_imagenet_npz(tmp_path / "Imagenet32_val_npz" / "val_data.npz", 4, 32, 3)
    train = load_dataset("imagenet32", tmp_path, "train")
    assert train.images.shape == (13, 3, 32, 32) and train.images.dtype == torch.uint8
    assert len(train.classes) == 1000
    np.testing.assert_array_equal(train.labels.numpy(), np.concatenate([l1, l2, l10]) - 1)  # 0-based, 1,2,10 order
    np.testing.assert_array_equal(train.images[6, 2].numpy(), d2[0, 2048:].reshape(32, 32))  # blue plane
    val = load_dataset("imagenet32", tmp_path, "test")
    np.testing.assert_array_equal(val.images.numpy(), dv.reshape(4, 3, 32, 32))
    np.testing.assert_array_equal(val.labels.numpy(), lv - 1)

    sub = load_dataset("imagenet32", tmp_path, "train", max_classes=500)
    keep = np.concatenate([l1, l2, l10]) - 1 < 500
    assert len(sub) == keep.sum() and sub.labels.max() < 500 and len(sub.classes) == 500
    with pytest.raises(DatasetFormatError, match="rows of 3072 values, expected 12288 for 64x64"):
        load_dataset("imagenet64", tmp_path, "train")


def test_imagenet64_val_name_and_missing(tmp_path) -> None:
    dv, _ = write_imagenet_npz(tmp_path / "Imagenet64_val.npz", 3, 64, 0, label_hi=5)
    val = load_dataset("imagenet64", tmp_path, "test")
    np.testing.assert_array_equal(val.images.numpy(), dv.reshape(3, 3, 64, 64))
    assert len(load_dataset("imagenet_downsampled", tmp_path, "test")) == 3
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("imagenet64", tmp_path, "train")
    assert str(tmp_path) in str(err.value) and "train_data_batch_1.npz" in str(err.value)


# ----------------------------------------------------------------------------- rotated MNIST


def test_rotate_images_matches_rot90_and_keeps_mass() -> None:
    x = torch.randint(0, 256, (4, 1, 28, 28), dtype=torch.uint8)
    for k in (1, 2, 3):
        assert torch.equal(rotate_images(x, [90.0 * k] * 4), torch.rot90(x, k, (2, 3)))  # anticlockwise
    assert torch.equal(rotate_images(x, [0.0] * 4), x)
    disc = torch.zeros(1, 1, 28, 28, dtype=torch.uint8)
    yy, xx = torch.meshgrid(torch.arange(28) - 13.5, torch.arange(28) - 13.5, indexing="ij")
    disc[0, 0, (yy**2 + xx**2) < 64] = 255
    r = rotate_images(disc, [33.0])
    assert abs(r.float().sum() / disc.float().sum() - 1) < 0.02


def _digits(n: int = 300) -> tuple[np.ndarray, np.ndarray]:
    if MNIST_NPZ.is_file():
        with np.load(MNIST_NPZ) as z:
            return z["images"][:n], z["labels"][:n]
    rng = np.random.default_rng(0)  # stand-in digits: a blob in the middle
    images = np.zeros((n, 28, 28), np.uint8)
    images[:, 8:20, 10:18] = rng.integers(100, 256, size=(n, 12, 8))
    return images, (np.arange(n) % 10).astype(np.uint8)


def test_rotated_mnist_from_npz_is_deterministic_and_rotated(tmp_path) -> None:
    images, labels = _digits()
    npz = tmp_path / "mnist-10k.npz"
    np.savez(npz, images=images, labels=labels)
    a = load_dataset("rotated_mnist", tmp_path, "train")  # finds mnist-10k.npz in the directory
    b = load_dataset("rotated_mnist", npz, "train")
    plain = load_dataset("rotated_mnist", npz, "train", max_angle=0)
    test = load_dataset("rotated_mnist", npz, "test")
    assert a.images.shape == (240, 1, 28, 28) and test.images.shape == (60, 1, 28, 28)
    assert a.images.dtype == torch.uint8 and a.classes == [str(i) for i in range(10)]
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)  # deterministic
    assert np.array_equal(a.meta["angles"], b.meta["angles"])
    assert a.meta["angles"].min() >= 0 and a.meta["angles"].max() < 360 and a.meta["angles"].std() > 80
    # the unrotated split holds the original digits: train and test partition them
    pool = {img.tobytes() for img in images}
    assert all(img.tobytes() in pool for img in plain.images[:, 0].numpy())
    assert torch.equal(plain.labels, a.labels)
    # actually rotated: most images differ clearly from their originals, mass roughly kept
    diff = (a.images.float() - plain.images.float()).abs().flatten(1).mean(1)
    assert (diff > 5).float().mean() > 0.8
    ratio = a.images.float().flatten(1).sum(1) / plain.images.float().flatten(1).sum(1)
    assert abs(ratio.median() - 1) < 0.05 and ratio.min() > 0.8
    other = load_dataset("rotated_mnist", npz, "train", seed=1)
    assert not torch.equal(other.images, a.images) and torch.equal(other.labels, a.labels)


@pytest.mark.skipif(not MNIST_NPZ.is_file(), reason=f"{MNIST_NPZ} not present")
def test_rotated_mnist_real_10k_split() -> None:
    train = load_dataset("rotated_mnist", MNIST_NPZ.parent, "train")
    test = load_dataset("rotated_mnist", MNIST_NPZ, "test")
    assert len(train) == 8000 and len(test) == 2000
    counts = torch.bincount(torch.cat([train.labels, test.labels]), minlength=10)
    with np.load(MNIST_NPZ) as z:
        assert counts.tolist() == np.bincount(z["labels"], minlength=10).tolist()


def test_rotated_mnist_from_idx_and_missing(tmp_path) -> None:
    arrays = make_idx_dir(tmp_path / "MNIST" / "raw", n_train=12, n_test=5)
    d = load_dataset("rotated_mnist", tmp_path, "test")
    assert d.images.shape == (5, 1, 28, 28)
    np.testing.assert_array_equal(d.labels.numpy(), arrays["test"][1])
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("rotated_mnist", tmp_path / "empty", "train")
    assert str(tmp_path / "empty") in str(err.value) and "mnist-10k.npz" in str(err.value)
    bad = tmp_path / "bad.npz"
    np.savez(bad, foo=np.zeros(3))
    with pytest.raises(DatasetFormatError, match="expected keys 'images' and 'labels'"):
        load_dataset("rotated_mnist", bad)


class _RunsCode:
    """A pickle that calls a function of its choosing when loaded (here: writes a marker file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


@pytest.mark.parametrize("name", ["data_batch_1", "batches.meta"])
def test_cifar10_pickle_that_would_run_code_is_refused_without_running_it(tmp_path, name) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar_pickle(folder)
    marker = tmp_path / "marker"
    with open(folder / name, "wb") as f:
        pickle.dump({b"data": _RunsCode(marker), b"label_names": _RunsCode(marker)}, f)
    with pytest.raises(DatasetFormatError, match=rf"{name}: not a CIFAR-10 pickle of NumPy arrays .*refusing"):
        load_dataset("cifar10", tmp_path, "train")
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_cifar10_pickle_of_arrays_reads_at_every_protocol(tmp_path, protocol) -> None:
    from equiconvert.data.array_pickle import load_array_pickle

    record = {
        b"data": np.arange(6, dtype=np.uint8).reshape(2, 3),
        b"labels": [np.int64(1), 2],
        b"batch_label": b"training batch 1 of 5",
    }
    path = tmp_path / "batch"
    path.write_bytes(pickle.dumps(record, protocol=protocol))
    loaded = load_array_pickle(path)
    np.testing.assert_array_equal(loaded[b"data"], record[b"data"])
    assert loaded[b"labels"] == [1, 2] and loaded[b"batch_label"] == b"training batch 1 of 5"


@pytest.mark.parametrize("core", [b"numpy.core", b"numpy._core"])
def test_cifar10_pickle_reads_arrays_written_by_numpy_1_and_2(tmp_path, core) -> None:
    """NumPy 1 names numpy.core in a pickle, NumPy 2 numpy._core: either reads under the installed NumPy."""
    from equiconvert.data.array_pickle import load_array_pickle

    data = np.arange(6, dtype=np.uint8).reshape(2, 3)
    written = pickle.dumps({b"data": data}, protocol=2)  # protocol 2 names globals as text lines
    spelled = written.replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n")
    spelled = spelled.replace(b"numpy.core.multiarray\n", core + b".multiarray\n")
    assert core + b".multiarray\n_reconstruct" in spelled
    (tmp_path / "batch").write_bytes(spelled)
    np.testing.assert_array_equal(load_array_pickle(tmp_path / "batch")[b"data"], data)
