"""Pure tensor functions of the RL algorithms (advantages, policy losses, KL estimators).
Imports nothing of the project."""
