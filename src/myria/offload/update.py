"""One update of an offloaded optimizer: what it reads, fixed when it starts, and its progress.

An update reads generation `g` and writes generation `new` chunk by chunk. Everything its
arithmetic reads (the gradients, each tensor's step count, each param group's settings with
this step's learning rate) is fixed in an `Update` when it starts, so that it can run on a
thread behind training, or start during the last backward (a speculation that `step()` keeps
or drops), and still give the bits of torch.optim.AdamW.step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class Update:
    """One update of every chunk, generation `g` into `new` (file `fd`), in `order`.

    Speculative (`ready` set): started during the last backward, before the gradients are
    clipped. Chunk c is updated once the gradients of all its tensors are final (`ready[c]`),
    assuming they will not be scaled; `step()` keeps it (`confirmed`) when nothing changed them,
    else it is dropped (`cancelled`) and its file is reused by the update that replaces it."""

    g: int
    new: int
    fd: int
    old_fd: int
    before: dict          # tensor -> its step count before this update
    settings: list[dict]  # each group's adam() settings (this step's learning rate)
    grads: dict           # tensor -> its flat gradient (speculative: filled as they are final)
    order: list[int]
    written: list[threading.Event]
    computed: list[threading.Event] | None
    left: list[int]       # tensor -> chunks of it not updated yet
    taken: set = field(default_factory=set)   # tensors whose gradient memory was charged
    kill: object = None
    full: object = None
    ready: list[threading.Event] | None = None
    waiting: list[int] | None = None          # chunk -> tensors whose gradient is not final
    ptr: dict = field(default_factory=dict)   # tensor -> data_ptr of the gradient used
    after: threading.Event | None = None      # the previous update's end
    confirmed: bool = True
    cancelled: bool = False
    decided: threading.Event = field(default_factory=threading.Event)
    used: list[int] = field(default_factory=list)   # used up before it was confirmed
    updated: int = 0      # chunks updated so far
    expect: dict = field(default_factory=dict)  # chunk -> its checksum in `g`, as written
    sums: dict = field(default_factory=dict)    # chunk -> its checksum in `new`, as updated
    psums: dict = field(default_factory=dict)   # tensor -> its parameter's in `new` (param_sum)
    done: threading.Event = field(default_factory=threading.Event)


def adam_kwargs(group: dict) -> dict:
    """The settings AdamW.step passes to torch.optim.adam.adam for `group`."""
    beta1, beta2 = group["betas"]
    return dict(amsgrad=group["amsgrad"], has_complex=False, beta1=beta1, beta2=beta2,
                lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                maximize=group["maximize"], foreach=group["foreach"],
                capturable=group["capturable"], differentiable=group["differentiable"],
                fused=group["fused"], grad_scale=None, found_inf=None,
                decoupled_weight_decay=group["decoupled_weight_decay"])
