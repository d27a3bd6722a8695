"""The trainer engine's layout-dependent operations on gloo ranks spawned by the test: a
sharded (FSDP2) and a replicated policy give every rank what one process has, for passes
without gradient over an odd number of rows (a rank short of rows runs a masked copy), whole
tensors gathered a tensor at a time, whole tensors loaded into shards, and metric sums."""

import pytest
import torch
import torch.distributed as dist

from honing.models.loading import load_causal_lm, load_tokenizer
from honing.trainer.batch import collate, response_logprobs
from honing.trainer.engine import TrainedModule, make_layout

from .ranks import on_ranks
from .test_policy_update import PAD, make_rollouts

pytestmark = pytest.mark.slow  # gloo ranks spawned, each importing torch

CPU = torch.device("cpu")
WORLD = 2
ROWS = 5  # odd: rank 1 has one row fewer, and pads its share


def _policy(model_dir: str, strategy: str, group) -> TrainedModule:
    torch.manual_seed(0)
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, tokenizer, dtype="float32", device=CPU)

    def optimizer(module):
        return torch.optim.SGD(module.parameters(), lr=0.1), None

    return TrainedModule.laid_out(
        "policy", model, make_layout(strategy, group), optimizer, serves_generation=True
    )


def _logprobs(policy: TrainedModule, batch) -> torch.Tensor:
    width = batch.responses.shape[1]
    with torch.no_grad():
        return policy.forward_rows(
            lambda rows: response_logprobs(policy.module, rows)[0], batch, width
        )


def _on_rank(model_dir: str) -> dict:
    rank = dist.get_rank()
    batch = collate(make_rollouts()[:ROWS], pad_id=PAD, device=CPU)
    found = {}
    for strategy in ("fsdp", "replicate"):
        policy = _policy(model_dir, strategy, dist.group.WORLD)
        found[strategy] = {
            "sharded": policy.is_sharded,
            "world": policy.world_size,
            "logprobs": _logprobs(policy, batch),
            "whole": {name: t.clone() for name, t in policy.whole_tensors()},
            "rows": [(c.tolist(), real) for c, real in policy.rows(torch.arange(ROWS), 2)],
            "sum": float(policy.reduce({"x": torch.tensor(rank + 1.0)})["x"]),
        }
        # whole tensors into this rank's shards: read back whole, they are what went in
        doubled = [(name, t * 2) for name, t in found[strategy]["whole"].items()]
        assert policy.load_tensors(doubled + [("not.a.weight", torch.zeros(1))]) == ["not.a.weight"]
        found[strategy]["reloaded"] = {n: t.clone() for n, t in policy.whole_tensors()}
        found[strategy]["generation_is_module"] = policy.generation_module is policy.module
    return found


def test_sharded_and_replicated_ranks_see_what_one_process_sees(micro_model_dir, tmp_path):
    model_dir = str(micro_model_dir)
    alone = _policy(model_dir, "fsdp", group=None)  # no group: whole in this process
    assert not alone.is_sharded and alone.world_size == 1
    batch = collate(make_rollouts()[:ROWS], pad_id=PAD, device=CPU)
    want_logprobs = _logprobs(alone, batch)
    want_whole = dict(alone.module.state_dict())
    ranks = on_ranks(_on_rank, str(tmp_path / "rank"), WORLD, model_dir)
    for rank, found in enumerate(ranks):
        sharded, replicated = found["fsdp"], found["replicate"]
        assert (sharded["sharded"], sharded["world"]) == (True, WORLD)
        assert (replicated["sharded"], replicated["world"]) == (False, WORLD)
        # Every rank gets the whole batch's logprobs of response tokens, as one process
        # computes them (sharded: each computed its rows and they were gathered; replicated:
        # each ran all of them). Past a row's response there is padding, masked in every use.
        mask = batch.response_mask.bool()
        for layout in (sharded, replicated):
            got = layout["logprobs"][mask]
            torch.testing.assert_close(got, want_logprobs[mask], atol=1e-5, rtol=1e-5)
            assert layout["sum"] == 3.0  # 1 + 2
        # Whole tensors, gathered from the shards; the tied head is given once, as the
        # embedding (Sharded skips a tensor whose storage it gave already).
        assert set(replicated["whole"]) == set(want_whole)
        assert set(sharded["whole"]) <= set(want_whole)
        assert "model.embed_tokens.weight" in sharded["whole"]
        for name, tensor in sharded["whole"].items():
            torch.testing.assert_close(tensor, want_whole[name], atol=0, rtol=0)
            torch.testing.assert_close(sharded["reloaded"][name], 2 * want_whole[name])
        # Rows r, r + 2, ... of 5; the sharded rank short of one runs a masked copy of its first.
        mine = list(range(ROWS))[rank::WORLD]
        micro_batches = [mine[start : start + 2] for start in range(0, len(mine), 2)]
        assert [rows for rows, _ in replicated["rows"]] == micro_batches
        assert sum(real for _, real in sharded["rows"]) == len(mine)
        assert [len(rows) for rows, _ in sharded["rows"]] == [2, 1]  # as many on every rank
        # A sharded policy samples from a whole copy; a replicated one from the module itself.
        assert not sharded["generation_is_module"] and replicated["generation_is_module"]
