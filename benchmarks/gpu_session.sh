#!/usr/bin/env bash
# The one prepared GPU check (a few minutes on an H100/H200): the CUDA-only tests, then
# benchmarks/gpu.py at 1B / 3B / 8B in bf16 and float8, then float8's loss curve against bf16
# over 300 steps (benchmarks/bench_float8_curve.py, when tokenizers and torchao import; each
# step has its own timeout, 570 s in all). Results go to ${OUT:-gpu-results}/.
# Runs from the repository root with the machine's own Python and PyTorch (PYTHON, default
# python3) and the source tree on PYTHONPATH; wheels placed in .whl/ (for example torchao for
# float8, which GPU images rarely carry) are installed into a scratch folder first.
# Usage: bash benchmarks/gpu_session.sh      (see DEVELOPERS.md)
set -uo pipefail
out=${OUT:-gpu-results}
py=${PYTHON:-python3}
mkdir -p "$out"
extra=/tmp/densetrain-extra
if ls .whl/*.whl > /dev/null 2>&1; then
  $py -m pip install -q --no-deps --target "$extra" .whl/*.whl > "$out/install.log" 2>&1
fi
export PYTHONPATH="$PWD/src:$extra${PYTHONPATH:+:$PYTHONPATH}"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } \
  > "$out/machine.txt" 2>&1
timeout 150 $py -m pytest -q -p no:cacheprovider tests/cuda -rs > "$out/cuda-tests.txt" 2>&1
echo "cuda tests rc=$?" >> "$out/cuda-tests.txt"
timeout 330 $py benchmarks/gpu.py --sizes 1b,3b,8b --dtypes bf16,float8 --steps 8 --warmup 3 \
  --timeout 120 --json "$out/gpu.json" > "$out/gpu.txt" 2>&1
echo "gpu.py rc=$?" >> "$out/gpu.txt"
if $py -c "import tokenizers, torchao.float8" > /dev/null 2>&1; then
  timeout 90 $py benchmarks/bench_float8_curve.py --steps 300 --dim 256 --layers 4 --seq 256 \
    --device cuda --out "$out/float8-curve" > "$out/float8-curve.txt" 2>&1
  echo "bench_float8_curve.py rc=$?" >> "$out/float8-curve.txt"
else
  echo "skipped: tokenizers or torchao.float8 does not import" > "$out/float8-curve.txt"
fi
tail -n 20 "$out/machine.txt" "$out/cuda-tests.txt" "$out/gpu.txt" "$out/float8-curve.txt"
