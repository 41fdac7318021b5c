"""`FiniteCheck`: every float dtype's NaN and infinities are caught, finite values pass (huge
ones included), and the first bad tensor is the one named."""

import pytest
import torch

from wtransfer.receiver.finite import FiniteCheck

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_single_non_finite_element_is_caught_in_every_float_dtype(dtype, value):
    check = FiniteCheck()
    check.watch("clean", torch.randn(300).to(dtype))
    bad = torch.randn(5, 700).to(dtype)
    bad[4, 699] = value
    check.watch("bad", bad)
    check.watch("later", torch.full((3,), float("nan")))
    assert check.first_bad() == "bad"


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_values_are_checked_by_their_bits(dtype):
    check = FiniteCheck()
    values = torch.randn(1000).to(dtype)
    check.watch("ok", values)
    assert check.first_bad() is None
    values.view(torch.uint8)[17] = 0x7F  # NaN in e4m3fn, infinity in e5m2
    check.watch("bad", values)
    assert check.first_bad() == "bad"


def test_finite_values_whose_sum_overflows_pass_and_integers_are_ignored():
    check = FiniteCheck()
    check.watch("huge", torch.full((64,), 3e38))  # the sum overflows; no element does
    check.watch("ints", torch.arange(10))
    check.watch("empty", torch.empty(0))
    assert check.first_bad() is None


@pytest.mark.gpu
def test_on_cuda_the_sums_are_read_once_at_the_end():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check = FiniteCheck()
    for i in range(2500):  # more than one buffer of sums
        check.watch(f"t{i}", torch.randn(64, device="cuda", dtype=torch.bfloat16))
    bad = torch.randn(64, device="cuda")
    bad[3] = float("inf")
    check.watch("bad", bad)
    assert check.first_bad() == "bad"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_bucket_checked_at_once_names_its_first_bad_tensor(device):
    """`watch_all` (a bucket's pieces in one call; on CUDA one multi-tensor launch) names
    the first tensor holding a NaN or an infinity, in the order they arrived."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pieces = [(f"t{i}", torch.randn(4, 33, device=device, dtype=torch.bfloat16))
              for i in range(300)]
    pieces[120][1][2, 5] = float("nan")
    pieces[200][1][0, 0] = float("-inf")
    pieces[50] = ("f64", torch.randn(7, device=device, dtype=torch.float64))  # other dtypes
    pieces[60] = ("f32", torch.randn(9, device=device))  # keep their place in the order
    pieces[130] = ("f64 bad", torch.full((3,), float("inf"), device=device,
                                         dtype=torch.float64))
    fine = FiniteCheck()
    fine.watch_all([*pieces[:100], ("ints", torch.arange(5, device=device))])
    assert fine.first_bad() is None
    check = FiniteCheck()
    check.watch_all(pieces[:150])
    check.watch_all(pieces[150:])
    assert check.first_bad() == "t120"
    alone = FiniteCheck()
    alone.watch_all([pieces[0], pieces[130]])
    assert alone.first_bad() == "f64 bad"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_on_cuda_a_checked_copy_is_bit_exact_and_flags_a_non_finite_value(dtype, value):
    """Large CUDA copies check what they copy in the same read (`FiniteCheck.copies`):
    the copy is bit-exact, the largest finite values pass, one non-finite element is named;
    a copy too small or misaligned for it is left to the caller."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton", reason="the checked copy is a Triton kernel")
    n = (3 << 20) // torch.empty((), dtype=dtype).element_size() + 5
    clean = torch.randn(n, device="cuda").to(dtype)
    clean[7] = torch.finfo(dtype).max
    clean[8] = -torch.finfo(dtype).max
    bad = clean.clone()
    bad[n - 2] = value
    check = FiniteCheck()
    copies = check.copies(torch.device("cuda", torch.cuda.current_device()), 4)
    assert copies is not None
    outs = {}
    for name, src in [("clean", clean), ("bad", bad), ("clean too", clean)]:
        outs[name] = torch.empty_like(src)
        assert copies.add(name, outs[name].view(torch.uint8), src.view(torch.uint8), dtype)
    small = torch.zeros(16, device="cuda", dtype=dtype)
    assert not copies.add("small", small.view(torch.uint8), small.view(torch.uint8), dtype)
    shifted = clean.view(torch.uint8)[1:1 + (2 << 20)]
    assert not copies.add("odd", torch.empty_like(shifted), shifted, dtype)
    assert torch.equal(outs["clean"].view(torch.uint8), clean.view(torch.uint8))
    assert torch.equal(outs["bad"].view(torch.uint8), bad.view(torch.uint8))
    assert check.first_bad() == "bad"
    fine = FiniteCheck()
    copies = fine.copies(torch.device("cuda", torch.cuda.current_device()), 1)
    assert copies is not None and copies.add("clean", outs["clean"].view(torch.uint8),
                                             clean.view(torch.uint8), dtype)
    assert fine.first_bad() is None
