"""Flow-level cluster network simulator.

``fabric``: two- and three-tier CLOS / fat-tree fabrics with rails, from TOML or presets;
``routing``: ECMP (polarised or not, queue pairs), adaptive and static rail-aware routes;
``flows``: event-driven max-min fair sharing over a sparse flows x links matrix;
``traffic``: the flows of NCCL's collectives over the groups of a layout, one job or several;
``layout``: the groups of a myria layout placed by ``myria.parallel.placement``;
``congestion``: a fluid PFC / DCQCN model; ``api``: cached pricing for the performance model;
``cli``: ``myria simulate-network``. docs/network.md describes the abstraction and its limits.
"""
