"""torchpjrt.distributed.spmd: data parallel, FSDP and tensor parallel training on a mesh.

The checks need 8 devices, which on a CPU means XLA_FLAGS set before JAX starts; this pytest
process has started JAX already, so one subprocess (tests/spmd_worker.py) runs them all and
prints a result per check, and each test here reports one of them.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("spmd_worker.py")
WORKER_TIMEOUT_S = 240


def _env(devices):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()
    env["JAX_PLATFORMS"] = "cpu"  # virtual devices exist on the CPU platform only
    env.pop("TORCHPJRT_PLATFORM", None)
    return env


def _parse(stdout, stderr, returncode):
    found = {}
    for line in stdout.splitlines():
        if line.startswith("SPMD_RESULT "):
            entry = json.loads(line[len("SPMD_RESULT "):])
            found[entry["check"]] = entry["error"]
    found["_log"] = f"exit status {returncode}\n--- stdout\n{stdout[-4000:]}\n--- stderr\n{stderr[-4000:]}"
    return found


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    # twice on one fresh cache: the second process loads the eager kernels and compiled graphs
    # the first one stored, onto one of its 8 devices
    env = {**_env(8), "TORCHPJRT_CACHE_DIR": str(tmp_path_factory.mktemp("cache")), "TORCHPJRT_KERNEL_CACHE": "on"}
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True, env=env,
                              timeout=WORKER_TIMEOUT_S, cwd=Path(__file__).parent.parent)
        runs.append(_parse(proc.stdout, proc.stderr, proc.returncode))
    cold, warm = runs
    return {name: cold.get(name) or warm.get(name, f"not reported by the second process\n{warm['_log']}")
            for name in cold} | {"_log": cold["_log"] + "\n--- second process\n" + warm["_log"]}


def _check(results, name):
    if "devices" not in results or results["devices"] is not None:
        pytest.fail(f"the SPMD worker did not get 8 devices:\n{results.get('devices') or results['_log']}")
    if name not in results:
        pytest.fail(f"the SPMD worker did not report {name!r}:\n{results['_log']}")
    if results[name] is not None:
        pytest.fail(f"{name} failed in the SPMD worker:\n{results[name]}")


pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * WORKER_TIMEOUT_S + 30)]


def test_unsharded_reference_matches_cpu(results):
    _check(results, "unsharded_reference")


def test_data_parallel_training_matches_unsharded(results):
    _check(results, "data_parallel")


def test_fsdp_training_matches_unsharded(results):
    _check(results, "fsdp")


def test_tensor_parallel_mlp_block_matches_unsharded(results):
    _check(results, "tensor_parallel")


def test_eager_ops_on_sharded_tensors(results):
    _check(results, "eager_ops")


def test_plan_errors_are_clear(results):
    _check(results, "errors")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(os.environ.get("TORCHPJRT_SPMD_MULTIPROCESS") != "1",
                    reason="two JAX processes (about 50 s on 2 cores): set TORCHPJRT_SPMD_MULTIPROCESS=1")
def test_multiprocess_fsdp_matches_cpu():
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--process", str(rank), port], env=_env(4),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=Path(__file__).parent.parent) for rank in range(2)]
    try:
        outputs = [p.communicate(timeout=WORKER_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        found = _parse(out, err, p.returncode)
        if found.get("multiprocess_fsdp", "missing") is not None:
            pytest.fail(f"process {rank}: {found.get('multiprocess_fsdp') or found['_log']}")
