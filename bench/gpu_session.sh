#!/usr/bin/env bash
# The GPU measurements of docs/performance.md, in parts; several parts run in order in one call,
# which DEADLINE bounds (for GPU runners that limit a call to about 10 minutes):
#
#   bash bench/gpu_session.sh step      # drafter step variants at the reference shape, flatness, profile
#   bash bench/gpu_session.sh daemon    # daemon, Qwen3-8B-shaped target on cuda:0, drafter on cuda:1:
#                                       # time to ready cold + warm, a 100-step job, /metrics
#   bash bench/gpu_session.sh recipe    # the same at the recipe's density (512 anchors), 50 steps
#   bash bench/gpu_session.sh twodrafters  # drafters on cuda:0 and cuda:1 (cold + warm ready), 30 steps
#                                      # WARM_STARTS=N; WARM_ENV="A=1;B=2": warm starts take turns (A/B)
#   bash bench/gpu_session.sh colocated # the daemon part with target and drafter on cuda:0 (one GPU)
#                                       # COLOC_ARGS="--anchors 512 --steps 30 ...": its bench.daemon_gpu arguments
#   bash bench/gpu_session.sh capture   # the target's capture per micro-batch: eager and fused layers, bf16 and FP8
#   bash bench/gpu_session.sh panels    # every Grafana panel against a real Prometheus, CUDA daemon
#   bash bench/gpu_session.sh tests     # pytest -m gpu (TESTS_SELECT="replicas or adamw": pytest -k)
#   bash bench/gpu_session.sh flex      # flex_attention alone: masks, query splits, backward kernel options
#   bash bench/gpu_session.sh optimizer # the optimizer step alone (Triton AdamW sweep vs torch)
#   bash bench/gpu_session.sh ce        # one loss chunk: compiled vs the Triton CE kernel (sweep)
#   bash bench/gpu_session.sh probe     # a warm start's imports and CUDA initialisation
#   bash bench/gpu_session.sh tests step   # several parts in one call, in order
#
# Packages a bare GPU image lacks (the service's: fastapi, uvicorn, pydantic, prometheus_client, ...)
# can travel as wheels in .whl/; the Prometheus binary for `panels` as .prom/prometheus (cp
# /usr/bin/prometheus .prom/ after apt-get install prometheus). Results, logs and compile logs go to
# $OUT (default out/, ignored by git), packed into one gpu_results.tgz at the end; never into docs/.
set -u
[ $# -gt 0 ] || { echo "usage: bash bench/gpu_session.sh step|daemon|recipe|twodrafters|colocated|capture|panels|tests|flex|optimizer|ce|probe ..." >&2; exit 2; }
for part in "$@"; do
  case "$part" in step|daemon|recipe|twodrafters|colocated|capture|panels|tests|flex|optimizer|ce|probe) ;; *) echo "unknown part $part" >&2; exit 2 ;; esac
done
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
case "$(realpath -m "$OUT")/" in
  "$(realpath "$PWD")"/docs/*) echo "OUT=$OUT is under docs/: benchmark output stays out of the repository (use out/)" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
# with their bytecode, as pip and the image install them: the daemon's start measures its own imports,
# not the compiling of these sources
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
# Parts share DEADLINE (s since this script started), each also bounded by PART_TIMEOUT; whatever
# ran is packed on exit, also when a part times out or fails.
DEADLINE=${DEADLINE:-570}
# Compiled kernels can travel between calls (a fresh machine compiles flex for minutes): the cache
# comes in as .cache_in/inductor_cache.tgz.* and goes back as $OUT pieces (CACHE_BACK=1).
export TORCHINDUCTOR_CACHE_DIR=$PWD/.inductor_cache
mkdir -p "$TORCHINDUCTOR_CACHE_DIR"
if ls .cache_in/inductor_cache.tgz.* >/dev/null 2>&1; then
  cat .cache_in/inductor_cache.tgz.* | tar xzf - -C "$TORCHINDUCTOR_CACHE_DIR" && echo "inductor cache restored: $(du -sh "$TORCHINDUCTOR_CACHE_DIR" | cut -f1)"
fi
# BACKGROUND_TESTS=1: pytest -m gpu runs beside the first part's compiles; step and flex wait for it
# before they time anything, every other part before it starts
WAIT_ARGS=""
if [ "${BACKGROUND_TESTS:-0}" = 1 ]; then
  for part in "$@"; do
    [ "$part" = tests ] && { echo "BACKGROUND_TESTS=1 already runs the tests: drop the tests part" >&2; exit 2; }
  done
  timeout $((DEADLINE - 20 - SECONDS)) python3 -u -m pytest -v -p no:cacheprovider --durations=0 -m gpu tests/gpu > "$OUT/gpu_tests.log" 2>&1 &
  TESTS_PID=$!
  WAIT_ARGS="--wait-pid $TESTS_PID"
  echo "=== tests in the background, pid $TESTS_PID"
fi
wait_background_tests() {
  if [ -n "${TESTS_PID:-}" ]; then wait "$TESTS_PID"; echo "=== background tests exit $?"; TESTS_PID=""; fi
}
pack() {  # for runners that bring back few files of limited size: the results in one, the cache in <= 4 pieces
  wait_background_tests
  (cd "$OUT" && tar czf /tmp/gpu_results.tgz . && find . -mindepth 1 -delete && mv /tmp/gpu_results.tgz .)
  if [ "${CACHE_BACK:-0}" = 1 ]; then  # after the flex sweep and the gpu tests it is usually over the limit
    tar czf /tmp/inductor_cache.tgz -C "$TORCHINDUCTOR_CACHE_DIR" . 2>/dev/null
    size=$(stat -c %s /tmp/inductor_cache.tgz)
    room=$((60 * 1024 * 1024 - $(stat -c %s "$OUT/gpu_results.tgz")))
    if [ "$size" -lt "$room" ]; then split -b 15M /tmp/inductor_cache.tgz "$OUT/inductor_cache.tgz."
    else echo "inductor cache not sent back: $size bytes compressed, $room bytes of room"; fi
  fi
  echo "=== done $(date +%T)"
}
trap pack EXIT
set -o pipefail
for part in "$@"; do
  case "$part" in step|flex) ;; *) wait_background_tests ;; esac
  left=$((DEADLINE - SECONDS - 10))
  if [ "$left" -lt 30 ]; then echo "=== $part skipped: ${left}s left of the call"; continue; fi
  T=${PART_TIMEOUT:-$left}
  [ "$T" -gt "$left" ] && T=$left
  WARM=$((T - 200 > T / 2 ? T - 200 : T / 2))  # parallel compile phase; the rest is for timing
  echo "=== $part $(date +%T) (limit ${T}s)"
  case "$part" in
    step)   timeout $T python3 -m bench.drafter_step --variants ${STEP_VARIANTS:-flex_layer,sdpa_dense,sdpa_chunked} \
              --iters 10 --profile --warm-jobs ${WARM_JOBS:-4} --warm-budget $WARM $WAIT_ARGS 2>&1 | tee "$OUT/drafter_step.log" ;;
    daemon) timeout $T python3 -m bench.daemon_gpu --anchors 256 --steps 100 --timeout 300 2>&1 | tee "$OUT/daemon_gpu.log" ;;
    recipe) DAEMON_WORK=/tmp/dflash-daemon-recipe OUT=$OUT/recipe timeout $T python3 -m bench.daemon_gpu --anchors 512 --steps 50 --timeout 300 2>&1 | tee "$OUT/daemon_recipe.log" ;;
    twodrafters) DAEMON_WORK=/tmp/dflash-daemon-two OUT=$OUT/twodrafters timeout $T python3 -m bench.daemon_gpu --two-drafters --anchors 256 --steps 30 --timeout 300 --warm-starts ${WARM_STARTS:-1} --warm-env "${WARM_ENV:-}" 2>&1 | tee "$OUT/daemon_two.log" ;;
    colocated) DAEMON_WORK=/tmp/dflash-daemon-coloc OUT=$OUT/colocated timeout $T python3 -m bench.daemon_gpu --colocated ${COLOC_ARGS:---anchors 256 --steps 100} --timeout 300 2>&1 | tee "$OUT/daemon_colocated.log" ;;
    capture) timeout $T python3 -m bench.target_capture --precisions ${CAPTURE_PRECISIONS:-bf16,bf16_fused,fp8,fp8_fused} --profile --iters 20 2>&1 | tee "$OUT/target_capture.log" ;;
    panels) PROMETHEUS_BIN=$PWD/.prom/prometheus timeout $T python3 -m tests.deploy.panels_check 2>&1 | tee "$OUT/panels.log" ;;
    flex)   timeout $T python3 -m bench.flex_sweep --cases ${FLEX_CASES:-all} --warm-jobs ${WARM_JOBS:-11} \
              --warm-budget $WARM $WAIT_ARGS 2>&1 | tee "$OUT/flex_sweep.log" ;;
    optimizer) timeout $T python3 -m bench.optimizer 2>&1 | tee "$OUT/optimizer.log" ;;
    ce)     timeout $T python3 -m bench.ce_kernel 2>&1 | tee "$OUT/ce_kernel.log" ;;
    probe)  timeout $T python3 -m bench.startup_probe 2>&1 | tee "$OUT/startup_probe.log" ;;
    tests)  timeout $T python3 -u -m pytest -v -p no:cacheprovider --durations=0 -m gpu ${TESTS_SELECT:+-k "$TESTS_SELECT"} tests/gpu 2>&1 \
              | tee "$OUT/gpu_tests.log" ;;
  esac
  echo "=== $part exit $? $(date +%T)"  # 124: hit its time limit
done
