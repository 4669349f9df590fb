"""The small-batch linear kernel (engine.linear_kernel) against float64 and F.linear, for
each weight dtype (float32, bfloat16, int8 with scales), x dtype (float32, bfloat16) and
bias, in both ISA variants where this CPU runs them, and its use by `layers`."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading

import pytest
import torch

from ridgeline.engine.kernels import cpu_kernels, linear_kernel
from ridgeline.engine.model_executor.models import layers

needs_kernel = pytest.mark.skipif(not linear_kernel.available(),
                                  reason="needs AVX-512 or AVX2 + FMA, Linux and a C compiler")


@pytest.fixture(params=["avx2", "avx512"])
def lib(request) -> ctypes.CDLL:
    """Each variant this CPU runs: the AVX2 one everywhere it builds (on an AVX-512 CPU
    built with -mno-avx512f), the AVX-512 one where the CPU has AVX-512 F."""
    if request.param == "avx2":
        built = linear_kernel.portable_library()
        if built is None:
            pytest.skip("needs AVX2 + FMA, Linux and a C compiler")
        assert linear_kernel.vector_width(built) == 8
        return built
    if "avx512f" not in cpu_kernels.cpu_flags() or not linear_kernel.available():
        pytest.skip("this CPU has no AVX-512 F")
    assert linear_kernel.vector_width() == 16
    return linear_kernel.load()


WEIGHT_DTYPES = [torch.float32, torch.bfloat16, torch.int8]
X_DTYPES = [torch.float32, torch.bfloat16]


def make_weight(n: int, k: int, dtype: torch.dtype, gen: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(weight as the kernel takes it, scales or None, the weight it stands for in
    float64)."""
    w = torch.randn(n, k, generator=gen)
    if dtype != torch.int8:
        w = w.to(dtype)
        return w, None, w.double()
    q, scale = layers.quantize_int8(w)
    return q, scale, q.double() * scale.double()[:, None]


def assert_close_to_exact(y: torch.Tensor, x: torch.Tensor, w64: torch.Tensor,
                          b: torch.Tensor | None, rel: float = 1e-5) -> None:
    """|y - exact| <= rel * (|x| |w|^T + |b|) elementwise (1e-5: the accuracy a float32
    dot product of this length has), plus half a unit in the last place of bfloat16 (2^-8
    relative) when y is bfloat16."""
    exact = x.double() @ w64.T
    scale = x.double().abs() @ w64.abs().T
    if b is not None:
        exact = exact + b.double()
        scale = scale + b.double().abs()
    err = (y.double() - exact).abs()
    bound = rel * scale + 1e-30
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * exact.abs() * (1 + 1e-5)
    assert bool((err <= bound).all()), float((err / scale).max())


@pytest.mark.parametrize("wdt", WEIGHT_DTYPES)
@pytest.mark.parametrize("xdt", X_DTYPES)
@pytest.mark.parametrize("bias", [None, torch.float32, torch.bfloat16])
def test_matches_float64_for_every_dtype_and_odd_shapes(lib, wdt, xdt, bias) -> None:
    # K not a multiple of 8 or 16 (the vector width), N not a multiple of any tile width,
    # M from 1 to 16 and past it (tiles of 8 or 4 rows and their rests)
    gen = torch.Generator().manual_seed(0)
    for n, k in [(37, 53), (3, 17), (389, 211), (50, 7), (1000, 1536), (13, 16)]:
        w, scales, w64 = make_weight(n, k, wdt, gen)
        b = torch.randn(n, generator=gen).to(bias) if bias is not None else None
        for m in [*range(1, 18), 23, 33]:
            x = torch.randn(m, k, generator=gen).to(xdt)
            for threads in (1, 2):
                y = linear_kernel.small_linear(x, w, b, threads, scales=scales, lib=lib)
                assert y.shape == (m, n) and y.dtype == xdt and y.is_contiguous()
                assert_close_to_exact(y, x, w64, b)


@pytest.mark.parametrize("wdt", WEIGHT_DTYPES)
def test_bfloat16_output_is_the_float32_result_rounded_to_nearest_even(lib, wdt) -> None:
    # bf16 x is widened exactly, so its product is the float32 one, rounded as torch rounds
    gen = torch.Generator().manual_seed(1)
    w, scales, w64 = make_weight(300, 129, wdt, gen)
    b = torch.randn(300, generator=gen).to(torch.bfloat16)
    x = torch.randn(7, 129, generator=gen).to(torch.bfloat16)
    y = linear_kernel.small_linear(x, w, b, scales=scales, lib=lib)
    wide = linear_kernel.small_linear(x.float(), w, b, scales=scales, lib=lib)
    if wdt != torch.float32 and lib.linear_bf16_dot():
        # bf16 dot products sum in pairs: not the widened order, as accurate
        assert_close_to_exact(y, x, w64, b)
    else:
        assert torch.equal(y, wide.to(torch.bfloat16))
    # ties and near-ties of the rounding: sums x0 + x1 chosen to land on them
    xs = torch.tensor([[1.0, 2.0 ** -8], [1.0, 3 * 2.0 ** -8], [-1.0, -(2.0 ** -8)],
                       [1.0, 2.0 ** -8 + 2.0 ** -16], [3.0, 2.0 ** -7]], dtype=torch.bfloat16)
    ones = torch.ones(3, 2, dtype=torch.bfloat16)
    sums = (xs.float() @ ones.float().T).to(torch.bfloat16)
    assert torch.equal(linear_kernel.small_linear(xs, ones, lib=lib), sums)
    assert sums[0, 0] == 1.0 and sums[1, 0] == 1.0 + 2.0 ** -6  # ties to even


@pytest.mark.parametrize("wdt", WEIGHT_DTYPES)
@pytest.mark.parametrize("xdt", X_DTYPES)
def test_a_rows_result_does_not_depend_on_the_other_rows(lib, wdt, xdt) -> None:
    # every output is summed in one fixed order: 1 row alone and the same row among M
    # (tiles of different heights and widths, other column splits between threads) give
    # the same bits, with one thread or two
    gen = torch.Generator().manual_seed(2)
    w, scales, _ = make_weight(577, 389, wdt, gen)
    b = torch.randn(577, generator=gen)
    x = torch.randn(40, 389, generator=gen).to(xdt)
    alone = torch.cat([linear_kernel.small_linear(x[i:i + 1], w, b, 1, scales=scales, lib=lib)
                       for i in range(40)])
    for m in (*range(2, 18), 23, 40):
        for threads in (1, 2):
            together = linear_kernel.small_linear(x[:m], w, b, threads, scales=scales, lib=lib)
            assert torch.equal(together, alone[:m]), (m, threads)
    # and a row at every position of a tile
    for i in range(16):
        rows = torch.cat([x[20:20 + i], x[:1], x[21:36 - i]])
        got = linear_kernel.small_linear(rows, w, b, 2, scales=scales, lib=lib)
        assert torch.equal(got[i], alone[0])


def test_the_two_variants_agree_to_rounding() -> None:
    if "avx512f" not in cpu_kernels.cpu_flags() or linear_kernel.portable_library() is None:
        pytest.skip("needs a CPU with AVX-512 F (to run both variants)")
    gen = torch.Generator().manual_seed(3)
    for wdt in WEIGHT_DTYPES:
        w, scales, w64 = make_weight(211, 389, wdt, gen)
        x = torch.randn(9, 389, generator=gen)
        wide = linear_kernel.small_linear(x, w, scales=scales)
        narrow = linear_kernel.small_linear(x, w, scales=scales,
                                            lib=linear_kernel.portable_library())
        assert_close_to_exact(wide, x, w64, None)
        assert_close_to_exact(narrow, x, w64, None)
        torch.testing.assert_close(wide, narrow, rtol=1e-5, atol=1e-5)


def test_strided_and_transposed_inputs(lib) -> None:
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(123, 45, generator=gen)
    wide = torch.randn(12, 100, generator=gen)
    for x in (wide[:, 10:55],            # rows at a stride of 100
              wide[::3, :45],            # every third row
              wide[:6, :45].clone().T.contiguous().T,  # column-major: copied
              torch.randn(45, 7, generator=gen).T,     # a transposed view: copied
              wide[:1, 10:55],           # one row of a wider tensor
              torch.randn(45, generator=gen).expand(1, 45)):  # one row, odd strides
        y = linear_kernel.small_linear(x, w, lib=lib)
        assert_close_to_exact(y, x, w.double(), None)
        assert torch.equal(y, linear_kernel.small_linear(x.contiguous(), w, lib=lib))
        xb = x.to(torch.bfloat16)
        for wt in (w, w.to(torch.bfloat16)):  # widened x, or bf16 dot products on it
            assert torch.equal(linear_kernel.small_linear(xb, wt, lib=lib),
                               linear_kernel.small_linear(xb.contiguous(), wt, lib=lib))


@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.int8])
def test_bfloat16_dot_products_where_the_cpu_has_them(lib, wdt) -> None:
    """bf16 x times bf16 or int8 weights (converted to bf16 in registers, exactly) use
    vdpbf16ps in the native build of a CPU with AVX512_BF16 (never in the AVX2 build):
    accurate, and a row's result the same whatever rows are multiplied with it (a verify
    row equals the one-row decode of that token)."""
    native = linear_kernel.vector_width(lib) == 16
    assert lib.linear_bf16_dot() == int(native and "avx512_bf16" in cpu_kernels.cpu_flags())
    gen = torch.Generator().manual_seed(9)
    for k in (576, 1536, 100, 31):  # whole and partial 32-element steps
        w, scales, w64 = make_weight(77, k, wdt, gen)
        b = torch.randn(77, generator=gen).to(torch.bfloat16)
        # a spread of magnitudes, so that the two summation orders would round apart
        x = (torch.randn(16, k, generator=gen) * torch.logspace(-3, 3, k)).to(torch.bfloat16)
        alone = torch.cat([linear_kernel.small_linear(x[i:i + 1], w, b, scales=scales, lib=lib)
                           for i in range(16)])
        for m in (2, 5, 7, 8, 9, 16):
            y = linear_kernel.small_linear(x[:m], w, b, scales=scales, lib=lib)
            assert torch.equal(y, alone[:m]), (k, m)
        assert_close_to_exact(alone, x, w64, b)


@needs_kernel
def test_rejects_what_it_does_not_compute() -> None:
    w = torch.randn(8, 16)
    q, s = layers.quantize_int8(w)
    x = torch.randn(2, 16)
    bad = [
        (torch.randn(2, 15), w, None, None),                 # K mismatch
        (x.double(), w, None, None),                         # float64 x
        (x.half(), w, None, None),                           # float16 x
        (x.to(torch.int8), q, None, s),                      # int8 x
        (x, w.half(), None, None),                           # float16 weight
        (x, w.T.contiguous().T, None, None),                 # strided W
        (x, w, torch.randn(7), None),                        # bias size
        (x, w, torch.randn(8).double(), None),               # float64 bias
        (x, w, torch.randn(16)[::2], None),                  # strided bias
        (torch.randn(2, 4, 16), w, None, None),              # not 2-D
        (torch.randn(0, 16), w, None, None),                 # no rows
        (x, q, None, None),                                  # int8 weight, no scales
        (x, w, None, s),                                     # scales with a float weight
        (x, q, None, s[:7]),                                 # scales size
        (x, q, None, s.double()),                            # float64 scales
    ]
    for args in bad:
        xx, ww, bb, ss = args
        with pytest.raises(ValueError, match="small_linear takes"):
            linear_kernel.small_linear(xx, ww, bb, scales=ss)


@needs_kernel
def test_in_place_weight_updates_are_seen() -> None:
    # the kernel reads W where it lies (no cached copy), so RL's in-place updates apply
    gen = torch.Generator().manual_seed(5)
    for dt in (torch.float32, torch.bfloat16):
        w = torch.randn(64, 96, generator=gen).to(dt)
        b = torch.randn(64, generator=gen).to(dt)
        x = torch.randn(4, 96, generator=gen).to(dt)
        before = linear_kernel.small_linear(x, w, b)
        with torch.no_grad():
            w.copy_(torch.randn(64, 96, generator=gen))
            b.mul_(-2)
        after = linear_kernel.small_linear(x, w, b)
        assert not torch.allclose(before, after)
        assert_close_to_exact(after, x, w.double(), b)


@needs_kernel
def test_concurrent_callers_each_get_their_own_result() -> None:
    # a call made while another holds the helper threads runs on its own thread
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(2048, 256, generator=gen)
    q, s = layers.quantize_int8(w)
    xs = [torch.randn(8, 256, generator=gen) for _ in range(4)]
    xs[1] = xs[1].to(torch.bfloat16)
    weights = [(w, None), (w.to(torch.bfloat16), None), (q, s), (q, s.to(torch.bfloat16))]
    expect = [linear_kernel.small_linear(x, ww, threads=1, scales=ss)
              for x, (ww, ss) in zip(xs, weights, strict=True)]
    errors: list[str] = []

    def work(i: int) -> None:
        ww, ss = weights[i]
        for _ in range(50):
            if not torch.equal(linear_kernel.small_linear(xs[i], ww, threads=2, scales=ss),
                               expect[i]):
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
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_layers_linear_uses_the_kernel_for_small_batches_without_grad(dt) -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(300, 80, generator=gen).to(dt)
    b = torch.randn(300, generator=gen).to(dt)
    for rows in range(layers.KERNEL_MIN_ROWS, layers.kernel_max_rows(dt) + 1):
        x = torch.randn(rows, 80, generator=gen).to(dt)
        with torch.inference_mode():
            y = layers.linear(x, w, b)
        assert torch.equal(y, linear_kernel.small_linear(x, w, b))
    # with autograd on, the product stays differentiable (PyTorch's path)
    x = torch.randn(4, 80, generator=gen).to(dt).requires_grad_()
    y = layers.linear(x, w, b)
    y.float().sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, w.sum(0).expand(4, 80))


@needs_kernel
def test_bfloat16_products_reach_the_kernel_up_to_its_limit_for_this_cpu() -> None:
    # with vdpbf16ps the kernel beats or matches oneDNN up to 64 rows; widened bf16 only to 16
    # where oneDNN has native bf16, and up to 128 where oneDNN emulates it
    limit = layers.kernel_max_rows(torch.bfloat16)
    if not layers._BF16_NATIVE:
        assert limit == layers.BF16_KERNEL_MAX_ROWS
    elif linear_kernel.bf16_dot():
        assert limit == layers.BF16_DOT_KERNEL_MAX_ROWS
    else:
        assert limit == layers.KERNEL_MAX_ROWS
    assert layers.kernel_max_rows(torch.float32) == layers.KERNEL_MAX_ROWS
    assert linear_kernel.bf16_dot() == bool(linear_kernel.load().linear_bf16_dot())


@needs_kernel
def test_bfloat16_past_the_kernel_rows_matches_f_linear() -> None:
    # more rows: the kernel up to BF16_KERNEL_MAX_ROWS where oneDNN emulates bf16, then a
    # float32 GEMM of widened copies; either way F.linear's result to bf16 rounding
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(200, 96, generator=gen).to(torch.bfloat16)
    b = torch.randn(200, generator=gen).to(torch.bfloat16)
    for rows in (layers.KERNEL_MAX_ROWS + 1, layers.BF16_DOT_KERNEL_MAX_ROWS + 1,
                 layers.BF16_KERNEL_MAX_ROWS, layers.BF16_KERNEL_MAX_ROWS + 1, 200):
        x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
        with torch.inference_mode():
            y = layers.linear(x, w, b)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 200)
        assert_close_to_exact(y, x, w.double(), b, rel=1e-4)
        if not layers._BF16_NATIVE and rows <= layers.BF16_KERNEL_MAX_ROWS:
            assert torch.equal(y, linear_kernel.small_linear(x, w, b))


@needs_kernel
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_int8_linear_uses_the_kernel_up_to_its_limit(dt) -> None:
    # Linear.forward and the int8 LM head: the kernel up to kernel_max_rows(dt, int8=True)
    # rows (the bias added before the one rounding; every row count with bf16 x where the
    # kernel has vdpbf16ps), PyTorch's int8 GEMM beyond
    gen = torch.Generator().manual_seed(9)
    lin = layers.Linear(96, 200, bias=True, dtype=dt, device="cpu")
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 96, generator=gen))
        lin.bias.copy_(torch.randn(200, generator=gen))
    lin.quantize_int8()
    w64 = lin.qweight.double() * lin.scales.double()[:, None]
    limit = layers.kernel_max_rows(dt, int8=True)
    dot = dt == torch.bfloat16 and linear_kernel.bf16_dot()
    assert limit == (layers.INT8_DOT_KERNEL_MAX_ROWS if dot else layers.KERNEL_MAX_ROWS)
    for rows in (1, 5, layers.KERNEL_MAX_ROWS, layers.KERNEL_MAX_ROWS + 1, 40, 300):
        x = torch.randn(rows, 96, generator=gen).to(dt)
        with torch.inference_mode():
            y = lin(x)
        assert y.dtype == dt and y.shape == (rows, 200)
        if rows <= limit:
            assert torch.equal(y, linear_kernel.small_linear(x, lin.qweight, lin.bias,
                                                             scales=lin.scales))
            assert_close_to_exact(y, x, w64, lin.bias)
        else:  # PyTorch's GEMM rounds before the bias: allow a bf16 step more
            torch.testing.assert_close(y.double(), x.double() @ w64.T + lin.bias.double(),
                                       rtol=2e-2, atol=2e-2)


@needs_kernel
def test_a_bfloat16_few_token_forward_keeps_its_threads_for_the_kernel() -> None:
    # the kernel reads torch's thread count; bf16 decode must not drop it to 1
    from ridgeline.engine.model_executor.model_runner import _few_token_threads

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with _few_token_threads(1, torch.device("cpu"), torch.bfloat16):
            assert torch.get_num_threads() == 2
        with _few_token_threads(1, torch.device("cpu"), torch.float16):  # oneDNN's, still
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_without_the_kernel_linear_falls_back_to_pytorch(tmp_path) -> None:
    # no C compiler: nothing is built, available() says so and every path still computes
    # (K = 48: PyTorch's int8 GEMM crashes where K is not a multiple of 8, e.g. 33)
    code = (
        "import torch, torch.nn.functional as F\n"
        "from ridgeline.engine.kernels import linear_kernel\n"
        "from ridgeline.engine.model_executor.models import layers\n"
        "assert not linear_kernel.available()\n"
        "assert linear_kernel.portable_library() is None\n"
        "w, b = torch.randn(70, 48), torch.randn(70)\n"
        "lin = layers.Linear(48, 70, bias=True, dtype=torch.bfloat16, device='cpu')\n"
        "lin.weight.data.copy_(w); lin.bias.data.copy_(b); lin.quantize_int8()\n"
        "for rows in (1, 2, 8, 16, 40):\n"
        "    x = torch.randn(rows, 48)\n"
        "    with torch.inference_mode():\n"
        "        y = layers.linear(x, w, b)\n"
        "        yb = layers.linear(x.bfloat16(), w.bfloat16(), b.bfloat16())\n"
        "        yq = lin(x.bfloat16())\n"
        "    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)\n"
        "    xb, bb = x.bfloat16().float(), b.bfloat16().float()\n"
        "    torch.testing.assert_close(yb.float(), F.linear(xb, w.bfloat16().float(), bb),\n"
        "                               rtol=2e-2, atol=0.1)\n"
        "    wq = lin.qweight.float() * lin.scales.float()[:, None]\n"
        "    torch.testing.assert_close(yq.float(), F.linear(xb, wq, bb), rtol=2e-2, atol=0.1)\n"
        "print('fallback ok')\n")
    env = {**os.environ, "CC": str(tmp_path / "no-such-compiler"), "PATH": str(tmp_path),
           "RIDGELINE_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "fallback ok" in done.stdout


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_the_pool_runs_every_share_of_other_work_once_and_reports_failures(threads) -> None:
    # linear_parallel: how decode_stack runs attention's shares on the matmul helpers
    import ctypes

    lib = linear_kernel.load()
    task_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64)
    lib.linear_parallel.argtypes = [task_t, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.linear_parallel.restype = ctypes.c_int
    seen: list[int] = []
    task = task_t(lambda _ctx, share: seen.append(share) or (7 if share == 5 else 0))
    w = torch.randn(64, 64)
    linear_kernel.small_linear(torch.randn(4, 64), w, threads=threads)  # helpers awake
    assert lib.linear_parallel(task, None, 9, threads) == 7
    assert sorted(seen) == list(range(9))
    seen.clear()
    task = task_t(lambda _ctx, share: seen.append(share) or 0)
    assert lib.linear_parallel(task, None, 3, threads) == 0 and sorted(seen) == [0, 1, 2]
