#!/usr/bin/env bash
# GPU smoke test: every framework example on every GPU of this node (nccl), in one command.
#
#   bash bench/gpu_smoke.sh            # from the repository root; PYTHON=... to pick the venv
#
# Needs a Python with torch (CUDA build) and deepspeed. Runs DDP, FSDP2, FSDP1 and DeepSpeed
# ZeRO 1/2/3; each trains on all visible GPUs, checks that the loss drops and that the ranks
# agree, and (all but DDP) saves a sharded checkpoint halfway, resumes from it in a second
# call and checks it ends on the same parameters; long_run.py (gangrun.Checkpointer, DDP and
# FSDP2) is preempted mid-run with cancel(checkpoint=True), resumed, and compared; a rank that
# skips an NCCL all_reduce is named by the hang verdict with the ranks' Flight Recorder state
# (bench/hang_nccl.py). Prints PASS/FAIL per example, keeps each
# example's log, exits non-zero if any failed. About 1-2 min on an 8-GPU node; each example
# is capped at EXAMPLE_TIMEOUT seconds (default 100) so the whole run stays under 5 minutes.
set -u -o pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
EXAMPLE_TIMEOUT="${EXAMPLE_TIMEOUT:-100}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export MLFLOW_DISABLE_TELEMETRY=true

WORK="$(mktemp -d -t gangrun-gpu-smoke-XXXXXX)"
# Keep any JIT-built op out of the user's cache (none is expected: the examples avoid them).
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$WORK/torch_extensions}"
echo "gangrun GPU smoke: logs and checkpoints in $WORK"

if ! "$PYTHON" - <<'PY'
import sys
import torch
n = torch.cuda.device_count()
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {n} GPU(s):",
      ", ".join(torch.cuda.get_device_name(i) for i in range(n)) or "-")
import os
if os.environ.get("GANGRUN_SMOKE_ALLOW_CPU") == "1" and n == 0:
    print("GANGRUN_SMOKE_ALLOW_CPU=1: running on 2 CPU ranks (gloo) to test this script")
    sys.exit(0)
sys.exit(0 if n > 0 and torch.distributed.is_nccl_available() else 1)
PY
then
    echo "FAIL: no CUDA GPU visible to $PYTHON (or no nccl); nothing to smoke-test"
    exit 2
fi

failed=0
start_all=$SECONDS

run() {  # run NAME ARGS...: one example, PASS/FAIL line, log kept
    local name="$1"; shift
    local log="$WORK/$name.log" t0=$SECONDS rc
    timeout --signal=INT --kill-after=15 "$EXAMPLE_TIMEOUT" "$PYTHON" "$@" --no-mlflow >"$log" 2>&1
    rc=$?
    if [ $rc -eq 0 ] && tail -n 1 "$log" | grep -qx "OK"; then
        printf 'PASS  %-14s %4ss  %s\n' "$name" $((SECONDS - t0)) "$(grep -m1 ' ranks' "$log")"
    else
        [ $rc -eq 124 ] || [ $rc -eq 137 ] && rc="timeout after ${EXAMPLE_TIMEOUT}s"
        printf 'FAIL  %-14s %4ss  (exit %s) log: %s\n' "$name" $((SECONDS - t0)) "$rc" "$log"
        tail -n 25 "$log" | sed 's/^/      | /'
        failed=$((failed + 1))
    fi
}

run ddp         examples/ddp_train.py
run fsdp2       examples/fsdp2_train.py     --ckpt "$WORK/ckpt-fsdp2"
run fsdp1       examples/fsdp1_train.py     --ckpt "$WORK/ckpt-fsdp1"
run deepspeed-1 examples/deepspeed_train.py --stage 1 --ckpt "$WORK/ckpt-ds1"
run deepspeed-2 examples/deepspeed_train.py --stage 2 --ckpt "$WORK/ckpt-ds2"
run deepspeed-3 examples/deepspeed_train.py --stage 3 --ckpt "$WORK/ckpt-ds3"
run long-run    examples/long_run.py        --ckpt "$WORK/ckpt-long"
run long-fsdp2  examples/long_run.py        --framework fsdp2 --ckpt "$WORK/ckpt-long-fsdp2"
run hang-nccl   bench/hang_nccl.py          # the hang verdict reads NCCL's Flight Recorder

echo "total $((SECONDS - start_all))s, $failed failed"
if [ $failed -eq 0 ]; then
    rm -rf "$WORK"
    echo "ALL PASS"
    exit 0
fi
exit 1
