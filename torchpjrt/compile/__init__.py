"""The static-graph path: torch.compile(backend="pjrt")."""

from .backend import compile_stats, pjrt_backend, register

__all__ = ["compile_stats", "pjrt_backend", "register"]
