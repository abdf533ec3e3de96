"""One process per chip under torchrun: which of the host's accelerators a rank gets.

`torchrun --nproc_per_node=N` starts N processes on a host with N chips; each must own exactly
its chip (LOCAL_RANK), and this must be settled before JAX creates the accelerator client.

- GPU: JAX's multi-process runtime takes the process's local devices as `local_device_ids`
  (`gpu_local_device_ids` below); nothing is set in the environment.
- TPU: libtpu reads per-process chip bounds from the environment when its client starts:
  TPU_VISIBLE_CHIPS (this process's chip), TPU_CHIPS_PER_PROCESS_BOUNDS (1,1,1: one chip),
  TPU_PROCESS_BOUNDS (how the host's processes tile its chips: 2,2,1 for a 4-chip host, 2,4,1
  for an 8-chip one), TPU_PROCESS_ADDRESSES and TPU_PROCESS_PORT (where the processes of the
  host reach each other) and CLOUD_TPU_TASK_ID (this process's index). Without them every
  process would try to open every chip, and all but the first would fail.

A user who has set any of these TPU variables is trusted: nothing is changed (the escape
hatch), and TORCHPJRT_PER_PROCESS_CHIPS=0 turns the whole mechanism off.
"""

import importlib.util
import os

TPU_VARIABLES = ("TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS",
                 "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_PORT", "CLOUD_TPU_TASK_ID")
TPU_BASE_PORT = 8476  # libtpu's default process port; a host's processes take consecutive ones
# chips on one host, one process each -> how those processes tile the host's chips (x, y, z)
TPU_PROCESS_BOUNDS = {4: "2,2,1", 8: "2,4,1"}


def enabled(environ=os.environ) -> bool:
    return environ.get("TORCHPJRT_PER_PROCESS_CHIPS", "1") not in ("0", "false", "False", "")


def accelerator(environ=os.environ) -> str:
    """The accelerator kind this process will use ('gpu', 'tpu' or '' for CPU or unknown),
    without starting any JAX backend: the requested platform, else the installed plugin."""
    platform = environ.get("TORCHPJRT_PLATFORM", environ.get("JAX_PLATFORMS", "")).split(",")[0].strip().lower()
    if platform in ("gpu", "cuda", "rocm"):
        return "gpu"
    if platform == "tpu":
        return "tpu"
    if platform:
        return ""
    if importlib.util.find_spec("libtpu") is not None:
        return "tpu"
    if any(importlib.util.find_spec(m) is not None for m in ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_rocm60_plugin")):
        return "gpu"
    return ""


def _local(environ):
    """(local rank, local world size, host index) from torchrun's variables, or None."""
    if "LOCAL_RANK" not in environ:
        return None
    local_rank = int(environ["LOCAL_RANK"])
    local_world = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    world = int(environ.get("WORLD_SIZE", str(local_world)))
    host = int(environ.get("GROUP_RANK", "0"))
    return local_rank, local_world, world, host


def tpu_environment(environ=os.environ) -> dict:
    """The TPU variables a torchrun rank needs to own one chip ({} when none are needed)."""
    local = _local(environ)
    if local is None or not enabled(environ):
        return {}
    local_rank, local_world, world, host = local
    if local_world <= 1 and world <= 1:
        return {}  # one process: it owns the whole host, libtpu's default
    if any(v in environ for v in TPU_VARIABLES):
        return {}  # the user's own bounds
    if world != local_world or host:
        raise RuntimeError(
            f"torchpjrt.distributed: one process per TPU chip across several hosts (WORLD_SIZE={world}, "
            f"LOCAL_WORLD_SIZE={local_world}) needs the slice's topology: set {', '.join(TPU_VARIABLES)} "
            "for each process yourself, or run one process per host (torchrun --nproc_per_node=1)")
    bounds = TPU_PROCESS_BOUNDS.get(local_world)
    if bounds is None:
        raise RuntimeError(
            f"torchpjrt.distributed: {local_world} processes on one TPU host: one process per chip is "
            f"known for hosts of {' or '.join(map(str, TPU_PROCESS_BOUNDS))} chips; for another split set "
            f"{', '.join(TPU_VARIABLES)} yourself, or run one process per host")
    ports = [TPU_BASE_PORT + i for i in range(local_world)]
    return {
        "TPU_VISIBLE_CHIPS": str(local_rank),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": bounds,
        "TPU_PROCESS_ADDRESSES": ",".join(f"localhost:{p}" for p in ports),
        "TPU_PROCESS_PORT": str(ports[local_rank]),
        "CLOUD_TPU_TASK_ID": str(local_rank),
    }


def gpu_local_device_ids(environ=os.environ):
    """[LOCAL_RANK] for a torchrun rank on a GPU host, else None (JAX's default: every GPU)."""
    local = _local(environ)
    if local is None or not enabled(environ) or accelerator(environ) != "gpu":
        return None
    local_rank, local_world, world, _ = local
    if local_world <= 1 and world <= 1:
        return None
    return [local_rank]


def prepare(environ=os.environ) -> dict:
    """Sets this process's chip variables before the accelerator client starts; returns them."""
    if accelerator(environ) != "tpu":
        return {}
    env = tpu_environment(environ)
    environ.update(env)
    return env
