"""Several pjrt devices in one process: tensors on pjrt:N, copies between devices, CUDA's device
errors, per-device random generators, and a model split across two devices by hand that trains
like the CPU, in every eager mode and compiled. The CPU platform is split into 4 devices in a
fresh process (tests/multi_device_worker.py); this process keeps its single device."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).with_name("multi_device_worker.py")
MISMATCH = "Expected all tensors to be on the same device, but found at least two devices, pjrt:0 and pjrt:1!"


def _run(tmp_path, mode, *flags, env=None):
    out = tmp_path / f"{mode}.json"
    proc = subprocess.run([sys.executable, str(WORKER), mode, str(out), *flags], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, **(env or {})))
    assert proc.returncode == 0, f"worker exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
    results = json.loads(out.read_text())
    failed = {k: v["error"] for k, v in results.items() if isinstance(v, dict) and "error" in v}
    assert not failed, "\n".join(f"{k}:\n{v}" for k, v in failed.items())
    return results


def _check_placement(r):
    assert r["counts"] == [4, 4]
    for name, (device, array_device) in r["factories"].items():
        assert device == f"pjrt:{name.split('@')[1]}" and array_device == int(name.split("@")[1]), name
    ops = r["ops_views_inplace"]
    for name in ("op", "view", "transpose", "inplace", "out", "reduction", "matmul"):
        assert ops[name] == ["pjrt:2", 2], (name, ops[name])
    assert ops["values"] == [[[10.0, 20.0, 30.0, 40.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]],
                             [[9.0, 13.0], [17.0, 21.0]],
                             [[20.0, 40.0, 60.0, 80.0], [10.0, 12.0, 14.0, 16.0], [18.0, 20.0, 22.0, 24.0]]]
    errors = r["device_mismatch"]
    for name in ("add", "matmul", "cat", "inplace", "index"):
        assert errors[name] == MISMATCH, (name, errors[name])
    assert errors["out"] is not None and "Expected all tensors to be on the same device" in errors["out"]
    assert errors["cpu_scalar"] == [3.0, 3.0, 3.0]
    copies = r["copies"]
    assert copies["to"] == ["pjrt:3", 3] and copies["to_non_blocking"] == ["pjrt:2", 2]
    assert copies["to_dtype"] == ["pjrt:0", 0] and copies["copy_"] == ["pjrt:3", 3]
    assert copies["from_cpu"] == ["pjrt:2", 2]
    assert copies["values"] == [[0.0, 2.0, 4.0, 6.0, 8.0, 10.0], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [0, 1, 2, 3, 4, 5]]
    assert copies["into_view"] == [["pjrt:2", 2], [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]]
    current = r["current_device"]
    assert current["start"] == 0
    assert current["after_set"] == [2, "pjrt:2", "pjrt:2", "pjrt:2"]
    assert current["in_context"] == [3, "pjrt:3"] and current["after_context"] == 2
    assert current["device_of"] == 1 and current["accelerator"] == 0
    assert current["missing"] == "pjrt:9 does not exist: 4 pjrt device(s) on platform 'cpu'"
    assert r["random_generators"] == {"same_seed_each_device": True, "devices_independent": True,
                                      "state_replays": True, "all_states": 4}
    assert r["memory_and_properties"] == [0, 1, 2, 3, True, True, True, True]
    assert r["module_moves"] == {"parameter_kept": True, "state_dict": {"weight": "pjrt:2", "bias": "pjrt:2"}}
    assert r["compiled_on_device"] == {"placed": ["pjrt:3", 3], "diff": 0.0}
    assert r["fused_factory_graph"] == [["pjrt:2", 2], [3.0, 4.0, 5.0]]
    modes = r["data_dependent_and_modes"]
    for name in ("nonzero", "mask", "unique", "inference"):
        assert modes[name] == ["pjrt:1", 1], (name, modes[name])
    assert modes["autocast"] == ["pjrt:1", 1, "torch.bfloat16"]
    assert modes["checkpoint_same_grads"] is True
    assert modes["adam_fused=False"] == modes["adam_fused=True"] == ["pjrt:1", 1, 0.9]
    assert r["save_and_load"] == {"torch_load": ["pjrt:2", 2], "safetensors": ["pjrt:3", 3],
                                  "values": [0.0, 1.0, 2.0, 3.0] * 2}


def _check_pipeline(r):
    pipe = r["pipeline_training"]
    assert pipe["loss_diff"] < 1e-5 and pipe["param_diff"] < 1e-5, pipe
    for name, (device, grad_device) in pipe["devices"].items():
        expected = "pjrt:0" if name.startswith("a.") else "pjrt:1"
        assert device == grad_device == expected, (name, device, grad_device)


@pytest.mark.slow
def test_strict_mode(tmp_path):
    r = _run(tmp_path, "strict")
    _check_placement(r)
    _check_pipeline(r)
    # the CPU oracle's backward ran before the pjrt runtime started: the autograd engine had
    # made its worker thread for pjrt:0 only, and pjrt:1's backward ran in the calling thread
    assert r["autograd_threads"] == ["pt_autograd_0"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fused", "debug", "compiled"])
def test_other_modes(tmp_path, mode):
    r = _run(tmp_path, mode)
    _check_placement(r)
    _check_pipeline(r)
    if mode == "compiled":
        # one compiled graph per stage, each on its own device, none run eagerly
        assert r["compile_stats"]["eager_graphs"] == 0 and r["compile_stats"]["graphs"] >= 4, r["compile_stats"]


@pytest.mark.slow
def test_runtime_first_gives_each_device_an_autograd_thread(tmp_path):
    r = _run(tmp_path, "strict", "--runtime-first")
    _check_pipeline(r)
    assert r["autograd_threads"] == ["pt_autograd_0", "pt_autograd_1", "pt_autograd_2", "pt_autograd_3"]


@pytest.mark.slow
def test_second_process_loads_each_devices_kernels(tmp_path):
    """The kernel cache keeps one executable per device: a second process loads them, and none is
    called on a device it was not built for (which would fall back to jit)."""
    env = {"TORCHPJRT_CACHE_DIR": str(tmp_path / "cache"), "TORCHPJRT_KERNEL_CACHE": "on"}
    cold = _run(tmp_path, "strict", env=env)
    warm = _run(tmp_path, "strict", env=env)
    assert warm["kernel_cache_stats"].get("kernel_cache_hits", 0) > 100, warm["kernel_cache_stats"]
    assert not warm["kernel_cache_stats"].get("kernel_cache_fallbacks"), warm["kernel_cache_stats"]
    for r in (cold, warm):
        _check_placement(r)
        _check_pipeline(r)
    assert warm["pipeline_training"] == cold["pipeline_training"]


def test_one_device_process_refuses_other_indices():
    import torch

    with pytest.raises(RuntimeError, match="pjrt:1 does not exist: 1 pjrt device"):
        torch.ones(2, device="pjrt:1")
    with pytest.raises(RuntimeError, match="pjrt:1 does not exist"):
        torch.pjrt.set_device(1)
    with pytest.raises(RuntimeError, match="pjrt:2 does not exist"):
        torch.ones(2).to("pjrt:2")


@pytest.mark.slow
def test_without_the_compiled_helper_other_indices_say_why(tmp_path):
    code = ("import os, torch\n"
            "x = torch.ones(2, device='pjrt:0')\n"
            "try:\n    torch.ones(2, device='pjrt:1')\nexcept RuntimeError as e:\n    print('ERR', e)\n"
            "print((x + 1).cpu().tolist())\n")
    env = dict(os.environ, TORCHPJRT_NATIVE="off",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ERR torchpjrt: pjrt:1 needs torchpjrt's compiled device helper" in proc.stdout
    assert "TORCHPJRT_NATIVE=off" in proc.stdout
    assert "[2.0, 2.0]" in proc.stdout
