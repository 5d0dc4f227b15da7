"""Peak memory of `densetrain export` from a DCP checkpoint against the model's size.

Saves a LLaMA-shaped model (default 8 layers, width 1024, fp32) as a training checkpoint with
torch.distributed.checkpoint, then exports it in a fresh process and reports that process's
peak resident memory (Linux VmHWM, reset after the imports) above its resident memory before
the export, next to the checkpoint's bytes and its largest tensor.
Run: python benchmarks/bench_export.py [--layers N] [--dim D] (Linux only).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_EXPORT = """
import json, sys, time
import densetrain.export, densetrain.checkpoint, torch.distributed.checkpoint  # baseline imports

def status_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark (VmHWM) to VmRSS
base = status_kib("VmRSS")
start = time.perf_counter()
densetrain.export.export_to_hf(sys.argv[1], sys.argv[2])
seconds = time.perf_counter() - start
print(json.dumps({"baseline_kib": base, "peak_kib": status_kib("VmHWM"), "seconds": seconds}))
"""


def _save_checkpoint(root: Path, layers: int, dim: int) -> tuple[int, int]:
    from densetrain.checkpoint import ModelState, save_checkpoint
    from densetrain.config import JobConfig, job_config_to_toml
    from densetrain.data.tokenizer import train_tokenizer
    from densetrain.models import Transformer

    job = JobConfig()
    job.model.preset = "tiny-llama"
    overrides = dict(vocab_size=32000, dim=dim, embed_dim=dim, num_layers=layers, num_heads=16,
                     num_kv_heads=16, head_dim=dim // 16, ffn_dim=4 * dim)
    for key, value in overrides.items():
        setattr(job.model, key, value)
    texts = [Path(__file__).read_text()] * 4
    job.data.tokenizer = str(root.parent / "tokenizer.json")
    train_tokenizer(texts, job.data.tokenizer, vocab_size=300)
    model = Transformer(job.build_model_config())
    sizes = [p.numel() * p.element_size() for p in model.state_dict().values()]
    save_checkpoint(root, 1, {"model": ModelState(model)}, config_toml=job_config_to_toml(job))
    return sum(sizes), max(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        total, largest = _save_checkpoint(Path(tmp) / "ckpt", args.layers, args.dim)
        checkpoint = next((Path(tmp) / "ckpt").iterdir())
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-c", _EXPORT, str(checkpoint),
                                 str(Path(tmp) / "hf")], capture_output=True, text=True,
                                check=True)
        wall = time.perf_counter() - start
        report = json.loads(result.stdout.strip().splitlines()[-1])
    extra = (report["peak_kib"] - report["baseline_kib"]) * 1024
    print(f"checkpoint {total / 2**20:.0f} MiB, largest tensor {largest / 2**20:.0f} MiB; "
          f"export peak RSS above baseline {extra / 2**20:.0f} MiB "
          f"({extra / total:.2f}x the model, {extra / largest:.2f}x its largest tensor); "
          f"export {report['seconds']:.1f} s, process {wall:.1f} s")


if __name__ == "__main__":
    main()
