"""The FSDP2 learner group: model build, losses, batching, the train loop."""
