"""pdserve: disaggregated prefill/decode LLM serving.

Importing the package does two things before anything else of pdserve runs:

- It takes the checkout's root off `sys.path`. The root *is* this package's folder, and
  Python puts the current directory first on `sys.path` for `python -m ...` and
  `python -c ...`: run from the checkout, `kernels/`, `engine/`, `router/` ... would be
  importable as top-level packages and shadow others of those names (Hugging Face's
  `kernels`, which transformers imports). pdserve itself is found through its
  installation (`pip install -e .` maps the package to this folder).
- It caps how long an idle OpenMP thread spins before it sleeps, unless the environment
  already chooses (`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT`). libgomp, the runtime torch's
  Linux wheels bundle, reads it once, when torch loads it: so here, before any pdserve
  module imports torch. Its default spin held a core that another thread of the same step
  needed, on a machine whose cores other processes share (docs/architecture.md,
  "Processes", has the measurements); one thread (the default) never waits.
"""

import os
import sys

_ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _ROOT]

if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "10000"

from pdserve import _moved  # noqa: E402 (after the path fix above)

_moved.install(__name__)
