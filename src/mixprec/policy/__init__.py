"""Precision policies: the vocabulary and its facts, support per device, the Policy object,
loss scaling, and the Candidate that names one configuration across mixprec."""

from mixprec.policy.candidate import Candidate
from mixprec.policy.policy import Policy, PolicyConfig, get_policy, policy_from_config
from mixprec.policy.registry import (
    ALIASES,
    POLICIES,
    POLICY_NAMES,
    PolicySpec,
    Thresholds,
    canonical_name,
    spec_of,
)
from mixprec.policy.scaler import ScalerOptions, StepStats
from mixprec.policy.support import Support, check_support, starting_policy

__all__ = [
    "ALIASES",
    "POLICIES",
    "POLICY_NAMES",
    "Candidate",
    "Policy",
    "PolicyConfig",
    "PolicySpec",
    "ScalerOptions",
    "StepStats",
    "Support",
    "Thresholds",
    "canonical_name",
    "check_support",
    "get_policy",
    "policy_from_config",
    "spec_of",
    "starting_policy",
]
