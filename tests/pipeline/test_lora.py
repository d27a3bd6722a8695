"""LoRA (model.lora_rank > 0): only the adapters train, the reference is the base with the
adapters off (no second copy), checkpoints hold the adapters and load as base + adapter, a
resumed run continues, and the fast decode path samples from the adapted policy."""

import copy
import json
import warnings

import pytest
import torch

peft = pytest.importorskip("peft")

from honing.backends.launch import train  # noqa: E402
from honing.cli import main  # noqa: E402
from honing.errors import ConfigError  # noqa: E402
from honing.models import llama_block  # noqa: E402
from honing.models.loading import (  # noqa: E402
    apply_lora,
    load_causal_lm,
    load_tokenizer,
    plain_weight_items,
    plain_weights,
)
from honing.pipeline.components import build_components  # noqa: E402
from honing.rollout.native.fast_decode import FastDecoder, supports  # noqa: E402
from tests.models.moe_models import moe_model  # noqa: E402

from ._configs import small_run_config  # noqa: E402

LORA = {"model.lora_rank": 4, "trainer.lr": 5e-2, "trainer.val_at_start": False}


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_only_adapters_train_and_the_checkpoint_is_base_plus_adapter(
    tmp_path, micro_model_dir, digit_reward
):
    config = small_run_config(
        micro_model_dir,
        digit_reward,
        **LORA | {"trainer.total_steps": 3, "checkpoint.every": 3, "algorithm.kl_coef": 0.1},
    )
    parts = build_components(config, log=lambda m: None)
    assert parts.reference is None  # the base with adapters off is the reference
    trainable = [n for n, p in parts.policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    train(config, tmp_path / "run", log=lambda m: None)
    steps = metrics(tmp_path / "run")
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["timing_s/ref"] > 0 for m in steps)  # the KL's reference pass ran
    assert any(m["actor/kl_loss"] > 0 for m in steps)  # the adapters moved off the base
    checkpoint = tmp_path / "run" / "checkpoints" / "step_3"
    assert (checkpoint / "adapter_model.safetensors").exists()
    assert (checkpoint / "adapter_config.json").exists()
    # base + adapter, loaded as PEFT users do, is the trained policy
    tokenizer = load_tokenizer(checkpoint)
    base = load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device="cpu")
    before = {k: v.clone() for k, v in base.state_dict().items()}
    loaded = peft.PeftModel.from_pretrained(base, checkpoint).eval()
    ids = torch.tensor([tokenizer.encode("12 + 7 =")])
    untouched = load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device="cpu")
    with torch.no_grad():
        adapted = loaded(input_ids=ids).logits
        plain = untouched(input_ids=ids).logits
    assert not torch.allclose(adapted, plain, atol=1e-4)  # the adapters changed the policy
    assert all(torch.equal(before[k], v) for k, v in untouched.state_dict().items() if k in before)


def test_a_lora_run_resumes_as_it_would_have_continued(tmp_path, micro_model_dir, digit_reward):
    base = LORA | {"checkpoint.every": 2}
    whole = small_run_config(micro_model_dir, digit_reward, **base | {"trainer.total_steps": 4})
    train(whole, tmp_path / "whole", log=lambda m: None)
    half = small_run_config(micro_model_dir, digit_reward, **base | {"trainer.total_steps": 2})
    train(half, tmp_path / "split", log=lambda m: None)
    train(whole, tmp_path / "split", log=lambda m: None)  # --resume auto from step 2
    a, b = metrics(tmp_path / "whole"), metrics(tmp_path / "split")
    for key in ("actor/pg_loss", "critic/score/mean"):
        assert [m[key] for m in a][2:] == [m[key] for m in b if m["step"] > 2][-2:], key


def adapted(model_dir, seed=0):
    """The micro model with LoRA adapters that do something (PEFT starts B at 0)."""
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, tokenizer, dtype="float32", device="cpu")
    model = apply_lora(model, 4, 8.0, ["q_proj", "v_proj", "down_proj"]).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    return model, tokenizer


@pytest.mark.parametrize("fuse_bytes", [4 << 20, 0], ids=["merged", "peft-forward"])
def test_fast_decode_samples_from_the_adapted_policy(micro_model_dir, fuse_bytes, monkeypatch):
    """Small adapted layers are merged into the decoder's matrices; big ones (forced here)
    run by PEFT's own forward: either way, the adapted policy's logits."""
    monkeypatch.setattr(llama_block, "FUSE_BYTES", fuse_bytes)
    model, tokenizer = adapted(micro_model_dir)
    assert supports(model) is True
    ids = torch.tensor([tokenizer.encode("12 + 7 =")])
    mask = torch.ones_like(ids)
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        want = model(input_ids=ids).logits[:, -1]
        got = FastDecoder(model).prefill(ids, mask, positions, 4)
        with model.disable_adapter():
            base = model(input_ids=ids).logits[:, -1]
    assert torch.allclose(got, want, atol=1e-4)
    assert not torch.allclose(want, base, atol=1e-3)


def test_wrapping_a_model_in_lora_does_not_warn(micro_model_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PEFT's read of a deprecated transformers name warned
        adapted(micro_model_dir)


def test_plain_weights_are_the_adapted_policy_merged(micro_model_dir):
    """What engines in other processes load: a plain model with these weights computes what
    the adapted policy computes, as PEFT's own merge does; the policy is left as it was."""
    model, tokenizer = adapted(micro_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    weights = plain_weights(model)
    plain = load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device="cpu").eval()
    base_weights = {k: v.clone() for k, v in plain.state_dict().items()}
    assert weights.keys() == base_weights.keys()
    plain.load_state_dict(weights)
    ids = torch.tensor([tokenizer.encode("12 + 7 =")])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        torch.testing.assert_close(plain(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
        with model.disable_adapter():
            base = model(input_ids=ids).logits
            assert not torch.allclose(want, base, atol=1e-3)
            for key, value in plain_weights(model).items():  # adapters off: the base
                assert torch.equal(value, base_weights[key]), key
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    for key, value in weights.items():
        torch.testing.assert_close(value, merged[key], atol=1e-6, rtol=0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [name for name, _ in plain_weight_items(model)] == list(weights)  # piece by piece


def test_adapted_embeddings_and_head_merge_too():
    """PEFT keeps an embedding's adapters apart from a linear layer's; both are merged."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2}
    config = LlamaConfig(vocab_size=50, num_hidden_layers=1, tie_word_embeddings=False, **shape)
    model = apply_lora(LlamaForCausalLM(config), 4, 8.0, ["embed_tokens", "q_proj", "lm_head"])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:  # PEFT zeroes B of a linear layer, A of an embedding
                param.normal_(0, 0.5)
    weights = plain_weights(model)
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert weights.keys() == merged.keys()
    for key, value in weights.items():
        torch.testing.assert_close(value, merged[key], atol=1e-6, rtol=0)
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(weights)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(input_ids=ids).logits)


def test_adapters_on_a_tied_embedding_are_refused_for_engines_elsewhere(
    micro_model_dir, digit_reward
):
    """The micro model ties its embeddings to the output head: merged adapters on one would
    change the other, so engines in other processes cannot get them; said at the start."""
    overrides = {
        "model.lora_rank": 4,
        "model.lora_target_modules": ["embed_tokens", "q_proj"],
        "pipeline.backend": "ray",
    }
    config = small_run_config(micro_model_dir, digit_reward, **overrides)
    with pytest.raises(ConfigError, match="embed_tokens's weight is tied to lm_head"):
        build_components(config, log=lambda m: None)


def test_lora_target_modules_must_name_modules(micro_model_dir, digit_reward):
    bad = small_run_config(
        micro_model_dir,
        digit_reward,
        **{"model.lora_rank": 4, "model.lora_target_modules": ["qq_proj"]},
    )
    with pytest.raises(ConfigError, match="qq_proj"):
        build_components(bad, log=lambda m: None)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize(
    "target, what",
    [("gate", "a mixture-of-experts router"), ("experts", "mixture-of-experts experts held")],
)
def test_lora_on_the_routers_or_experts_is_refused_naming_what_works(family, target, what):
    """Routing replay and the router statistics hook the router module itself, which PEFT
    would wrap; the experts are fused 3-D weights PEFT cannot adapt by module name."""
    model = moe_model(family, 64, 0)
    with pytest.raises(ConfigError) as info:
        apply_lora(model, 4, 8.0, [target])
    message = str(info.value)
    assert message.startswith(f"model.lora_target_modules: '{target}' names {what}")
    assert "choose among its linear layers: " in message and "o_proj" in message
    assert "\n" not in message
    assert not any("lora_" in name for name, _ in model.named_parameters())


def test_a_moe_run_with_lora_on_its_routers_stops_with_one_line(tmp_path, moe_dirs, capsys):
    out = tmp_path / "out"
    argv = [f"model.path={moe_dirs['qwen3_moe']}", "model.lora_rank=4"]
    argv += ["model.lora_target_modules=[q_proj,gate]", "--output-dir", str(out)]
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'gate' names a mixture-of-experts router" in err[0], err
    assert not out.exists()


def test_a_decoder_layer_whose_router_is_hidden_is_not_taken_by_the_lean_paths():
    model = moe_model("qwen3_moe", 64, 0)
    block = model.model.layers[0].mlp
    block.gate = torch.nn.Sequential(block.gate)  # as a wrapper would hold it: no top_k
    assert "Qwen3MoeSparseMoeBlock is neither a gated MLP" in llama_block.supports(model)
