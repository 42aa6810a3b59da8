"""Rollout: admission of groups, one task per trajectory, token bookkeeping, local envs."""
