"""In-process training machinery used by the nodes and by ``launch central``: a worker's stage
compute (forward, stateless backward, accumulation, step), the central reference run, the
self-termination monitor, and the typed run report. No networking."""
