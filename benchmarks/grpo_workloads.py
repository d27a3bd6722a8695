"""Models and data of the TRL side-by-side benchmark (benchmarks/grpo_step.py).

The peer workload is the one ../shared/peers/trl_grpo_bench.py builds: a byte-level BPE
tokenizer with one token per digit, trained on "Q: a+b=c" strings (64 entries with the
specials <pad>/<bos>/<eos>), and a random Qwen2 (hidden 128, 4 layers, 4 heads, 2 kv heads,
intermediate 256, tied embeddings; 594,560 parameters). It is rebuilt here, in our own code,
so that honing and TRL read the very same directory (the peer script reuses a directory that
already holds a config.json). Larger workloads change the body (hidden size, layers) or pad
the vocabulary with synthetic entries: tokens that encoding never produces (they have no
merges) but that the model can sample and the decoder turns into text, so the LM head and
the logits grow like those of a real 32k or 150k tokenizer. The prompts are the peer's:
256 problems drawn with ``random.Random(seed)``, the same seed giving the same problems.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


@dataclass(frozen=True)
class ModelSpec:
    """A random Qwen2 and its tokenizer; ``vocab_size=0`` keeps the trained 64-entry BPE."""

    name: str
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 0
    max_positions: int = 256


def build_tokenizer(vocab_size: int = 0):
    """The peer's BPE tokenizer, padded with synthetic entries up to ``vocab_size``.

    Returns a left-padding ``PreTrainedTokenizerFast`` with pad != eos.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [f"Q: {a}+{b}={a + b}" for a in range(100) for b in range(100)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=64, special_tokens=[PAD, BOS, EOS], show_progress=False
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    if vocab_size > tok.get_vocab_size():
        spec = json.loads(tok.to_str())
        vocab = spec["model"]["vocab"]
        # "x" never occurs in the corpus, so these entries cannot clash with trained ones;
        # without merges, encoding never produces them: the prompts tokenize as before.
        index = 0
        while len(vocab) < vocab_size:
            vocab.setdefault(f"x{index}", len(vocab))
            index += 1
        tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        padding_side="left",
        truncation_side="left",
    )


def build_model_dir(spec: ModelSpec, model_dir: Path, seed: int = 42) -> int:
    """Writes tokenizer + random Qwen2 to ``model_dir`` unless it is there; returns params."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    marker = model_dir / "params.txt"
    if (model_dir / "config.json").exists() and marker.exists():
        return int(marker.read_text())
    tokenizer = build_tokenizer(spec.vocab_size)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, key, getattr(tokenizer, key))
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    params = model.num_parameters()
    marker.write_text(str(params))
    return params


def peer_problems(count: int, seed: int) -> list[tuple[str, str]]:
    """``(prompt, answer)`` pairs exactly as the peer script's ``build_dataset`` draws them."""
    rng = random.Random(seed)
    problems = []
    for _ in range(count):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        problems.append((f"Q: {a}+{b}=", str(a + b)))
    return problems


def peer_data(work: Path, seed: int) -> dict[str, Path]:
    """The peer workload's train (256) and validation (8) problems as JSONL under ``work``."""
    return {
        "train": write_rows(work / "data" / "train.jsonl", peer_problems(256, seed)),
        "val": write_rows(work / "data" / "val.jsonl", peer_problems(8, seed + 1)),
    }


def alternating(rounds: int, names) -> list[tuple[int, str]]:
    """``(round, name)`` for every round, each round in the other order than the one before,
    so that drift on the machine falls on every variant alike."""
    names = list(names)
    return [
        (index, name)
        for index in range(rounds)
        for name in (names if index % 2 == 0 else names[::-1])
    ]


def write_rows(path: Path, problems: list[tuple[str, str]]) -> Path:
    """The problems as JSONL in verl's row schema (honing's ``data.train_files``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for index, (prompt, answer) in enumerate(problems):
            row = {
                "prompt": prompt,
                "data_source": "bench_addition",
                "reward_model": {"ground_truth": answer},
                "extra_info": {"index": index},
            }
            handle.write(json.dumps(row) + "\n")
    return path
