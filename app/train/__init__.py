"""The FlowGRPO trainer: policy (LoRA on the diffusers transformer, FSDP2), prompts, checkpoints, the Ray Train loop."""
