"""The balancing policies, one module each, and the one table that names them for
`--policy`. A policy is built from a `Setup` and picks with `choose(candidates, ask)`; it
says whether it needs the request's prompt (`needs_prompt`) and records what it must in
`picked`. A new policy is a module here and one line in POLICIES."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from router.forwarding.policies.base import (
    PREFIX_WEIGHT,
    TOKENS_PER_BLOCK,
    Ask,
    Candidate,
    Policy,
    Setup,
    kv_free,
    kv_need,
    load,
)
from router.forwarding.policies.least_loaded import LeastLoaded
from router.forwarding.policies.p2c import P2C
from router.forwarding.policies.p2c_depth import P2CDepth
from router.forwarding.policies.prefix import Prefix
from router.forwarding.policies.round_robin import RoundRobin
from router.forwarding.policies.uniform import Uniform

POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (Prefix, P2C, P2CDepth, LeastLoaded, RoundRobin, Uniform)
}

if TYPE_CHECKING:
    PolicyName = str
else:  # the settings' choices (and --policy's), from the table above
    PolicyName = Literal[tuple(POLICIES)]


def build(name: str, setup: Setup) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {tuple(POLICIES)}")
    return POLICIES[name](setup)


__all__ = [
    "PREFIX_WEIGHT",
    "TOKENS_PER_BLOCK",
    "Ask",
    "Candidate",
    "Policy",
    "PolicyName",
    "Setup",
    "build",
    "kv_free",
    "kv_need",
    "load",
]
