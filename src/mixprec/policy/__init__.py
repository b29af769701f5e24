"""Precision policies: the vocabulary, the Policy object and loss scaling."""

from mixprec.policy.policy import Policy, PolicyConfig, get_policy, policy_from_config
from mixprec.policy.registry import (
    ALIASES,
    POLICIES,
    POLICY_NAMES,
    PolicySpec,
    Support,
    canonical_name,
    check_support,
)
from mixprec.policy.scaler import ScalerOptions, StepStats

__all__ = [
    "ALIASES",
    "POLICIES",
    "POLICY_NAMES",
    "Policy",
    "PolicyConfig",
    "PolicySpec",
    "ScalerOptions",
    "StepStats",
    "Support",
    "canonical_name",
    "check_support",
    "get_policy",
    "policy_from_config",
]
