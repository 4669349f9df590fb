"""The small-batch float32 linear kernel (engine.linear_kernel) against float64 and
F.linear, and its use by `layers.linear`."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

from ridgeline.engine import linear_kernel
from ridgeline.engine.models import layers

needs_kernel = pytest.mark.skipif(not linear_kernel.available(),
                                  reason="needs AVX-512, Linux and a C compiler")


def assert_fp32_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                      b: torch.Tensor | None) -> None:
    """|y - exact| <= 1e-5 * (|x| |w|^T + |b|) elementwise: relative 1e-5 of the sum's
    magnitude, the accuracy a float32 dot product of this length has."""
    exact = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    if b is not None:
        exact = exact + b.double()
        scale = scale + b.double().abs()
    err = (y.double() - exact).abs()
    assert bool((err <= 1e-5 * scale + 1e-30).all()), float((err / scale).max())


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_and_f_linear_for_1_to_16_rows(threads: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    for n, k in [(37, 53), (3, 17), (389, 211), (1000, 1536), (50, 7)]:
        w = torch.randn(n, k, generator=gen)
        b = torch.randn(n, generator=gen) if with_bias else None
        for m in range(1, 17):
            x = torch.randn(m, k, generator=gen)
            y = linear_kernel.small_linear(x, w, b, threads=threads)
            assert y.shape == (m, n) and y.dtype == torch.float32 and y.is_contiguous()
            assert_fp32_close(y, x, w, b)
            assert_fp32_close(F.linear(x, w, b), x, w, b)  # the bound holds for torch too


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_other_rows() -> None:
    # every output is summed in one fixed order: 1 row alone and the same row among 16
    # (in a tile of 8, of 5 ...) give the same bits, with one thread or two
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(577, 389, generator=gen)
    x = torch.randn(16, 389, generator=gen)
    alone = torch.cat([linear_kernel.small_linear(x[i:i + 1], w, threads=1)
                       for i in range(16)])
    for m in (2, 5, 8, 9, 13, 16):
        together = linear_kernel.small_linear(x[:m], w, threads=2)
        assert torch.equal(together, alone[:m])


@needs_kernel
def test_strided_and_transposed_inputs() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(123, 45, generator=gen)
    wide = torch.randn(12, 100, generator=gen)
    for x in (wide[:, 10:55],            # rows at a stride of 100
              wide[::3, :45],            # every third row
              wide[:6, :45].clone().T.contiguous().T,  # column-major: copied
              torch.randn(45, 7, generator=gen).T):    # a transposed view: copied
        y = linear_kernel.small_linear(x, w)
        assert_fp32_close(y, x, w, None)
        assert torch.equal(y, linear_kernel.small_linear(x.contiguous(), w))


@needs_kernel
def test_rejects_what_it_does_not_compute() -> None:
    w = torch.randn(8, 16)
    with pytest.raises(ValueError):
        linear_kernel.small_linear(torch.randn(2, 15), w)           # K mismatch
    with pytest.raises(ValueError):
        linear_kernel.small_linear(torch.randn(2, 16).double(), w)  # float64 x
    with pytest.raises(ValueError):
        linear_kernel.small_linear(torch.randn(2, 16), w.T.contiguous().T)  # strided W
    with pytest.raises(ValueError):
        linear_kernel.small_linear(torch.randn(2, 16), w, torch.randn(7))  # bias size
    with pytest.raises(ValueError):
        linear_kernel.small_linear(torch.randn(2, 4, 16), w)        # not 2-D


@needs_kernel
def test_in_place_weight_updates_are_seen() -> None:
    # the kernel reads W where it lies (no cached copy), so RL's in-place updates apply
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 96, generator=gen)
    b = torch.randn(64, generator=gen)
    x = torch.randn(4, 96, generator=gen)
    before = linear_kernel.small_linear(x, w, b)
    with torch.no_grad():
        w.copy_(torch.randn(64, 96, generator=gen))
        b.mul_(-2)
    after = linear_kernel.small_linear(x, w, b)
    assert not torch.allclose(before, after)
    assert_fp32_close(after, x, w, b)


@needs_kernel
def test_concurrent_callers_each_get_their_own_result() -> None:
    # a call made while another holds the helper threads runs on its own thread
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(2048, 256, generator=gen)
    xs = [torch.randn(8, 256, generator=gen) for _ in range(4)]
    expect = [linear_kernel.small_linear(x, w, threads=1) for x in xs]
    errors: list[str] = []

    def work(i: int) -> None:
        for _ in range(50):
            if not torch.equal(linear_kernel.small_linear(xs[i], w, threads=2), expect[i]):
                errors.append(f"caller {i}")
                return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@needs_kernel
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_can_use_the_kernel() -> None:
    # the helper threads do not survive fork; the child must start its own, not wait
    w = torch.randn(4096, 128)
    x = torch.randn(8, 128)
    expect = linear_kernel.small_linear(x, w, threads=2)
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        ok = torch.equal(linear_kernel.small_linear(x, w, threads=2), expect)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


@needs_kernel
def test_layers_linear_uses_the_kernel_for_small_batches_without_grad() -> None:
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(300, 80, generator=gen)
    b = torch.randn(300, generator=gen)
    for rows in range(layers.KERNEL_MIN_ROWS, layers.KERNEL_MAX_ROWS + 1):
        x = torch.randn(rows, 80, generator=gen)
        with torch.inference_mode():
            y = layers.linear(x, w, b)
        assert torch.equal(y, linear_kernel.small_linear(x, w, b))
    # with autograd on, the product stays differentiable (PyTorch's path)
    x = torch.randn(4, 80, generator=gen, requires_grad=True)
    y = layers.linear(x, w, b)
    y.sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, w.sum(0).expand(4, 80))


def test_without_the_kernel_linear_falls_back_to_pytorch(tmp_path) -> None:
    # no C compiler: nothing is built, available() says so and linear() still computes
    code = (
        "import torch, torch.nn.functional as F\n"
        "from ridgeline.engine import linear_kernel\n"
        "from ridgeline.engine.models import layers\n"
        "assert not linear_kernel.available()\n"
        "w, b = torch.randn(70, 33), torch.randn(70)\n"
        "for rows in (1, 2, 8, 16, 40):\n"
        "    x = torch.randn(rows, 33)\n"
        "    with torch.inference_mode():\n"
        "        y = layers.linear(x, w, b)\n"
        "    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)\n"
        "print('fallback ok')\n")
    env = {**os.environ, "CC": str(tmp_path / "no-such-compiler"), "PATH": str(tmp_path),
           "RIDGELINE_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "fallback ok" in done.stdout
