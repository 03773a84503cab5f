"""The checks of `myria doctor`, one small module per family.

- `report`: a check's outcome (`Check`: pass, warn, fail or skip, with its evidence) and a host's
  report (`HostReport`);
- `hooks`: the MYRIA_DOCTOR_FAULT test hook (slow or wrong GEMMs);
- `expected`: the figures checks are judged against, where each comes from, and the judgement
  (re-measure before failing; peers first, own history second);
- `compute`: GEMM correctness against a float64 reference and GEMM throughput;
- `memory`: memory copy bandwidth;
- `golden`: computations with known exact answers (GEMM, reductions, softmax);
- `collectives`: collective and point-to-point results and bandwidth, and the neighbour-host
  discovery of multi-host launches.

`myria.resilience.diagnostics` runs them in worker processes and renders the report. A new
family is a new module here with a function that returns `Check`s, called from the worker.
"""
