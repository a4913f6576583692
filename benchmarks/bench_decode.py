"""Capacity-bound long-context decode benchmark (same as ``hisparse bench``); see
hisparse/bench/decode.py for the workload and the flags."""

import sys

from hisparse.bench.decode import main

if __name__ == "__main__":
    sys.exit(main())
