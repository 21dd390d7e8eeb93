"""LoRA adapters as vLLM 0.32's OpenAI frontend keeps them (``OpenAIServingModels``).

What a gateway sees of LoRA lives here and in the engine: the adapters a request's ``model``
may name, their cards in ``/v1/models``, and the runtime routes ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (only when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is ``1`` or
``true``, as vLLM reads it), all read from vLLM 0.32's source
(``entrypoints/openai/models/serving.py``, ``entrypoints/serve/lora/api_router.py``,
``entrypoints/launchers/cli_args.py``). ``LoraRegistry`` has the rules. Paths are never read:
the simulator has no weights, so a path that does not exist loads (vLLM would answer 404
``LoRAAdapterNotFoundError``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loadtests.sim.request import ApiError, _input_repr, validation_error

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM 0.32's ``MaxLoRARanks``: the ``--max-lora-rank`` choices."""

LORA_NOT_ENABLED = "LoRA is not enabled. Use --enable-lora to enable LoRA."


def runtime_updating_from_env(env: Mapping[str, str] | None = None) -> bool:
    """vLLM's reading of ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: ``1`` or ``true``, any case."""
    value = (os.environ if env is None else env).get(RUNTIME_UPDATING_ENV, "0")
    return value.strip().lower() in ("1", "true")


@dataclass(frozen=True)
class LoraModule:
    """One ``--lora-modules`` item (vLLM's ``LoRAModulePath``)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(item: str) -> LoraModule:
    """``NAME=PATH`` (no comma), else a JSON object with ``name``, ``path`` and optionally
    ``base_model_name``, as vLLM's ``LoRAParserAction`` reads them; ``ValueError`` else."""
    if "=" in item and "," not in item:
        name, path = item.split("=", 1)
        return LoraModule(name, path)
    try:
        fields = json.loads(item)
    except json.JSONDecodeError:
        raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"Invalid fields for --lora-modules: {item}")
    unknown = set(fields) - {"name", "path", "base_model_name", "is_3d_lora_weight"}
    if unknown or "name" not in fields or "path" not in fields:
        raise ValueError(f"Invalid fields for --lora-modules: {item}")
    base = fields.get("base_model_name")
    return LoraModule(str(fields["name"]), str(fields["path"]), None if base is None else str(base))


@dataclass(frozen=True)
class LoraAdapter:
    """A loaded adapter: what a request for it carries into the engine."""

    name: str
    path: str
    lora_id: int
    parent: str
    """Its ``/v1/models`` parent: the base model it was loaded for, or the first served name."""


class LoraRegistry:
    """The adapters a server answers for, in load order (vLLM's ``lora_requests``).

    The rules, as vLLM 0.32 has them:

    - ``--lora-modules`` takes ``NAME=PATH`` items or JSON objects ``{"name", "path",
      "base_model_name"}``; each is loaded at start-up as a runtime load would be, so a name
      that is a served model, or given twice, stops the server;
    - every load takes the next integer id (``lora_int_id``), and so does every request for an
      unknown model while runtime updating is on (vLLM's ``resolve_lora`` counts one before it
      finds no resolver); a reload in place (``load_inplace``) keeps its id and its place;
    - ``/v1/models`` lists the served names, then the adapters in load order with ``root`` the
      adapter's path, ``parent`` its ``base_model_name`` when that is a served name or else the
      first served name, and no ``max_model_len``;
    - unloading only forgets the name (vLLM 0.32's frontend does not tell the engine): the
      adapter's requests in flight go on, and the engine keeps it in its slots until evicted.
    """

    def __init__(self, served: tuple[str, ...]) -> None:
        self.served = served
        self.adapters: dict[str, LoraAdapter] = {}
        self._last_id = 0

    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    def get(self, name: str) -> LoraAdapter | None:
        return self.adapters.get(name)

    def next_id(self) -> int:
        """vLLM's ``lora_id_counter.inc(1)``."""
        self._last_id += 1
        return self._last_id

    def check_load(self, name: str, path: str, load_inplace: bool = False) -> None:
        """vLLM's checks before a load reaches the engine: ``ApiError`` (its 400s)."""
        if not name or not path:
            raise ApiError(
                "Both 'lora_name' and 'lora_path' must be provided.", err_type="InvalidUserInput"
            )
        if name in self.served:
            raise ApiError(
                f"The lora adapter '{name}' conflicts with a served base model.",
                err_type="InvalidUserInput",
            )
        if name in self.adapters and not load_inplace:
            raise ApiError(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                err_type="InvalidUserInput",
            )

    def load(
        self, name: str, path: str, load_inplace: bool = False, base_model_name: str | None = None
    ) -> LoraAdapter:
        """Load ``name`` from ``path`` (``check_load`` first); a reload in place keeps the
        adapter's id and its place in the list."""
        self.check_load(name, path, load_inplace)
        old = self.adapters.get(name)
        parent = base_model_name if base_model_name in self.served else self.served[0]
        assert parent is not None
        lora_id = old.lora_id if old is not None else self.next_id()
        adapter = LoraAdapter(name, path, lora_id, parent)
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> LoraAdapter:
        """Forget ``name``; ``ApiError`` (vLLM's 400 or 404) when it cannot be."""
        if not name:
            raise ApiError(
                "'lora_name' needs to be provided to unload a LoRA adapter.",
                err_type="InvalidUserInput",
            )
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise ApiError(
                f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError", None
            )
        return adapter

    def cards(self) -> list[tuple[str, str, str]]:
        """``(id, root, parent)`` of each adapter's ``/v1/models`` card, in load order."""
        return [(a.name, a.path, a.parent) for a in self.adapters.values()]


def loaded_message(name: str) -> bytes:
    return f"Success: LoRA adapter '{name}' added successfully.".encode()


def unloaded_message(name: str) -> bytes:
    return f"Success: LoRA adapter '{name}' removed successfully.".encode()


# ----------------------------------------------------------------- the route bodies

_BOOL_TRUE = frozenset(("1", "on", "t", "true", "y", "yes"))
_BOOL_FALSE = frozenset(("0", "off", "f", "false", "n", "no"))


def _missing(body: Mapping[str, Any], name: str) -> dict[str, Any]:
    return {
        "type": "missing",
        "loc": f"body.{name}",
        "msg": "Field required",
        "input": _input_repr(dict(body)),
    }


def _string_field(body: Mapping[str, Any], name: str, errors: list[dict[str, Any]]) -> str:
    if name not in body:
        errors.append(_missing(body, name))
        return ""
    value = body[name]
    if not isinstance(value, str):
        errors.append(
            {
                "type": "string_type",
                "loc": f"body.{name}",
                "msg": "Input should be a valid string",
                "input": _input_repr(value),
            }
        )
        return ""
    return value


def _bool_field(body: Mapping[str, Any], name: str, errors: list[dict[str, Any]]) -> bool:
    """Pydantic's lax bool: bools, 0/1 and the usual words."""
    value = body.get(name, False)
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _BOOL_TRUE | _BOOL_FALSE:
        return value.strip().lower() in _BOOL_TRUE
    kind = "bool_parsing" if isinstance(value, (str, int, float)) else "bool_type"
    msg = (
        "Input should be a valid boolean, unable to interpret input"
        if kind == "bool_parsing"
        else "Input should be a valid boolean"
    )
    errors.append({"type": kind, "loc": f"body.{name}", "msg": msg, "input": _input_repr(value)})
    return False


def parse_load_body(body: Mapping[str, Any]) -> tuple[str, str, bool]:
    """``(lora_name, lora_path, load_inplace)`` of a ``/v1/load_lora_adapter`` body, or
    vLLM's request-validation 400."""
    errors: list[dict[str, Any]] = []
    name = _string_field(body, "lora_name", errors)
    path = _string_field(body, "lora_path", errors)
    inplace = _bool_field(body, "load_inplace", errors)
    if errors:
        raise validation_error(errors)
    return name, path, inplace


def parse_unload_body(body: Mapping[str, Any]) -> str:
    """The ``lora_name`` of a ``/v1/unload_lora_adapter`` body, or vLLM's validation 400."""
    errors: list[dict[str, Any]] = []
    name = _string_field(body, "lora_name", errors)
    if errors:
        raise validation_error(errors)
    return name
