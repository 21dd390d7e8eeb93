"""Models in the policy: each tenant's allowed models and default, aliases with weights,
their file:line errors, and the pure functions the request path asks."""

from __future__ import annotations

import dataclasses
import textwrap
from types import MappingProxyType

import pytest

from extproc.policy import (
    DEFAULT_POLICY_PATH,
    AliasTarget,
    Policy,
    PolicyError,
    Tenant,
    Tier,
    load_policy,
    may_request,
    may_use,
    parse_policy,
    resolve_model,
)

BASE = """\
tiers:
  - {name: fast, priority: 0, queue_limit: 10, queue_deadline_s: 5}
models:
  aliases:
    gpt-4o-mini: llama-8b
    chat-latest:
      - {model: llama-70b-v2, weight: 90}
      - {model: llama-70b-v3, weight: 10}
tenants:
  - name: alice
    api_keys: [sk-alice-0001]
    tiers: [fast]
    models: [llama-70b-*, gpt-4o-mini]
    default_model: chat-latest
  - name: bob
    api_keys: [sk-bob-0001]
    tiers: [fast]
"""
"""Lines: 3 models, 5 gpt-4o-mini, 6 chat-latest, 7-8 its targets, 9 tenants, 13 alice's
models, 14 her default_model, 15 bob."""
MINIMAL_TIERS = "tiers:\n  - {name: fast, priority: 0, queue_limit: 10, queue_deadline_s: 5}\n"
BOB = "tenants:\n  - {name: bob, api_keys: [sk-bob-0001], tiers: [fast]}\n"


def policy_of(text: str = BASE) -> Policy:
    return parse_policy(textwrap.dedent(text), "m.yaml")


def errors_of(text: str) -> list[str]:
    with pytest.raises(PolicyError) as info:
        policy_of(text)
    return info.value.errors


def tenant(*models: str, default_model: str | None = None) -> Tenant:
    return Tenant(
        "t",
        api_keys=("sk-t-0001",),
        tiers=("fast",),
        default_tier="fast",
        models=models,
        default_model=default_model,
    )


FAST = Tier("fast", rank=0, priority=0, queue_limit=1, queue_deadline_s=1.0)


def with_aliases(**aliases: tuple[AliasTarget, ...]) -> Policy:
    return Policy(tiers=(FAST,), tenants=(tenant(),), model_aliases=aliases)


CANARY = (AliasTarget("v2", 90), AliasTarget("v3", 10))


# --------------------------------------------------------------------------- reading


def test_models_and_aliases_are_read() -> None:
    policy = policy_of()
    assert dict(policy.model_aliases) == {
        "gpt-4o-mini": (AliasTarget("llama-8b", 1.0),),
        "chat-latest": (AliasTarget("llama-70b-v2", 90.0), AliasTarget("llama-70b-v3", 10.0)),
    }
    alice, bob = policy.tenants
    assert alice.models == ("llama-70b-*", "gpt-4o-mini")
    assert alice.default_model == "chat-latest"
    assert (bob.models, bob.default_model) == ((), None)


def test_no_models_section_means_no_aliases_and_every_model() -> None:
    policy = load_policy(DEFAULT_POLICY_PATH)
    assert dict(policy.model_aliases) == {}
    assert all(t.models == () and t.default_model is None for t in policy.tenants)
    assert all(may_use(t, "anything/at-all") for t in policy.tenants)
    empty = policy_of(BASE.replace("    models: [llama-70b-*, gpt-4o-mini]\n", "    models: []\n"))
    assert empty.tenants[0].models == () and may_use(empty.tenants[0], "llama-8b")
    no_aliases = MINIMAL_TIERS + "models: {aliases: {}}\n" + BOB
    assert dict(policy_of(no_aliases).model_aliases) == {}
    assert dict(policy_of(MINIMAL_TIERS + "models: {}\n" + BOB).model_aliases) == {}


def test_an_alias_may_point_at_its_own_name() -> None:
    """``llama-70b: [{model: llama-70b, ...}, {model: llama-70b-v3, ...}]`` keeps most
    traffic on the model served under the alias's name: one step, not a chain."""
    text = BASE.replace("chat-latest:\n", "llama-70b-v2:\n").replace(
        "default_model: chat-latest", "default_model: llama-70b-v2"
    )
    policy = policy_of(text)
    assert [t.model for t in policy.model_aliases["llama-70b-v2"]] == [
        "llama-70b-v2",
        "llama-70b-v3",
    ]


def test_the_policy_keeps_its_aliases_read_only_and_stays_hashable() -> None:
    policy = with_aliases(canary=CANARY)
    assert isinstance(policy.model_aliases, MappingProxyType)
    with pytest.raises(TypeError):
        policy.model_aliases["other"] = CANARY  # type: ignore[index]
    assert hash(policy) == hash(with_aliases())  # the mapping is compared, not hashed
    assert policy == with_aliases(canary=CANARY) and policy != with_aliases()
    assert policy_of() == policy_of()
    targets = [AliasTarget("x")]
    listed = Policy(tiers=(FAST,), tenants=(), model_aliases={"a": targets})  # type: ignore[dict-item]
    targets.append(AliasTarget("y"))
    assert listed.model_aliases["a"] == (AliasTarget("x"),)  # copied into a tuple


def test_a_policy_built_in_code_refuses_what_a_file_may_not_say() -> None:
    with pytest.raises(ValueError, match="'a' has no target"):
        with_aliases(a=())
    with pytest.raises(ValueError, match="'a' points to alias 'b'"):
        with_aliases(a=(AliasTarget("b"),), b=(AliasTarget("c"),))
    with_aliases(a=(AliasTarget("a"), AliasTarget("b")))  # itself: fine
    for weight in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="weight must be a positive number"):
            AliasTarget("x", weight)
    with pytest.raises(ValueError, match="needs a model name"):
        AliasTarget("")


# --------------------------------------------------------------------------- errors

LONG = "m" * 257


@pytest.mark.parametrize(
    ("old", "new", "errors"),
    [
        (
            "weight: 90}",
            "weight: 0}",
            ["m.yaml:7: models.aliases.chat-latest[0].weight: must be > 0, not 0"],
        ),
        (
            "weight: 10}",
            "weight: -10}",
            ["m.yaml:8: models.aliases.chat-latest[1].weight: must be > 0, not -10"],
        ),
        (
            "weight: 10}",
            "weight: .inf}",
            ["m.yaml:8: models.aliases.chat-latest[1].weight: must be a finite number, not inf"],
        ),
        (
            "weight: 10}",
            "weight: ten}",
            ["m.yaml:8: models.aliases.chat-latest[1].weight: must be a number, not a string"],
        ),
        (
            "{model: llama-70b-v3, weight: 10}",
            "{model: llama-70b-v3}",
            ["m.yaml:8: models.aliases.chat-latest[1].weight: is required"],
        ),
        (
            "{model: llama-70b-v3, weight: 10}",
            "{model: llama-70b-v3, weight: 10, share: 1}",
            [
                "m.yaml:8: models.aliases.chat-latest[1].share: unknown field "
                "(expected one of: model, weight)"
            ],
        ),
        (
            "model: llama-70b-v3,",
            "model: '',",
            ["m.yaml:8: models.aliases.chat-latest[1].model: must not be empty"],
        ),
        (
            "model: llama-70b-v3,",
            "model: 3,",
            ["m.yaml:8: models.aliases.chat-latest[1].model: must be a string, not an integer"],
        ),
        (
            "model: llama-70b-v3,",
            "model: llama-70b-v2,",
            ["m.yaml:8: models.aliases.chat-latest[1].model: 'llama-70b-v2' is listed twice"],
        ),
        (
            "model: llama-70b-v3,",
            "model: gpt-4o-mini,",
            [
                "m.yaml:8: models.aliases.chat-latest[1].model: 'gpt-4o-mini' is an alias "
                "itself: aliases resolve in one step, so point it at a served model"
            ],
        ),
        (
            "gpt-4o-mini: llama-8b",
            "gpt-4o-mini: chat-latest",
            [
                "m.yaml:5: models.aliases.gpt-4o-mini: 'chat-latest' is an alias itself: "
                "aliases resolve in one step, so point it at a served model"
            ],
        ),
        (
            "gpt-4o-mini: llama-8b",
            f"gpt-4o-mini: {LONG}",
            ["m.yaml:5: models.aliases.gpt-4o-mini: must be at most 256 characters, not 257"],
        ),
        (
            "gpt-4o-mini: llama-8b",
            "gpt-4o-mini: llama-*",
            [
                "m.yaml:5: models.aliases.gpt-4o-mini: 'llama-*' is a pattern, not a model "
                "name (no *, ? or [)"
            ],
        ),
        (
            "gpt-4o-mini: llama-8b",
            "gpt-4o-mini: null",
            [
                "m.yaml:5: models.aliases.gpt-4o-mini: must be a model's name or a list of "
                "{model, weight}, not null"
            ],
        ),
        (
            "gpt-4o-mini: llama-8b",
            "gpt-4o-mini: {model: llama-8b}",
            [
                "m.yaml:5: models.aliases.gpt-4o-mini: must be a model's name or a list of "
                "{model, weight}, not a mapping"
            ],
        ),
        (
            "gpt-4o-mini: llama-8b",
            "gpt-4o-mini: []",
            ["m.yaml:5: models.aliases.gpt-4o-mini: must list at least one target"],
        ),
        (
            "gpt-4o-mini: llama-8b",
            "gpt-4o-mini: llama-8b\n    gpt-4o-mini: llama-9b",
            ["m.yaml:6: models.aliases.gpt-4o-mini: duplicate field"],
        ),
        (
            "    gpt-4o-mini: llama-8b",
            f"    {LONG}: llama-8b",
            [f"m.yaml:5: models.aliases.{LONG}: must be at most 256 characters, not 257"],
        ),
        (
            "    gpt-4o-mini: llama-8b",
            "    gpt-*: llama-8b",
            [
                "m.yaml:5: models.aliases.gpt-*: 'gpt-*' is a pattern, not a model name "
                "(no *, ? or [)"
            ],
        ),
        (
            "  aliases:\n",
            "  alias:\n",
            ["m.yaml:4: models.alias: unknown field (expected one of: aliases, adapters)"],
        ),
        (
            BASE[BASE.index("models:") : BASE.index("tenants:")],
            "models: [gpt-4o-mini]\n",
            ["m.yaml:3: models: must be a mapping, not a list"],
        ),
        (
            BASE[BASE.index("  aliases:") : BASE.index("tenants:")],
            "  aliases: [gpt-4o-mini]\n",
            ["m.yaml:4: models.aliases: must be a mapping, not a list"],
        ),
        (
            "models: [llama-70b-*, gpt-4o-mini]",
            "models: llama-70b-*",
            ["m.yaml:13: tenants[0].models: must be a list, not a string"],
        ),
        (
            "models: [llama-70b-*, gpt-4o-mini]",
            "models: [llama-70b-*, '', llama-70b-*]",
            [
                "m.yaml:13: tenants[0].models[1]: must not be empty",
                "m.yaml:13: tenants[0].models[2]: 'llama-70b-*' is listed twice",
            ],
        ),
        (
            "models: [llama-70b-*, gpt-4o-mini]",
            f"models: [llama-70b-*, {LONG}]",
            ["m.yaml:13: tenants[0].models[1]: must be at most 256 characters, not 257"],
        ),
        (
            "default_model: chat-latest",
            "default_model: llama-8b",
            [
                "m.yaml:14: tenants[0].default_model: 'llama-8b' is not allowed by this "
                "tenant's models (llama-70b-*, gpt-4o-mini)"
            ],
        ),
        (
            "models: [llama-70b-*, gpt-4o-mini]",
            "models: [llama-70b-v2, gpt-4o-mini]",
            [
                "m.yaml:14: tenants[0].default_model: alias 'chat-latest' is not allowed by "
                "this tenant's models (llama-70b-v2, gpt-4o-mini): allow the alias or every "
                "one of its targets"
            ],
        ),
        (
            "default_model: chat-latest",
            "default_model: llama-70b-?",
            [
                "m.yaml:14: tenants[0].default_model: 'llama-70b-?' is a pattern, not a "
                "model name (no *, ? or [)"
            ],
        ),
        (
            "default_model: chat-latest",
            "default_model: [chat-latest]",
            ["m.yaml:14: tenants[0].default_model: must be a string, not a list"],
        ),
        # a broken alias is reported once, not also as a default the tenant may not use
        (
            "weight: 90}",
            "weight: 0}",
            ["m.yaml:7: models.aliases.chat-latest[0].weight: must be > 0, not 0"],
        ),
    ],
)
def test_bad_models_are_located(old: str, new: str, errors: list[str]) -> None:
    """Each mistake once, at its line; a default_model naming a broken alias, or any
    default_model when the aliases cannot be read, is not also reported."""
    assert old in BASE
    assert errors_of(BASE.replace(old, new, 1)) == errors


def test_every_model_error_in_a_file_is_reported() -> None:
    text = (
        BASE.replace("weight: 90}", "weight: 0}")
        .replace("default_model: chat-latest", "default_model: llama-8b")
        .replace("    api_keys: [sk-bob-0001]\n", "    api_keys: [sk-bob-0001]\n    models: ['']\n")
    )
    assert errors_of(text) == [
        "m.yaml:7: models.aliases.chat-latest[0].weight: must be > 0, not 0",
        "m.yaml:14: tenants[0].default_model: 'llama-8b' is not allowed by this tenant's "
        "models (llama-70b-*, gpt-4o-mini)",
        "m.yaml:17: tenants[1].models[0]: must not be empty",
    ]


# --------------------------------------------------------------------------- may_use


@pytest.mark.parametrize(
    ("models", "model", "expected"),
    [
        ((), "anything", True),
        (("llama-8b",), "llama-8b", True),
        (("llama-8b",), "llama-8b-instruct", False),  # a name is whole, not a prefix
        (("llama-8b",), "Llama-8b", False),  # case-sensitive, as engines' names are
        (("llama-*",), "llama-70b", True),
        (("llama-*",), "llama-", True),
        (("llama-*",), "my-llama-70b", False),  # anchored at both ends
        (("team-a/*",), "team-a/summarizer", True),
        (("team-a/*",), "team-a/x/y", True),  # `*` crosses `/`
        (("team-a/*",), "team-b/summarizer", False),
        (("llama-?b",), "llama-8b", True),
        (("llama-?b",), "llama-70b", False),
        (("llama-[78]b",), "llama-7b", True),
        (("llama-[!78]b",), "llama-7b", False),
        (("qwen-*", "llama-8b"), "llama-8b", True),
        (("qwen-*", "llama-8b"), "mistral-7b", False),
        (("*",), "", True),
    ],
)
def test_may_use(models: tuple[str, ...], model: str, expected: bool) -> None:
    assert may_use(tenant(*models), model) is expected


def test_may_request_allows_an_alias_by_its_name_or_by_all_its_targets() -> None:
    policy = with_aliases(canary=CANARY, mini=(AliasTarget("llama-8b"),))
    assert may_request(policy, tenant("canary"), "canary")  # the alias's own name
    assert may_request(policy, tenant("v*"), "canary")  # every target
    assert not may_request(policy, tenant("v2"), "canary")  # one target is not enough
    assert not may_request(policy, tenant("canary"), "v3")  # nor is the alias a grant of v3
    assert may_request(policy, tenant("llama-*"), "mini")
    assert not may_request(policy, tenant("llama-*"), "qwen")
    assert may_request(policy, tenant(), "qwen")  # no list: every model
    assert may_request(policy, tenant("qwen"), "qwen")


# --------------------------------------------------------------------------- resolve_model


def test_resolve_model_without_a_model_takes_the_tenant_default() -> None:
    policy = with_aliases(canary=CANARY)
    assert resolve_model(policy, tenant(), None, 0.5) is None
    assert resolve_model(policy, tenant(default_model="llama-8b"), None, 0.5) == "llama-8b"
    assert resolve_model(policy, tenant(default_model="canary"), None, 0.95) == "v3"
    # a model asked for wins over the default
    assert resolve_model(policy, tenant(default_model="canary"), "qwen", 0.0) == "qwen"


def test_resolve_model_passes_other_names_through() -> None:
    policy = with_aliases(canary=CANARY)
    assert resolve_model(policy, tenant(), "v2", 0.99) == "v2"
    assert resolve_model(policy, tenant(), "Canary", 0.0) == "Canary"  # exact names only
    assert resolve_model(policy, tenant(), "", 0.0) == ""


@pytest.mark.parametrize(
    ("draw", "expected"),
    [(0.0, "v2"), (0.5, "v2"), (0.8999999, "v2"), (0.9, "v3"), (0.95, "v3"), (0.9999999, "v3")],
)
def test_resolve_model_draws_a_target_by_cumulative_weight(draw: float, expected: str) -> None:
    assert resolve_model(with_aliases(canary=CANARY), tenant(), "canary", draw) == expected


def test_resolve_model_weights_are_relative_and_in_order() -> None:
    thirds = (AliasTarget("a", 1), AliasTarget("b", 1), AliasTarget("c", 1))
    policy = with_aliases(thirds=thirds, one=(AliasTarget("only", 0.001),))
    draws = {d: resolve_model(policy, tenant(), "thirds", d) for d in (0.0, 0.33, 0.34, 0.66)}
    assert draws == {0.0: "a", 0.33: "a", 0.34: "b", 0.66: "b"}
    assert resolve_model(policy, tenant(), "thirds", 0.67) == "c"
    assert resolve_model(policy, tenant(), "thirds", 1 - 2**-53) == "c"
    assert resolve_model(policy, tenant(), "one", 0.999) == "only"


def test_resolve_model_draws_in_proportion_to_the_weights() -> None:
    policy = with_aliases(canary=CANARY)
    drawn = [resolve_model(policy, tenant(), "canary", i / 1000) for i in range(1000)]
    assert drawn.count("v3") == 100


def test_resolve_model_resolves_the_parsed_example() -> None:
    policy = policy_of()
    alice, bob = policy.tenants
    assert resolve_model(policy, alice, None, 0.1) == "llama-70b-v2"
    assert resolve_model(policy, alice, "gpt-4o-mini", 0.1) == "llama-8b"
    assert resolve_model(policy, bob, None, 0.1) is None
    assert may_request(policy, alice, "chat-latest")  # both targets match llama-70b-*
    assert not may_request(policy, alice, "llama-8b")  # only through its alias


@pytest.mark.parametrize("draw", [-0.1, 1.0, 1.5, float("nan")])
def test_resolve_model_refuses_a_draw_outside_0_1(draw: float) -> None:
    with pytest.raises(ValueError, match=r"draw must be in \[0, 1\)"):
        resolve_model(with_aliases(canary=CANARY), tenant(), "canary", draw)


def test_tenants_compare_with_their_models() -> None:
    assert tenant("a") != tenant("b")
    assert dataclasses.replace(tenant("a"), default_model="a") != tenant("a")


ADAPTERS = MINIMAL_TIERS + "models:\n  adapters:\nADAPTERS" + BOB
"""Line 5 is the first adapter."""


def with_adapters(adapters: str) -> str:
    return ADAPTERS.replace("ADAPTERS", adapters)


def test_runtime_adapters_are_read_with_their_base_and_path() -> None:
    text = with_adapters("    sql: {base: llama-8b, path: /adapters/sql}\n")
    assert {n: (a.base, a.path) for n, a in policy_of(text).runtime_adapters.items()} == {
        "sql": ("llama-8b", "/adapters/sql")
    }
    assert not policy_of().runtime_adapters  # opt-in: none unless listed


@pytest.mark.parametrize(
    ("adapters", "error"),
    [
        ("    sql: {base: llama-8b}\n", "m.yaml:5: models.adapters.sql.path: is required"),
        ("    sql: {path: /a}\n", "m.yaml:5: models.adapters.sql.base: is required"),
        ('    sql: {base: llama-8b, path: " "}\n', "m.yaml:5: models.adapters.sql.path: must"),
        ("    sql: {base: sql, path: /a}\n", "m.yaml:5: models.adapters.sql.base: an adapter"),
        ("    'sq*': {base: b, path: /a}\n", "m.yaml:5: models.adapters.sq*: 'sq*' is a pattern"),
        ("    sql: {base: b, path: /a, rank: 8}\n", "m.yaml:5: models.adapters.sql.rank: unknown"),
        ("    - sql\n", "m.yaml:5: models.adapters: must be a mapping, not a list"),
    ],
)
def test_a_bad_runtime_adapter_is_located(adapters: str, error: str) -> None:
    errors = errors_of(with_adapters(adapters))
    assert len(errors) == 1 and errors[0].startswith(error), errors


def test_a_name_cannot_be_both_an_alias_and_a_runtime_adapter() -> None:
    text = (
        MINIMAL_TIERS
        + ("models:\n  aliases:\n    sql: llama-8b\n  adapters:\n    sql: {base: b, path: /a}\n")
        + BOB
    )
    assert errors_of(text) == [
        "m.yaml:5: models.aliases.sql: 'sql' is also a runtime adapter (models.adapters): "
        "a name is one or the other"
    ]
