"""HTTP reward service (``rollart serve-reward``), its built-in functions and its client.

User reward modules need only ``from rollart.reward import reward_function, RewardInputError``;
the client is ``rollart.reward.client.RewardClient`` (imported from there, to keep this package
light for the service's spawned scoring workers).
"""

from rollart.reward.registry import RewardInputError, reward_function

__all__ = ["RewardInputError", "reward_function"]
