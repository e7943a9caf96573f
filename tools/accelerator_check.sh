#!/usr/bin/env bash
# One command for an accelerator (GPU or TPU, whatever JAX sees): a few RL steps of a Qwen3-0.6B-shaped
# policy (random weights, or --checkpoint DIR) on the synthetic collection; prints sampled and trained
# tokens/s, MFU against the device's bf16 peak, and peak device memory. Options: tools/accelerator_check.py --help
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m tools.accelerator_check "$@"
