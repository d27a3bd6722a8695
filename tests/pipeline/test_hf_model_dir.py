"""Any local Hugging Face causal-LM directory works: here a Qwen2 whose tokenizer has a chat
template and pad == eos, trained on a chat-format JSONL file in verl's row schema."""

import json

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from honing.cli import main
from honing.models.loading import PAD_TOKEN
from honing.models.tiny import build_tokenizer

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_model_dir(path):
    tokenizer = build_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token  # as many released tokenizers ship
    tokenizer.chat_template = TEMPLATE
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_rows(path, count):
    with path.open("w") as out:
        for i in range(count):
            row = {
                "prompt": [{"role": "user", "content": f"{i}+1="}],
                "data_source": "toy",
                "reward_model": {"ground_truth": str(i + 1)},
                "extra_info": {"index": i},
            }
            out.write(json.dumps(row) + "\n")


def test_chat_model_with_pad_equal_to_eos(tmp_path, digit_reward):
    model_dir = make_model_dir(tmp_path / "qwen-ish")
    write_rows(tmp_path / "train.jsonl", 12)
    write_rows(tmp_path / "val.jsonl", 4)
    run = tmp_path / "run"
    status = main(
        [
            "train",
            f"model.path={model_dir}",
            f"reward.function={digit_reward}",
            f"data.train_files=[{tmp_path / 'train.jsonl'}]",
            f"data.val_files=[{tmp_path / 'val.jsonl'}]",
            "trainer.total_steps=2",
            "rollout.batch_size=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=3",
            "rollout.val_samples=2",
            "monitor.console=false",
            "--output-dir",
            str(run),
        ]
    )
    assert status == 0
    samples = [json.loads(line) for line in (run / "samples.jsonl").open()]
    # The chat template rendered the prompt (role markers, generation prompt).
    assert all(s["prompt"].startswith("<|user|>") for s in samples)
    assert all(s["prompt"].endswith("<|assistant|>") for s in samples)
    # A pad distinct from EOS was added, and the checkpoint carries it.
    saved = json.loads((run / "checkpoints" / "step_2" / "tokenizer_config.json").read_text())
    assert saved["pad_token"] == PAD_TOKEN
