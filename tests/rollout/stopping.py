"""``SamplingParams.stop_ids`` (the turn loop's closing tag), as the engine tests check it:
the same call made without and with a stop id, each sample drawn with the same seed."""

from dataclasses import replace


def assert_cut_at_a_stop_id(engine, requests, params) -> None:
    """Generates ``requests`` freely, then again with the second token of the longest
    response as a stop id: each sample must be the free one cut after its first such token,
    as ``stop``; at least one has it."""
    free = engine.generate(requests, params)
    stop = max(free, key=lambda r: len(r.response_ids)).response_ids[1]
    cut = engine.generate(requests, replace(params, stop_ids=(stop,)))
    stopped = 0
    for whole, part in zip(free, cut, strict=True):
        ids = whole.response_ids
        if stop in ids:
            ids, stopped = ids[: ids.index(stop) + 1], stopped + 1
            assert part.finish_reason == "stop"
        assert part.response_ids == ids
    assert stopped >= 1
