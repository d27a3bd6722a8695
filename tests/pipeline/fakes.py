"""A run without a transformer: a bigram policy, its own sampler and a character tokenizer,
assembled into the real ``Components`` so that the real loop, schedules, accounting,
alerts, rollback, checkpoints and resume run on them in milliseconds a step.

The bigram policy is a table of next-token logits (``TinyLM``); ``BigramEngine`` samples from
it with the request's seed, so its behaviour logprobs are the policy's and its samples are a
pure function of seed and weights, as the real engine's are. Rewards come from the config's
reward function (the tests use the digit-fraction reward), so training moves them.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file
from torch import nn

from honing.algorithms.kl_control import KLController
from honing.config import Config
from honing.data import PromptSource, arithmetic_prompts
from honing.pipeline.components import (
    Components,
    Trainers,
    policy_trainer,
    update_settings,
)
from honing.pipeline.inputs import build_scorer, tokenize_prompts
from honing.pipeline.rollout_engines import train_sampling
from honing.pipeline.rules import advantage_settings
from honing.rollout.base import Holding, RolloutEngine
from honing.trainer.layouts import OneProcess
from honing.types import Rollout

CHARS = "0123456789+= "
PAD, EOS = 0, 1


class CharTokenizer:
    """Characters of arithmetic prompts and answers; pad 0, eos 1 (distinct)."""

    pad_token, eos_token = "<pad>", "<eos>"
    pad_token_id, eos_token_id = PAD, EOS
    chat_template = None

    def __len__(self) -> int:
        return len(CHARS) + 2

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [CHARS.index(c) + 2 if c in CHARS else len(CHARS) + 1 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(CHARS[i - 2] if 2 <= i < len(CHARS) + 2 else "" for i in ids)

    def save_pretrained(self, directory) -> None:
        (Path(directory) / "tokenizer.json").write_text(json.dumps({"chars": CHARS}))


class TinyLM(nn.Module):
    """Next-token logits from the current token alone: [B, T] ids -> [B, T, V] logits."""

    def __init__(self, vocab: int, seed: int = 0):
        super().__init__()
        self.table = nn.Embedding(vocab, vocab)
        with torch.no_grad():
            self.table.weight.copy_(torch.randn(vocab, vocab, generator=_seeded(seed)) * 0.5)
        self.config = SimpleNamespace(tie_word_embeddings=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return SimpleNamespace(logits=self.table(input_ids))

    def save_pretrained(self, directory, safe_serialization: bool = True) -> None:
        save_file(self.state_dict(), str(Path(directory) / "model.safetensors"))
        (Path(directory) / "config.json").write_text(json.dumps({"model_type": "bigram"}))


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class BigramEngine(RolloutEngine):
    """Samples ``TinyLM``'s next-token distribution token by token (temperature, greedy)."""

    def __init__(self, model: TinyLM, tokenizer: CharTokenizer, holds=Holding.SHARED):
        super().__init__(holds)
        self.model, self.tokenizer = model, tokenizer
        self.calls = 0

    def generate(self, requests, params) -> list[Rollout]:
        self.calls += 1
        generator = _seeded(params.seed)
        table = self.model.table.weight.detach()
        out = []
        for request in requests:
            for _ in range(params.n):
                last, ids, logprobs = request.prompt_ids[-1], [], []
                budget = min(params.max_new_tokens, params.max_seq_len - len(request.prompt_ids))
                for _ in range(budget):
                    dist = (table[last] / params.temperature).log_softmax(-1)
                    if params.greedy:
                        token = int(dist.argmax())
                    else:
                        token = int(torch.multinomial(dist.exp(), 1, generator=generator))
                    ids.append(token)
                    logprobs.append(float(dist[token]))
                    if token == EOS:
                        break
                    last = token
                finish = "stop" if ids and ids[-1] == EOS else "length"
                text = self.tokenizer.decode(ids)
                out.append(
                    Rollout(
                        request.prompt_id,
                        request.group_index,
                        list(request.prompt_ids),
                        ids,
                        logprobs,
                        finish,
                        self.weight_version,
                        text,
                    )
                )
        return out

    def load_weights(self, version: int, weights=None) -> None:
        if weights is not None:
            own = self.model.state_dict()
            with torch.no_grad():
                for bucket in weights:
                    for name, tensor in bucket:
                        own[name].copy_(tensor)
        self.weight_version = version

    def detached_copy(self) -> BigramEngine:
        engine = BigramEngine(copy.deepcopy(self.model), self.tokenizer, Holding.COPY)
        engine.weight_version = self.weight_version
        return engine


def fake_components(config: Config, log=print) -> Components:
    """The run's parts for ``config`` around a ``TinyLM`` policy and a ``BigramEngine``: the
    real scorer, data (the built-in task), trainer engine, settings and prompt source."""
    tokenizer, t = CharTokenizer(), config.trainer
    digits = {"max_digits": config.data.max_digits, "min_digits": config.data.min_digits}
    train = arithmetic_prompts("train", config.data.train_size, t.seed, **digits)
    val = arithmetic_prompts("val", config.data.val_size, t.seed, **digits)
    rendered, prompt_ids = tokenize_prompts(train + val, tokenizer, config.rollout.max_seq_len)
    policy = TinyLM(len(tokenizer), seed=t.seed)
    engine = BigramEngine(policy, tokenizer)
    algo = config.algorithm
    return Components(
        model_path=Path("tiny-bigram"),
        device=torch.device("cpu"),
        tokenizer=tokenizer,
        trainers=Trainers(policy=policy_trainer(config, policy, OneProcess())),
        reference=None,
        engine=engine,
        val_engine=engine,
        scorer=build_scorer(config),
        train_prompts=train,
        val_prompts=val,
        prompt_ids=prompt_ids,
        rendered=rendered,
        source=PromptSource(train, config.rollout.batch_size, seed=t.seed),
        update_settings=update_settings(config),
        advantage_settings=advantage_settings(config),
        train_sampling=train_sampling(config),
        kl_controller=KLController(algo.kl_coef, algo.kl_ctrl, algo.kl_target, algo.kl_horizon),
        skipped_rows=0,
        make_scorer=lambda: build_scorer(config),
    )
