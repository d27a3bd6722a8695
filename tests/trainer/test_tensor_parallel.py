"""Tensor parallelism (``trainer.tensor_parallel``): each family's plan (which projections
split which way), what is refused, and on gloo ranks the test spawns: every planned family's
forward and gradients split over 2 ranks as one process computes them; the policy split over
2 ranks, alone or under FSDP over 2 slots (2-D), ends two policy updates where one process
does; a checkpoint saved under TP x FSDP resumes under FSDP alone and in one process to the
same weights; every rank gathers the same whole tensors for the rollout engines and
exports."""

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from transformers import AutoConfig, AutoModelForCausalLM

from honing.errors import ConfigError
from honing.models.loading import load_causal_lm, load_tokenizer
from honing.trainer.batch import collate
from honing.trainer.engine import TrainedModule, make_layout
from honing.trainer.layouts import OneProcess
from honing.trainer.policy_update import UpdateSettings, update_policy
from honing.trainer.tensor_parallel import PLANS, layer_plans, parallelize

from .ranks import on_ranks
from .test_policy_update import PAD, make_rollouts

CPU = torch.device("cpu")
# each planned family, small: 4 query and 2 key/value heads of 8, an MLP of 64; the MoE ones
# with 4 experts (Qwen3-MoE's first layer dense)
SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
SMALL |= {"num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "vocab_size": 64}
SMALL |= {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
FAMILIES = {family: {} for family in PLANS}
FAMILIES["qwen2"] = {"head_dim": None}  # it has no head_dim setting: hidden / heads
FAMILIES["qwen3_moe"] = {"num_experts": 4, "moe_intermediate_size": 16, "mlp_only_layers": [0]}
FAMILIES["qwen3_moe"] |= {"num_experts_per_tok": 2}
FAMILIES["mixtral"] = {"num_local_experts": 4}
SPLIT = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def small_model(family: str, **changes) -> torch.nn.Module:
    torch.manual_seed(0)
    options = SMALL | FAMILIES.get(family, {}) | changes
    settings = {k: v for k, v in options.items() if v is not None}
    config = AutoConfig.for_model(family, **settings)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", sorted(PLANS))
def test_each_family_splits_attention_and_dense_mlps_by_columns_then_rows(family):
    plans = layer_plans(small_model(family), 2)
    dense_layers = {"qwen3_moe": [0], "mixtral": []}.get(family, [0, 1])
    head_norms = {"qwen3": 2, "qwen3_moe": 2, "gemma3_text": 1}.get(family)
    for index, (_, plan) in enumerate(plans):
        split = SPLIT + (MLP if index in dense_layers else ())
        split += ("self_attn.q_norm", "self_attn.k_norm") if head_norms else ()
        assert sorted(plan) == sorted(split)
        for path, style in plan.items():
            if path.endswith("_norm"):  # split along the heads of its input
                assert isinstance(style, SequenceParallel)
                assert style.sequence_sharding[0].dim == head_norms
                continue
            rows = path.endswith(("o_proj", "down_proj"))
            assert isinstance(style, RowwiseParallel if rows else ColwiseParallel), path


@pytest.mark.parametrize(
    "family, changes, size, message",
    [
        ("phi3", {}, 2, "Phi3ForCausalLM .model_type phi3. has no tensor-parallel plan; plans "),
        ("llama", {}, 4, "2 key/value heads .num_key_value_heads. do not divide by 4"),
        ("qwen3", {"num_attention_heads": 3}, 3, "2 key/value heads"),
        ("qwen3", {"num_key_value_heads": 4}, 3, "4 attention heads .* do not divide by 3"),
        ("llama", {"intermediate_size": 66, "num_key_value_heads": 4}, 4, "gate_proj has 66 out"),
    ],
)
def test_what_a_plan_cannot_split_is_refused_in_one_line(family, changes, size, message):
    with pytest.raises(ConfigError, match=f"^trainer.tensor_parallel={size}: .*{message}") as err:
        layer_plans(small_model(family, **changes), size)
    assert "\n" not in str(err.value)


def _family_gaps() -> dict[str, tuple[float, float]]:
    """Each planned family split over this process's 2 ranks against its whole self: the
    largest gap of the logits and of the gradients (a slice gathered whole)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    gaps = {}
    for family in sorted(PLANS):
        whole = small_model(family)
        split = parallelize(copy.deepcopy(whole), mesh)
        outputs = []
        for model in (whole, split):
            logits = model(input_ids=ids).logits  # [2, 9, V]
            logits.log_softmax(-1)[..., 5].sum().backward()
            outputs.append(logits.detach())
        grads = [
            (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) - q.grad
            for p, q in zip(split.parameters(), whole.parameters(), strict=True)
        ]
        gap = max(float(g.abs().max()) for g in grads)
        gaps[family] = (float((outputs[0] - outputs[1]).abs().max()), gap)
    return gaps


@pytest.mark.slow  # gloo ranks spawned, each importing torch
def test_every_planned_family_split_over_two_ranks_computes_what_one_process_does(tmp_path):
    for rank in on_ranks(_family_gaps, str(tmp_path / "rank"), 2):
        for family, (logits, grads) in rank.items():
            assert logits < 1e-5 and grads < 1e-5, family


# two mini-batches of 6 in micro-batches of 2; a clip far under the gradients' norm, so that
# every step is scaled by the global norm (a rank's own norm would scale it otherwise)
SETTINGS = dataclasses.replace(
    UpdateSettings(kl_coef=0.05, entropy_coef=0.01, grad_clip=0.05),
    mini_batch_sequences=6,
    micro_batch_size=2,
)
CALLS = 2  # policy updates, each of two optimizer steps


def _engine(model_dir: str, layout) -> TrainedModule:
    torch.manual_seed(0)
    model = load_causal_lm(model_dir, load_tokenizer(model_dir), dtype="float32", device=CPU)

    def optimizer(module):  # momentum: state to save and reshard; the step is linear in it
        return torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9), None

    return TrainedModule.laid_out("policy", model, layout, optimizer, serves_generation=True)


def _update(engine: TrainedModule, call: int) -> None:
    batch = collate(make_rollouts(seed=call), pad_id=PAD, device=CPU)
    gen = torch.Generator().manual_seed(1 + call)
    advantages = torch.randn(batch.responses.shape, generator=gen) * batch.response_mask
    old = torch.randn(batch.responses.shape, generator=gen) * 0.1 - 2.0
    ref = torch.randn(batch.responses.shape, generator=gen) * 0.1 - 2.0
    generator = torch.Generator().manual_seed(5 + call)
    update_policy(
        engine, batch, advantages, SETTINGS, old_logprobs=old, ref_logprobs=ref, generator=generator
    )


def _whole(engine: TrainedModule) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in engine.whole_tensors()}


def _on_rank(
    model_dir: str, strategy: str, tensor: int, shards: str | None, resume: str | None = None
) -> dict:
    """Two updates under the layout; with ``shards``, the state saved after the first, and
    with ``resume`` (a strategy) that state read back under it (without tensor parallelism)
    and the second update run again."""
    engine = _engine(model_dir, make_layout(strategy, dist.group.WORLD, tensor=tensor))
    for call in range(CALLS):
        if call == 1 and shards:
            engine.save_shards({"policy": engine.state()}, shards)
        _update(engine, call)
    sent = [piece for bucket in engine.weights() for piece in bucket]
    resumed = None
    if resume:
        again = _engine(model_dir, make_layout(resume, dist.group.WORLD))
        template = {"policy": again.state(template=True)}
        again.load_shards(template, shards)
        again.load_state(template["policy"])
        _update(again, 1)
        resumed = _whole(again)
    return {
        "resumed": resumed,
        "whole": _whole(engine),
        "sent": [name for name, _ in sent],
        "slot": engine.data_parallel_size,
        "split": sorted(
            name for name, p in engine.module.named_parameters() if isinstance(p, DTensor)
        ),
    }


def _one_process(model_dir: str, shards: str | None = None) -> dict[str, torch.Tensor]:
    """Two updates in one process; with ``shards``, the first's state read from them."""
    engine = _engine(model_dir, OneProcess())
    if shards:
        template = {"policy": engine.state(template=True)}
        engine.load_shards(template, shards)
        engine.load_state(template["policy"])
    for call in range(1 if shards else 0, CALLS):
        _update(engine, call)
    return _whole(engine)


def _assert_same(got: dict, want: dict, before: dict) -> float:
    """Every tensor within 1e-5 of ``want``'s; most of them moved. The largest gap. (A
    sharded gather gives the tied head once, as the embeddings.)"""
    assert got.keys() <= want.keys() and want.keys() - got.keys() <= {"lm_head.weight"}
    want = {name: want[name] for name in got}
    gap = max(float((got[n] - want[n]).abs().max()) for n in want)
    moved = sum(bool((want[n] - before[n]).abs().max() > 1e-6) for n in want)
    assert moved >= len(want) // 2  # the updates did change the weights
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-5, rtol=0, msg=name)
    return gap


@pytest.fixture(scope="module")
def one_process(micro_model_dir):
    before = _whole(_engine(str(micro_model_dir), OneProcess()))
    return _one_process(str(micro_model_dir)), before


@pytest.mark.slow  # gloo ranks spawned, each importing torch
def test_two_tensor_parallel_ranks_update_as_one_process(micro_model_dir, one_process, tmp_path):
    want, before = one_process
    args = (str(micro_model_dir), "replicate", 2, None)
    ranks = on_ranks(_on_rank, str(tmp_path / "rank"), 2, *args)
    for rank in ranks:
        _assert_same(rank["whole"], want, before)
        assert rank["slot"] == 1  # both ranks run every row
    # the attention and MLP projections are split; embeddings and norms are whole
    split = ranks[0]["split"]
    assert split == sorted(
        f"model.layers.{i}.{path}.weight"
        for i in range(2)
        for path in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        + ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    )
    assert "lm_head.weight" not in ranks[0]["sent"]  # the tied head is sent once


@pytest.mark.slow
def test_tensor_parallel_under_fsdp_updates_as_one_process_and_resumes_in_one(
    micro_model_dir, one_process, tmp_path
):
    """TP=2 x FSDP=2 on 4 ranks (2-D: split within a slot, sharded over the slots); its
    checkpoint of the first update's state read back by FSDP over the 4 ranks, and by one
    process, each of which goes on to the same weights."""
    want, before = one_process
    shards = str(tmp_path / "shards")
    args = (str(micro_model_dir), "fsdp", 2, shards, "fsdp")
    ranks = on_ranks(_on_rank, str(tmp_path / "rank"), 4, *args)
    for rank in ranks:
        _assert_same(rank["whole"], want, before)
        _assert_same(rank["resumed"], want, before)
        assert rank["slot"] == 2
    _assert_same(_one_process(str(micro_model_dir), shards), want, before)
