"""Reinforcement learning on a verifiable task, measuring what the training-inference mismatch does.

    losses.py      policy objectives (GRPO, CISPO, PG-IS, TIS, four DPPO variants) -> (loss, metrics)
    advantages.py  group baseline advantages (GRPO, Dr. GRPO)                     -> (adv, metrics)
    tasks/         prompts and verifiers (arithmetic: seeded problems, last-number parser, 1/0 reward)

`losses` and `advantages` are pure tensor math (torch); `tasks` needs only the standard library, so
prompt files can be written without importing torch. Nothing is imported here on purpose: importing
`mismatch_lab.rl.tasks` must stay cheap. See docs/rl.md for the equations and every metric name.
"""
