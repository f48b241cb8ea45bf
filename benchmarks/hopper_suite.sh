#!/usr/bin/env bash
# The Hopper kernels' native checks and benchmarks, in stages, each writing its logs to OUT.
#
#   bash benchmarks/hopper_suite.sh OUT [STAGE ...]      (default: every stage, in order)
#
# Stages, each bounded by its own timeout so that one fits in 10 minutes
# (a failed stage is logged and the next one runs):
#   tests      the Mosaic GPU forward's tests natively (plain, padded and packed rows, XA
#              heads, the lowering) against the float32 reference
#   tests-training  the Mosaic GPU training kernels' tests natively (outputs and gradients,
#              XA lists, packed rows); apart from `tests` since together they outran 560 s
#   tests-triton  the Triton, packed-row and XAttention kernel tests natively
#   schedules  the forward's schedules (the default chains each warpgroup's two products;
#              `Tiles(chain=False)` does not; `Tiles(overlap=True, chain=False)`, FA3's
#              intra-warpgroup overlap; `Tiles(persistent=132, chain=False)`, persistent
#              programs; `multicast`, K/V tiles shared by a cluster of two; `q_registers`,
#              Q in registers for QK^T): their tests natively, kernel_profile.py of the forward
#              kernels in each schedule with the register and spill report
#   schedules-attention  attention.py's forward at 32K and 128K (MSR 0, 0.75 and 1) with the
#              unchained, chained (2 and 3 slots), overlapped, persistent, multicast and
#              Q-in-registers rows side by side
#   profile    benchmarks/kernel_profile.py per Mosaic kernel at 32K (MSR 0.75, gates 0.5,
#              fa-xa at density 0.5), with the compiler's register and spill report
#   backward   kernel_profile.py of the dQ and dK/dV kernels at 32K, MSR 0, 0.75 and 1 and
#              gates 0.5, each with 2 and 3 ring slots and 232 and 240 registers (checked
#              bit-equal to the default, timed interleaved)
#   backward-triton  kernel_profile.py --triton: the Triton training forward, dQ and dK/dV
#              kernels alone at 32K, MSR 0, 0.75 and 1 and gates 0.5
#   attention  benchmarks/attention.py at 32K and 128K (MSR 0.75), training at 64K, with the
#              Triton training rows beside, JSON beside the log
#   xattention benchmarks/xattention.py (forward at 32K and 128K with the scoring at tiles of
#              32 to 256 blocks, training at 16K)
#   packed     benchmarks/packed_attention.py with the Mosaic training rows and the packed
#              fa-xa forward on the Triton and Mosaic kernels
# Run from the repository root on a machine with a Hopper GPU and the project installed.
set -u
out=${1:?usage: hopper_suite.sh OUT [STAGE ...]}
shift
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests tests-training tests-triton schedules
                                    schedules-attention profile backward backward-triton
                                    attention xattention packed)
mkdir -p "$out"
# The GPU first (the default device); the CPU beside it for the tests that run Pallas TPU
# interpret mode, whose callbacks need a CPU device.
export JAX_PLATFORMS=cuda,cpu PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python}

run() {   # run NAME SECONDS COMMAND...: log to OUT/NAME.log, note the exit status and time
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name: rc $rc, $((SECONDS - start)) s" | tee -a "$out/summary.txt"
}

profile_with_report() {   # NAME SECONDS KERNEL-ARGS...: kernel_profile.py, plus OUT/NAME.ptxas.txt
  # The compiler's dumps (a dozen files per kernel) go to a scratch folder; only ptxas's
  # register and spill report of each kernel is kept.
  local name=$1 limit=$2
  shift 2
  local dump
  dump=$(mktemp -d)
  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$dump" \
    run "$name" "$limit" "$py" benchmarks/kernel_profile.py --kernel "$@"
  local f
  for f in "$dump"/*.ptxas; do   # one per kernel compiled, in order (entry_0, entry_1, ...)
    [ -e "$f" ] || continue
    echo "== $(basename "$f")"
    grep -a -E "^ptxas|spill" "$f"
  done > "$out/$name.ptxas.txt"
  rm -rf "$dump"
}

for stage in "${stages[@]}"; do
  case $stage in
    tests)
      run tests 560 "$py" -m pytest -v -p no:cacheprovider tests/test_mosaic_gpu.py ;;
    tests-training)
      run tests-training 560 "$py" -m pytest -v -p no:cacheprovider \
        tests/test_mosaic_gpu_training.py ;;
    tests-triton)
      run tests-triton 560 "$py" -m pytest -q -p no:cacheprovider tests/test_pallas_gpu.py \
        tests/test_packed_kernels.py tests/test_xattention.py ;;
    schedules)
      run schedules-tests 240 "$py" -m pytest -q -p no:cacheprovider tests/test_mosaic_gpu.py \
        tests/test_mosaic_gpu_training.py \
        -k "overlap or persistent or multicast or qreg or plain or chain or lower"
      for args in "forward" "forward --no-chain" "forward --overlap" "forward --persistent 132" \
                  "forward --overlap --persistent 132" "forward --multicast" \
                  "forward --q-registers" "xa" "xa --overlap" "train_forward" \
                  "train_forward --overlap"; do
        profile_with_report schedule_profile_$(echo "$args" | tr -d ' -') 40 $args
      done ;;
    schedules-attention)
      run schedules-attention 560 "$py" benchmarks/attention.py --lengths 32768 131072 \
        --msr 0.75 --skip-train --skip-torch --mosaic-tiles 64x128x2 64x128x2+chain \
        64x128x3+chain 64x128x2+overlap \
        64x128x2+p132 64x128x2+multicast 64x128x2+qreg 64x128x2+overlap+qreg \
        --seconds 1 --reps 5 \
        --json "$out/schedules_attention.json" ;;
    profile)
      for args in "forward" "xa" "train_forward" "dq" "dkv" "dq --mixed" "dkv --mixed" \
                  "train_forward --xa" "dq --xa" "dkv --xa" "dq --xa --mixed" "dkv --xa --mixed"; do
        profile_with_report profile_$(echo "$args" | tr -d ' -') 45 $args
      done ;;
    backward)
      for kernel in dkv dq; do
        for args in "--msr 0" "--msr 0.75" "--msr 1" "--mixed"; do
          run backward_${kernel}_$(echo "$args" | tr -d ' -.') 70 "$py" \
            benchmarks/kernel_profile.py --kernel $kernel $args --slots 2 3 \
            --registers 232 240 --reps 9
        done
      done ;;
    backward-triton)
      for kernel in train_forward dq dkv; do
        for args in "--msr 0" "--msr 0.75" "--msr 1" "--mixed"; do
          run backward_triton_${kernel}_$(echo "$args" | tr -d ' -.') 60 "$py" \
            benchmarks/kernel_profile.py --kernel $kernel $args --triton --reps 9
        done
      done ;;
    attention)
      run attention 560 "$py" benchmarks/attention.py --lengths 32768 131072 --msr 0.75 \
        --train-lengths 65536 --train-msr 0.75 --triton-training --seconds 1 --reps 5 \
        --torch-timeout 180 --json "$out/attention.json" ;;
    xattention)
      run xattention 560 "$py" benchmarks/xattention.py --lengths 32768 131072 \
        --chunk-blocks 32 128 256 \
        --train-lengths 16384 --reps 5 ;;
    packed)
      run packed 560 "$py" benchmarks/packed_attention.py --mosaic-training --reps 5 \
        --seconds 1 ;;
    *)
      echo "unknown stage '$stage' (tests, tests-training, tests-triton, schedules," \
        "schedules-attention, profile, backward, backward-triton, attention, xattention," \
        "packed)" >&2
      exit 2 ;;
  esac
done
