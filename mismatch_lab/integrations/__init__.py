"""Record the mismatch of a training framework's own runs, with a few lines in the user's script.

    from mismatch_lab.integrations.trl import attach, use_cpu_weight_sync

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(use_vllm=True, ...), ...)
    attach(trainer, "runs/my-grpo")          # a Recorder; closed when training ends
    trainer.train()

Integrations (one module per framework, imported by its full name; none imports its framework until used):
    trl   `trl.GRPOTrainer` with vLLM rollouts, colocated or server (docs/record.md)
    verl  a policy loss registered with verl's register_policy_loss, wrapping verl's own (docs/import.md)
"""
