"""The training loop's building blocks: Session (the custom-loop facade), Trainer, the step runner, the registry of stateful objects, tiers and the post-train plan."""
