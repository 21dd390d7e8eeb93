"""The first request ``fairlane up`` suggests: a curl that works against these backends.

A hint naming the simulator's model (``sim-llama-8b``) fails against real engines with a
404 from vLLM, on the user's very first try. So the model comes from a backend's own
``GET /v1/models`` at startup (with the engine's own key when the backend names one), and
the key from the policy (the demo key only when the
policy accepts it). When neither can be known, the line shows a placeholder and says what
to put there, rather than something that looks right and is not.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

from extproc.fleet.backend import BackendSpec
from extproc.fleet.models import ServedModels
from extproc.policy import Policy
from extproc.transport.credentials import CredentialError, read_secret

DEMO_KEY = "sk-chat-demo"
MODEL_PLACEHOLDER = "MODEL"
KEY_PLACEHOLDER = "YOUR_API_KEY"


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What a backend's ``/v1/models`` said: the model's id, or why there is none."""

    name: str | None
    problem: str = ""


def served_models(spec: BackendSpec, timeout_s: float = 2.0) -> ServedModels | str:
    """What ``spec``'s engine answers to (its ``/v1/models``), or why that is not known."""
    url = f"{spec.url}/v1/models"
    request = urllib.request.Request(url)
    try:
        if spec.credential is not None:  # vLLM's --api-key guards /v1/models too
            request.add_header("authorization", f"Bearer {read_secret(spec.credential)}")
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return ServedModels.parse(json.load(response))
    except urllib.error.HTTPError as exc:
        return f"{url}: HTTP {exc.code}"
    except CredentialError as exc:
        return str(exc)  # names the reference, never the key
    except (OSError, ValueError) as exc:
        return f"{url}: {getattr(exc, 'reason', None) or exc}"


def served_model(served: Sequence[ServedModels | str]) -> ServedModel:
    """A model to suggest: the first base name of the first backend whose models are known."""
    problems = []
    for models in served:
        if isinstance(models, str):
            problems.append(models)
        elif models.bases:
            return ServedModel(sorted(models.bases)[0])
    return ServedModel(None, "; ".join(problems) or "no backend")


def curl_lines(url: str, policy: Policy, model: ServedModel) -> list[str]:
    """The banner's "try:" lines for a gateway at ``url``."""
    key = DEMO_KEY if policy.tenant_for_key(DEMO_KEY) is not None else KEY_PLACEHOLDER
    body = json.dumps(
        {"model": model.name or MODEL_PLACEHOLDER, "messages": [{"role": "user", "content": "Hi"}]}
    )
    lines = [
        "try:",
        f"  curl -s {url}/v1/chat/completions -H 'Authorization: Bearer {key}' \\",
        "    -H 'content-type: application/json' \\",
        f"    -d '{body}'",
    ]
    if model.name is None:
        lines.append(
            f"  ({MODEL_PLACEHOLDER}: a model your backends serve; their /v1/models could "
            f"not be read: {model.problem})"
        )
    if key == KEY_PLACEHOLDER:
        lines.append(f"  ({KEY_PLACEHOLDER}: one of the policy's api_keys)")
    return lines
