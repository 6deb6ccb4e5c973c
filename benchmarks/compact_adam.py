"""The compact (8-bit) Adam step against torch's fused AdamW, per parameter, on this CPU.

Steps the same number of fp32 params three ways, each as one flat row: ``torch._fused_adamw_``
(fp32 master, grad, momentum and variance), ``compact_adam_`` through the native kernel, and
``compact_adam_`` in torch ops; reports the median nanoseconds per param of each, the ratio
fused / native (>= 1.0: the 8-bit step is at least as fast per param) and the bytes each moves
per param. Each method runs its repeats back to back (torch's OpenMP threads spin a while after
a fused call and would slow a kernel timed straight after). ``--breakdown`` times the native
kernel's parts on one thread: built again with parts of the work left out (a C compiler and the
kernel's source needed), the differences say where the time goes.

    python -m benchmarks compact_adam                       # JSON on stdout
    python -m benchmarks compact_adam --elements 4M,16M --repeats 7 --breakdown
"""

from __future__ import annotations

import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import harness
from hybridps.client.optim import native
from hybridps.client.optim.compact_adam import compact_adam_, native_kernel_available
from hybridps.client.optim.moment_codes import MomentRow, row_bytes

NAME = "compact_adam"
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
#: bytes read and written per param: fused reads master, grad, m, v and writes master, m, v
FUSED_BYTES = 4 * 7
#: compact: reads master, grad, 2 codes, writes master, 2 codes; scales 2 x 4 B per 256 read and written
COMPACT_BYTES = 4 + 4 + 2 + 4 + 2 + 4 * 4 / 256


def median_s(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_size(n: int, repeats: int, with_torch_path: bool) -> dict:
    torch.manual_seed(0)
    grad = torch.randn(n) * 1e-3
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    step_t = torch.tensor(1.0)

    def fused():
        torch._fused_adamw_(
            [p], [grad], [m], [v], [], [step_t], amsgrad=False, maximize=False,
            lr=HYPER["lr"], beta1=HYPER["beta1"], beta2=HYPER["beta2"], weight_decay=HYPER["weight_decay"], eps=HYPER["eps"],
        )  # fmt: skip

    master = torch.randn(n)
    mom = MomentRow(torch.zeros(row_bytes(n), dtype=torch.uint8), n, True)
    var = MomentRow(torch.zeros(row_bytes(n), dtype=torch.uint8), n, False)
    steps = iter(range(1, 1 << 30))

    def compact(path):
        return lambda: compact_adam_(
            master, grad, mom, var, 0, n, step=next(steps), decoupled_weight_decay=True, path=path, **HYPER
        )

    out = {"elements": n}
    fused_s = median_s(fused, repeats)
    out["fused_adamw_ns_per_param"] = round(fused_s / n * 1e9, 3)
    if native_kernel_available():
        native_s = median_s(compact("native"), repeats)
        out["compact_native_ns_per_param"] = round(native_s / n * 1e9, 3)
        out["ratio_fused_over_native"] = round(fused_s / native_s, 3)
    if with_torch_path:
        torch_s = median_s(compact("torch"), max(3, repeats // 2), warmup=1)
        out["compact_torch_ns_per_param"] = round(torch_s / n * 1e9, 3)
        out["ratio_fused_over_torch_path"] = round(fused_s / torch_s, 3)
    return out


# the kernel built again with a part of its work left out: {part: [(text, replacement)]}
_QUANT = """    quantize_block_simd_(m_new, m_s, &t->m_q, t->order, t->m_book, m_codes);
    quantize_block_simd_(v_new, v_s, &t->v_q, t->order, t->v_book, v_codes);"""
_DEQUANT = """        lookup256_(&t->m_map, _mm512_loadu_si512((const void *)(m_codes + i)), t->order, m_old);
        lookup256_(&t->v_map, _mm512_loadu_si512((const void *)(v_codes + i)), t->order, v_old);"""
_DEQUANT_NONE = """        for (int k = 0; k < 4; ++k) {
            m_old[k] = _mm512_castps_si512(_mm512_set1_ps(0.5f));
            v_old[k] = _mm512_castps_si512(_mm512_set1_ps(0.25f));
        }"""
_VARIANTS = {
    "quantize (both moments)": [(_QUANT, "    m_codes[0] = (uint8_t)m_new[3];\n    v_codes[0] = (uint8_t)v_new[5];")],
    "quantize: divisions by the scale": [
        ("_mm512_div_ps(_mm512_loadu_ps(values + 16 * k), scale)", "_mm512_mul_ps(_mm512_loadu_ps(values + 16 * k), scale)")
    ],
    "quantize: threshold lookup": [
        (
            "    lookup256_(&q->thresholds, code, order, threshold);",
            "    for (int k = 0; k < 4; ++k) threshold[k] = _mm512_castps_si512(x[k]);",
        )
    ],
    "dequantize (both moments)": [(_DEQUANT, _DEQUANT_NONE)],
    "step: divisions and sqrt": [
        ("_mm512_div_ps(_mm512_sqrt_ps(v), a->bc2_sqrt)", "_mm512_mul_ps(v, a->bc2_sqrt)"),
        (
            "_mm512_div_ps(_mm512_mul_ps(a->lr, _mm512_div_ps(m, a->bc1)), denom)",
            "_mm512_mul_ps(_mm512_mul_ps(a->lr, _mm512_mul_ps(m, a->bc1)), denom)",
        ),
    ],
}


def _variant_kernel(source: str, subs, directory: Path, name: str):
    for old, new in subs:
        if old not in source:
            return None
        source = source.replace(old, new)
    src = directory / f"{name}.c"
    src.write_text(source)
    lib = directory / f"{name}.so"
    cc = native.build.compiler()
    proc = subprocess.run([cc, *native.build.BASE_FLAGS, "-march=native", "-o", str(lib), str(src), "-lm"], capture_output=True)
    return native.CompactAdamKernel(ctypes.CDLL(str(lib)), str(lib)) if proc.returncode == 0 else None


def breakdown(n: int, repeats: int) -> dict:
    """ns per param of the native kernel on one thread, whole and with each part left out."""
    kernel, _ = native.load_compact_adam()
    if kernel is None or not kernel.simd or native.build.compiler() is None:
        return {"skipped": "needs the SIMD kernel and a C compiler"}
    source = (Path(native.__file__).parent / "compact_adam.c").read_text()
    grad, master = torch.randn(n) * 1e-3, torch.randn(n)
    out = {"threads": 1, "elements": n}
    hyper = native.HyperArray(1e-3, 1e-5, 0.01, 0.1, 0.001, 1e-8, 0.1, 0.0316, 1e-12)
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {"whole step": kernel}
        for k, (part, subs) in enumerate(_VARIANTS.items()):
            kernels[part] = _variant_kernel(source, subs, Path(tmp), f"variant{k}")
        missing = [part for part, kern in kernels.items() if kern is None]
        runs = {}
        for part, kern in kernels.items():
            if kern is not None:
                m, v = (MomentRow(torch.zeros(row_bytes(n), dtype=torch.uint8), n, s) for s in (True, False))
                runs[part] = lambda k=kern, m=m, v=v: k.step(master, grad, m, v, 0, n, hyper, 1)
        timer = harness.Alternation(*runs, warmup=2)  # interleaved: drift in the machine's speed hits all alike
        for _ in timer.rounds(repeats):
            for part, run in runs.items():
                with timer.time(part):
                    run()
        timings = {part: timer.median(part) / n * 1e9 for part in runs}
    if missing:
        out["variants_not_built"] = missing
    whole = timings.pop("whole step")
    out["whole_ns_per_param"] = round(whole, 3)
    out["ns_per_param_saved_without"] = {part: round(whole - t, 3) for part, t in timings.items()}
    parts = [p for p in out["ns_per_param_saved_without"] if not p.startswith("quantize:")]
    out["rest_ns_per_param"] = round(whole - sum(out["ns_per_param_saved_without"][p] for p in parts), 3)
    out["note"] = (
        "each part's figure is the whole step's time less the time of a build without it (quantize: ... are within "
        "quantize); the rest is loading and storing master, grad and codes and the step's other arithmetic"
    )
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--elements", default="4M,16M", help="params per step, comma-separated (K/M/G suffixes)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--no-torch-path", action="store_true", help="skip the (slow) torch-ops path")
    ap.add_argument("--breakdown", action="store_true", help="time the native kernel's parts (one thread)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel, where = native.load_compact_adam()
    out = harness.header(NAME, argv)
    out.update(
        native_kernel={"loaded": kernel is not None, "where": where, "simd": bool(kernel and kernel.simd)},
        bytes_per_param={"fused_adamw": FUSED_BYTES, "compact": round(COMPACT_BYTES, 3)},
        results=[bench_size(harness.parse_count(e), args.repeats, not args.no_torch_path) for e in args.elements.split(",")],
    )
    if args.breakdown:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        out["native_breakdown"] = breakdown(harness.parse_count(args.elements.split(",")[0]), args.repeats)
        torch.set_num_threads(threads)
    return harness.emit(out)
