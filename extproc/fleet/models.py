"""What each engine serves, as its own ``GET /v1/models`` says.

vLLM lists every name it answers to: the base model under each ``--served-model-name``
(``parent`` null) and each loaded LoRA adapter (``parent`` the base's name). A request may
go only to an engine that answers to its ``model``; the gateway refuses a model no engine
serves before it queues. An engine not read yet is taken to serve anything, as every engine
was before models were read: a fleet whose ``/v1/models`` cannot be read routes as it always
did, and a failed read keeps the last set known. A runtime adapter of the policy's (``loadable``:
adapter -> base) may also go to an engine that serves its base, which loads it first
(``extproc.fleet.adapters``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

MAX_MODELS = 1024
"""Names read from one engine at most: an engine lists a handful (aliases and adapters)."""
MAX_NAME_CHARS = 256
"""The longest model name kept (vLLM's own names are paths or short identifiers)."""


class ModelsError(ValueError):
    """A ``/v1/models`` answer that is not vLLM's list."""


@dataclass(frozen=True)
class ServedModels:
    """The names one engine answers to: base names, and adapters with their base."""

    bases: frozenset[str]
    adapters: Mapping[str, str] = field(default_factory=dict)
    """LoRA adapter name -> the base model's name it runs on."""

    def serves(self, model: str) -> bool:
        return model in self.bases or model in self.adapters

    def pool_name(self, model: str) -> str:
        """The name of the pool this engine runs ``model`` on: its smallest base name (an
        adapter runs on its base, which is one of them)."""
        return min(self.bases) if self.bases else model

    def describe(self) -> str:
        """``tiny, ad1 (adapter of tiny)``: for ``fairlane up``'s banner and logs."""
        parts = sorted(self.bases)
        parts += [f"{name} (adapter of {base})" for name, base in sorted(self.adapters.items())]
        return ", ".join(parts) or "(none)"

    @classmethod
    def parse(cls, document: Any) -> ServedModels:
        """vLLM's ``{"object": "list", "data": [{"id", "parent", ...}]}``; ModelsError if
        it is anything else."""
        if not isinstance(document, dict) or not isinstance(document.get("data"), list):
            raise ModelsError("not a model list (no 'data' list)")
        cards = document["data"]
        if len(cards) > MAX_MODELS:
            raise ModelsError(f"{len(cards)} models listed, more than {MAX_MODELS}")
        bases: set[str] = set()
        adapters: dict[str, str] = {}
        for card in cards:
            name = card.get("id") if isinstance(card, dict) else None
            if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
                raise ModelsError(f"a model card without a usable 'id': {str(card)[:80]}")
            parent = card.get("parent")
            if parent is None:
                bases.add(name)
            elif isinstance(parent, str) and parent:
                adapters[name] = parent
            else:
                raise ModelsError(f"model {name!r} has a 'parent' that is not a name")
        return cls(frozenset(bases), adapters)


class Serving(Protocol):
    """What this module reads of a backend (``extproc.fleet.backend.Backend``)."""

    @property
    def models(self) -> ServedModels | None: ...

    @property
    def models_expected(self) -> bool: ...


Loadable = Mapping[str, str]
"""Runtime adapters the policy lets the gateway load: adapter name -> base model name."""

NOTHING_LOADABLE: Loadable = MappingProxyType({})


def may_serve(backend: Serving, model: str | None, loadable: Loadable = NOTHING_LOADABLE) -> bool:
    """Whether a request for ``model`` may go to ``backend``: any request when it names no
    model, or the engine's models were never read, unless it joined a fleet whose models
    are known (``models_expected``): it then waits for its own list, read within a health
    round, rather than take another model's requests meanwhile. A loadable adapter may go
    where its base is served (``needs_load``)."""
    served = backend.models
    if model is None:
        return True
    if served is None:
        return not backend.models_expected
    return served.serves(model) or needs_load(served, model, loadable)


def needs_load(served: ServedModels | None, model: str | None, loadable: Loadable) -> bool:
    """Whether an engine serving ``served`` runs ``model`` only once it loads it: a runtime
    adapter it does not list, whose base it serves."""
    if model is None or served is None or served.serves(model):
        return False
    base = loadable.get(model)
    return base is not None and base in served.bases


def with_adapter(served: ServedModels, name: str, base: str) -> ServedModels:
    """``served`` once the engine has loaded adapter ``name`` on ``base``."""
    return ServedModels(served.bases, {**served.adapters, name: base})


def fleet_models(backends: Iterable[Serving]) -> ServedModels:
    """Every name the engines whose models are known answer to."""
    bases: set[str] = set()
    adapters: dict[str, str] = {}
    for backend in backends:
        served = backend.models
        if served is not None:
            bases |= served.bases
            adapters.update(served.adapters)
    return ServedModels(frozenset(bases), adapters)


def several_models(backends: Iterable[Serving]) -> bool:
    """Whether the engines serve more than one base model (engines that list the same base
    names, ``--served-model-name`` aliases included, serve one)."""
    return len({b.models.bases for b in backends if b.models is not None}) > 1
