"""grpo.py: advantages, masks, clip-higher, the hand-computed dual-track batch, global token-mean across ranks.

    python -m pytest -q tests/test_grpo.py
"""
import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen3Config, Qwen3ForCausalLM

from grpo import (GRPOConfig, advantages, build_batch, group_advantages, grpo_step, policy_loss, schema_track_mask,
                  token_logprobs, trajectory_ok)
from distributed import compile_layers

A = 0.5 / (math.sqrt(0.5) + 1e-6)  # advantage of each member of a 2-group whose rewards differ by 1

# -----------------------------------------------------------------------------
# group_advantages


def test_two_groups_unbiased_std():
    # group 1: [1.2, 0.2] mean 0.7, unbiased std sqrt(0.5); group 2: [0.0, 1.1] mean 0.55, std 1.1/sqrt(2)
    adv = group_advantages([1.2, 0.2, 0.0, 1.1], group_size=2)
    b = 0.55 / (1.1 / math.sqrt(2) + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([A, -A, -b, b]))


def test_zero_variance_group_gets_zeros():
    adv = group_advantages([0.2, 0.2, 0.2, 1.0, 0.0, 0.0], group_size=3)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert adv[3] > 0 > adv[4] and adv[4] == adv[5]


def test_dr_grpo_skips_std():
    torch.testing.assert_close(group_advantages([3.0, 1.0, 2.0, 2.0], 2, scale_std=False),
                               torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_keep_mask_leaves_rows_out_of_group_stats():
    # the dropped 100.0 would dominate the mean; without it the group is [1, 0, 0]
    adv = group_advantages([1.0, 0.0, 0.0, 100.0], 4, keep=[True, True, True, False])
    ref = group_advantages([1.0, 0.0, 0.0], 3)
    torch.testing.assert_close(adv[:3], ref)
    assert adv[3] == 0.0


def test_mtir_filters_before_the_group_statistics_so_its_format_reward_moves_no_advantage():
    # MTIR eq. 3 keeps only good trajectories "during rollout generation": dropped rows leave the mean and std. Every
    # kept row is well-formed, so its format reward (eq. 5) is +0.1 on all of them: a constant, which no advantage sees
    trajs = _trajs(8)  # rows 3 (an invalid turn), 5 (no answer) and 6 (truncated) fail the filter
    kept = [trajectory_ok(t) for t in trajs]
    result = [1.0, -1.0, 1.0, 0.0, -1.0, 0.0, 0.0, 1.0]
    with_format = [{"full": r + (0.1 if ok else -0.1), "schema": None} for r, ok in zip(result, kept)]
    without = [{"full": r, "schema": None} for r in result]
    cfg = GRPOConfig(group_size=4, trajectory_filter=True)
    a = advantages(trajs, with_format, cfg)
    b = advantages(trajs, without, cfg)
    assert kept == [True, True, True, False, True, False, False, True]
    torch.testing.assert_close(a.adv_full, b.adv_full)
    assert a.adv_full[[3, 5, 6]].tolist() == [0.0, 0.0, 0.0]
    # without the filter the format term does move the advantages: the -0.1 rows stay in the statistics
    unfiltered = GRPOConfig(group_size=4)
    assert not torch.allclose(advantages(trajs, with_format, unfiltered).adv_full,
                              advantages(trajs, without, unfiltered).adv_full)


def test_lone_survivor_gets_zero_not_nan():
    adv = group_advantages([1.0, 0.0], 2, keep=[True, False])
    assert adv.tolist() == [0.0, 0.0]

# -----------------------------------------------------------------------------
# schema_track_mask


def test_schema_mask_stops_after_propose_turn():
    loss_mask = torch.tensor([[0, 1, 1, 0, 1, 1, 0, 1]] * 3, dtype=torch.float32)
    turn_ids = torch.tensor([[-1, 0, 0, 0, 1, 1, 1, 2]] * 3)
    mask = schema_track_mask(loss_mask, turn_ids, [1, -1, 0])
    assert mask.tolist() == [[0, 1, 1, 0, 1, 1, 0, 0],   # turns 0-1 (observation tokens stay out)
                             [0, 0, 0, 0, 0, 0, 0, 0],   # never proposed: empty schema track
                             [0, 1, 1, 0, 0, 0, 0, 0]]

# -----------------------------------------------------------------------------
# clip-higher


def _token_loss_and_grad(ratio, adv, eps_low=0.2, eps_high=0.28):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, stats = policy_loss(logp, torch.zeros(1, 1), torch.tensor([[adv]]), torch.ones(1, 1), eps_low, eps_high)
    loss.backward()
    return loss.item(), logp.grad.item(), stats


def test_clip_higher_is_asymmetric():
    # ratio 1.25 with A > 0 is inside 1 + eps_high = 1.28: the gradient still pushes the token up
    loss, grad, st = _token_loss_and_grad(1.25, +1.0)
    assert loss == pytest.approx(-1.25) and grad == pytest.approx(-1.25) and st["clip_high"] == 0
    # ratio 0.75 with A < 0 is below 1 - eps_low = 0.8: clipped, no gradient
    loss, grad, st = _token_loss_and_grad(0.75, -1.0)
    assert loss == pytest.approx(0.8) and grad == 0.0 and st["clip_low"] == 1
    # the symmetric cases: A > 0 clips at 1.28, A < 0 at 0.8
    loss, grad, st = _token_loss_and_grad(1.5, +1.0)
    assert loss == pytest.approx(-1.28) and grad == 0.0 and st["clip_high"] == 1
    loss, grad, st = _token_loss_and_grad(0.85, -1.0)
    assert loss == pytest.approx(0.85) and grad == pytest.approx(0.85) and st["clip_low"] == 0
    # and the pessimistic min keeps gradients where clipping would be optimistic
    _, grad, _ = _token_loss_and_grad(0.5, +1.0)
    assert grad == pytest.approx(-0.5)


def test_aggregations():
    logp = torch.zeros(2, 4)
    adv = torch.tensor([[1.0] * 4, [-1.0] * 4])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float32)
    tok, _ = policy_loss(logp, logp, adv, mask, agg="token_mean")        # -(3 - 1) / 4
    seq, _ = policy_loss(logp, logp, adv, mask, agg="seq_mean")          # -(1 - 1) / 2
    dr, _ = policy_loss(logp, logp, adv, mask, agg="dr_grpo", denom=2 * 8)  # -(3 - 1) / (2 seqs * 8)
    assert (tok.item(), seq.item(), dr.item()) == pytest.approx((-0.5, 0.0, -0.125))
    with pytest.raises(ValueError, match="dr_grpo"):
        policy_loss(logp, logp, adv, mask, agg="dr_grpo")

# -----------------------------------------------------------------------------
# the hand-computed two-group dual-track batch (TRUST-SQL eqs. 4-6)
#   positions: 0-1 prompt | 2-3 turn 0 sampled | 4 observation | 5-9 turn 1 sampled   -> 7 sampled tokens per row
#   rows 0, 1 proposed in turn 0; rows 2, 3 never proposed
#   full rewards  [1.2, 0.2 | 0.0, 1.1] -> A_full   [+a, -a | -b, +b]
#   schema rewards [0, 1   | 0, 0]      -> A_schema [-a, +a |  0,  0]
#   N_full = 28 active tokens, N_schema = 4 (rows 0 and 1, turn 0)


def _dual_track_batch():
    turn_ids = torch.tensor([[-1, -1, 0, 0, 0, 1, 1, 1, 1, 1]] * 4)
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 1, 1, 1]] * 4, dtype=torch.float32)
    adv_full = group_advantages([1.2, 0.2, 0.0, 1.1], 2)
    adv_schema = group_advantages([0.0, 1.0, 0.0, 0.0], 2)
    schema_mask = schema_track_mask(loss_mask, turn_ids, [0, 0, -1, -1])
    return loss_mask, schema_mask, adv_full, adv_schema


def test_dual_track_advantages_and_masks():
    loss_mask, schema_mask, adv_full, adv_schema = _dual_track_batch()
    b = 0.55 / (1.1 / math.sqrt(2) + 1e-6)
    torch.testing.assert_close(adv_full, torch.tensor([A, -A, -b, b]))
    torch.testing.assert_close(adv_schema, torch.tensor([-A, A, 0.0, 0.0]))
    assert loss_mask.sum() == 28 and schema_mask.sum() == 4
    assert schema_mask[:, 5:].sum() == 0  # no schema credit after the propose turn


def test_dual_track_loss_value_and_gradient_signs():
    loss_mask, schema_mask, adv_full, adv_schema = _dual_track_batch()
    lam = 0.25
    # row 0 moved its sampled tokens up by 0.1 since sampling (ratio e^0.1, inside the clip); others ratio 1
    old = torch.zeros(4, 10)
    old[0] = -0.1
    logp = torch.zeros(4, 10, requires_grad=True)
    l_full, _ = policy_loss(logp, old, adv_full[:, None] * loss_mask, loss_mask)
    l_schema, _ = policy_loss(logp, old, adv_schema[:, None] * schema_mask, schema_mask)
    loss = l_full + lam * l_schema
    loss.backward()
    r0 = math.exp(0.1)
    # L_full = -(7a·r0 - 7a - 7b + 7b) / 28 ;  L_schema = -(2·(-a)·r0 + 2a) / 4
    assert l_full.item() == pytest.approx(-A * (r0 - 1) / 4, rel=1e-5)
    assert l_schema.item() == pytest.approx(A * (r0 - 1) / 2, rel=1e-5)
    assert loss.item() == pytest.approx(-A * (r0 - 1) / 8, rel=1e-5)
    g = logp.grad
    # row 1 (wrong SQL, right schema): its propose-turn tokens are pushed UP (dL/dlogp < 0) by the schema track,
    # its SQL-turn tokens DOWN by the full track: dL/dlogp = a/28 - λ·a/4 before, a/28 after
    assert g[1, 2].item() == pytest.approx(A / 28 - lam * A / 4, rel=1e-5) and g[1, 2] < 0
    assert g[1, 5].item() == pytest.approx(A / 28, rel=1e-5) and g[1, 5] > 0
    # row 0 (right SQL, wrong schema): the opposite signs
    assert g[0, 2] > 0 > g[0, 5]
    # rows that never proposed get only the full-track signal, identical before and after turn 0
    assert g[2, 2] == g[2, 5] > 0 and g[3, 2] == g[3, 5] < 0
    # prompt and observation tokens get nothing
    assert g[:, [0, 1, 4]].abs().sum() == 0

# -----------------------------------------------------------------------------
# grpo_step on a small Qwen3 model


def _tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg)


def _trajs(n, seed=0, lengths=(12, 9, 14, 10)):
    """Hand-built trajectories: 3 prompt tokens, turn 0 (propose) + 1 observation token, then turn 1."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = lengths[i % len(lengths)]
        turn = [-1] * 3 + [0] * 4 + [1] * (T - 7)
        mask = [0] * 3 + [1] * 3 + [0] + [1] * (T - 7)  # the 4th turn-0 token is the observation
        ep = SimpleNamespace(propose_turn=0 if i % 2 == 0 else -1, turn_valid=[True, i != 3],
                             final_sql=None if i == 5 else "SELECT 1")
        out.append(SimpleNamespace(token_ids=torch.randint(0, 64, (T,), generator=g).tolist(), loss_mask=mask,
                                   turn_ids=turn, sample_logprobs=[-4.0 * m for m in mask], episode=ep,
                                   num_turns=2, stop_reason="max_tokens" if i == 6 else "answer"))
    return out


REWARDS8 = [{"full": f, "schema": s} for f, s in
            [(1.1, 1.0), (0.2, 0.0), (0.0, 0.0), (1.1, 0.0), (0.2, 0.0), (0.2, 0.0), (0.2, 0.0), (0.2, 0.0)]]


def test_build_batch_right_pads():
    batch = build_batch(_trajs(2), pad_id=7)
    assert batch["input_ids"].shape == (2, 12) and batch["input_ids"][1, 9:].tolist() == [7, 7, 7]
    assert batch["loss_mask"][1, 9:].sum() == 0 and batch["turn_ids"][1, 9:].tolist() == [-1, -1, -1]


def test_grpo_step_first_pass_loss_is_minus_mean_advantage():
    # at ratio 1 the token-mean loss is -Σ_i A_i·n_i / Σ_i n_i, n_i = sampled tokens of row i
    model = _tiny_model()
    trajs = _trajs(4)
    cfg = GRPOConfig(group_size=2, schema_lambda=0.25, micro_batch_size=3)
    rewards = REWARDS8[:4]
    m = grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.0), trajs, rewards, cfg)
    adv = group_advantages([r["full"] for r in rewards], 2)
    n = torch.tensor([sum(t.loss_mask) for t in trajs], dtype=torch.float32)
    assert m["loss_full"] == pytest.approx((-(adv * n).sum() / n.sum()).item(), abs=1e-6)
    # schema track: rows 0 and 2 proposed (3 turn-0 tokens each); group 1 schema rewards [1, 0] -> A on row 0,
    # group 2 [0, 0] -> 0 on row 2: L_schema = -(3A + 0) / 6
    assert m["schema_tokens"] == 6 and m["loss_schema"] == pytest.approx(-A / 2, rel=1e-5)
    assert m["tokens"] == n.sum() and m["clip_frac_high"] == m["clip_frac_low"] == 0.0 and m["entropy"] > 0


def test_grpo_step_updates_and_ppo_epochs_clip():
    model = _tiny_model()
    trajs = _trajs(4)
    before = [p.detach().clone() for p in model.parameters()]
    cfg = GRPOConfig(group_size=2, ppo_epochs=3, micro_batch_size=2, grad_clip=1e9)
    m = grpo_step(model, torch.optim.SGD(model.parameters(), lr=5.0), trajs, REWARDS8[:4], cfg)
    assert any((p - q).abs().max() > 0 for p, q in zip(model.parameters(), before))
    assert m["approx_kl"] > 0 and m["clip_frac_high"] + m["clip_frac_low"] > 0  # big steps hit the clip


def test_filters_report_what_they_removed():
    model = _tiny_model()
    trajs = _trajs(8)
    # group 2 (rows 2-3) has different rewards; groups 3-4 (rows 4-7) are all 0.2: dynamic sampling drops them
    cfg = GRPOConfig(group_size=2, dynamic_sampling=True, mask_truncated=True)
    m = grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.0), trajs, REWARDS8, cfg)
    assert m["filtered_groups"] == 2 and m["rows"] == 4 and m["masked_truncated"] == 0  # row 6 went with its group
    # MTIR filter: row 3 has an invalid turn, row 5 no answer, row 6 is truncated
    cfg = GRPOConfig(group_size=2, trajectory_filter=True)
    m = grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.0), trajs, REWARDS8, cfg)
    assert m["filtered_trajectories"] == 3 and m["rows"] == 5
    cfg = GRPOConfig(group_size=2, mask_truncated=True)
    m = grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.0), trajs, REWARDS8, cfg)
    assert m["masked_truncated"] == 1 and m["tokens"] == sum(sum(t.loss_mask) for t in trajs) - sum(trajs[6].loss_mask)


def test_rows_without_advantage_are_not_forwarded_and_change_no_weight():
    # rows 4-7 are two groups of equal rewards on both tracks: skipped, but still in the token-mean normaliser, so
    # the update equals one that forwards all 8 rows (a KL term against an identical reference forwards every row
    # and adds no gradient: d/dlogp of k3 is 0 where logp = ref)
    trajs = _trajs(8)
    cfg = GRPOConfig(group_size=2, micro_batch_size=2, grad_clip=1e9)
    skipping, forwarding = _tiny_model(), _tiny_model()
    m = grpo_step(skipping, torch.optim.SGD(skipping.parameters(), lr=1.0), trajs, REWARDS8, cfg)
    ref = _tiny_model()
    cfg.kl_beta = 1.0
    full = grpo_step(forwarding, torch.optim.SGD(forwarding.parameters(), lr=1.0), trajs, REWARDS8, cfg, ref)
    assert m["forwarded_tokens"] == sum(sum(t.loss_mask) for t in trajs[:4]) < m["tokens"]
    assert full["forwarded_tokens"] == full["tokens"] == m["tokens"] and m["loss_full"] == pytest.approx(
        full["loss_full"], abs=1e-6)
    assert any((p - q).abs().max() > 1e-4 for p, q in zip(skipping.parameters(), ref.parameters()))  # it moved
    for p, q in zip(skipping.parameters(), forwarding.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def test_naive_single_track_adds_schema_to_terminal_reward():
    model = _tiny_model()
    trajs = _trajs(4)
    naive = GRPOConfig(group_size=2, naive_schema_weight=0.25, schema_lambda=0.25, micro_batch_size=4)
    m = grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.0), trajs, REWARDS8[:4], naive)
    summed = [{"full": r["full"] + 0.25 * r["schema"], "schema": None} for r in REWARDS8[:4]]
    ref = grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.0), trajs, summed, GRPOConfig(group_size=2))
    assert m["loss_full"] == pytest.approx(ref["loss_full"]) and m["schema_tokens"] == 0 and m["loss_schema"] == 0


def test_kl_needs_reference_and_is_zero_against_itself():
    model = _tiny_model()
    trajs = _trajs(4)
    cfg = GRPOConfig(group_size=2, kl_beta=0.1)
    with pytest.raises(ValueError, match="ref_model"):
        grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.0), trajs, REWARDS8[:4], cfg)
    m = grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.0), trajs, REWARDS8[:4], cfg, ref_model=_tiny_model())
    assert m["kl_ref"] == pytest.approx(0.0, abs=1e-6)


def test_one_step_per_batch_never_clips_but_a_second_mini_batch_does():
    # rewards alternate inside every group, so all four groups carry an advantage
    trajs = _trajs(8)
    rewards = [{"full": float(i % 2), "schema": None} for i in range(8)]
    model = _tiny_model()
    one = grpo_step(model, torch.optim.SGD(model.parameters(), lr=5.0), trajs, rewards,
                    GRPOConfig(group_size=2, grad_clip=1e9))
    # the only pass runs on the weights that sampled: ratio exactly 1, so clip-higher cannot act
    assert one["optimizer_steps"] == 1 and one["approx_kl"] == 0 and one["clip_frac_high"] == one["clip_frac_low"] == 0
    model = _tiny_model()
    two = grpo_step(model, torch.optim.SGD(model.parameters(), lr=5.0), trajs, rewards,
                    GRPOConfig(group_size=2, grad_clip=1e9, mini_batches=2))
    # groups 3-4 are scored against the weights before step 1: their ratio moved, and the big step hits the clip
    assert two["optimizer_steps"] == 2 and two["approx_kl"] > 0 and two["clip_frac_high"] + two["clip_frac_low"] > 0


def test_sampler_logprobs_stand_in_for_the_recompute_when_the_sampler_is_the_model():
    # the rollout's log-probs came from these very weights (train.py's fp32 case): two mini-batch steps, so the
    # second one's ratios depend on the old log-probs, must land where recomputing them lands
    trajs = _trajs(8)
    rewards = [{"full": float(i % 2), "schema": None} for i in range(8)]
    batch = build_batch(trajs)
    with torch.no_grad():
        own = token_logprobs(_tiny_model(), batch["input_ids"], batch["loss_mask"])[0]
    for t, row in zip(trajs, own):
        t.sample_logprobs = row[: len(t.token_ids)].tolist()
    after = {}
    for recompute in (True, False):
        model = _tiny_model()
        m = grpo_step(model, torch.optim.SGD(model.parameters(), lr=5.0), trajs, rewards,
                      GRPOConfig(group_size=2, grad_clip=1e9, mini_batches=2, recompute_old_logp=recompute))
        weights = torch.cat([p.flatten() for p in model.parameters()])
        after[recompute] = (weights, m["clip_frac_high"] + m["clip_frac_low"])
    assert after[True][1] > 0  # the second step clips: the old log-probs matter
    assert torch.allclose(after[True][0], after[False][0], atol=1e-5) and after[True][1] == after[False][1]


def test_kl_gradient_pulls_the_policy_back_to_the_reference():
    ref, model = _tiny_model(0), _tiny_model(0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    trajs = _trajs(4)
    cfg = GRPOConfig(group_size=2, kl_beta=1.0, grad_clip=1e9)
    flat = [{"full": 0.5, "schema": None}] * 4  # equal rewards: zero advantages, the KL term is the whole loss
    before = grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.05), trajs, flat, cfg, ref_model=ref)
    after = grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.0), trajs, flat, cfg, ref_model=ref)
    assert before["kl_ref"] > 0 and after["kl_ref"] < 0.9 * before["kl_ref"]


def test_bad_group_shape_is_a_clear_error():
    model = _tiny_model()
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.0), _trajs(4), REWARDS8[:4], GRPOConfig(group_size=3))

# -----------------------------------------------------------------------------
# global token-mean across two ranks (gloo, CPU)


# each case: (rows of rank 0, rows of rank 1, config); the single process runs rows 0 + rows 1 in one call
RANK_CASES = {
    "plain": ([0, 1], [2, 3], dict()),
    # dynamic sampling empties rank 1 (its group's rewards are equal): it must still join every collective
    "rank1_filtered": ([0, 1], [4, 5], dict(dynamic_sampling=True)),
    # rank 1 holds no group at all (the difficulty filter's first batch kept none of its candidates)
    "rank1_empty": ([0, 1, 2, 3], [], dict()),
    # FSDP2 with uneven micro-batch counts (1 vs 2 passes of one row): fillers keep the collectives in step
    "fsdp": ([0, 1], [2, 3, 0, 1], dict(micro_batch_size=1)),
}


def _step(model, rows, extra):
    trajs = _trajs(8)
    return grpo_step(model, torch.optim.SGD(model.parameters(), lr=1.0), [trajs[i] for i in rows],
                     [REWARDS8[i] for i in rows], GRPOConfig(group_size=2, grad_clip=1e9, **extra))


def _rank_main(rank, world, tmp):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    logp, old, adv, mask = (torch.load(f"{tmp}/inputs.pt")[k] for k in ("logp", "old", "adv", "mask"))
    rows = slice(0, 1) if rank == 0 else slice(1, 4)  # uneven split: 1 row vs 3 rows of different lengths
    loss, _ = policy_loss(logp[rows], old[rows], adv[rows], mask[rows])
    dist.all_reduce(loss)  # per-rank losses carry the global normaliser, so they add up
    out = {"loss": loss}
    for name, (rows0, rows1, extra) in RANK_CASES.items():  # whole grpo_steps; gradients all-reduced inside
        model = _tiny_model()
        if name == "fsdp":
            from torch.distributed.fsdp import fully_shard
            fully_shard(model.model.layers[0])
            fully_shard(model)
        m = _step(model, rows0 if rank == 0 else rows1, extra)
        out[name] = {"loss_full": m["loss_full"], "tokens": m["tokens"],
                     "params": {k: getattr(v, "full_tensor", lambda: v)().detach()
                                for k, v in model.state_dict().items()}}
    torch.save(out, f"{tmp}/rank{rank}.pt")
    dist.destroy_process_group()
    os._exit(0)  # gloo's threads can abort interpreter teardown after a clean run (SIGABRT, ~1 in 8): skip it


def test_token_mean_is_global_across_two_ranks(tmp_path):
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]],
                        dtype=torch.float32)
    inputs = {"logp": torch.randn(4, 6, generator=g) * 0.2, "old": torch.randn(4, 6, generator=g) * 0.2,
              "adv": torch.randn(4, 1, generator=g).expand(4, 6) * mask, "mask": mask}
    torch.save(inputs, tmp_path / "inputs.pt")
    mp.spawn(_rank_main, args=(2, str(tmp_path)), nprocs=2, join=True)
    single, _ = policy_loss(inputs["logp"], inputs["old"], inputs["adv"], mask)
    outs = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for out in outs:
        assert out["loss"].item() == pytest.approx(single.item(), rel=1e-6)
    for name, (rows0, rows1, extra) in RANK_CASES.items():
        model = _tiny_model()
        ref = _step(model, rows0 + rows1, extra)
        for out in outs:
            got = out[name]
            assert got["tokens"] == ref["tokens"] and got["loss_full"] == pytest.approx(ref["loss_full"], abs=1e-6)
            for k, v in model.state_dict().items():
                torch.testing.assert_close(got["params"][k], v, rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")


def test_compiled_checkpointed_layers_update_as_eager_ones():
    # train.py --compile: each decoder layer compiled in place, under the gradient checkpointing GPUs run. The aot_eager
    # backend traces forward and backward graphs as inductor does, without generating kernels (test_cuda runs
    # inductor); micro-batches of other lengths make dynamo recompile for dynamic shapes
    torch._dynamo.reset()
    eager, compiled = _tiny_model(), _tiny_model()
    compiled.activation_checkpointing_enable()
    compile_layers(compiled, backend="aot_eager")
    cfg = GRPOConfig(group_size=2, micro_batch_size=2, grad_clip=1e9)
    metrics = [grpo_step(m, torch.optim.SGD(m.parameters(), lr=1.0), _trajs(8), REWARDS8, cfg)
               for m in (eager, compiled)]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the layers did run compiled
    assert list(compiled.state_dict()) == list(eager.state_dict())  # checkpoints keep their keys
    assert metrics[1]["loss"] == pytest.approx(metrics[0]["loss"], abs=1e-6)
    assert any((p - q).abs().max() > 1e-4 for p, q in zip(eager.parameters(), _tiny_model().parameters()))
    for p, q in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
