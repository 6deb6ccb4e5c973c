"""The compact (8-bit) Adam moments and their step: the maps, codes and steps checked against
torchao's 8-bit Adam (the reference the format and the arithmetic come from), the native
kernel against the torch-ops path, the padding rules of a range, and the fallback when the
kernel cannot be built."""

import ctypes
import logging
from pathlib import Path

import pytest
import torch

from hybridps.client.optim import compact_adam as ca
from hybridps.client.optim import native
from hybridps.client.optim.moment_codes import (
    MomentRow,
    dequantize_codes,
    dynamic_map,
    qmap,
    quantize_bucketed,
    quantize_scaled,
    round_up_thresholds,
    row_bytes,
    scale_count,
)

HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


def _torchao(name: str):
    pytest.importorskip("torchao.optim.quant_utils")
    import importlib

    return importlib.import_module(name)


def _row(n: int, signed: bool) -> MomentRow:
    return MomentRow(torch.zeros(row_bytes(n), dtype=torch.uint8), n, signed)


def _kernel():
    kernel, reason = native.load_compact_adam()
    if kernel is None:
        pytest.skip(f"native kernel unavailable: {reason}")
    return kernel


def _special_values(table: torch.Tensor) -> torch.Tensor:
    """Values in [-1, 1] where rounding is decided: the map's values, the exact rounding
    thresholds (midpoints as torchao's fp32 rule sees them), their float neighbours, and
    +-1, +-0, tiny and subnormal values, plus random ones."""
    thresholds = round_up_thresholds(table)[:255]
    base = torch.cat([table, thresholds, torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 1e-45, -1e-45, 2.0**-31, 3e-7])])
    bits = base.view(torch.int32)
    near = torch.cat([(bits + d).view(torch.float32) for d in (-2, -1, 0, 1, 2)])
    values = torch.cat([near, torch.rand(1 << 14) * 2 - 1, (torch.rand(1 << 14) * 2 - 1) ** 7])
    return values[values.abs() <= 1]


def test_the_maps_are_bitsandbytes_dynamic_maps_as_torchao_builds_them():
    quant_utils = _torchao("torchao.optim.quant_utils")
    for signed in (True, False):
        assert dynamic_map(signed) == quant_utils.create_dynamic_map(signed)
        assert torch.equal(qmap(signed), torch.tensor(quant_utils.create_dynamic_map(signed), dtype=torch.float32))


def test_a_row_holds_a_code_per_element_then_a_scale_per_block_in_cache_lines():
    for n, expected in ((1, 320), (256, 320), (257, 576), (4096, 4096 + 64), (1000, 1024 + 64)):
        assert row_bytes(n) == expected and row_bytes(n) % 64 == 0
        row = _row(n, True)
        assert row.codes.numel() == -(-n // 256) * 256 and row.scales.numel() == scale_count(n)
        assert row.scales.data_ptr() == row.payload.data_ptr() + row.codes.numel()
    with pytest.raises(ValueError):
        MomentRow(torch.zeros(100, dtype=torch.uint8), 256, True)
    try:
        from hybridps.common.optimizer_states import compact_row_bytes
    except ImportError:
        return
    assert all(compact_row_bytes(n) == row_bytes(n) for n in (1, 255, 256, 257, 4096, 12345))


@pytest.mark.parametrize("signed", [True, False])
def test_codes_are_torchaos_at_midpoints_signs_zeros_and_tiny_values(signed):
    quant_utils = _torchao("torchao.optim.quant_utils")
    table = qmap(signed)
    x = _special_values(table)
    expected = quant_utils.quantize_8bit_with_qmap(x, table)
    assert torch.equal(quantize_scaled(x, table), expected)
    assert torch.equal(quantize_bucketed(x, signed), expected)
    kernel = native.load_compact_adam()[0]
    if kernel is not None:
        assert torch.equal(kernel.quantize_scaled(x, signed), expected)
        if kernel.simd:
            n = x.numel() // 64 * 64
            assert torch.equal(kernel.quantize_scaled(x[:n], signed, simd=True), expected[:n])
    odd = torch.tensor([float("nan")] * 4 + [float("inf"), -float("inf"), 3.0, -7.0])
    assert torch.equal(quantize_bucketed(odd, signed), quant_utils.quantize_8bit_with_qmap(odd, table))
    if kernel is not None:
        assert torch.equal(kernel.quantize_scaled(odd, signed), quant_utils.quantize_8bit_with_qmap(odd, table))


@pytest.mark.parametrize("signed", [True, False])
def test_a_row_round_trips_blocks_as_torchao_quantizes_them_partial_last_block_too(signed):
    quant_utils = _torchao("torchao.optim.quant_utils")
    n = 3 * 256 + 77
    values = torch.randn(n) * torch.logspace(-6, 0, n)
    if not signed:
        values = values.abs()
    row = _row(n, signed)
    row.quantize_into(0, values)
    padded = torch.cat([values, torch.zeros(row.codes.numel() - n)])
    scaled, scale = quant_utils.scale_tensor(padded, 256)
    assert torch.equal(row.codes, quant_utils.quantize_8bit_with_qmap(scaled, qmap(signed)))
    assert torch.equal(row.scales, scale)
    back = row.dequantize(0, n)
    assert torch.equal(back, quant_utils.dequant_with_qmap(row.codes, qmap(signed), row.scales)[:n])
    half_step = (qmap(signed)[1:] - qmap(signed)[:-1]).max() / 2 * 1.001  # -1 lies as far below the signed map's lowest value
    assert bool(((back - values).abs() <= half_step * scale.repeat_interleave(256)[:n]).all())
    assert torch.equal(row.dequantize(256, 300), back[256:300])
    assert torch.equal(dequantize_codes(row.codes[:n].clone(), row.scales.clone(), signed=signed), back)


def _torchao_reference(shape, adamw: bool, steps: int, grads, p0, lr):
    adam = _torchao("torchao.optim.adam")
    subclass = _torchao("torchao.optim.subclass_8bit")
    p = p0.clone()
    m = subclass.OptimState8bit.zeros(shape, True, 256)
    v = subclass.OptimState8bit.zeros(shape, False, 256)
    for step in range(1, steps + 1):
        adam.single_param_adam(
            p, grads[step - 1], torch.tensor(float(step)), m, v, None, torch.tensor(lr), HYPER["beta1"], HYPER["beta2"],
            HYPER["weight_decay"], HYPER["eps"], adamw, False,
        )  # fmt: skip
    return p, m, v


def _compare(p, m: MomentRow, v: MomentRow, ref_p, ref_m, ref_v, rtol: float) -> dict:
    out = {}
    for name, row, ref in (("m", m, ref_m), ("v", v, ref_v)):
        diff = (row.codes.int() - ref.codes.reshape(-1).int()).abs()
        assert int(diff.max()) <= 1, f"{name} codes differ by {int(diff.max())}"
        torch.testing.assert_close(row.scales, ref.scale, rtol=1e-5, atol=0)
        out[name] = float((diff != 0).float().mean())
    torch.testing.assert_close(p.reshape(-1), ref_p.reshape(-1), rtol=rtol, atol=1e-6)
    return out


@pytest.mark.parametrize("path", ["torch", "native"])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("shape", [(4096,), (64, 256), (3, 1024, 8)])
def test_twenty_steps_follow_torchaos_8bit_adam(shape, adamw, path):
    if path == "native":
        _kernel()
    steps = 20
    p0 = torch.randn(shape)
    grads = [torch.randn(shape) * (0.01 * k) for k in range(1, steps + 1)]
    ref_p, ref_m, ref_v = _torchao_reference(shape, adamw, steps, grads, p0, HYPER["lr"])
    n = p0.numel()
    master, m, v = p0.clone().reshape(-1), _row(n, True), _row(n, False)
    for step in range(1, steps + 1):
        ca.compact_adam_(
            master, grads[step - 1].reshape(-1), m, v, 0, n, step=step, decoupled_weight_decay=adamw, path=path, **HYPER
        )
    _compare(master, m, v, ref_p, ref_m, ref_v, rtol=1e-5)


def _random_state(n: int, steps: int = 3):
    master, grad = torch.randn(n), torch.randn(n) * 1e-2
    m, v = _row(n, True), _row(n, False)
    for step in range(1, steps + 1):
        ca.compact_adam_(master, torch.randn(n) * 1e-2, m, v, 0, n, step=step, decoupled_weight_decay=True, path="torch", **HYPER)
    return master, grad, m, v


def _copy(master, m: MomentRow, v: MomentRow):
    return master.clone(), MomentRow(m.payload.clone(), m.elements, True), MomentRow(v.payload.clone(), v.elements, False)


def test_the_native_kernel_steps_a_large_row_as_the_torch_path_does():
    _kernel()
    n = 1 << 20
    master, grad, m, v = _random_state(n)
    ranges = [(0, n), (256 * 7, 256 * 1000 + 13), (256 * 2000, 256 * 2000 + 256), (n - 512, n - 3), (512, 512)]
    fractions = []
    for start, end in ranges:
        a, b = _copy(master, m, v), _copy(master, m, v)
        ca.compact_adam_(a[0], grad, a[1], a[2], start, end, step=4, decoupled_weight_decay=True, path="torch", **HYPER)
        ca.compact_adam_(b[0], grad, b[1], b[2], start, end, step=4, decoupled_weight_decay=True, path="native", **HYPER)
        torch.testing.assert_close(b[0], a[0], rtol=1e-6, atol=1e-7)
        for row_a, row_b in ((a[1], b[1]), (a[2], b[2])):
            diff = (row_a.codes.int() - row_b.codes.int()).abs()
            assert int(diff.max()) <= 1
            fractions.append(float((diff != 0).float().mean()))
            torch.testing.assert_close(row_b.scales, row_a.scales, rtol=1e-6, atol=0)
    assert max(fractions) < 1e-3, fractions  # differences only at rounding ties, if any
    print(f"native vs torch path: fraction of differing codes {max(fractions):.2e}")


def test_the_portable_loops_compute_the_simd_paths_bits(tmp_path):
    kernel = _kernel()
    cc = native.build.compiler()
    if not kernel.simd or cc is None:
        pytest.skip("needs the SIMD kernel and a C compiler")
    src = Path(native.__file__).parent / "compact_adam.c"
    target = tmp_path / "portable.so"
    flags = native.build.BASE_FLAGS + ("-march=native", "-DHPS_PORTABLE_ONLY")
    assert native.build._compile(cc, src, flags, target) is None
    portable = native.CompactAdamKernel(ctypes.CDLL(str(target)), str(target))
    assert not portable.simd
    n = 64 * 256 + 100
    master, grad, m, v = _random_state(n)
    for decoupled, beta1, maximize in ((True, 0.9, False), (False, 0.3, True)):
        h = ca._hyper(1e-3, beta1, 0.999, 1e-8, 0.01, 4, decoupled, maximize)
        outs = []
        for kern in (kernel, portable):
            a = _copy(master, m, v)
            kern.step(a[0], grad, a[1], a[2], 0, n, h.native_scalars(), h.native_flags())
            outs.append(a)
        (p1, m1, v1), (p2, m2, v2) = outs
        assert torch.equal(p1, p2) and torch.equal(m1.payload, m2.payload) and torch.equal(v1.payload, v2.payload)


def test_the_threads_split_a_range_without_changing_a_bit(monkeypatch):
    _kernel()
    n = (1 << 20) + 300
    master, grad, m, v = _random_state(n, steps=1)
    a, b = _copy(master, m, v), _copy(master, m, v)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    ca.compact_adam_(a[0], grad, a[1], a[2], 256, n, step=2, decoupled_weight_decay=True, path="native", **HYPER)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    ca.compact_adam_(b[0], grad, b[1], b[2], 256, n, step=2, decoupled_weight_decay=True, path="native", **HYPER)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1].payload, b[1].payload) and torch.equal(a[2].payload, b[2].payload)


@pytest.mark.parametrize("path", ["torch", "native"])
def test_maximize_small_betas_and_a_tensor_lr_step_as_the_torch_path_defines(path):
    if path == "native":
        _kernel()
    n = 4096
    master, grad, m, v = _random_state(n, steps=2)
    hyper = dict(HYPER, beta1=0.3, beta2=0.4, lr=torch.tensor(3e-3))
    a, b = _copy(master, m, v), _copy(master, m, v)
    ca.compact_adam_(a[0], -grad, a[1], a[2], 0, n, step=3, decoupled_weight_decay=False, path="torch", **hyper)
    ca.compact_adam_(b[0], grad, b[1], b[2], 0, n, step=3, decoupled_weight_decay=False, maximize=True, path=path, **hyper)
    torch.testing.assert_close(b[0], a[0], rtol=1e-6, atol=1e-7)
    assert int((a[1].codes.int() - b[1].codes.int()).abs().max()) <= 1


@pytest.mark.parametrize("path", ["torch", "native"])
def test_a_range_ending_mid_block_zeroes_the_blocks_tail_and_leaves_master_beyond_it(path):
    if path == "native":
        _kernel()
    n = 1024
    master, grad, m, v = _random_state(n)
    before = master.clone()
    end = 512 + 100
    ca.compact_adam_(master, grad, m, v, 256, end, step=4, decoupled_weight_decay=True, path=path, **HYPER)
    assert torch.equal(master[end:], before[end:]) and torch.equal(master[:256], before[:256])
    assert not torch.equal(master[256:end], before[256:end])
    for row in (m, v):
        tail = row.dequantize(512, 768)[end - 512 :]
        assert torch.equal(tail, torch.zeros_like(tail)) and not bool(tail.signbit().any())


@pytest.mark.parametrize("path", ["torch", "native"])
def test_a_zero_payload_steps_as_zero_moments(path):
    if path == "native":
        _kernel()
    n = 2048
    master, grad = torch.randn(n), torch.randn(n)
    zero = _row(n, True), _row(n, False)  # every code 0, every scale 0
    explicit = _row(n, True), _row(n, False)
    for row in explicit:
        row.quantize_into(0, torch.zeros(n))
    a, b = master.clone(), master.clone()
    ca.compact_adam_(a, grad, *zero, 0, n, step=1, decoupled_weight_decay=True, path=path, **HYPER)
    ca.compact_adam_(b, grad, *explicit, 0, n, step=1, decoupled_weight_decay=True, path=path, **HYPER)
    assert (
        torch.equal(a, b)
        and torch.equal(zero[0].payload, explicit[0].payload)
        and torch.equal(zero[1].payload, explicit[1].payload)
    )


def test_without_the_native_kernel_cpu_rows_step_in_torch_ops_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(native.build, "build", lambda name: (None, "no C compiler (test)"))
    monkeypatch.setattr(ca, "_warned", set())
    native.forget()
    try:
        assert not ca.native_kernel_available()
        n = 512
        master, grad, m, v = torch.randn(n), torch.randn(n), _row(n, True), _row(n, False)
        ref = _copy(master, m, v)
        with caplog.at_level(logging.WARNING, logger=ca.__name__):
            for _ in range(2):
                ca.compact_adam_(master, grad, m, v, 0, n, step=1, decoupled_weight_decay=True, **HYPER)
        warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(warnings) == 1 and "no C compiler (test)" in warnings[0].getMessage()
        for _ in range(2):
            ca.compact_adam_torch_(ref[0], grad, ref[1], ref[2], 0, n, step=1, decoupled_weight_decay=True, **HYPER)
        assert torch.equal(master, ref[0])
        with pytest.raises(RuntimeError, match="no C compiler"):
            ca.compact_adam_(master, grad, m, v, 0, n, step=1, decoupled_weight_decay=True, path="native", **HYPER)
    finally:
        native.forget()


def test_the_environment_turns_the_kernel_off_and_a_bad_cache_directory_is_a_reason(monkeypatch, tmp_path):
    monkeypatch.setenv(native.build.ENABLE_ENV, "0")
    assert native.build.build("compact_adam") == (None, "HYBRIDPS_NATIVE_KERNELS=0")
    monkeypatch.delenv(native.build.ENABLE_ENV)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(native.build.CACHE_ENV, str(tmp_path / "file" / "kernels"))
    lib, reason = native.build.build("compact_adam")
    assert lib is None and reason


def test_a_build_is_cached_under_a_key_of_source_flags_compiler_and_cpu(monkeypatch, tmp_path):
    if native.build.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv(native.build.CACHE_ENV, str(tmp_path))
    lib, where = native.build.build("compact_adam")
    assert lib is not None, where
    (built,) = tmp_path.glob("compact_adam-*.so")
    assert str(built) in where and not list(tmp_path.glob("*.tmp"))
    mtime = built.stat().st_mtime_ns
    assert native.build.build("compact_adam")[0] is not None and built.stat().st_mtime_ns == mtime
    key = native.build.build_key(b"src", ("-O3",), "cc 1", "cpu a")
    assert (
        key
        != native.build.build_key(b"src", ("-O3",), "cc 1", "cpu b")
        != native.build.build_key(b"src", ("-O2",), "cc 1", "cpu a")
    )


@pytest.mark.gpu
def test_the_torch_path_on_cuda_follows_torchaos_8bit_adam():
    shape, steps = (64, 256), 10
    p0 = torch.randn(shape, device="cuda")
    grads = [torch.randn(shape, device="cuda") * 0.01 * k for k in range(1, steps + 1)]
    adam = _torchao("torchao.optim.adam")
    subclass = _torchao("torchao.optim.subclass_8bit")
    p = p0.clone()
    ref_m = subclass.OptimState8bit.zeros(shape, True, 256, "cuda")
    ref_v = subclass.OptimState8bit.zeros(shape, False, 256, "cuda")
    n = p0.numel()
    master = p0.clone().reshape(-1)
    m = MomentRow(torch.zeros(row_bytes(n), dtype=torch.uint8, device="cuda"), n, True)
    v = MomentRow(torch.zeros(row_bytes(n), dtype=torch.uint8, device="cuda"), n, False)
    lr = torch.tensor(HYPER["lr"])
    for step in range(1, steps + 1):
        adam.single_param_adam(
            p, grads[step - 1], torch.tensor(float(step)), ref_m, ref_v, None, lr, HYPER["beta1"], HYPER["beta2"],
            HYPER["weight_decay"], HYPER["eps"], True, False,
        )  # fmt: skip
        ca.compact_adam_(
            master, grads[step - 1].reshape(-1), m, v, 0, n, step=step, decoupled_weight_decay=True, **dict(HYPER, lr=lr)
        )
    _compare(master, m, v, p, ref_m, ref_v, rtol=1e-5)


@pytest.mark.slow
def test_twenty_steps_follow_torchaos_compiled_adamw8bit():
    """Against the optimizer users run: torchao's AdamW8bit, its step compiled by inductor. The
    compiled step rounds a few operations unlike eager torch and so flips a rare code (and the
    params downstream of it) against torchao's own eager step; the compact step may differ from
    the compiled one only where the eager one does too."""
    optim = _torchao("torchao.optim")
    adam = _torchao("torchao.optim.adam")
    subclass = _torchao("torchao.optim.subclass_8bit")
    shape, steps = (64, 256), 20
    param = torch.nn.Parameter(torch.randn(shape))
    eager_p = param.detach().clone()
    eager_m, eager_v = subclass.OptimState8bit.zeros(shape, True, 256), subclass.OptimState8bit.zeros(shape, False, 256)
    master = param.detach().clone().reshape(-1)
    opt = optim.AdamW8bit(
        [param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"], weight_decay=HYPER["weight_decay"]
    )
    n = param.numel()
    m, v = _row(n, True), _row(n, False)
    for step in range(1, steps + 1):
        grad = torch.randn(shape) * 0.01 * step
        param.grad = grad.clone()
        try:
            opt.step()
        except Exception as exc:  # torch.compile needs a working C++ toolchain on the CPU
            pytest.skip(f"torchao's AdamW8bit did not compile here: {type(exc).__name__}: {exc}"[:300])
        adam.single_param_adam(
            eager_p, grad, torch.tensor(float(step)), eager_m, eager_v, None, torch.tensor(HYPER["lr"]), HYPER["beta1"],
            HYPER["beta2"], HYPER["weight_decay"], HYPER["eps"], True, False,
        )  # fmt: skip
        ca.compact_adam_(master, grad.reshape(-1), m, v, 0, n, step=step, decoupled_weight_decay=True, **HYPER)
        state = opt.state[param]
        for ours, eager, compiled in ((m, eager_m, state["exp_avg"]), (v, eager_v, state["exp_avg_sq"])):
            c = compiled.codes.reshape(-1)
            assert int((ours.codes.int() - c.int()).abs().max()) <= 1
            assert not bool(((ours.codes != c) & (eager.codes.reshape(-1) == c)).any())
    compiled_p = param.detach().reshape(-1)

    def off(p):
        return ~torch.isclose(p, compiled_p, rtol=1e-5, atol=1e-6)

    assert not bool((off(master) & ~off(eager_p.reshape(-1))).any())
    assert int(off(master).sum()) <= n // 1000
