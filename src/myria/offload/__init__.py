"""Models larger than memory: where the optimizer state (and the parameters) live.

ZeRO-Infinity (Rajbhandari et al. 2021) keeps what does not fit in accelerator memory in host
memory and on NVMe and streams it in with overlap; PyTorch offers the host tier (FSDP2's
`CPUOffloadPolicy`, myria's `offload = cpu`) but nothing for NVMe. This package is that tier for
AdamW (`parallel.offload = nvme`): each rank's two moments (and, with `offload_params`, its fp32
parameters) live in a file on a local disk; the fast tier holds only a ring of a few aligned
buffers, sized from `parallel.fast_memory_gb`. docs/offload.md tells the whole story.

One idea per module, each importing only those above it in this list:

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

**Checkpoints** link the committed generation file into the checkpoint (a hard link, else a
reflink, else a kernel-side copy: `myria.fsutil.link_or_copy`), so saving costs no copy through
memory and no write-back; the checkpoint manager checksums and validates it like any shard.
Since no generation is modified in place, a linked file is immutable. Resuming links it back. A
process killed mid-step leaves a half-written generation that the next start deletes; training
resumes from the last checkpoint, bit for bit. A full or unwritable offload directory raises an
`OffloadError` (one line; training stops, committed checkpoints are untouched).
"""
