"""`python -m pdserve.engine.worker.rank_main --fd N`: a local tensor-parallel rank
(engine/worker/tp_worker.py, `ProcessLauncher`).

Its own module, so that the rank's `__main__` is not a second copy of tp_worker: importing
`pdserve.engine` already imports tp_worker, and running that module with `-m` would run it
again under another name (runpy warns, and its classes would exist twice).
"""

from pdserve.engine.worker.tp_worker import main

if __name__ == "__main__":
    main()
