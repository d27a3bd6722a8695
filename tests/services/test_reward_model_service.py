"""The reward-model service: a small sequence-classification model made in the test, scored
through /score with dynamic batching; batched scores equal one-at-a-time scores."""

import threading

import httpx
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from honing.services.reward_model import RewardModelScorer, reward_model_app
from tests.services._metrics import scraped, value


@pytest.fixture(scope="module")
def reward_model_dir(micro_model_dir, tmp_path_factory):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(micro_model_dir, num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(micro_model_dir)
    out = tmp_path_factory.mktemp("rm")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


TEXTS = [("12+5=", "17"), ("3+4=", "7 because"), ("1+1=", "2"), ("90+9=", "99 ok then")]


def _alone(path, prompt, response):
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.inference_mode():
        return model(**tokenizer(prompt + response, return_tensors="pt")).logits[0, 0].item()


def test_batched_scores_equal_single_scores(reward_model_dir):
    scorer = RewardModelScorer(str(reward_model_dir), device="cpu", max_batch=8, max_wait_ms=50)
    items = [{"prompt": p, "response": r} for p, r in TEXTS]
    results = scorer.score_batch(items)
    expected = [_alone(reward_model_dir, p, r) for p, r in TEXTS]
    assert [r["score"] for r in results] == pytest.approx(expected, abs=1e-4)
    assert scorer.batch_sizes == [4]  # padded together, still the same scores
    scorer.close()


def test_concurrent_requests_share_forward_passes(serve, reward_model_dir):
    app = reward_model_app(str(reward_model_dir), device="cpu", max_batch=16, max_wait_ms=100)
    url = serve(app)
    answers = []

    def post(prompt, response):
        payload = {"items": [{"prompt": prompt, "response": response}]}
        answers.append(httpx.post(f"{url}/score", json=payload, timeout=30).json())

    threads = [threading.Thread(target=post, args=pair) for pair in TEXTS * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == 8 and all(a["results"][0]["score"] is not None for a in answers)
    health = httpx.get(f"{url}/health").json()
    assert health["service"] == "reward-model" and health["items_scored"] == 8
    assert health["forward_passes"] < 8  # requests in flight together share a forward pass
    metrics = scraped(url)
    assert value(metrics, "honing_requests_total", service="reward-model", code="200") == 8


def test_missing_model_is_one_clear_error(tmp_path):
    from honing.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot load a sequence-classification model"):
        RewardModelScorer(str(tmp_path / "nope"))


def test_items_need_a_response_but_no_ground_truth(serve, reward_model_dir):
    url = serve(reward_model_app(str(reward_model_dir), device="cpu"))
    scored = httpx.post(
        f"{url}/score", json={"items": [{"prompt": "1+1=", "response": "2"}]}, timeout=30
    )
    assert scored.status_code == 200 and scored.json()["results"][0]["score"] is not None
    missing = httpx.post(f"{url}/score", json={"items": [{"prompt": "1+1="}]}, timeout=30)
    assert missing.status_code == 422
    assert (
        missing.json()["error"] == "items[0].response: missing or null (every item needs response)"
    )


def test_a_checkpoint_without_a_reward_head_is_refused(micro_model_dir):
    """A causal-LM checkpoint has no score head: transformers would start it at random."""
    from honing.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        RewardModelScorer(str(micro_model_dir), device="cpu")
    assert str(refused.value) == (
        f"--model: {micro_model_dir} has no weights for score.weight (the reward head would "
        "start at random): it was saved as LlamaForCausalLM. Serve a sequence-classification "
        "reward model (saved from AutoModelForSequenceClassification with num_labels=1)"
    )


def test_serving_it_is_one_line_and_status_2(micro_model_dir, monkeypatch, capfd):
    from honing.cli import main
    from honing.services import server

    def serve(*args):
        raise AssertionError("served a reward model whose head is random")

    monkeypatch.setattr(server, "serve", serve)
    assert main(["serve", "reward-model", "--model", str(micro_model_dir), "--port", "0"]) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"honing: error: --model: {micro_model_dir} has no weights for ")
    assert err.count("\n") == 1
