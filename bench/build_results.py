"""Assemble bench/RESULTS.md from the per-area sections (bench/RESULTS_*.md)."""

from pathlib import Path

ORDER = ["train", "lamb", "parallel", "resilience", "observe", "detect", "sim", "selfcheck",
         "offload", "network", "architectures"]

here = Path(__file__).resolve().parent
parts = ["# myria benchmark results\n",
         "Every table below names the command that reproduces it, the machine and the date. "
         "The machine is a 2-core x86_64 CPU shared with other work: wall-clock figures vary "
         "several-fold between runs, so comparisons are made side by side within one run. "
         "JSON results are in `bench/results/`.\n"]
for name in ORDER:
    f = here / f"RESULTS_{name}.md"
    if f.exists():
        parts.append(f.read_text().strip() + "\n")
(here / "RESULTS.md").write_text("\n".join(parts))
print(f"wrote {here / 'RESULTS.md'}")
