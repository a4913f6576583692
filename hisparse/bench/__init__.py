"""Benchmarks of hisparse.

- :mod:`hisparse.bench.decode`: capacity-bound long-context decode (GPU).
- :mod:`hisparse.bench.locality`: top-k sources (recorded trace of a real model, synthetic overlap)
  and hot-buffer hit rates of the resolver's LRU and of Belady (CPU).

Submodules are imported on use (``from hisparse.bench import locality``), so importing this
package costs nothing.
"""

import tempfile

_scratch: list[tempfile.TemporaryDirectory] = []


def scratch_dir(prefix: str) -> str:
    """A new empty directory under the system's temp folder, removed when this process exits
    normally (a benchmark's generated config or random checkpoint: each run used to leave one
    behind; a killed process still leaves it). Child processes may read it while the caller
    runs."""
    d = tempfile.TemporaryDirectory(prefix=prefix)
    _scratch.append(d)
    return d.name
