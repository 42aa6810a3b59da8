"""Training from the controller's side: the step protocol, GRPO advantages, the trainer-service
adapter (``remote``), weight sync."""
