"""Models larger than memory: the nvme tier, AdamW's state (and parameters) in local files.

`parallel.offload = nvme`: each rank's AdamW moments (and fp32 parameters) live in files on a
local disk, streamed through a ring of aligned buffers (docs/offload.md). One idea per module,
each importing only those above it in this list:

- `diskio`: aligned and huge-page I/O buffers, O_DIRECT files, whole reads and writes;
- `files`: the map of a generation file (`FileMap`: which bytes hold which tensor piece);
- `procmem`: this process's memory (glibc's heap threshold, peak and current RSS);
- `budget`: the fast-memory plan (`plan_memory`, `plan_for_config`), from myria.models.memory;
- `pipeline`: the reader and writer threads around the ring of buffers;
- `generations`: the generation files (create, reuse as the spare, commit, restore);
- `lending`: updated chunks kept readable, and gradient memory lent to write-behind buffers;
- `update`: what one update reads, fixed when it starts;
- `adamw`: `OffloadedAdamW`, torch's AdamW over chunks of the files, bit for bit;
- `params`: parameters on disk too, loaded a unit at a time around forward and backward;
- `nvme`: the rank's nvme tier (one OffloadedAdamW per model part);
- `tier`: the optimizer-tier protocol the engine calls, the in-memory tier, the tier rules.
"""
