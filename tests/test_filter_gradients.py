"""The filter-gradient kernel's guards and its matmul-precision switch (CUDA path exercised on CPU flags)."""
import pytest
import torch

from equiconvert.privacy.filter_gradients import matmuls_in_convolution_precision, per_example_filter_gradients


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


def test_an_output_gradient_of_the_wrong_size_is_refused():
    inputs, grad_out = torch.randn(2, 3, 6, 6), torch.randn(2, 4, 5, 5)
    with pytest.raises(ValueError, match="does not fit a 3x3 stride-1 conv"):
        per_example_filter_gradients(inputs, grad_out, 1, kernel=3, padding=1)


def test_an_empty_batch_gives_an_empty_result_on_both_paths():
    for stride in (1, 2):
        out = 6 if stride == 1 else 3
        grads = per_example_filter_gradients(torch.randn(0, 3, 6, 6), torch.randn(0, 4, out, out), 2,
                                             kernel=3, padding=1, stride=stride)
        assert grads.shape == (0, 4, 3, 3, 3)
