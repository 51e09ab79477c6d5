"""Rollout engines: sample n completions per prompt behind one small protocol (HF ``generate`` now, vLLM later)."""

from pods.rollout.base import RolloutEngine, Rollouts, SamplingParams
from pods.rollout.hf import HFGenerateEngine

__all__ = ["HFGenerateEngine", "RolloutEngine", "Rollouts", "SamplingParams"]
