"""Record any RL training loop's mismatch: the rollout engine's and the trainer's log-probs of the same
tokens, step by step, into a shard store (`mismatch_lab.store.shards`) that `analyze`, `figures` and the
app read.

    from mismatch_lab.record import Recorder

    rec = Recorder("runs/my-grpo", "exp-7", framework="verl", rollout_engine="vllm", trainer_dtype="bf16")
    for step in ...:
        rec.log_step(step, token_ids, mask, logp_rollout, logp_trainer, advantages=adv, rewards=rew)
    rec.close()

Tensors are `[B, T]` (torch on any device, or numpy); see `record.tables` for what is stored.
"""

from mismatch_lab.record.recorder import Recorder, scorer_label

__all__ = ["Recorder", "scorer_label"]
