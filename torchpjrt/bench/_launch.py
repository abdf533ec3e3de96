"""Start a bench worker (or the probe) as a script, without importing the torchpjrt package.

`import torchpjrt` imports JAX and registers the pjrt device; the cpu and cuda targets must
not pay for that in their start-up time. So the bench modules are loaded here as a private
package from this folder; a pjrt worker imports torchpjrt itself, as a user's program would.
"""

import importlib.util
import os
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
PRIVATE_NAME = "_torchpjrt_bench"

# Python put this folder first on sys.path; the user's modules (--model) resolve from the cwd instead.
sys.path[0] = os.getcwd()
spec = importlib.util.spec_from_file_location(
    PRIVATE_NAME, BENCH_DIR / "__init__.py", submodule_search_locations=[str(BENCH_DIR)]
)
package = importlib.util.module_from_spec(spec)
sys.modules[PRIVATE_NAME] = package
spec.loader.exec_module(package)
importlib.import_module(f"{PRIVATE_NAME}.worker").main()
