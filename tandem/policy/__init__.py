"""Pure partition policies and SLO-aware admission (see docs: "Performance model and policies")."""

from __future__ import annotations

from tandem.policy.admission import AdmissionResult, Rejection, admit
from tandem.policy.policies import CPU_DEFAULT_POLICY, DEFAULT_POLICY, POLICIES, Policy, get_policy
from tandem.policy.types import ClusterSnapshot, Decision, Predictor, QueuedRequest, RunningPrefill, Slo

__all__ = [
    "CPU_DEFAULT_POLICY",
    "DEFAULT_POLICY",
    "POLICIES",
    "AdmissionResult",
    "ClusterSnapshot",
    "Decision",
    "Policy",
    "Predictor",
    "QueuedRequest",
    "Rejection",
    "RunningPrefill",
    "Slo",
    "admit",
    "get_policy",
]
