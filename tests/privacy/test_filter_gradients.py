"""The filter-gradient kernel's guards and its matmul-precision switch (CUDA path exercised on CPU flags)."""

import pytest
import torch

from equiconvert.privacy.filter_gradients import (
    filter_gradient_method,
    matmuls_in_convolution_precision,
    per_example_filter_gradients,
)


@pytest.fixture
def default_precision():
    yield
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False


def test_precision_switch_turns_tf32_on_inside_and_restores_the_default(default_precision):
    assert torch.get_float32_matmul_precision() == "highest" and torch.backends.cudnn.allow_tf32
    with matmuls_in_convolution_precision(True):
        assert torch.backends.cuda.matmul.allow_tf32
    assert not torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "highest"
    with pytest.raises(KeyError), matmuls_in_convolution_precision(True):
        raise KeyError
    assert not torch.backends.cuda.matmul.allow_tf32
    with matmuls_in_convolution_precision(False):  # CPU inputs: nothing changes
        assert not torch.backends.cuda.matmul.allow_tf32


def test_precision_switch_leaves_a_users_choice_alone(default_precision):
    torch.set_float32_matmul_precision("medium")
    with matmuls_in_convolution_precision(True):
        assert torch.get_float32_matmul_precision() == "medium"
    assert torch.get_float32_matmul_precision() == "medium"  # still readable: no mixed legacy/new state


@pytest.mark.parametrize("method", ["products", "grouped", "unfolded"])
@pytest.mark.parametrize("stride, out", [(1, 5), (2, 4)])
def test_an_output_gradient_of_the_wrong_size_is_refused(method, stride, out):
    from equiconvert.privacy.filter_gradients import filter_gradient_method

    inputs, grad_out = torch.randn(2, 3, 6, 6), torch.randn(2, 4, out, out)
    with pytest.raises(
        ValueError, match=r"does not fit a 3x3 conv \(stride \(%d, %d\).*whose output is" % (stride, stride)
    ):
        with filter_gradient_method(method):
            per_example_filter_gradients(inputs, grad_out, 1, kernel=3, padding=1, stride=stride)


def test_an_empty_batch_gives_an_empty_result_on_both_paths():
    for stride in (1, 2):
        out = 6 if stride == 1 else 3
        grads = per_example_filter_gradients(
            torch.randn(0, 3, 6, 6), torch.randn(0, 4, out, out), 2, kernel=3, padding=1, stride=stride
        )
        assert grads.shape == (0, 4, 3, 3, 3)


def naive_filter_gradients(inputs, grad_out, views, weight_shape, **conv):
    """Each example's filter gradient by autograd through its own K-view convolution, one example at a time."""
    padding_mode = conv.pop("padding_mode", "zeros")
    grads = []
    for b in range(inputs.shape[0] // views):
        weight = torch.zeros(weight_shape, dtype=inputs.dtype, requires_grad=True)
        x = inputs[b * views : (b + 1) * views]
        if padding_mode != "zeros":
            pad = conv.pop("padding")
            x = torch.nn.functional.pad(x, (pad, pad, pad, pad), mode=padding_mode)
            conv["padding"] = 0
            out = torch.nn.functional.conv2d(x, weight, **conv)
            conv["padding"] = pad
        else:
            out = torch.nn.functional.conv2d(x, weight, **conv)
        (out * grad_out[b * views : (b + 1) * views]).sum().backward()
        grads.append(weight.grad)
    return torch.stack(grads)


GEOMETRIES = [  # (C_in, C_out, size, conv arguments)
    (3, 5, 7, dict(kernel=3, padding=1)),
    (4, 6, 8, dict(kernel=3, padding=1, stride=2)),
    (4, 6, 6, dict(kernel=1)),
    (4, 6, 9, dict(kernel=3, padding=2, dilation=2)),
    (4, 6, 6, dict(kernel=3, padding=1, groups=2)),
    (4, 6, 9, dict(kernel=1, stride=2)),  # a wide ResNet's strided shortcut
    (6, 6, 9, dict(kernel=3, padding=1, stride=2, groups=3)),
    (3, 4, 6, dict(kernel=3, padding=1, padding_mode="circular")),
    (10, 3, 9, dict(kernel=5, padding=2)),  # fewer output channels: the gradient is placed once per column shift
    (3, 6, 8, dict(kernel=5, padding=2)),  # fewer input channels: the input is copied once per column shift
]


def conv_case(c_in, c_out, size, conv, views, dtype=torch.float64, seed=0):
    """4 examples x `views` inputs in dtype and an output gradient of the conv's shape, the conv's arguments without
    its kernel size, that size, and the per-example autograd loop's filter gradients in float64."""
    conv = dict(conv)
    kernel, groups = conv.pop("kernel"), conv.get("groups", 1)
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(4 * views, c_in, size, size, generator=generator, dtype=dtype)
    padded = size + 2 * conv.get("padding", 0) if conv.get("padding_mode", "zeros") != "zeros" else None
    zero_filter = torch.zeros(c_out, c_in // groups, kernel, kernel, dtype=dtype)
    probe = torch.nn.functional.conv2d(  # only for the output's shape
        inputs.new_zeros(1, c_in, padded, padded) if padded else inputs[:1],
        zero_filter,
        **{k: (0 if padded and k == "padding" else v) for k, v in conv.items() if k != "padding_mode"},
    )
    grad_out = torch.randn(4 * views, *probe.shape[1:], generator=generator, dtype=dtype)
    weight_shape = (c_out, c_in // groups, kernel, kernel)
    expected = naive_filter_gradients(inputs.double(), grad_out.double(), views, weight_shape, **conv)
    return inputs, grad_out, kernel, conv, expected


@pytest.mark.parametrize("method", ["products", "grouped", "unfolded"])
@pytest.mark.parametrize("c_in, c_out, size, conv", GEOMETRIES)
@pytest.mark.parametrize("views", [1, 3])
def test_every_kernel_equals_a_per_example_autograd_loop(method, c_in, c_out, size, conv, views):
    from equiconvert.privacy.filter_gradients import filter_gradient_method

    inputs, grad_out, kernel, conv, expected = conv_case(c_in, c_out, size, conv, views)
    with filter_gradient_method(method):
        got = per_example_filter_gradients(inputs, grad_out, views, kernel=kernel, **conv)
    assert got.shape == expected.shape == (4, c_out, c_in // conv.get("groups", 1), kernel, kernel)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.fixture
def spied_kernels(monkeypatch):
    """Both kernels wrapped to record their calls; the "fastest" cache emptied and restored."""
    from equiconvert.privacy import filter_gradients

    calls = []
    for name, kernel in dict(filter_gradients.KERNELS).items():

        def spy(*args, _name=name, _kernel=kernel):
            calls.append(_name)
            return _kernel(*args)

        monkeypatch.setitem(filter_gradients.KERNELS, name, spy)
    monkeypatch.setattr(filter_gradients, "_fastest", {})
    return calls


def test_the_method_in_force_picks_the_kernel(spied_kernels):
    from equiconvert.privacy.filter_gradients import filter_gradient_method

    inputs, grad_out = torch.randn(4, 3, 6, 6), torch.randn(4, 5, 6, 6)
    per_example_filter_gradients(inputs, grad_out, 2, kernel=3, padding=1)
    assert spied_kernels == ["grouped"]  # "auto" off CUDA: a fixed kernel, never a timing
    with filter_gradient_method("products"):
        per_example_filter_gradients(inputs, grad_out, 2, kernel=3, padding=1)
    assert spied_kernels == ["grouped", "products"]
    with pytest.raises(ValueError, match="must be one of"), filter_gradient_method("cudnn"):
        pass


def test_fastest_times_every_kernel_once_per_geometry_and_keeps_the_fastest(spied_kernels, monkeypatch):
    from equiconvert.privacy import filter_gradients
    from equiconvert.privacy.filter_gradients import fastest_choices, filter_gradient_method

    timings = {"products": 2.0, "grouped": 1.0, "unfolded": 3.0}
    monkeypatch.setattr(filter_gradients, "_seconds", lambda kernel, *args: timings[spied_name(kernel)])
    names = {id(kernel): name for name, kernel in filter_gradients.KERNELS.items()}

    def spied_name(kernel):
        return names[id(kernel)]

    with filter_gradient_method("fastest"):
        per_example_filter_gradients(torch.randn(4, 3, 6, 6), torch.randn(4, 5, 6, 6), 2, kernel=3, padding=1)
        timings.update(products=0.5)  # a second timing would now choose products: there must be none
        per_example_filter_gradients(torch.randn(6, 3, 6, 6), torch.randn(6, 5, 6, 6), 2, kernel=3, padding=1)
        assert spied_kernels == ["grouped", "grouped"]  # the same geometry at another batch size: no re-timing
        per_example_filter_gradients(torch.randn(4, 3, 8, 8), torch.randn(4, 5, 8, 8), 2, kernel=3, padding=1)
    assert spied_kernels[-1] == "products"  # a new geometry is timed again
    assert sorted(fastest_choices().values()) == ["grouped", "products"]


def test_fastest_times_random_stand_ins_of_the_public_batch_never_the_batch_it_is_handed(spied_kernels, monkeypatch):
    """A Poisson chunk's size is secret and the choice is public (result.json): timings that favour small batches
    must still see only the public size, and the handed batch's values and the global RNG stay out of it."""
    from equiconvert.privacy import filter_gradients

    timed = []

    def seconds(kernel, inputs, grad_out, views, geometry):  # products win below 20 rows, grouped above
        timed.append((inputs, grad_out))
        return {"products": inputs.shape[0], "grouped": 20.0}.get(spied_name[id(kernel)], 30.0)

    spied_name = {id(kernel): name for name, kernel in filter_gradients.KERNELS.items()}
    monkeypatch.setattr(filter_gradients, "_seconds", seconds)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(4, 3, 6, 6, generator=generator).contiguous(memory_format=torch.channels_last)  # 2 x 2 views
    grad_out = torch.randn(4, 5, 6, 6, dtype=torch.float64, generator=generator)
    rng = torch.get_rng_state()
    with filter_gradient_method("fastest", timing_examples=16):
        per_example_filter_gradients(inputs, grad_out, 2, kernel=3, padding=1)
    assert torch.equal(torch.get_rng_state(), rng)
    assert spied_kernels == ["grouped"]  # chosen at 32 rows; the handed 4 rows would have chosen products
    assert len(timed) == 3
    for stand_in, stand_in_grad in timed:
        assert stand_in.shape == (32, 3, 6, 6) and stand_in_grad.shape == (32, 5, 6, 6)
        assert (stand_in.dtype, stand_in_grad.dtype) == (torch.float32, torch.float64)
        assert stand_in.is_contiguous(memory_format=torch.channels_last) and not stand_in.is_contiguous()
        assert not torch.equal(stand_in[:4], inputs) and not torch.equal(stand_in_grad[:4], grad_out)

    monkeypatch.setattr(filter_gradients, "_fastest", {})
    with filter_gradient_method("fastest", timing_examples=4):  # 8 rows: products, whatever the batch handed
        per_example_filter_gradients(torch.randn(40, 3, 6, 6), torch.randn(40, 5, 6, 6), 2, kernel=3, padding=1)
    assert spied_kernels[-1] == "products"
    with pytest.raises(ValueError, match="timing_examples must be a positive int"):
        with filter_gradient_method("fastest", timing_examples=0):
            pass


# two DPTrainer steps on CPU through book-keeping, the back-end whose conv gradients use the kernels
SMALL_RUN = dict(
    target_epsilon=8.0, steps=2, aug_mult=2, lr=0.5, progress=False, device="cpu", per_sample_method="bookkeeping"
)


def _small_model_and_data():
    """A small C4 ResNet9 and 32 random 16x16 images of 4 classes, the same every call."""
    import equiconvert
    from equiconvert.models import resnet9

    torch.manual_seed(0)
    model = equiconvert.make_equivariant(resnet9(widths=(8, 8, 8), num_classes=4), "C4", head="invariant")
    generator = torch.Generator().manual_seed(0)
    return model, (torch.randint(0, 256, (32, 3, 16, 16), dtype=torch.uint8, generator=generator), torch.arange(32) % 4)


def test_dptrainer_times_the_kernels_at_its_physical_batch_whatever_the_poisson_batches(spied_kernels, monkeypatch):
    from equiconvert.privacy import filter_gradients
    from equiconvert.training.trainer import DPTrainer

    timed_rows, handed_rows = [], []

    def seconds(kernel, inputs, *args):
        timed_rows.append(inputs.shape[0])
        return 1.0

    def stand_in(tensor, rows, _stand_in=filter_gradients._stand_in):
        handed_rows.append((tensor.dtype, tensor.shape[0]))
        return _stand_in(tensor, rows)

    monkeypatch.setattr(filter_gradients, "_seconds", seconds)
    monkeypatch.setattr(filter_gradients, "_stand_in", stand_in)
    model, data = _small_model_and_data()
    trainer = DPTrainer(model, batch_size=4, physical_batch_size=16, filter_gradients="fastest", **SMALL_RUN)
    trainer.fit(data)
    # physical batch x views, never the size of a Poisson chunk (about 4 examples) or of the DP-safety probe's (3)
    assert timed_rows and set(timed_rows) == {16 * 2}
    # timed while the model ran one random example (x 2 views) before the first batch, so no batch's activations
    # were held (float64: the book-keeping probe's own 3 random examples, on a CPU copy of the model)
    assert set(handed_rows) == {(torch.float32, 1 * 2), (torch.float64, 3 * 2)}


def test_dptrainer_runs_the_kernel_it_is_given_and_both_take_the_same_steps(spied_kernels):
    import copy

    from equiconvert.training.trainer import DPTrainer

    model, data = _small_model_and_data()
    # the same noise and batches in every run
    options = dict(batch_size=8, physical_batch_size=8, insecure_seeded_noise=True, **SMALL_RUN)
    runs = {}
    for method in ("products", "grouped", "unfolded"):
        spied_kernels.clear()
        trainer = DPTrainer(copy.deepcopy(model), filter_gradients=method, **options)
        trainer.fit(data)
        assert spied_kernels and set(spied_kernels) == {method}
        runs[method] = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    torch.testing.assert_close(runs["grouped"], runs["products"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(runs["unfolded"], runs["products"], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="filter_gradients must be one of"):
        DPTrainer(copy.deepcopy(model), filter_gradients="cudnn", **options)


def _kernel_failures():
    from equiconvert.privacy.triton_filter_gradients import KERNEL_FAILURES

    return [RuntimeError, *KERNEL_FAILURES]  # cuDNN's and torch's, then Triton's build and launch errors


@pytest.mark.parametrize("failure", _kernel_failures())
def test_fastest_never_chooses_a_kernel_that_fails_on_the_shape(spied_kernels, monkeypatch, failure):
    from equiconvert.privacy import filter_gradients
    from equiconvert.privacy.filter_gradients import filter_gradient_method

    def no_algorithm(*args):
        raise failure("no algorithm for this shape")

    monkeypatch.setitem(filter_gradients.KERNELS, "grouped", no_algorithm)
    with filter_gradient_method("fastest"):
        grads = per_example_filter_gradients(torch.randn(4, 3, 6, 6), torch.randn(4, 5, 6, 6), 2, kernel=3, padding=1)
    assert grads.shape == (2, 5, 3, 3, 3) and set(spied_kernels) == {"products", "unfolded"}  # timed, run
    assert set(filter_gradients.fastest_choices().values()) <= {"products", "unfolded"}


def test_products_run_in_the_gradients_dtype_whatever_the_inputs_dtype():
    """Under bf16 autocast the recorded activations are fp32 and the output gradient bf16; the kernels cast the input."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(6, 3, 7, 7, generator=generator)
    grad_out = torch.randn(6, 5, 7, 7, generator=generator, dtype=torch.float64)
    expected = naive_filter_gradients(inputs.double(), grad_out, 2, (5, 3, 3, 3), padding=1)
    for method in ("products", "grouped", "unfolded"):
        with filter_gradient_method(method):
            got = per_example_filter_gradients(inputs, grad_out, 2, kernel=3, padding=1)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("method, products", [("products", 9), ("unfolded", 1)])
@pytest.mark.parametrize("channels_in, channels_out", [(13, 11), (11, 13)])  # the gradient or the input shifted
def test_every_product_gets_aligned_operands(monkeypatch, method, products, channels_in, channels_out):
    """Every pointer and leading dimension handed to cuBLAS is a multiple of 8 elements (16 bytes in bf16): a tap
    shifted by one column was misaligned, and cuBLAS then picked its 1- and 2-element-aligned kernels."""
    from equiconvert.privacy import filter_gradients

    seen = []
    real_bmm = torch.bmm

    def spy(a, b, *, out):
        seen.append((a, b, out))
        return real_bmm(a, b, out=out)

    monkeypatch.setattr(filter_gradients.torch, "bmm", spy)
    inputs, grad_out = torch.randn(6, channels_in, 7, 7), torch.randn(6, channels_out, 7, 7)  # odd widths, channels
    with filter_gradient_method(method):
        per_example_filter_gradients(inputs, grad_out, 2, kernel=3, padding=1)
    assert len(seen) == products
    for operands in seen:
        for tensor in operands:
            inner = [stride for stride in tensor.stride()[1:] if stride != 1]
            assert tensor.storage_offset() % filter_gradients.ALIGNMENT == 0
            assert all(stride % filter_gradients.ALIGNMENT == 0 for stride in inner), tensor.stride()
            assert 1 in tensor.stride()[1:]


def test_unfolded_products_over_slices_of_the_examples_equal_the_loop(monkeypatch):
    """A slice budget smaller than the batch's stacked input: several slices (the last one shorter), same result."""
    from equiconvert.privacy import filter_gradients

    seen = []
    real_bmm = torch.bmm

    def spy(a, b, *, out):
        seen.append(a.shape[0])
        return real_bmm(a, b, out=out)

    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(5 * 2, 3, 6, 6, generator=generator, dtype=torch.float64)
    grad_out = torch.randn(5 * 2, 4, 6, 6, generator=generator, dtype=torch.float64)
    one_example = filter_gradients._aligned(27) * 2 * 8 * 8 * 8  # stacked rows x grid positions x bytes
    monkeypatch.setattr(filter_gradients, "UNFOLD_SLICE_BYTES", 2 * one_example)
    monkeypatch.setattr(filter_gradients.torch, "bmm", spy)
    with filter_gradient_method("unfolded"):
        got = per_example_filter_gradients(inputs, grad_out, 2, kernel=3, padding=1)
    assert seen == [2, 2, 1]
    expected = naive_filter_gradients(inputs, grad_out, 2, (4, 3, 3, 3), padding=1)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("method", ["products", "unfolded"])
def test_strided_convs_read_patches_as_a_view_not_through_unfold(monkeypatch, method):
    """F.unfold launches one CUDA kernel per image; the strided path must not call it."""
    from equiconvert.privacy.filter_gradients import filter_gradient_method

    def refuse(*args, **kwargs):
        raise AssertionError("F.unfold called")

    monkeypatch.setattr(torch.nn.functional, "unfold", refuse)
    inputs, grad_out = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.randn(4, 5, 4, 4, dtype=torch.float64)
    with filter_gradient_method(method):
        got = per_example_filter_gradients(inputs, grad_out, 2, kernel=3, padding=1, stride=2)
    expected = naive_filter_gradients(inputs, grad_out, 2, (5, 3, 3, 3), padding=1, stride=2)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
