"""The trl/* presets against TRL's own GRPOTrainer code on the same float64 tokens.

A real GRPOTrainer (TRL as installed, 1.16.0) around the session's tiny random Llama. Orchestration only:
the vLLM engine is replaced by the recorded rollout (`_generate` returns the tokens' completions and μ), the
trainer's forward pass by the tokens' log π_old (during generation) and log π (during the loss, a leaf that
requires grad), and the advantages TRL derives from rewards by the tokens' own. Everything else — the vLLM
importance-sampling ratio and its truncation or mask, OPSM, the per-token loss, the aggregation and the logged
metrics — is TRL's code. Compared at 1e-9 relative (float64), the clip fractions bitwise (both sides count them
in float32, as TRL does).
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("trl")
torch = pytest.importorskip("torch")

from frameworks_reference.inputs import fresh, rel_close, rows, tokens

from mismatch_lab.corrections.frameworks.base import Tokens
from mismatch_lab.corrections.frameworks.trl import DEFAULTS, PRESETS

TOKEN_ID = 42  # any id that is neither EOS nor padding


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.fixture(scope="module")
def batch() -> list:
    return rows()


def _trainer(model: str, out, settings):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(out), use_cpu=True, bf16=False, report_to=[], use_vllm=False,
                      num_generations=2, per_device_train_batch_size=2, **settings)
    trainer = GRPOTrainer(model=model, reward_funcs=zero_reward, args=args,
                          train_dataset=Dataset.from_list([{"prompt": "p"}] * 2))
    trainer.use_vllm = True  # the engine's part is played by the recorded rollout below
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def run_trl(trainer, t: Tokens) -> dict:
    """TRL's IS ratio, loss, gradient wrt log π, OPSM mask and metrics on the tokens."""
    lengths = t.mask.sum(-1).tolist()
    mu = [row[:n] for row, n in zip(t.logp_rollout.tolist(), lengths)]

    def recorded_rollout(prompts):
        completions = [[TOKEN_ID] * n for n in lengths]
        return [[TOKEN_ID]] * len(lengths), completions, None, ["x"] * len(lengths), mu, {}, None, None

    logps = {"now": t.logp_old}

    def forward(*args, **kwargs):
        return logps["now"], torch.zeros_like(t.logp_old), None

    opsm = []

    def off_policy_mask(**kwargs):
        opsm.append(type(trainer).get_off_policy_mask(**kwargs))
        return opsm[-1]

    trainer._generate, trainer._get_per_token_logps_and_entropies = recorded_rollout, forward
    trainer.get_off_policy_mask = off_policy_mask
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # TRL builds μ with torch.tensor(list): keep it float64
    try:
        inputs = trainer._generate_and_score_completions([{"prompt": "p"}] * len(lengths))
    finally:
        torch.set_default_dtype(previous)
    inputs["advantages"] = t.advantages[:, 0]
    leaf = fresh(t).logp
    logps["now"] = leaf
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return {"inputs": inputs, "loss": loss.item(), "grad": leaf.grad, "opsm": opsm,
            "metrics": {k: v[-1] for k, v in trainer._metrics["train"].items()}}


def _trl_keep_and_weight(t: Tokens, settings, trl: dict):
    ratio = trl["inputs"]["importance_sampling_ratio"]
    keep = t.mask.clone()
    if settings["vllm_importance_sampling_mode"].endswith("_mask"):
        keep &= ratio != 0  # TRL masks by writing 0 into the ratio (no ratio here underflows to 0)
    for mask in trl["opsm"]:
        keep &= mask.bool()
    return keep, (ratio * t.mask).detach()


def _assert_close_tensor(ours: torch.Tensor, theirs: torch.Tensor, what: str):
    assert ours.dtype == theirs.dtype == torch.float64, what
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=0.0, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("preset", PRESETS, ids=[p.name for p in PRESETS])
def test_each_trl_preset_matches_grpo_trainers_own_loss_weights_masks_gradient_and_metrics(
        preset, batch, tiny_model, tmp_path):
    t = tokens(batch)
    trainer = _trainer(tiny_model, tmp_path, preset.settings)
    trl = run_trl(trainer, t)
    assert torch.equal(trl["inputs"]["sampling_per_token_logps"] * t.mask, t.logp_rollout * t.mask)
    ours_t = fresh(t)
    ours = preset(ours_t)
    ours.loss.backward()
    assert rel_close(ours.loss.item(), trl["loss"]), (ours.loss.item(), trl["loss"])
    _assert_close_tensor(ours_t.logp.grad, trl["grad"], "gradient wrt log π")
    keep, weight = _trl_keep_and_weight(t, preset.settings, trl)
    assert torch.equal(ours.keep, keep)
    _assert_close_tensor(ours.weight, weight.expand_as(ours.weight), "weight")
    names = [k for k in trl["metrics"] if k.startswith(("sampling/", "clip_ratio/", "cispo_clip_ratio"))]
    assert sorted(ours.metrics) == sorted(names)
    for name in names:
        exact = name.startswith(("clip_ratio/", "cispo"))
        assert rel_close(ours.metrics[name], trl["metrics"][name], 0.0 if exact else 1e-9), \
            (name, ours.metrics[name], trl["metrics"][name])


def test_the_inputs_reach_every_band_the_trl_presets_test(batch):
    """The comparison means something only if the tokens drop, truncate and clip somewhere."""
    t = tokens(batch)
    default = next(p for p in PRESETS if p.default)
    out = default(fresh(t))
    assert (~out.keep & t.mask).any() and out.keep.any()
    assert out.metrics["clip_ratio/region_mean"] > 0
    truncated = default.settings | {"vllm_importance_sampling_mode": "token_truncate"}
    assert (default.loss(fresh(t), truncated).weight == 3.0).any()
    assert (t.advantages[:, 0] == 0).any() and (t.mask.sum(-1) == 1).any()


def test_the_default_trl_preset_is_grpo_configs_default(tmp_path):
    from trl import GRPOConfig

    config = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[])
    (default,) = [p for p in PRESETS if p.default]
    assert default.name == "trl/dapo-sequence_mask"
    for key, value in DEFAULTS.items():
        theirs = getattr(config, key)
        if key == "epsilon_high" and theirs is None:
            theirs = config.epsilon  # GRPOTrainer: ε_high = ε when unset
        assert theirs == value, key
    assert default.settings == DEFAULTS


def test_trls_default_weights_kept_tokens_by_the_product_ratio_where_our_seq_mis_keeps_each_tokens_ratio(batch):
    """What the registry says of seq_mis: same drop rule at C = 3, different weights on the kept tokens."""
    from mismatch_lab.corrections.batch import Batch
    from mismatch_lab.corrections.registry import CORRECTIONS

    t = tokens(batch)
    trl = next(p for p in PRESETS if p.default)(fresh(t))
    b = Batch(t.logp.detach(), t.logp_rollout, t.logp_rollout, t.logp_old, t.mask, t.advantages)
    ours = CORRECTIONS["seq_mis"].rule(b, CORRECTIONS["seq_mis"].params)
    both = ours.keep & trl.keep
    assert both.sum() > 0.9 * trl.keep.sum()
    assert not torch.allclose(ours.weight[both], trl.weight[both])
    assert "not equal" in CORRECTIONS["seq_mis"].framework


NAN_PRESETS = [p for p in PRESETS if p.name in ("trl/dapo-sequence_mask", "trl/grpo-token_truncate",
                                                  "trl/dapo-sequence_mask-opsm")]


@pytest.mark.parametrize("preset", NAN_PRESETS, ids=[p.name for p in NAN_PRESETS])
def test_trl_presets_treat_a_nan_rollout_logprob_as_trl_does(preset, batch, tiny_model, tmp_path):
    """vLLM can return NaN for a token's log-prob: TRL sets its log-ratio to 0 and leaves it out of
    sampling_logp_difference (compared with TRL's code, as above)."""
    nan = float("nan")
    rows_ = batch[:6] + [([-0.5, -1.0], [-0.4, -1.1], [nan, -1.2], -1.0), ([-0.3], [-0.3], [nan], 1.0)]
    t = tokens(rows_)
    trl = run_trl(_trainer(tiny_model, tmp_path, preset.settings), t)
    ours_t = fresh(t)
    ours = preset(ours_t)
    ours.loss.backward()
    assert rel_close(ours.loss.item(), trl["loss"])
    _assert_close_tensor(ours_t.logp.grad, trl["grad"], "gradient wrt log π")
    for name in ours.metrics:
        assert rel_close(ours.metrics[name], trl["metrics"][name], 1e-9), name
    assert not any(math.isnan(v) for v in ours.metrics.values())
