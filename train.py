"""
Train a text-to-SQL agent: SFT warm-up on multi-turn trajectories, then multi-turn GRPO against a live database.

    python train.py                                   # the demo: SmolLM2-135M-Instruct on the gym, SFT, GRPO, eval
    python train.py --quick --model tiny              # a few steps of everything on the test model (the tests)
    python train.py --recipe trail --model Qwen/Qwen2.5-Coder-3B-Instruct --data data/spider/train.jsonl \\
        --sft-data out/teacher/spider_trail.jsonl --dev-data data/spider/dev.jsonl
    torchrun --nproc_per_node=8 train.py --recipe trust --model Qwen/Qwen3-4B --data ... --fsdp
    python train.py --recipe skyrl --model Qwen/Qwen2.5-Coder-7B-Instruct --lora-r 16 --rl-lr 1e-5 --data ...  # 1 GPU

A recipe (--recipe trust|trail|mtir|skyrl) is a dict of flag defaults taken from its paper, a preset (--preset demo)
the sizes of a setting; explicit flags win (config.py).
Checkpoints (out/<run-name>/ckpt-XXXXXX; the default run name is run-<date>-<time>) are save_pretrained folders plus
optimizer/scheduler/RNG/data position; --resume continues the latest one exactly. A new run refuses a folder that
holds checkpoints (pass --resume, another --run-name or --overwrite): it never deletes what it did not write.
"""
import copy
import functools
import math
import random
import shutil
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers.utils import logging as hf_logging

import cli
import config
import lora
import memory
import practice
import protocols
from checkpoint import (keep_in_last_checkpoint, load_trainer_state, load_weights, replaceable_checkpoints, run_name,
                        save_if_due, start_state)
from distributed import all_ranks, barrier, distribute, over_ranks, setup_distributed
from eval import evaluate_ex, trained_settings
from grpo import grpo_step
from model import (TORCH_DTYPES, load_model, make_optimizer, reference_model, refresh_sampler, resolve,
                   resolve_dtype)
from report import Logger, report, timed, trajectory_record
from rewards import REWARDS, turn_budget
from sft import agent_tokens, load_sft_data, sft_step

hf_logging.disable_progress_bar()  # save_pretrained's shard bar would interleave with ours

# -----------------------------------------------------------------------------
# an RL update


def rl_update(model, opt, trajs, rewards, cfg, ref, tracks, autocast):
    """One grpo_step under autocast (autocast holds for the thread that enters it: memory.on_training_thread's)."""
    with autocast():
        return grpo_step(model, opt, trajs, rewards, cfg, ref_model=ref, tracks=tracks)


# -----------------------------------------------------------------------------


def main(argv=None):
    args, typed, saved = config.settings(argv)
    owns_group = not dist.is_initialized()  # a caller's process group outlives this run; one made here ends with it
    rank, world, device = setup_distributed(args)
    if torch.device(device).type == "cpu":
        memory.return_memory_on_free()
    args.dtype = resolve_dtype(args.dtype, device)  # saved resolved in config.json
    config.check_resume(args, typed, saved)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    args.run_name = run_name(args.run_name, args.resume)
    run_dir = Path(args.out_dir) / args.run_name
    stages = ["sft", "rl"] if args.stage == "both" else [args.stage]
    master = rank == 0
    if master:
        print(config.describe(args))
    trained = trained_settings(args.model)
    if master and trained:
        print("settings the checkpoint was trained in (a flag overrides): "
              + ", ".join(f"{k}={getattr(args, k)}" for k in trained))

    # --- checked before any work: the model can load, and a run never deletes what it did not write
    try:
        model_path = resolve(args.model)  # a missing folder, a Hub id neither cached nor reachable, smollm2's fetch
        old = replaceable_checkpoints(run_dir, args.model, args.resume, args.overwrite)
    except (OSError, RuntimeError, ValueError) as e:
        raise cli.UserError(e) from None
    config.check_sizes(args, world)
    lora_settings = config.lora_settings(args)  # None: full fine-tuning

    # --- data (the gym by default, built once by rank 0) and the model: fp32 master weights, compute per --dtype
    train, evalsets = config.load_data(args, master)
    try:
        model, tokenizer = load_model(model_path, device=device, seed=args.seed)
    except ValueError as e:  # e.g. a tokenizer without a chat template
        raise cli.UserError(e) from None
    args.eval_batch_size = memory.decode_rows(model, args, device, master)
    if master:  # the layers, then the command line, then the memory: what this run uses
        config.save(args, run_dir)

    # --- rollouts decode a full copy: bf16 under bf16, unsharded under FSDP, uncompiled under --compile, plain (the
    # adapters merged into it) under LoRA; made before any of these changes the model
    bf16 = args.dtype == "bf16"
    fsdp = args.fsdp and world > 1
    decode_copy = bf16 or fsdp or args.compile or lora_settings is not None
    sampler = copy.deepcopy(model).to(TORCH_DTYPES[args.dtype]) if decode_copy else model

    # --- resume: the latest checkpoint's state decides which stage and step we are at (optimizer state is loaded by
    # the stage that owns it)
    ckpt, state = start_state(run_dir, args.resume, stages[0])
    adapter = None  # LoRA: peft's wrapper of the adapter being trained
    merged = []     # LoRA: the adapters already added into the weights, in order (each checkpoint keeps them)
    if ckpt is not None and lora_settings:
        adapter, merged = lora.restore(model, ckpt, args.seed)
    elif ckpt is not None:
        model = load_weights(model, ckpt)
    if ckpt is not None and master:
        print(f"resuming {ckpt} ({state['stage']} step {state['step']})")
    if ckpt is None and master and old:  # --overwrite (checked above)
        print(f"--overwrite: deleting the {len(old)} checkpoints of an earlier run in {run_dir}")
        for c in old:
            shutil.rmtree(c)
    barrier()

    autocast = functools.partial(torch.autocast, torch.device(device).type, torch.bfloat16) if bf16 else nullcontext
    distribute(model, args.fsdp, world, device, bf16, args.compile)
    log = Logger(run_dir, args, rank, state["gstep"], state["log_lines"], state["rollout_lines"])
    times = {}
    reward_fn = REWARDS[args.reward]
    base_protocol = args.protocol  # the prompt variant (--brief-prompt, --obs-rows) is registered under its own name
    protocol = protocols.protocol_variant(args.protocol, args.brief_prompt, args.obs_rows, args.force_final_answer)
    rollout_cfg = config.rollout_config(args, protocol)

    def record_eval(tag):
        """Greedy EX of the eval sets after a stage, logged, printed and kept in the stage's last checkpoint."""
        if tag in state["evals"]:
            return
        with timed(times, "eval"):
            e = evaluate_ex(refresh_sampler(sampler, model), tokenizer, evalsets, rollout_cfg, args.eval_batch_size,
                            args.seed, rank, world)
        state["evals"][tag] = e
        log.log({"stage": "eval", "after": tag, "step": state["step"], "gstep": state["gstep"],
                 **{f"{name}_ex": e[name]["ex"] for name in e}})
        if master:
            print(f"[{tag}] " + "  ".join(f"{name} EX {100 * e[name]['ex']:.1f}% ({e[name]['n']})" for name in e))
        keep_in_last_checkpoint(run_dir, state, log, args, rank)

    def record_practice(tag, pool):
        """pass@1 of RL's questions after a stage (practice.measure_practice), its samples in rollouts.jsonl."""
        if tag in state["practice"]:
            return
        with timed(times, "practice"):
            rates, records = practice.measure_practice(
                refresh_sampler(sampler, model), tokenizer, pool, rollout_cfg, reward_fn, args.practice_k,
                batch_size=args.eval_batch_size, seed=args.seed, rank=rank, world=world, tag=tag)
        state["practice"][tag] = rates
        log.rollouts([r | {"gstep": state["gstep"]} for part in all_ranks(records) for r in part])
        pass1 = float(np.mean(list(rates.values())))
        log.log({"stage": "practice", "after": tag, "step": state["step"], "gstep": state["gstep"],
                 "practice_pass1": pass1})
        if master:
            print(f"[{tag}] practice pass@1 {pass1:.2f} ({len(rates)} questions x {args.practice_k} samples)")

    try:
        # --- stage 1: SFT, masked NLL on teacher (or any) trajectories, args.sft_batch_size of them a step
        if "sft" in stages and state["stage"] == "sft":
            sft_path = Path(args.sft_data) if args.sft_data else run_dir / f"teacher_{protocol}.jsonl"
            if args.sft_data is None and master and not (args.resume and sft_path.exists()):  # fresh run: fresh data
                from data.teacher import write_teacher_data
                write_teacher_data(train[: args.teacher_limit or None], sft_path, protocol, max_turns=args.max_turns,
                                   schema_mode=args.schema_mode, seed=args.seed, max_probes=args.teacher_probes,
                                   distractors=args.teacher_distractors, list_tables=args.teacher_list_tables)
            barrier()
            rows = load_sft_data(sft_path, tokenizer, args.max_total_tokens, rank)
            if args.sft_epochs:
                args.sft_steps = math.ceil(args.sft_epochs * len(rows) / args.sft_batch_size)
                if master:
                    print(f"sft: {args.sft_epochs:g} epochs of {len(rows):,} trajectories at batch "
                          f"{args.sft_batch_size}: {args.sft_steps} steps")
            if lora_settings and adapter is None:
                adapter = lora.add_adapter(model, lora_settings, args.seed)
            opt, sched = make_optimizer(model, args.sft_lr, args.sft_steps, args.weight_decay, args.warmup_ratio)
            if ckpt is not None and state["step"]:
                load_trainer_state(ckpt, model, opt, sched, args, rank)
            model.train()
            bar = tqdm(range(state["step"], args.sft_steps), desc="sft", disable=not master, initial=state["step"],
                       total=args.sft_steps)
            with timed(times, "sft"):
                for step in bar:
                    t0 = time.perf_counter()
                    idx = practice.take(len(rows), args.sft_batch_size, args.seed, step * args.sft_batch_size)
                    mine = sorted((rows[i] for i in idx[rank::world]), key=lambda r: len(r[0]))  # less padding
                    tokens = over_ranks(torch.tensor(agent_tokens(mine), dtype=torch.float64)).item()  # past 2^24
                    lr = sched.get_last_lr()[0]  # this step's: after sched.step() it would be the next one's
                    loss, grad_norm = memory.on_training_thread(
                        device, sft_step, model, opt, mine, tokens, tokenizer.pad_token_id,
                        micro_batch_size=args.micro_batch_size or args.sft_batch_size, grad_clip=args.grad_clip,
                        autocast=autocast, full_forward=args.fsdp)
                    sched.step()
                    loss = over_ranks(torch.tensor(loss, dtype=torch.float64)).item()
                    state["step"] = step + 1
                    state["gstep"] += 1
                    memory.release_freed_memory()
                    log.log({"stage": "sft", "step": step + 1, "gstep": state["gstep"], "loss": loss,
                             "grad_norm": grad_norm, "lr": lr, "tokens": tokens,
                             "time_update": time.perf_counter() - t0})
                    bar.set_postfix(loss=f"{loss:.3f}")
                    save_if_due(run_dir, state, log, model, tokenizer, opt, sched, args, rank, world,
                                final=step + 1 == args.sft_steps, merged=merged)
            model.eval()
            ckpt = None
            if adapter is not None:  # LoRA: SFT's adapter goes into the weights; RL trains a new one from there
                merged.append(lora.adapter_state(model))
                lora.merge_adapter(adapter)
                adapter = None
        if "sft" in stages:
            record_eval("sft")

        # --- stage 2: GRPO on the practice set: the training questions the policy solves sometimes
        if "rl" in stages:
            if state["stage"] != "rl":
                state.update(stage="rl", step=0)
            warm = None  # the filter's own rollouts of RL's first batch, when they can be reused
            if state["rl_pool"] is None:
                pool = train
                if args.filter_k:
                    cands = train[: args.filter_limit or None]
                    rule = practice.PoolRule(args.filter_pass_rate, args.filter_solved_once, args.filter_top_n,
                                             args.filter_unsolved_n)
                    with timed(times, "filter"):
                        pool, rates, warm = practice.difficulty_filter(
                            refresh_sampler(sampler, model), tokenizer, cands, rollout_cfg, reward_fn, rule,
                            args.filter_k, size=args.practice_size, batch_size=args.eval_batch_size,
                            rl_batch_size=args.rl_batch_size, seed=args.seed,
                            reuse=args.filter_k == args.group_size and not args.adaptive_turns, rank=rank, world=world)
                    if master:
                        print(f"difficulty filter: kept {len(pool)} of the first {len(rates)} of {len(cands)} "
                              f"candidates by {rule.describe()} over {args.filter_k} rollouts")
                    if not pool:
                        raise cli.UserError(f"the difficulty filter kept none of {len(cands)} questions: raise "
                                            "--filter-pass-rate or --filter-top-n, or give more with --filter-limit")
                    log.log({"stage": "filter", "step": 0, "gstep": state["gstep"], "filter_candidates": len(rates),
                             "filter_kept": len(pool)})
                state["rl_pool"] = [ex["id"] for ex in pool]
            by_id = {ex["id"]: ex for ex in train}
            pool = [by_id[i] for i in state["rl_pool"]]
            if args.adaptive_turns:  # SQL-Trail's turn budget by difficulty
                pool = [ex | {"max_turns": turn_budget(ex["difficulty"], args.max_turns)} for ex in pool]
            if args.rl_epochs:
                args.rl_steps = math.ceil(args.rl_epochs * len(pool) / args.rl_batch_size)
                if master:
                    print(f"rl: {args.rl_epochs:g} epochs of {len(pool):,} questions at batch {args.rl_batch_size}: "
                          f"{args.rl_steps} steps")
            if args.practice_k and state["step"] == 0:  # after SFT; a resume from there measures again, same draws
                record_practice("sft", pool)

            if lora_settings and adapter is None:
                adapter = lora.add_adapter(model, lora_settings, args.seed + 1)
            opt, sched = make_optimizer(model, args.rl_lr, args.rl_steps, args.weight_decay, args.warmup_ratio)
            if ckpt is not None and state["step"]:
                load_trainer_state(ckpt, model, opt, sched, args, rank)
            grpo_cfg = config.grpo_config(args, tokenizer.pad_token_id)
            ref = None
            if args.kl_beta and adapter is not None:  # LoRA: the policy with RL's adapter off, no copy
                ref = lora.WithoutAdapter(adapter)
            elif args.kl_beta:
                ref = reference_model(refresh_sampler(sampler, model), run_dir, rank, fsdp,
                                      resumed=ckpt is not None and state["step"] > 0)

            def refill(n):  # DAPO's fresh prompts: their own stream, its position checkpointed: a resume draws alike
                idx = practice.take(len(pool), n, args.seed + 2 + 1000 * rank, state["refill"])
                state["refill"] += n
                return [pool[i] for i in idx]
            bar = tqdm(range(state["step"], args.rl_steps), desc="rl", disable=not master, initial=state["step"],
                       total=args.rl_steps)
            with timed(times, "rl"):
                for step in bar:
                    idx = practice.rl_batch(len(pool), args.rl_batch_size, args.seed, step)
                    mine = [pool[i] for i in idx[rank::world]]  # whole groups stay on one rank
                    t0 = time.perf_counter()
                    reused = step == 0 and warm is not None  # the filter's own rollouts of these questions
                    tracks = None
                    ds = {}
                    if reused:
                        trajs, rewards = warm
                    else:
                        trajs, rewards, tracks, ds = practice.rollout_with_signal(
                            refresh_sampler(sampler, model), tokenizer, mine, rollout_cfg, reward_fn, grpo_cfg,
                            refill=refill if args.dynamic_sampling else None, rounds=args.dynamic_sampling_rounds,
                            seed=(args.seed * 100_003 + step) * 1009 + rank, max_rows=args.eval_batch_size)
                    t1 = time.perf_counter()  # the rollout: generation, its tool calls, the rewards
                    lr = sched.get_last_lr()[0]  # the lr this step uses
                    model.train()
                    gm = memory.on_training_thread(device, rl_update, model, opt, trajs, rewards, grpo_cfg, ref,
                                                   tracks, autocast)
                    with warnings.catch_warnings():  # a step with no signal skips the update; the schedule counts on
                        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler", UserWarning)
                        sched.step()
                    state["step"] = step + 1
                    state["gstep"] += 1
                    records = [trajectory_record(t, r, tokenizer, stage="rl", step=step + 1, gstep=state["gstep"],
                                                 reused_filter_draws=reused) for t, r in zip(trajs, rewards)]
                    log.rollouts([r for part in all_ranks(records) for r in part])
                    row = {"stage": "rl", "step": step + 1, "gstep": state["gstep"], "lr": lr,
                           "reused_filter_draws": reused, **practice.rollout_metrics(trajs, rewards),
                           "time_rollout": t1 - t0, "time_update": time.perf_counter() - t1, **ds,
                           **{k: v for k, v in gm.items() if isinstance(v, (int, float, bool))}}  # already global
                    if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.rl_steps:
                        row["dev_ex"] = evaluate_ex(refresh_sampler(sampler, model), tokenizer,
                                                    {"dev": evalsets["dev"]}, rollout_cfg, args.eval_batch_size,
                                                    args.seed, rank, world)["dev"]["ex"]
                    log.log(row)
                    bar.set_postfix(reward=f"{row['reward_full']:.2f}", ex=f"{row['ex']:.2f}",
                                    turns=f"{row['turns']:.1f}")
                    save_if_due(run_dir, state, log, model, tokenizer, opt, sched, args, rank, world,
                                final=step + 1 == args.rl_steps, merged=merged)
            if args.practice_k:
                record_practice("rl", pool)
                keep_in_last_checkpoint(run_dir, state, log, args, rank)
            record_eval("rl")

        # --- report: the EX table, stage seconds, results.json and curves.png
        if master:
            report(run_dir, state["evals"], times, state["practice"])
        log.finish()
        return state
    finally:
        if protocol != base_protocol:  # leave the registry as we found it (in-process callers, tests)
            protocols.PROTOCOLS.pop(protocol, None)
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()

if __name__ == "__main__":
    cli.run(main)
