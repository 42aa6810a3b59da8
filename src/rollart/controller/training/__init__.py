"""Training from the controller's side: the step protocol, GRPO advantages, weight sync."""
