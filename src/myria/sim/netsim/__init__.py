"""Flow-level cluster network simulator (issue 12, first part).

Done so far: a two-tier leaf-spine fabric (``fabric.py``), ECMP 5-tuple hashing with several
queue pairs per connection and greedy adaptive routing, and event-driven max-min fair sharing
vectorised over a sparse flows x links incidence matrix (``flows.py``), with ring traffic.
Not yet: three-tier CLOS, presets, PFC/DCQCN, other collectives, the CLI and the perf-model hook.
"""
