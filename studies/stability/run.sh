#!/usr/bin/env bash
# Advance the eleven runs of studies/stability/study.toml round-robin, STEP_BLOCK steps at a time, up to
# STEPS (default 100): an interrupted sitting loses at most the steps after each run's last checkpoint
# (every 5 steps); re-running this script continues where the store and the checkpoints stand.
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${STEPS:-100}
STEP_BLOCK=${STEP_BLOCK:-20}
RUNS=(
  "--loss pg_is"
  "--loss dppo_binary_tv"
  "--loss pg_is --rollout-weights fp8"
  "--loss dppo_binary_tv --rollout-weights fp8"
  "--loss pg_is --model default --split-scorer bf16"
  "--loss dppo_topk_tv"
  "--loss dppo_binary_tv --seed 1"
  "--loss dppo_topk_tv --seed 1"
  "--loss pg_is --seed 1"
  "--loss pg_is --rollout-weights fp8 --seed 1"
  "--loss dppo_binary_tv --rollout-weights fp8 --seed 1"
)
for ((target = STEP_BLOCK; target < STEPS + STEP_BLOCK; target += STEP_BLOCK)); do
  (( target > STEPS )) && target=$STEPS
  for run in "${RUNS[@]}"; do
    # shellcheck disable=SC2086  # each entry is a list of flags
    mismatch-lab train --study studies/stability/study.toml $run --steps "$target" --no-progress
  done
done
