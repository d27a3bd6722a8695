"""The start-up checks of a remote rollout engine (``rollout.engine=openai``): before a run
writes anything, every server at ``rollout.endpoints`` must answer, take the token, serve the
policy, and tokenize text as the policy's tokenizer does; and a ``weight_dir`` must be
writable. Each failure is one ``UserError`` naming the endpoint (or key) and what to fix.
Servers that fail later, mid-run, are the engine's retries' business.

What is checked uses only what honing's server, vLLM and SGLang all expose:

- ``GET /v1/models``: reachable, the token taken (HTTP 401 or 403 otherwise), and the served
  model. With ``rollout.model_name`` each server must serve that name; without it every server
  must serve the same model, whose ``id`` or ``root`` (the directory it was loaded from) must
  name the policy's directory (the same path, or the same last component: another machine may
  mount it elsewhere). A server that serves the policy under another name is named in
  ``rollout.model_name``.
- ``POST /tokenize`` ``{"model", "prompt", "add_special_tokens": false}`` answers
  ``{"tokens": [...]}``: a probe text (digits, operators, words, accents, CJK, an emoji and the
  end-of-sequence token) must give the policy tokenizer's ids. A server without the endpoint
  (404 or 405) is not checked for it.
- A vLLM server (``owned_by: vllm``): its logprobs mode, and what ``rollout.weight_sync`` needs
  of it (``honing.rollout.remote.vllm_checks``).
"""

from __future__ import annotations

import tempfile
from functools import partial
from pathlib import Path

import httpx

from honing.errors import ConfigError, UserError
from honing.rollout.remote.vllm_checks import check_vllm_server, is_vllm, refuse_other_server

PROBE = "0123456789 +-*/=()<>. The quick brown fox: jumps! ¿Qué? déjà 数学 🙂"
_NO_TOKENIZE = {404, 405}


def check_servers(
    client: httpx.Client,
    urls: list[str],
    tokenizer,
    *,
    model: str,
    model_dir: str,
    token: str,
    weight_sync: str = "none",
) -> str:
    """The served model's name, once every server at ``urls`` passed the checks of the module
    docstring (``model``: ``rollout.model_name``; ``model_dir``: the policy's directory, not
    checked against when empty).

    Raises:
        UserError: a server cannot be reached, refuses the token, serves another model, or
            tokenizes differently from ``tokenizer``.
    """
    chosen, first = model, ""
    for url in urls:
        served = _served_models(client, url, token)
        ids = [str(entry.get("id")) for entry in served]
        if chosen and chosen not in ids:
            key = "rollout.model_name" if model else "rollout.endpoints"
            where = f"; {first} serves it" if first else ""
            raise ConfigError(f"{key}: {url} does not serve {chosen!r} (it serves {ids}){where}")
        entry = served[ids.index(chosen)] if chosen else served[0]
        if not model and model_dir and not _names_policy(entry, model_dir):
            raise ConfigError(
                f"rollout.endpoints: {url} serves {entry.get('id')!r} (from "
                f"{entry.get('root') or entry.get('id')}), not the policy at {model_dir}; serve "
                "the policy there (the servers start from model.path), or if it is the policy "
                f"under another name, set rollout.model_name={entry.get('id')}"
            )
        chosen, first = chosen or str(entry.get("id")), first or url
        _check_tokenizer(client, url, token, chosen, tokenizer, model_dir)
        if is_vllm(entry):  # its logprobs mode and RL API (honing.rollout.remote.vllm_checks)
            check_vllm_server(partial(_request, client), url, token, chosen, tokenizer, weight_sync)
        elif weight_sync == "vllm":
            refuse_other_server(url)
    return chosen


def check_weight_dir(path: str) -> None:
    """Raises ``ConfigError`` when ``rollout.weight_dir`` cannot be made or written to."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".honing-write-check"):
            pass
    except OSError as err:
        raise ConfigError(
            f"rollout.weight_dir: cannot write to {path} ({err.strerror or err}); give a "
            "directory this process can write and the servers can read"
        ) from None


def _served_models(client: httpx.Client, url: str, token: str) -> list[dict]:
    answer = _request(client, "GET", url, "/v1/models", token)
    if answer.status_code != 200:
        raise UserError(
            f"rollout.endpoints: {url}/v1/models answered HTTP {answer.status_code} "
            f"({answer.text[:200]}); is it an OpenAI-compatible server (vLLM, SGLang, honing "
            "serve rollout)?"
        )
    try:
        served = [entry for entry in answer.json().get("data") or [] if isinstance(entry, dict)]
    except (ValueError, AttributeError):
        served = []
    if not served:
        raise UserError(f"rollout.endpoints: {url}/v1/models lists no model")
    return served


def _request(client: httpx.Client, method: str, url: str, path: str, token: str, **kwargs):
    """``client``'s answer, after the failures every check shares: an unreachable server and a
    refused token."""
    try:
        answer = client.request(method, url + path, **kwargs)
    except httpx.HTTPError as err:
        raise UserError(
            f"rollout.endpoints: cannot reach {url} ({type(err).__name__}: {err}); start the "
            "server or correct the address"
        ) from None
    if answer.status_code in (401, 403):
        sent = "refused the token in HONING_ROLLOUT_TOKEN" if token else "needs a token"
        raise UserError(
            f"rollout.endpoints: {url} {sent} (HTTP {answer.status_code}); set "
            "HONING_ROLLOUT_TOKEN to the server's token (honing serve rollout --token, vLLM's "
            "and SGLang's --api-key)"
        )
    return answer


def _names_policy(entry: dict, model_dir: str) -> bool:
    """Whether a ``/v1/models`` entry's ``id`` or ``root`` names the policy's directory."""
    policy = Path(model_dir)
    for name in (entry.get("root"), entry.get("id")):
        if not isinstance(name, str) or not name:
            continue
        served = Path(name)
        if served.name == policy.name or _same_file(served, policy):
            return True
    return False


def _same_file(one: Path, other: Path) -> bool:
    try:
        return one.samefile(other)
    except OSError:  # either is not on this machine
        return False


def _check_tokenizer(
    client: httpx.Client, url: str, token: str, model: str, tokenizer, model_dir: str
) -> None:
    probe = PROBE + (tokenizer.eos_token or "")
    body = {"model": model, "prompt": probe, "add_special_tokens": False}
    answer = _request(client, "POST", url, "/tokenize", token, json=body)
    if answer.status_code in _NO_TOKENIZE:
        return
    try:
        tokens = answer.json().get("tokens") if answer.status_code == 200 else None
    except (ValueError, AttributeError):
        tokens = None
    if not isinstance(tokens, list):
        raise UserError(
            f"rollout.endpoints: {url}/tokenize answered HTTP {answer.status_code} "
            f"({answer.text[:200]}) where its tokens were expected"
        )
    want = tokenizer(probe, add_special_tokens=False)["input_ids"]
    if tokens != want:
        at = next(
            (i for i, (got, wanted) in enumerate(zip(tokens, want, strict=False)) if got != wanted),
            min(len(tokens), len(want)),
        )
        policy = model_dir or "the policy"
        raise ConfigError(
            f"rollout.endpoints: {url} tokenizes {probe!r} differently from the tokenizer of "
            f"{policy} (token {at}: {tokens[at : at + 3]} against {want[at : at + 3]}); the "
            "servers must serve the policy's model and tokenizer"
        )
