#!/usr/bin/env bash
# The GPU measurements of docs/performance.md's objectives section, in one call:
#   bash bench/objectives_gpu.sh            # Triton distillation kernel check, then bench.objective_step
#   DAEMON=1 bash bench/objectives_gpu.sh   # and the colocated daemon, CE vs a KL job on a teacher daemon
# Results and logs go to $OUT (default out/).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
if [ -d ../../.whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/objectives-inductor}
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_objectives_gpu.py -k triton 2>&1 | tail -3 | tee "$OUT/gpu_tests.log"
# DSpark's shapes compile in a second process while the first rows compile and run; rows time
# nothing until it has exited
OUT=/tmp/objectives-warm timeout 300 python3 -m bench.objective_step --objectives dspark --compile-only > /tmp/warm_dspark.log 2>&1 &
WARM=$!
timeout ${STEP_TIMEOUT:-330} python3 -m bench.objective_step --graph --iters ${ITERS:-20} --flat-steps ${FLAT_STEPS:-30} \
  --wait-pid $WARM 2>&1 | grep -v Warning | tee "$OUT/objective_step.log"
if [ "${DAEMON:-0}" = 1 ]; then
  for spec in "kl|teacher = true|{\"loss\": \"kl\"}" "ce||{}"; do
    IFS='|' read -r name extra job <<< "$spec"
    DAEMON_WORK=/tmp/daemon-$name OUT=/tmp/daemon-out-$name timeout ${DAEMON_TIMEOUT:-150} python3 -m bench.daemon_gpu \
      --colocated --anchors 256 --steps ${DAEMON_STEPS:-40} --warm-starts 0 --engine-extra "$extra" --job-extra "$job" 2>&1 \
      | tail -15 | tee "$OUT/daemon_$name.log"
    cp /tmp/daemon-out-$name/daemon_gpu.json "$OUT/daemon_$name.json" 2>/dev/null
  done
fi
