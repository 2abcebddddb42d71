#!/usr/bin/env bash
# The GPU checks, as one prepared run for a session lent a GPU machine (device tool `run`):
#   bash tools/gpu_check.sh
# Runs the CUDA tests (tests/gpu: stream schedule, CPU offload's real path, bf16 on the
# device) and the 1-GPU benchmark row, writing logs and the benchmark section under $OUT
# (or ./gpu-check). Needs torch with CUDA, pytest and pytest-timeout (the GPU image has them).
set -uo pipefail
out=${OUT:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))' 2>&1 | tee "$out/env.log"
python3 -m pytest -p no:cacheprovider -o addopts="-ra" -q tests/gpu 2>&1 | tee "$out/gpu_tests.log"
tests=${PIPESTATUS[0]}
cp docs/benchmarks.md "$out/benchmarks.md"
timeout 300 python -m ftsdp.tools.bench_engine --cuda only --out "$out/benchmarks.md" 2>&1 | tee "$out/bench.log"
bench=${PIPESTATUS[0]}
echo "gpu tests exit $tests, benchmark exit $bench"
exit $(( tests || bench ))
