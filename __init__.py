"""pdserve: disaggregated prefill/decode LLM serving.

Importing the package caps how long an idle OpenMP thread spins before it sleeps, unless
the environment already chooses (`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT`). libgomp, the
runtime torch's Linux wheels bundle, reads it once, when torch loads it: so here, before
any pdserve module imports torch. Its default spin (300000 pauses, ~13 ms on the 2-core
dev box) made a 2-thread engine whose cores other processes share 5-13x slower than one
thread: a waiting thread holds a core the other one needs, at each of the ~50-200 fork/joins
of a decode step. 10000 (~0.4 ms) is as fast as the default on free cores; with one busy
process beside it, a 2-thread step takes ~2x a 1-thread one instead of ~10x.
`OMP_WAIT_POLICY=PASSIVE` stalls least (~1x) but wakes a sleeping thread per fork
(~50-100 us on a VM), 15-25% slower on free cores. One thread (the default) never waits.
"""

import os

if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "10000"
