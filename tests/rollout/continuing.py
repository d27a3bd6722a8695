"""Samples continued over several generate calls, as partial rollouts continue them: the
tests of engines that keep a sample's cache between calls share this driver."""

from dataclasses import replace

from honing.rollout.base import GenerationRequest


def continued(engine, requests, params, calls, *, keyed=True, reseed=False, between=None):
    """Each of ``requests`` continued as one sample over ``calls`` calls of
    ``params.max_new_tokens`` tokens, keyed by its prompt id (or not); ``reseed``: call i
    samples with seed i; ``between(i)`` runs after call i. Returns prompt id -> (token ids,
    logprobs) made."""
    made = {r.prompt_id: ([], []) for r in requests}
    going = {r.prompt_id for r in requests}
    for call in range(calls):
        asked = [
            GenerationRequest(
                r.prompt_id,
                r.prompt_ids + made[r.prompt_id][0],
                i,
                key=r.prompt_id if keyed else None,
            )
            for i, r in enumerate(requests)
            if r.prompt_id in going
        ]
        if not asked:
            break
        for rollout in engine.generate(asked, replace(params, seed=call) if reseed else params):
            made[rollout.prompt_id][0].extend(rollout.response_ids)
            made[rollout.prompt_id][1].extend(rollout.behaviour_logprobs)
            if rollout.finish_reason != "length":
                going.discard(rollout.prompt_id)
        if between is not None:
            between(call)
    return made
