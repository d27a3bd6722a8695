"""The demo with LoRA adapters: does the built-in task still learn, and does the checkpoint load
as base + adapter the way PEFT users load one?

Runs ``examples/arithmetic.yaml`` with ``model.lora_rank`` (PEFT adapters on every projection;
only they train) for ``--steps`` steps, then loads the final checkpoint with
``PeftModel.from_pretrained(base, checkpoint)`` and checks that its greedy answers to the
validation prompts are the run's own (the validation accuracy recomputed from the loaded
model). Writes benchmarks/results/lora_demo.{json,md}.

    .venv/bin/python -m benchmarks.lora_demo [--steps 500] [--rank 16] [--lr 1e-3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="honing-lora-")) / "run"
    overrides = [
        f"model.lora_rank={args.rank}",
        f"trainer.lr={args.lr}",
        f"trainer.total_steps={args.steps}",
        f"checkpoint.every={args.steps}",
        "monitor.console=false",
    ]
    command = [sys.executable, "-m", "honing.cli", "train", "examples/arithmetic.yaml"]
    subprocess.run(
        command + overrides + ["--output-dir", str(run_dir), "--resume", "never"],
        check=True,
        cwd=ROOT,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    checkpoint = run_dir / "checkpoints" / f"step_{args.steps}"
    files = sorted(p.name for p in checkpoint.iterdir())

    from peft import PeftModel

    from honing.config import build_config, load_yaml
    from honing.models.loading import load_causal_lm, load_tokenizer
    from honing.pipeline.components import resolve_model_path
    from honing.pipeline.evaluate import validate
    from honing.pipeline.inputs import load_datasets, tokenize_prompts
    from honing.rewards import Scorer, numeric_reward
    from honing.rollout.base import SamplingParams
    from honing.rollout.native.engine import TransformersEngine

    config = build_config(load_yaml(ROOT / "examples" / "arithmetic.yaml"))
    base_dir = resolve_model_path(config, log=lambda m: None)
    tokenizer = load_tokenizer(checkpoint)
    base = load_causal_lm(base_dir, tokenizer, dtype="float32", device=torch.device("cpu"))
    model = PeftModel.from_pretrained(base, checkpoint).eval()
    _, val, _ = load_datasets(config)
    rendered, ids = tokenize_prompts(val, tokenizer, config.rollout.max_seq_len)
    engine = TransformersEngine(model, tokenizer, device=torch.device("cpu"))
    sampling = SamplingParams(max_new_tokens=config.rollout.max_new_tokens)
    loaded = validate(engine, Scorer(numeric_reward), val, ids, rendered, sampling, 1)
    record = {
        "command": "python -m benchmarks.lora_demo "
        f"--steps {args.steps} --rank {args.rank} --lr {args.lr}",
        "overrides": overrides,
        "val_accuracy_start": summary["val_accuracy_start"],
        "val_accuracy_end": summary["val_accuracy_end"],
        "pass_at_k_start": summary["pass_at_k_start"],
        "pass_at_k_end": summary["pass_at_k_end"],
        "training_seconds": summary["seconds"],
        "checkpoint_files": files,
        "val_accuracy_of_base_plus_adapter": loaded["val/accuracy"],
        "curve": summary["curve"],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "lora_demo.json").write_text(json.dumps(record, indent=1))
    text = (
        "# The demo with LoRA adapters\n\n"
        f"`{record['command']}` (examples/arithmetic.yaml with {' '.join(overrides[:2])}).\n\n"
        f"- greedy validation accuracy: {record['val_accuracy_start']:.3f} -> "
        f"{record['val_accuracy_end']:.3f} in {args.steps} steps "
        f"({record['training_seconds']:.0f} s of training); pass@8 "
        f"{record['pass_at_k_start']:.3f} -> {record['pass_at_k_end']:.3f}\n"
        f"- checkpoint files: {', '.join(files)}\n"
        "- loaded as `PeftModel.from_pretrained(base, checkpoint)`: greedy validation accuracy "
        f"{record['val_accuracy_of_base_plus_adapter']:.3f}\n"
    )
    (RESULTS / "lora_demo.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
