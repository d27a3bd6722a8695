"""The start-up checks of a vLLM server behind ``rollout.engine=openai``, beside those every
server passes (``honing.rollout.remote.checks``). A vLLM server is one whose ``/v1/models``
entry is ``owned_by: vllm``. Each failure is one ``ConfigError`` naming the endpoint and the
flag or variable to set.

- Logprobs: the server must report the logprob of each token under the distribution it was
  sampled from (``--logprobs-mode processed_logprobs``). vLLM's default, ``raw_logprobs``,
  reports the model's distribution before temperature and top-k/top-p, which makes every
  behaviour logprob, and so every importance weight, wrong whenever ``rollout.temperature``
  is not 1 or a filter is on. Probed, so that any server is checked, dev mode or not: one
  token sampled with ``top_k=1``, whose processed logprob is exactly 0 (a one-token
  distribution); a raw logprob is the model's own, below 0 unless the model is certain of
  that token to float precision (the one case the probe cannot tell apart).
- Paused: a server a trainer left paused in the middle of a weight update (its RL API's
  ``GET /is_paused``, in dev mode) holds every request and may hold part-new weights; one
  whose ``GET /weight_info`` says ``INCOMPLETE`` holds part of an update a trainer abandoned
  (paused or resumed since by hand).
- Weights: ``rollout.weight_sync=vllm`` needs vLLM's RL API (``VLLM_SERVER_DEV_MODE=1``) and
  a weight-transfer backend honing speaks (``--weight-transfer-config``, read from
  ``GET /server_info``); ``tensors`` and ``disk`` are honing's and SGLang's endpoints, which
  vLLM does not have, and ``vllm`` needs vLLM servers.
"""

from __future__ import annotations

from collections.abc import Callable

from honing.errors import ConfigError

# the backends honing sends through: its own (files, any device) and vLLM's NCCL (CUDA)
BACKENDS = ("honing", "nccl")
LAUNCH = '--weight-transfer-config \'{"backend": "honing"}\''
PROCESSED = "--logprobs-mode processed_logprobs"

PROMPT = "0123456789"  # the logprobs probe's prompt
# the weight version of a server left holding part of an update (a sync abandoned half-way)
INCOMPLETE = "incomplete"

# checks' request: (method, url, path, token, **httpx arguments) -> the answer; raises
# UserError when the server cannot be reached or refuses the token
Ask = Callable[..., object]


def is_vllm(entry: dict) -> bool:
    """Whether a ``/v1/models`` entry is a vLLM server's."""
    return entry.get("owned_by") == "vllm"


def check_vllm_server(
    ask: Ask, url: str, token: str, model: str, tokenizer, weight_sync: str
) -> None:
    """Raises ``ConfigError`` when the vLLM server at ``url`` (asked through ``ask``) cannot
    serve the policy ``model`` with ``weight_sync``: see the module."""
    if weight_sync in ("tensors", "disk"):
        raise ConfigError(
            f"rollout.weight_sync={weight_sync}: {url} is a vLLM server, which takes weights "
            f"through its RL API: set rollout.weight_sync=vllm (and start it with "
            f"VLLM_SERVER_DEV_MODE=1 and {LAUNCH}), or none"
        )
    _not_paused(ask, url, token)
    probe_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    missing = [] if _processed_logprobs(ask, url, token, model, probe_ids) else [PROCESSED]
    if weight_sync == "vllm":
        missing += _weight_transfer_missing(ask, url, token)
    if not missing:
        return
    flags = ", ".join(missing[:-1]) + " and " + missing[-1] if len(missing) > 1 else missing[0]
    why = (
        " (vLLM reports logprobs before temperature and top-k/top-p otherwise, which makes every "
        "importance weight wrong)"
        if PROCESSED in missing
        else ""
    )
    raise ConfigError(f"rollout.endpoints: {url} cannot serve this run: start it with {flags}{why}")


def refuse_other_server(url: str) -> None:
    """``rollout.weight_sync=vllm`` against a server that is not vLLM's."""
    raise ConfigError(
        f"rollout.weight_sync=vllm: {url} is not a vLLM server; use rollout.weight_sync="
        "tensors for honing serve rollout, disk for SGLang"
    )


def _not_paused(ask: Ask, url: str, token: str) -> None:
    """A server left paused (a trainer that stopped in the middle of a weight update leaves
    it so, its weights part old, part new) would hold every request: refused at once; so is
    one whose weights are marked ``INCOMPLETE``."""
    answer = ask("GET", url, "/is_paused", token)
    if answer.status_code == 200 and answer.json().get("is_paused"):
        raise ConfigError(
            f"rollout.endpoints: {url} is paused (a weight update was left unfinished, so its "
            "weights may be part old, part new): restart it"
        )
    answer = ask("GET", url, "/weight_info", token)
    version = str(answer.json().get("weight_version", "")) if answer.status_code == 200 else ""
    if version.startswith(INCOMPLETE):
        raise ConfigError(
            f"rollout.endpoints: {url} holds part of one weight version over another "
            f"({version}: a weight update was abandoned half-way): restart it"
        )


def _processed_logprobs(ask: Ask, url: str, token: str, model: str, probe_ids: list) -> bool:
    body = {
        "model": model,
        "prompt": probe_ids,
        "max_tokens": 1,
        "temperature": 1.0,
        "top_k": 1,
        "seed": 0,
        "logprobs": 0,
    }
    answer = ask("POST", url, "/v1/completions", token, json=body)
    try:
        value = answer.json()["choices"][0]["logprobs"]["token_logprobs"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ConfigError(
            f"rollout.endpoints: {url}/v1/completions answered HTTP {answer.status_code} "
            f"({answer.text[:200]}) where one token and its logprob were expected"
        ) from None
    return abs(float(value)) < 1e-6


def _weight_transfer_missing(ask: Ask, url: str, token: str) -> list[str]:
    """What the server's launch lacks for ``rollout.weight_sync=vllm``."""
    answer = ask("GET", url, "/server_info", token, params={"config_format": "json"})
    if answer.status_code == 404:  # dev mode off: no RL API, no server_info
        return ["VLLM_SERVER_DEV_MODE=1 in its environment", LAUNCH]
    try:
        backend = transfer_backend(answer.json())
    except (ValueError, KeyError, AttributeError, TypeError):
        raise ConfigError(
            f"rollout.endpoints: {url}/server_info answered HTTP {answer.status_code} "
            f"({answer.text[:200]}) where vLLM's config was expected"
        ) from None
    if backend in BACKENDS:
        return []
    if backend:
        return [f"{LAUNCH} (or backend nccl on GPUs; honing does not speak {backend!r})"]
    return [f"{LAUNCH} (or backend nccl on GPUs)"]


def transfer_backend(server_info: dict) -> str:
    """The weight-transfer backend of a vLLM server's ``/server_info`` answer ("" for none)."""
    transfer = server_info["vllm_config"].get("weight_transfer_config") or {}
    return str(transfer.get("backend", ""))
