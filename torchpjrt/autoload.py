"""PyTorch's device-backend autoload entry point (`torch.backends` group).

`import torch` calls `load()`. Importing this module imports the torchpjrt package first, which
registers the device; when torchpjrt itself is being imported (it imports torch), the package
is already in sys.modules and its own import finishes the registration.
"""


def load() -> None:
    """Nothing left to do: importing the package registered the pjrt device."""
