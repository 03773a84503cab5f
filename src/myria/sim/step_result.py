"""A step model's prediction (`StepResult`) and the names of its breakdown's costs."""

from __future__ import annotations

from dataclasses import dataclass, field

from myria.sim.memory import MemoryResult

# What each key of StepResult.breakdown is called in the tables of simulate and plan.
BREAKDOWN_LABELS = {
    "compute_gemm": "GEMMs", "compute_attention": "attention", "compute_memory_bound":
    "memory-bound ops", "host_overhead": "host (Python, launches)",
    "recompute": "recompute", "tp_comm_exposed": "TP comm",
    "cp_comm_exposed": "CP comm", "ep_comm_exposed": "EP all-to-all", "pp_p2p_exposed":
    "PP send/recv", "pp_bubble": "PP bubble", "dp_comm_exposed": "DP comm", "optimizer":
    "optimizer", "offload": "offload", "data_loading": "data loading",
    "sync_wait": "waiting for the slowest rank",
}


@dataclass
class StepResult:
    """Prediction for one run."""

    name: str
    iteration_time_s: float
    mfu: float                 # the live meter's convention (flops.py "dense")
    tokens_per_s: float
    tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    memory_gb_per_gpu: float
    fits: bool
    breakdown: dict[str, float]
    memory: MemoryResult
    layout: dict
    details: dict = field(default_factory=dict)
    ops: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # the planner's band, ETTR, ties
    mfu_megatron: float = 0.0  # Narayanan et al. 2021's convention, as published tables use it
    mfu_causal: float = 0.0    # attention charged only for the keys a causal query sees

    def to_json(self) -> dict:
        """The JSON object `myria simulate --json` prints."""
        from myria.sim.band import band_coverage, held_out_mae, uncertainty

        t, b = self.iteration_time_s, uncertainty()
        return {
            "name": self.name,
            "iteration_time_s": t,
            "mfu": self.mfu,
            "mfu_megatron": self.mfu_megatron,
            "mfu_causal": self.mfu_causal,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "flops_note": "mfu and tflops_per_gpu count model FLOPs as myria's live meter does "
                          "(every matmul the model runs, 3x its forward; flops.py 'dense'); "
                          "mfu_megatron uses Narayanan et al. 2021's formula (72 B s l h^2 (...) "
                          "for GPT: the output layer at 2.25x), as published tables do; both "
                          "charge attention for every key; mfu_causal only for the keys a "
                          "causal query sees; hardware_tflops_per_gpu counts what runs: the "
                          "causal attention FlashAttention computes, and recomputation",
            "memory_gb_per_gpu": self.memory_gb_per_gpu,
            "fits": self.fits,
            "breakdown": {k: v for k, v in self.breakdown.items()},
            "breakdown_fraction": {k: v / t for k, v in self.breakdown.items()},
            "memory_gb": self.memory.gb(),
            "memory_peak_stage": self.memory.stage,
            "layout": self.layout,
            "details": self.details,
            "warnings": self.warnings,
            # the model's uncertainty (leave-one-out residuals of the calibration, jackknife+
            # quantile): the iteration time lies within t (1 -/+ band) with the nominal coverage
            "band": b, "band_nominal_coverage": band_coverage(),
            "band_held_out_mae": held_out_mae(),
            "iteration_time_low_s": t * (1 - b), "iteration_time_high_s": t * (1 + b),
            "mfu_low": self.mfu / (1 + b), "mfu_high": self.mfu / (1 - b),
            **self.extra,
        }
