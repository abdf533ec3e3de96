"""torch.distributed on pjrt: the c10d backend "pjrt" (process_group.py) running collectives
as XLA programs over JAX's multi-process runtime (runtime.py, collectives.py).

    dist.init_process_group("pjrt")   # under torchrun; then DDP, DTensor, FSDP2 as usual
"""

from . import storage_resize
from .process_group import BACKEND_NAME, ProcessGroupPJRT, register

register()
storage_resize.install()  # FSDP2 frees and re-allocates parameter storages

__all__ = ["BACKEND_NAME", "ProcessGroupPJRT", "register"]
