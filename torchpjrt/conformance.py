"""OpInfo conformance: run PyTorch's own op_db samples on CPU and on pjrt, compare.

    python -m torchpjrt.conformance --only add,mul --dtype float32 [--grad] [--json out.json]
    python -m torchpjrt.conformance --error-inputs      # exception parity on OpInfo error_inputs

Each op's result also names the aten ops its samples reached only through a torch._decomp
decomposition (no lowering of their own).
"""

import argparse
import functools
import json
import sys
import time
import traceback
import warnings

import torch

import torchpjrt  # noqa: F401  (registers the device)
from torchpjrt import dispatch

# Ops whose samples are random by nature: compared by statistics, not values.
RANDOM_OPS = {
    "bernoulli", "normal", "rand_like", "randn_like", "randint_like", "uniform", "multinomial",
    "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout", "cauchy", "exponential",
    "geometric", "log_normal", "randint", "randn", "rand", "nn.functional.rrelu", "empty",
    "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted",
    "normal_", "uniform_",
}
# Ops whose outputs are not values (uninitialized memory): only shape/dtype compared.
UNINITIALIZED_OPS = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}


def op_db():
    from torch.testing._internal.common_methods_invocations import op_db as db

    return db


def _to(x, device):
    if isinstance(x, torch.Tensor):
        y = x.detach().to(device)
        if x.requires_grad:
            y.requires_grad_(True)
        return y
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    if isinstance(x, torch.device) and x.type == "cpu":
        return torch.device(device)
    if isinstance(x, str) and x == "cpu":
        return device
    return x


def _cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(_cpu(v) for v in x)
    return x


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        out = []
        for v in x:
            out.extend(_tensors(v))
        return out
    return []


def _compare(expected, actual, opinfo, dtype, random_op):
    et, at = _tensors(expected), _tensors(actual)
    if len(et) != len(at):
        if not isinstance(expected, torch.Tensor) and not et:
            if expected != actual:
                raise AssertionError(f"value mismatch: {expected!r} vs {actual!r}")
            return
        raise AssertionError(f"{len(et)} outputs on CPU, {len(at)} on pjrt")
    for e, a in zip(et, at):
        a = a.cpu() if a.device.type != "cpu" else a
        if e.shape != a.shape:
            raise AssertionError(f"shape mismatch: {tuple(e.shape)} vs {tuple(a.shape)}")
        if e.dtype != a.dtype:
            raise AssertionError(f"dtype mismatch: {e.dtype} vs {a.dtype}")
        if random_op:
            continue
        tol = _tolerance(dtype)
        torch.testing.assert_close(a, e, equal_nan=True, check_device=False, check_stride=False, **tol)


def _tolerance(dtype):
    if dtype in (torch.bfloat16,):
        return dict(atol=1e-2, rtol=1.6e-2)
    if dtype in (torch.float16,):
        return dict(atol=1e-3, rtol=1e-3)
    if dtype in (torch.float32, torch.complex64):
        return dict(atol=1e-4, rtol=1.3e-5 * 10)
    return {}


def check_sample(opinfo, sample, dtype, grad=False):
    """Run one OpInfo sample on CPU and pjrt; raise on mismatch."""
    random_op = opinfo.name in RANDOM_OPS
    inp = sample.input
    args, kwargs = sample.args, sample.kwargs
    torch.manual_seed(0)
    expected = opinfo.op(inp, *args, **kwargs)
    pinp, pargs, pkwargs = _to(inp, "pjrt"), _to(args, "pjrt"), _to(kwargs, "pjrt")
    torch.manual_seed(0)
    actual = opinfo.op(pinp, *pargs, **pkwargs)
    _compare(expected, actual, opinfo, dtype, random_op)
    if not grad or random_op:
        return
    e_out = [t for t in _tensors(expected) if t.requires_grad and t.dtype.is_floating_point]
    a_out = [t for t in _tensors(actual) if t.requires_grad and t.dtype.is_floating_point]
    if not e_out:
        return
    e_in = [t for t in _tensors([inp, args, kwargs]) if t.requires_grad]
    a_in = [t for t in _tensors([pinp, pargs, pkwargs]) if t.requires_grad]
    gen = torch.Generator().manual_seed(1)
    cots = [torch.randn(t.shape, dtype=t.dtype, generator=gen) for t in e_out]
    e_grads = torch.autograd.grad(e_out, e_in, cots, allow_unused=True)
    a_grads = torch.autograd.grad(a_out, a_in, [c.to("pjrt") for c in cots], allow_unused=True)
    for eg, ag in zip(e_grads, a_grads):
        if eg is None and ag is None:
            continue
        if eg is None or ag is None:
            raise AssertionError("gradient defined on one device only")
        _compare(eg, ag, opinfo, dtype, False)


def check_op(opinfo, dtype=torch.float32, grad=False, max_samples=None):
    """('pass' | 'mismatch' | 'error' | 'skip', detail) for one OpInfo at one dtype."""
    supported = opinfo.supported_dtypes("cpu")
    if dtype not in supported:
        return "skip", f"{dtype} not supported by the op on CPU"
    if grad and not opinfo.supports_autograd:
        return "skip", "no autograd"
    if grad and dtype not in opinfo.supported_backward_dtypes("cpu"):
        return "skip", f"no backward for {dtype}"
    try:
        samples = list(opinfo.sample_inputs("cpu", dtype, requires_grad=grad))
    except Exception as e:  # noqa: BLE001
        return "skip", f"sample generation failed: {e}"
    if max_samples:
        samples = samples[:max_samples]
    n = 0
    for sample in samples:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                check_sample(opinfo, sample, dtype, grad)
            n += 1
        except AssertionError as e:
            return "mismatch", f"{_describe(sample)}: {str(e)[:300]}"
        except NotImplementedError as e:
            return "error", f"NotImplementedError: {str(e)[:300]}"
        except Exception as e:  # noqa: BLE001
            # CPU raising too means the sample is an error case; only pjrt-only errors count
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    opinfo.op(sample.input, *sample.args, **sample.kwargs)
            except Exception:  # noqa: BLE001
                continue
            return "error", f"{type(e).__name__}: {str(e)[:300]}\n{_short_tb()}"
    if n == 0:
        return "skip", "no samples"
    return "pass", f"{n} samples"


def check_error_inputs(opinfo):
    """Exception parity on the op's OpInfo `error_inputs`: ('pass' | 'mismatch' | 'skip',
    detail, same, total). An input counts when the CPU raises the error type OpInfo expects;
    it matches when pjrt raises that type too (never a crash, another type, or no error)."""
    if opinfo.error_inputs_func is None:
        return "skip", "no error_inputs", 0, 0
    try:
        error_inputs = list(opinfo.error_inputs("cpu"))
    except Exception as e:  # noqa: BLE001
        return "skip", f"error_inputs generation failed: {e}", 0, 0
    same, total, first_miss = 0, 0, None
    for ei in error_inputs:
        sample, expected_type = ei.sample_input, ei.error_type
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                opinfo.op(sample.input, *sample.args, **sample.kwargs)
                continue  # this build's CPU accepts it: not an error case here
            except expected_type:
                pass
            except Exception:  # noqa: BLE001 - the CPU raised something else: not comparable
                continue
            total += 1
            try:
                opinfo.op(_to(sample.input, "pjrt"), *_to(sample.args, "pjrt"), **_to(sample.kwargs, "pjrt"))
                torch.pjrt.synchronize()  # errors found on the device are raised here
                outcome = "no error"
            except expected_type:
                same += 1
                continue
            except Exception as e:  # noqa: BLE001
                outcome = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if first_miss is None:
            first_miss = f"{_describe(sample)}: expected {expected_type.__name__}, got {outcome}"
    if total == 0:
        return "skip", "no error input raises on this CPU build", 0, 0
    if same == total:
        return "pass", f"{total} error inputs", same, total
    return "mismatch", f"{same}/{total} same type; {first_miss}", same, total


def family(key: str) -> str:
    """The namespace an OpInfo lives in (nn.functional, linalg, special, fft, ...)."""
    name = _names_by_key().get(key, key)
    head, dot, _ = name.partition(".")
    if not dot:
        return "torch"
    return "nn.functional" if name.startswith("nn.functional.") else head


@functools.lru_cache(maxsize=1)
def _names_by_key():
    return {op_key(o): o.name for o in op_db()}


def print_family_table(res: dict) -> None:
    rows = {}
    for key, r in res.items():
        counts = rows.setdefault(family(key), {})
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(f"  {'family':16s}{'pass':>6s}{'mismatch':>10s}{'error':>7s}{'skip':>6s}{'pass %':>8s}")
    for fam, c in sorted(rows.items(), key=lambda kv: -sum(kv[1].values())):
        ran = c.get("pass", 0) + c.get("mismatch", 0) + c.get("error", 0)
        pct = f"{100.0 * c.get('pass', 0) / ran:.1f}" if ran else "-"
        print(f"  {fam:16s}{c.get('pass', 0):6d}{c.get('mismatch', 0):10d}{c.get('error', 0):7d}{c.get('skip', 0):6d}{pct:>8s}")


def _short_tb():
    tb = traceback.format_exc().strip().splitlines()
    return "\n".join(tb[-6:])


def _describe(sample):
    def d(x):
        if isinstance(x, torch.Tensor):
            return f"T{list(x.shape)}"
        if isinstance(x, (list, tuple)):
            return "[" + ",".join(d(v) for v in x) + "]"
        return repr(x)[:40]

    return f"input={d(sample.input)} args={d(list(sample.args))} kwargs={ {k: d(v) for k, v in sample.kwargs.items()} }"


def op_key(opinfo):
    return opinfo.name + ("." + opinfo.variant_test_name if opinfo.variant_test_name else "")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64, "float64": torch.float64,
          "complex64": torch.complex64}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m torchpjrt.conformance", description=__doc__)
    p.add_argument("--dtype", default="float32", choices=[*DTYPES, "all"])
    p.add_argument("--grad", action="store_true", help="also compare gradients")
    p.add_argument("--only", default="", help="comma-separated OpInfo names")
    p.add_argument("--json", default=None, help="write per-op results here")
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("--write-baseline", default=None, metavar="PATH",
                   help="write the names of passing ops (the regression baseline CI checks)")
    p.add_argument("--error-inputs", action="store_true",
                   help="check that OpInfo error_inputs raise the same exception type as on CPU")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    only = set(filter(None, a.only.split(",")))
    dtype_names = list(DTYPES) if a.dtype == "all" else [a.dtype]
    results = {}
    t0 = time.time()
    if a.error_inputs:
        return _error_inputs_sweep(only, a.json, a.verbose, t0, a.write_baseline)
    for dname in dtype_names:
        dt = DTYPES[dname]
        for n, opinfo in enumerate(op_db()):
            if not a.verbose and n % 50 == 0:
                print(f"  {dname}: {n}/{len(op_db())} ops, {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
            key = op_key(opinfo)
            if only and opinfo.name not in only and key not in only:
                continue
            before = dict(dispatch.decomposed_counts)
            status, detail = check_op(opinfo, dt, a.grad, a.max_samples)
            decomposed = sorted(k for k, v in dispatch.decomposed_counts.items() if v > before.get(k, 0))
            results.setdefault(dname, {})[key] = {"status": status, "detail": detail, "decomposed": decomposed}
            if a.verbose or status in ("mismatch", "error") and only:
                print(f"{dname:9s} {key:45s} {status:9s} {detail.splitlines()[0] if detail else ''}")
    for dname, res in results.items():
        counts = {}
        for r in res.values():
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        ran = counts.get("pass", 0) + counts.get("mismatch", 0) + counts.get("error", 0)
        pct = 100.0 * counts.get("pass", 0) / ran if ran else 0.0
        print(f"{dname}{' grad' if a.grad else ''}: {counts} -> {pct:.1f}% of {ran} ops pass")
        print_family_table(res)
        via = sorted(k for k, r in res.items() if r["status"] == "pass" and r["decomposed"])
        aten_ops = sorted({op for k in via for op in res[k]["decomposed"]})
        print(f"  {len(via)} passing ops reach {len(aten_ops)} aten ops only through torch._decomp decompositions:")
        print("    " + ", ".join(aten_ops))
    print(f"wall time {time.time() - t0:.0f}s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    if a.write_baseline:
        kind = "backward" if a.grad else "forward"
        _update_baseline(a.write_baseline, {f"{kind}_{dname}": sorted(k for k, r in res.items() if r["status"] == "pass")
                                            for dname, res in results.items()})
    return 0


def _error_inputs_sweep(only, json_path, verbose, t0, baseline_path=None):
    results, same, total = {}, 0, 0
    for opinfo in op_db():
        key = op_key(opinfo)
        if only and opinfo.name not in only and key not in only:
            continue
        status, detail, s, n = check_error_inputs(opinfo)
        results[key] = {"status": status, "detail": detail, "same": s, "total": n}
        same, total = same + s, total + n
        if verbose or status == "mismatch":
            print(f"{key:45s} {status:9s} {detail}")
    ops = [r for r in results.values() if r["status"] != "skip"]
    n_pass = sum(r["status"] == "pass" for r in ops)
    print(f"error_inputs: {same}/{total} error inputs raise the CPU's exception type on pjrt "
          f"({100.0 * same / max(total, 1):.1f}%); {n_pass}/{len(ops)} ops with all of them "
          f"({100.0 * n_pass / max(len(ops), 1):.1f}%)")
    print_family_table(results)
    print(f"wall time {time.time() - t0:.0f}s")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"error_inputs": results}, f, indent=1, sort_keys=True)
    if baseline_path:
        _update_baseline(baseline_path, {"error_inputs": sorted(k for k, r in results.items() if r["status"] == "pass")})
    return 0


def _update_baseline(path, entries):
    try:
        with open(path) as f:
            baseline = json.load(f)
    except FileNotFoundError:
        baseline = {}
    baseline.update(entries)
    with open(path, "w") as f:
        json.dump(baseline, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    sys.exit(main())
