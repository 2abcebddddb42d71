#!/usr/bin/env bash
# The GPU checks, as one prepared run for a session lent a GPU machine (device tool `run`):
#   bash tools/gpu_check.sh [STEP...]     (default: every step below)
# With ftsdp installed (an editable install of this checkout), torch with CUDA, pytest and
# pytest-timeout. Runs, each under a time limit of its own, logs under $OUT (or ./gpu-check):
#   gpu_tests.log   tests/gpu: the engine's CUDA paths, checkpoints of state on the device, the
#                   main job killed with kill -9 on the GPU and resumed
#   snap_cuda.log   the Snapshots benchmark on the GPU (one NCCL rank, the MLP, a larger batch)
#   snap_gpt.log    the Snapshots benchmark's own rows (W=2 CPU ranks) on this machine's cores
#   snap_mlp.log    the same on the MLP
#   engine.log      the Engine benchmark's 1-GPU row
set -uo pipefail
out=${OUT:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import os, torch; print(torch.__version__, torch.cuda.get_device_name(0), os.cpu_count(), "CPUs")' 2>&1 | tee "$out/env.log"
status=0
wanted=" $* "
step() {  # step NAME SECONDS COMMAND...: run it under a limit, log to $out/NAME.log
  local name=$1 limit=$2
  shift 2
  if [ "$wanted" != "  " ] && [[ "$wanted" != *" $name "* ]]; then return; fi
  echo "== $name: $*" | tee -a "$out/env.log"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$out/env.log"
  tail -n 40 "$out/$name.log"
  [ $rc -eq 0 ] || status=1
}
step gpu_tests 300 python3 -m pytest -p no:cacheprovider -o addopts="-ra" -q tests/gpu
only=floor,ftsdp/storage,ftsdp/persister,dcp,dcp-process,fsdp2/persister
step snap_cuda 150 python3 -m ftsdp.tools.bench_snapshot --cuda --world 1 --model mlp \
  --mlp-batch 8192 --rounds 2 --only $only
step snap_gpt 100 python3 -m ftsdp.tools.bench_snapshot --rounds 2 --only $only
step snap_mlp 100 python3 -m ftsdp.tools.bench_snapshot --model mlp --rounds 2 --only $only
step engine 60 python3 -m ftsdp.tools.bench_engine --cuda only
echo "gpu checks exit $status"
exit $status
