"""Run PyTorch's own device-generic test files against pjrt, next to the CPU, and print the pass
rate of each file on each device.

    python tools/pytorch_device_tests.py --pytorch-src ~/src/pytorch \\
        [--files test_view_ops,test_shape_ops,test_type_promotion,test_indexing] [--json out.json]

PyTorch's test sources are not part of its wheel: `--pytorch-src` is a checkout of the PyTorch
repository (its `test/` directory), ideally at the tag of the installed torch. Each file runs
twice under pytest in a fresh process: once with `PYTORCH_TESTING_DEVICE_ONLY_FOR=cpu` (its CPU
test classes), once with `privateuse1` (the classes PyTorch instantiates for the PrivateUse1
backend, which is pjrt once torchpjrt is installed: `import torch` loads it). A failure on pjrt
that also fails on CPU is PyTorch's or this machine's, not pjrt's; the table shows both.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

DEFAULT_FILES = ("test_view_ops", "test_shape_ops", "test_type_promotion", "test_indexing")
DEVICES = {"cpu": "cpu", "pjrt": "privateuse1"}


def run_file(test_dir: pathlib.Path, name: str, device: str, timeout: int, per_test_timeout: int) -> dict:
    """Counts of one test file's outcomes on one device (from pytest's JUnit XML)."""
    path = test_dir / f"{name}.py"
    if not path.exists():
        return {"error": f"{path} not found"}
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "report.xml"
        env = {**os.environ, "PYTORCH_TESTING_DEVICE_ONLY_FOR": DEVICES[device], "TF_CPP_MIN_LOG_LEVEL": "2"}
        env.setdefault("TORCHPJRT_PLATFORM", "cpu")
        cmd = [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider",
               f"--junitxml={report}", f"--timeout={per_test_timeout}", "-o", "addopts="]
        started = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=test_dir, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"did not finish within {timeout}s"}
        seconds = round(time.monotonic() - started, 1)
        if not report.exists():
            return {"error": (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no report"], "seconds": seconds}
        return {**_counts(ET.parse(report).getroot()), "seconds": seconds}


def _counts(root) -> dict:
    counts = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for case in root.iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        counts[outcome] += 1
        if outcome == "failed":
            counts["failures"].append(f"{case.get('classname', '').rsplit('.', 1)[-1]}.{case.get('name')}")
    return counts


def _rate(c: dict) -> str:
    if "error" in c:
        return f"error: {c['error']}"
    ran = c["passed"] + c["failed"]
    return f"{c['passed']}/{ran} ({100.0 * c['passed'] / ran:.1f}%)" if ran else "none ran"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/pytorch_device_tests.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pytorch-src", required=True, type=pathlib.Path, help="a checkout of the PyTorch repository")
    p.add_argument("--files", default=",".join(DEFAULT_FILES), help="comma-separated test file names under test/")
    p.add_argument("--devices", default="cpu,pjrt")
    p.add_argument("--timeout", type=int, default=3600, help="seconds for one file on one device")
    p.add_argument("--per-test-timeout", type=int, default=300)
    p.add_argument("--json", type=pathlib.Path, default=None, help="write the counts and failing test names here")
    a = p.parse_args(argv)
    test_dir = a.pytorch_src / "test"
    if not test_dir.is_dir():
        p.error(f"{test_dir} is not a directory: --pytorch-src must be a PyTorch checkout")
    results = {}
    for name in filter(None, a.files.split(",")):
        for device in a.devices.split(","):
            if device not in DEVICES:
                p.error(f"unknown device {device!r}: expected one of {sorted(DEVICES)}")
            results.setdefault(name, {})[device] = c = run_file(test_dir, name, device, a.timeout, a.per_test_timeout)
            print(f"{name:24s} {device:5s} {_rate(c):24s} skipped {c.get('skipped', '-')}, {c.get('seconds', '-')} s",
                  flush=True)
    print("\n| file | " + " | ".join(a.devices.split(",")) + " |")
    print("| --- |" + " --- |" * len(a.devices.split(",")))
    for name, by_device in results.items():
        print(f"| {name} | " + " | ".join(_rate(by_device[d]) for d in a.devices.split(",")) + " |")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
