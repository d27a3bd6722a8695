"""The generative judge as reward: its prompt, its verdict parsers, its client against a fake
OpenAI completions server (batches, the model it asks, format errors scored and counted),
and ``honing train`` with a judge served by ``honing serve rollout`` on loopback, and with a
judge that hangs. (Its timeouts, retries, replicas and cache: tests/rewards/test_remote.py
runs every fault test for it.)"""

import json
import threading
import time
from http.server import ThreadingHTTPServer

import pytest

from honing.backends.launch import train
from honing.config import build_config
from honing.errors import ConfigError
from honing.pipeline.rules import check_config
from honing.rewards.judge import JudgeClient, base_url, read_label, read_score, render
from tests.pipeline._configs import BASE, small_run_config
from tests.rewards.test_remote import _Handler
from tests.warm import start_service


def test_the_prompt_shows_the_question_the_answer_and_the_reference():
    item = {"prompt": "2+2=", "response": "4 {reference}", "ground_truth": "4"}
    assert render("Q {question} A {answer} R {reference}", item) == "Q 2+2= A 4 {reference} R 4"
    assert render("R {reference}", {"response": "x"}) == "R (none)"


def test_a_score_is_the_reply_s_last_number_in_range():
    assert read_score("reasons 3 and 4... Score: 7", 10.0) == 0.7
    assert read_score("Score: 1", 1.0) == 1.0 and read_score("Score: .5", 1.0) == 0.5
    assert read_score("Score: 11", 10.0) is None and read_score("Score: -1", 1.0) is None
    assert read_score("no number", 1.0) is None


def test_a_label_is_the_last_whole_word_of_the_labels():
    labels = {"correct": 1.0, "incorrect": 0.0}
    assert read_label("It is INCORRECT.", labels) == 0.0  # not the "correct" inside it
    assert read_label("incorrect at first, but Correct", labels) == 1.0
    assert read_label("correctly done", labels) is None


def test_an_endpoint_is_taken_with_or_without_the_api_path():
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/completions"):
        assert base_url(url) == "http://h:1"
        assert JudgeClient.endpoint_url(url) == "http://h:1/v1/completions"


class _Judge(_Handler):
    """A judge that replies ``server.reply(prompt)`` to every prompt (the verifier tests'
    server's way of answering)."""

    def do_GET(self):  # noqa: N802 - http.server's name
        self._send({"object": "list", "data": [{"id": "served-judge"}]})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        time.sleep(self.server.delay)
        choices = [{"index": i, "text": self.server.reply(p)} for i, p in enumerate(body["prompt"])]
        self._send({"choices": choices})


@pytest.fixture
def judge():
    """``start(reply, delay=0)``: a fake judge on loopback; its URL."""
    started = []

    def start(reply, delay=0.0):
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
        httpd.reply, httpd.delay, httpd.bodies = reply, delay, []
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        started.append(httpd)
        return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"

    yield start
    for httpd in started:
        httpd.shutdown()


def _items(*answers):
    return [{"prompt": "2+2=", "response": a, "ground_truth": "4"} for a in answers]


def test_a_batch_is_one_request_of_prompts_and_each_reply_its_verdict(judge):
    replies = {"4": "correct", "5": "The answer is incorrect", "?": "I cannot tell"}
    httpd, url = judge(lambda prompt: replies[prompt.split("Answer to grade:\n")[1][0]])
    client = JudgeClient(url, verdict="label", request_items=8, format_score=-1.0)
    results = client.score_batch(_items("4", "5", "?", "4"))
    assert [r["score"] for r in results] == [1.0, 0.0, -1.0, 1.0]
    assert results[2]["judge_format_error"] == 1 and results[2]["judge_reply"] == "I cannot tell"
    assert client.last_metrics["reward/judge_format_errors"] == 1
    [body] = httpd.bodies  # one request; the repeated item sent once
    assert body["model"] == "served-judge" and len(body["prompt"]) == 3
    assert body["temperature"] == 0.0 and body["max_tokens"] == 64
    assert "2+2=" in body["prompt"][0] and "Reference answer:\n4" in body["prompt"][0]
    again = client.score_batch(_items("5"))  # cached
    assert again[0]["score"] == 0.0 and len(httpd.bodies) == 1
    client.close()


@pytest.mark.parametrize(
    "values, message",
    [
        ({"reward.function": "judge"}, "reward.judge_endpoint is empty"),
        ({"reward.judge_endpoint": "http://127.0.0.1:1"}, "no reward asks the judge"),
        (
            {
                "reward.function": "judge",
                "reward.judge_endpoint": "http://127.0.0.1:1",
                "reward.judge_template": "Grade {question}",
            },
            "no {answer}",
        ),
    ],
)
def test_a_judge_without_its_servers_or_its_answer_is_one_line(values, message):
    with pytest.raises(ConfigError, match=message) as refused:
        check_config(build_config(BASE | values))
    assert "\n" not in str(refused.value)


def _metrics(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if m["step"] >= 1]


@pytest.mark.slow
def test_a_run_trains_on_a_served_judge_and_goes_on_when_the_judge_hangs(
    tmp_path, micro_model_dir, judge, monkeypatch
):
    """A random model served by ``honing serve rollout`` judges 3 steps: its replies are
    mostly not verdicts, scored 0 and counted, and the run trains on. A judge that answers
    past reward.timeout_s fails its items, which reward.on_error=zero scores 0 and counts."""
    process, url = start_service("rollout", "--model", str(micro_model_dir))
    try:
        values = {
            "reward.judge_endpoint": url,
            "reward.judge_max_tokens": 4,
            "trainer.total_steps": 3,
            "trainer.val_at_start": False,
        }
        config = small_run_config(micro_model_dir, "judge", **values)
        train(config, tmp_path / "served", resume="never", log=lambda message: None)
    finally:
        process.kill()
        process.wait()
    served = _metrics(tmp_path / "served")
    assert [m["step"] for m in served] == [1, 2, 3]
    errors = sum(m["reward/judge_format_errors"] for m in served)
    generated = sum(m["samples/generated"] for m in served)
    assert 0 < errors <= generated and all(m["samples/score_errors"] == 0 for m in served)
    _, hung = judge(lambda prompt: "Score: 1", delay=2.0)
    # the final validation's scores fail too: tried again at once, not after 1 s and 2 s
    monkeypatch.setattr("honing.pipeline.evaluate.RESCORE_WAITS_S", (0.0,))
    values = {
        "reward.judge_endpoint": hung,
        "reward.timeout_s": 0.5,
        "reward.retries": 0,
        "reward.on_error": "zero",
        "trainer.total_steps": 2,
        "trainer.val_at_start": False,
    }
    config = small_run_config(micro_model_dir, "judge", **values)
    train(config, tmp_path / "hung", resume="never", log=lambda message: None)
    hung_steps = _metrics(tmp_path / "hung")
    assert [m["step"] for m in hung_steps] == [1, 2]
    assert all(m["samples/score_errors"] == m["samples/generated"] > 0 for m in hung_steps)
