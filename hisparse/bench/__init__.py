"""Benchmarks of hisparse.

- :mod:`hisparse.bench.decode`: capacity-bound long-context decode (GPU).
- :mod:`hisparse.bench.locality`: top-k sources (recorded trace of a real model, synthetic overlap)
  and hot-buffer hit rates of the resolver's LRU and of Belady (CPU).

Submodules are imported on use (``from hisparse.bench import locality``), so importing this
package costs nothing.
"""
