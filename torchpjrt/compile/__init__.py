"""The static-graph path: torch.compile(backend="pjrt").

The backend module imports Dynamo and AOTAutograd (about a second), so it loads on first use:
Dynamo finds the backend through the `torch_dynamo_backends` entry point, and an eager-only
program never pays for it.
"""

__all__ = ["compile_stats", "pjrt_backend", "register"]


def __getattr__(name):
    if name in __all__:
        from . import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
