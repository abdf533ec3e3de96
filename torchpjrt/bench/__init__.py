"""`torchpjrt bench`: one PyTorch workload on every available target, side by side.

Speed, start-up, memory, energy and cost per target, and whether the losses agree. See
docs/bench.md. Layout: workloads (what runs), targets (where), worker (one process per
target), runner (the parent: probe, interleaved rounds), measure, prices, results, display
(terminal), report (JSON, CSV, HTML).

This package is also loaded by _launch.py without the torchpjrt package: it must not
import torchpjrt at module level.
"""
