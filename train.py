"""
Train a text-to-SQL agent: SFT warm-up on multi-turn trajectories, then multi-turn GRPO against a live database.

    python train.py                                   # the demo: SmolLM2-135M-Instruct on the gym, SFT, GRPO, eval
    python train.py --quick --model tiny              # a few steps of everything on the test model (the tests)
    python train.py --recipe trail --model Qwen/Qwen2.5-Coder-3B-Instruct --data data/spider/train.jsonl \\
        --sft-data out/teacher/spider_trail.jsonl --dev-data data/spider/dev.jsonl
    torchrun --nproc_per_node=8 train.py --recipe trust --model Qwen/Qwen3-4B --data ... --fsdp

A recipe (--recipe trust|trail|mtir|skyrl) is a dict of flag defaults taken from its paper; explicit flags win.
Checkpoints (out/<run-name>/ckpt-XXXXXX; the default run name is run-<date>-<time>) are save_pretrained folders plus
optimizer/scheduler/RNG/data position; --resume continues the latest one exactly. A new run refuses a folder that
holds checkpoints (pass --resume, another --run-name or --overwrite): it never deletes what it did not write.
"""
import copy
import functools
import json
import math
import os
import random
import shutil
import sys
import textwrap
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

import env  # noqa: E402
from eval import trained_settings  # noqa: E402
from model import load_model, resolve  # noqa: E402
from rewards import REWARDS  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.disable_progress_bar()  # save_pretrained's shard bar would interleave with ours

# -----------------------------------------------------------------------------
# recipes: plain dicts of flag defaults from each paper (explicit flags override them)

RECIPES = {
    # TRUST-SQL §3.4, §5.1 and Table 8: dual-track λ=0.25, 10 turns, G=8; App. A.3: keep pass rate < 6/8.
    # The clip range is not in any of the four papers (SQL-Trail eq. 4 only says ε_low < ε_high): 0.2 / 0.28 are
    # DAPO's values (Yu et al. 2025), our choice for every clip-higher recipe
    "trust": dict(protocol="trust", reward="trust", schema_lambda=0.25, max_turns=10, group_size=8,
                  eps_low=0.2, eps_high=0.28, traj_filter=False),
    # SQL-Trail §3.1 (clip-higher, no KL), A.5: six-term panel (single track), 10 turns, G=6, top-p 0.99, T=1
    "trail": dict(protocol="trail", reward="trail", schema_lambda=0.0, max_turns=10, group_size=6,
                  eps_low=0.2, eps_high=0.28, traj_filter=False, top_p=0.99, temperature=1.0),
    # MTIR-SQL: trajectory filter, no KL, 6 turns, G=5
    "mtir": dict(protocol="mtir", reward="mtir", schema_lambda=0.0, max_turns=6, group_size=5,
                 eps_low=0.2, eps_high=0.2, traj_filter=True),
    # SkyRL-SQL §4.1: -1/0/1 reward, 5 turns, G=5
    "skyrl": dict(protocol="skyrl", reward="skyrl", schema_lambda=0.0, max_turns=5, group_size=5,
                  eps_low=0.2, eps_high=0.2, traj_filter=False),
}
# --model smollm2 (the default): the demo's sizes on top of the recipe, for ~20 minutes on a 2-core CPU. A short
# system prompt keeps a trajectory near 800 tokens (the paper's prompt alone is 612), which every SFT and GRPO update
# pays for. The teacher lists the tables (40 observation rows: the gym's largest database has 39), reads the CREATE
# TABLE of the ones it needs and answers, with no value probes or distractor tables.
DEMO = dict(brief_prompt=1, obs_rows=40, teacher_probes=0, teacher_distractors=0, teacher_list_tables=1, max_turns=6,
            max_new_tokens=160, max_total_tokens=2048, sft_steps=32, sft_batch_size=4, micro_batch_size=4,
            sft_lr=1e-4, warmup_ratio=0.05, rl_steps=4, rl_batch_size=4, group_size=4, rl_lr=5e-6, filter_k=0,
            filter_limit=0, filter_drop_unsolved=0, eval_limit=100, spider_limit=50, ckpt_every=0, eval_batch_size=128)
# --quick: a few steps of every stage, small enough for a test
QUICK = dict(brief_prompt=1, obs_rows=3, teacher_probes=0, teacher_distractors=0, teacher_list_tables=0, sft_steps=2,
             rl_steps=2, sft_batch_size=4, rl_batch_size=2, group_size=2, teacher_limit=16, eval_limit=4, eval_every=0,
             ckpt_every=1, max_turns=5, max_new_tokens=24, max_total_tokens=1024, filter_k=0, filter_limit=0,
             filter_drop_unsolved=0, run_name="quick")


def get_parser(add_help=True):
    p = env.ArgumentParser(description=__doc__, add_help=add_help)
    a = p.add_argument
    pos, nonneg, file = env.positive_int, env.nonneg_int, env.existing_file  # argparse types: an error is one line
    a("--stage", default="both", choices=["sft", "rl", "both"], help="which stages to run")
    a("--recipe", default="trust", choices=sorted(RECIPES), help="a paper's settings (RECIPES)")
    a("--model", default="smollm2", help='"smollm2" (the demo), "tiny" (tests), a Hugging Face id or a folder')
    a("--dtype", default="bf16", choices=["bf16", "fp32"], help="bf16: fp32 master weights and optimizer, bf16 "
      "compute (autocast), rollouts from a bf16 copy of the weights")
    a("--data", type=file, default=None, help="RL training examples JSONL (default: the gym's train split)")
    a("--sft-data", type=file, default=None, help="SFT trajectories JSONL (default: scripted teacher on --data)")
    a("--dev-data", type=file, default=None, help="dev examples JSONL for periodic eval (default: gym dev)")
    a("--test-data", type=file, default=None, help="test examples JSONL evaluated at the end (default: gym test)")
    a("--spider-dir", default=str(ROOT.parent / "shared" / "data" / "spider"), help="Spider (dev.json, database/) "
      "for a fixed sample of dev questions evaluated with dev and test; skipped with a note when missing")
    a("--spider-limit", type=nonneg, default=0, help="Spider dev questions in that sample (0 = no Spider eval)")
    a("--protocol", default="trust", choices=["trust", "trail", "mtir", "skyrl"], help="agent turn format (env.py)")
    a("--reward", default="trust", choices=sorted(REWARDS), help="reward recipe (rewards.REWARDS)")
    a("--schema-mode", default="none", choices=env.SCHEMA_MODES, help="none: unknown schema (the papers)")
    a("--brief-prompt", type=int, default=0, help="1 = a short system prompt instead of the paper's (CPU demo)")
    a("--obs-rows", type=nonneg, default=0, help="observation row cap (0 = the protocol's: trust 30, trail 50...)")
    a("--teacher-probes", type=nonneg, default=2, help="filtered columns whose values the teacher probes")
    a("--teacher-distractors", type=nonneg, default=1, help="extra tables whose schema the teacher reads")
    a("--teacher-list-tables", type=int, default=1, help="0: the teacher skips listing tables (shorter)")
    # lengths and sampling
    a("--max-turns", type=pos, default=10, help="assistant turns per episode")
    a("--max-new-tokens", type=pos, default=2048, help="per assistant turn")
    a("--max-total-tokens", type=pos, default=16384, help="whole trajectory (prompt + turns + observations)")
    a("--temperature", type=float, default=1.0, help="sampling temperature of RL rollouts (eval is greedy)")
    a("--top-p", type=float, default=1.0, help="nucleus sampling of RL rollouts")
    # SFT
    a("--sft-steps", type=pos, default=150, help="TRUST: 9.2k questions x 2 epochs / batch 256")
    a("--sft-batch-size", type=pos, default=128, help="trajectories per step, all ranks together")
    a("--sft-lr", type=float, default=1e-5, help="peak SFT learning rate")
    a("--teacher-limit", type=nonneg, default=0, help="teacher trajectories from the first N examples (0 = all)")
    # RL
    a("--rl-steps", type=pos, default=200, help="GRPO steps")
    a("--rl-batch-size", type=pos, default=32, help="prompts per step, all ranks together (x group size rollouts)")
    a("--rl-lr", type=float, default=1e-6, help="peak RL learning rate")
    a("--group-size", type=pos, default=8, help="rollouts per prompt (G)")
    a("--schema-lambda", type=float, default=0.25, help="weight of TRUST's schema track (0 = single track)")
    a("--eps-low", type=float, default=0.2, help="PPO clip below 1")
    a("--eps-high", type=float, default=0.28, help="PPO clip above 1 (clip-higher)")
    a("--traj-filter", type=int, default=0, help="MTIR trajectory filter: drop truncated / unfinished rollouts")
    a("--dynamic-sampling", type=int, default=0, help="1: leave groups with equal rewards out of the update (DAPO)")
    a("--ppo-epochs", type=pos, default=1, help="updates per batch of rollouts (>1 makes the clip matter)")
    a("--filter-pass-rate", type=float, default=0.75, help="keep questions with pass rate below this (TRUST <6/8)")
    a("--filter-drop-unsolved", type=int, default=0, help="1: also drop pass rate 0 (SQL-Trail's hard-but-solvable)")
    a("--filter-k", type=nonneg, default=8, help="rollouts per question for the difficulty filter (0 = no filter)")
    a("--filter-limit", type=nonneg, default=0, help="candidate questions for the filter (0 = all)")
    # optimisation
    a("--warmup-ratio", type=float, default=0.1, help="fraction of each stage's steps with linear warmup")
    a("--weight-decay", type=float, default=0.01, help="AdamW weight decay (matrices only)")
    a("--grad-clip", type=float, default=1.0, help="max gradient norm")
    a("--micro-batch-size", type=nonneg, default=0, help="sequences per forward (0 = whole local batch)")
    # eval, checkpoints, logging
    a("--eval-every", type=nonneg, default=0, help="RL steps between dev evals (0 = only after each stage)")
    a("--eval-limit", type=nonneg, default=0, help="dev/test examples per eval (0 = all)")
    a("--eval-batch-size", type=pos, default=64, help="trajectories decoded together in eval")
    a("--ckpt-every", type=nonneg, default=50, help="0 = only at the end of each stage")
    a("--keep-ckpts", type=nonneg, default=2, help="0 = all")
    a("--resume", action="store_true", help="continue the latest checkpoint in --out-dir/--run-name")
    a("--stop-after", type=nonneg, default=0, help="exit right after the checkpoint at this global step (tests)")
    a("--out-dir", default=str(ROOT / "out"), help="runs go to <out-dir>/<run-name>")
    a("--run-name", default=None, help="run directory under --out-dir (default: run-<date>-<time>; torchrun claims "
      "--run for itself)")
    a("--overwrite", action="store_true", help="a new run may replace the checkpoints in --run-name's folder (never "
      "the one --model loads: a --model inside that folder is refused)")
    a("--seed", type=int, default=0, help="data order, rollouts and the tiny model's init")
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda (torchrun: per rank)")
    a("--fsdp", action="store_true", help="shard the model with FSDP2 fully_shard instead of DDP")
    a("--wandb", action="store_true", help="also log to Weights & Biases")
    a("--quick", action="store_true", help="a few steps of each stage (smoke test)")
    return p


def get_args(argv=None):
    """Parse once for --recipe/--model/--quick, make their presets the defaults, parse again: explicit flags win.
    A train.py checkpoint as --model brings the prompt variant and limits it was trained in (eval.trained_settings)."""
    parser = get_parser()
    first, _ = get_parser(add_help=False).parse_known_args(argv)  # --help waits for the presets: it shows them
    parser.set_defaults(**RECIPES[first.recipe])
    if first.model == "smollm2":
        parser.set_defaults(**DEMO)
    parser.set_defaults(**trained_settings(first.model))
    if first.quick:
        parser.set_defaults(**QUICK)
    return parser.parse_args(argv)

# -----------------------------------------------------------------------------
# distributed setup: torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; plain python is a world of one


def setup_distributed(args):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if world > 1 and not dist.is_initialized():
        cuda = args.device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo")
    device = f"cuda:{local}" if args.device.startswith("cuda") else args.device
    return rank, world, device


def all_reduce_sum(x):
    if dist.is_initialized():
        dist.all_reduce(x)
    return x


def barrier():
    if dist.is_initialized():
        dist.barrier()


def unwrap(model):
    return model.module if hasattr(model, "module") else model

# -----------------------------------------------------------------------------
# SFT data: chat-message trajectories -> token ids + a loss mask covering only the agent's tokens


def render(tokenizer, messages, add_generation_prompt=False):
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def tokenize_chat(messages, tokenizer):
    """(ids, mask) for one trajectory. The chat template renders growing prefixes; each new piece is tokenized on its
    own, which is how rollout builds sequences (prompt, sampled turn, observation...). mask = 1 on an assistant
    turn's content and its closing eos, 0 on the prompt, role headers and observations."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; SFT renders trajectories with it. Use a chat model or "
                         "set tokenizer.chat_template (model.CHAT_TEMPLATE is ChatML)")
    eos = tokenizer.eos_token
    ids, mask, done = [], [], ""

    def add(text, trained):
        if text:
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids.extend(piece)
            mask.extend([int(trained)] * len(piece))

    for i, msg in enumerate(messages):
        full = render(tokenizer, messages[: i + 1])
        if msg["role"] == "assistant":
            head = render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
            end = full.find(eos, len(head) + len(msg["content"]))
            if not head.startswith(done) or not full.startswith(head) or end < 0:
                raise ValueError("chat template is not prefix-stable around assistant turns (e.g. it drops earlier "
                                 "<think> blocks); multi-turn training needs one that renders history unchanged")
            add(head[len(done):], False)  # "<|im_start|>assistant\n"
            add(full[len(head): end + len(eos)], True)  # the turn and its eos: what the policy samples
            add(full[end + len(eos):], False)  # template tail after eos ("\n")
        else:
            if not full.startswith(done):
                raise ValueError("chat template is not prefix-stable: rendering more messages changed earlier text")
            add(full[len(done):], False)
        done = full
    return ids, mask


def load_sft_data(path, tokenizer, max_len, rank=0):
    """Tokenized trajectories from a JSONL of {"messages": [...]}; too long ones are dropped (and counted)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SFT data {path} not found; write it with `python data/teacher.py --out {path}`")
    rows, too_long = [], 0
    for line in path.read_text().splitlines():
        if line.strip():
            ids, mask = tokenize_chat(json.loads(line)["messages"], tokenizer)
            if len(ids) > max_len:
                too_long += 1
            else:
                rows.append((ids, mask))
    if not rows:
        raise ValueError(f"{path}: no usable SFT trajectories ({too_long} longer than --max-total-tokens {max_len})")
    if rank == 0:
        lens = [len(r[0]) for r in rows]
        agent = [sum(r[1]) for r in rows]
        print(f"sft data: {len(rows)} trajectories, mean {np.mean(lens):.0f} tokens ({np.mean(agent):.0f} agent), "
              f"max {max(lens)}, dropped {too_long} longer than {max_len}")
    return rows


def spider_sample(spider_dir, n):
    """A fixed sample of n Spider dev questions (the same for every run, so seeds compare on the same questions);
    [] when the folder has no dev.json."""
    if not (Path(spider_dir) / "dev.json").is_file():
        return []
    from data.spider.prepare import load_spider
    records, _ = load_spider(Path(spider_dir))
    return [{**r, "db_path": str(r["db_path"])} for r in random.Random(0).sample(records, min(n, len(records)))]


def pad_batch(rows, pad_id, device):
    """Right-padded (B, T) ids, (B, T) loss mask."""
    T = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, (x, m) in enumerate(rows):
        ids[i, : len(x)], mask[i, : len(m)] = torch.tensor(x), torch.tensor(m)
    return ids.to(device), mask.to(device)


@functools.lru_cache(maxsize=4)
def epoch_order(n, seed, epoch):
    """A fixed permutation per (seed, epoch): the data order depends only on the position, so resume replays it."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def take(n, batch_size, seed, position):
    """Indices [position, position + batch_size) of the endless sequence of epoch permutations."""
    out = []
    while len(out) < batch_size:
        epoch, i = divmod(position, n)
        out.append(epoch_order(n, seed, epoch)[i])
        position += 1
    return out


class AgentTokenLoss(torch.nn.Module):
    """SFT loss as a module, so DDP wraps the whole computation: summed next-token NLL over agent tokens divided by
    ALL ranks' agent tokens, x world because DDP averages gradients. The LM head runs only on positions that predict
    an agent token: most of a multi-turn sequence is prompt and observations."""

    def __init__(self, model, full_forward=False):
        super().__init__()
        self.model, self.full_forward = model, full_forward  # FSDP: go through the root module's forward

    def forward(self, ids, mask, global_tokens, world):  # ids, mask: (B, T), right padded
        target = mask[:, 1:] > 0  # position t-1 predicts token t
        if self.full_forward:
            logits = self.model(input_ids=ids).logits[:, :-1][target].float()  # (N, V)
        else:
            hidden = self.model.get_decoder()(input_ids=ids).last_hidden_state[:, :-1][target]  # (N, D)
            logits = self.model.get_output_embeddings()(hidden).float()  # (N, V)
        return F.cross_entropy(logits, ids[:, 1:][target], reduction="sum") / global_tokens * world


# -----------------------------------------------------------------------------
# checkpoints: save_pretrained weights + tokenizer, trainer state, per-rank RNG; temp dir then atomic rename


def rng_state():
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def full_state_dict(model, fsdp):
    if not fsdp:
        return None  # save_pretrained reads the (unwrapped) module itself
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def optim_state(model, optimizer, fsdp):
    if not fsdp:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_checkpoint(run_dir, gstep, model, tokenizer, optimizer, scheduler, state, args, rank, world):
    """out/<run-name>/ckpt-<global step>: loadable with AutoModelForCausalLM.from_pretrained; keeps the last K."""
    final, tmp = run_dir / f"ckpt-{gstep:06d}", run_dir / f".tmp-ckpt-{gstep:06d}"
    weights = full_state_dict(model, args.fsdp)  # collective under FSDP: every rank takes part
    opt = optim_state(model, optimizer, args.fsdp)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        unwrap(model).save_pretrained(tmp, state_dict=weights)
        tokenizer.save_pretrained(tmp)
        torch.save({"optimizer": opt, "scheduler": scheduler.state_dict()}, tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps({**state, "global_step": gstep, "args": vars(args)}, indent=1))
    barrier()
    torch.save(rng_state(), tmp / f"rng-rank{rank}.pt")  # every rank its own stream
    barrier()
    if rank == 0:
        # atomic: a kill leaves either the old set or the complete new one. `final` cannot exist (a new run starts
        # without checkpoints, a resumed one past its latest): nothing is deleted before the new one is in place
        os.replace(tmp, final)
        for old in sorted(run_dir.glob("ckpt-*"))[: -args.keep_ckpts]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def latest_checkpoint(run_dir):
    ckpts = sorted(Path(run_dir).glob("ckpt-*"))
    return ckpts[-1] if ckpts else None


def load_trainer_state(path, model, optimizer, scheduler, args, rank):
    """Optimizer, scheduler and this rank's RNG from a checkpoint (its weights are loaded before sharding)."""
    trainer = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
    if args.fsdp and dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(model, optimizer, trainer["optimizer"], options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(trainer["optimizer"])
    scheduler.load_state_dict(trainer["scheduler"])
    rng = path / f"rng-rank{rank}.pt"
    if rng.exists():
        set_rng_state(torch.load(rng, weights_only=False))


def load_weights(model, path):
    """save_pretrained safetensors -> model. Tied embeddings are stored once; anything else missing is an error."""
    from safetensors.torch import load_file
    weights = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        weights.update(load_file(f))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if [k for k in missing if "lm_head" not in k] or unexpected:
        raise ValueError(f"{path}: checkpoint does not fit the model (missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]}); was it written by a run with another --model?")
    return model


def make_optimizer(model, lr, steps, args):
    """AdamW (betas 0.9/0.95, SQL-Trail A.5) with linear warmup then cosine decay."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    warm = max(1, int(args.warmup_ratio * steps))
    cosine = lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps))))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, cosine)

# -----------------------------------------------------------------------------
# RL: rollouts -> rewards -> GRPO, with the difficulty filter in front


def rollout_kwargs(args, temperature=None):
    return dict(group_size=args.group_size, max_turns=args.max_turns, max_new_tokens=args.max_new_tokens,
                max_total_tokens=args.max_total_tokens, temperature=args.temperature if temperature is None else
                temperature, top_p=args.top_p, schema_mode=args.schema_mode)


def difficulty_filter(policy, tokenizer, examples, args, rank, world):
    """TRUST App. A.3: roll each candidate k times with the current policy, keep pass rate < threshold.
    Each rank filters a strided share; the kept ids are gathered so every rank holds the same pool."""
    from rewards import REWARDS
    from rollout import rollout
    mine = examples[rank::world]
    kept, chunk = [], max(1, 64 // args.filter_k)
    kw = rollout_kwargs(args) | {"group_size": args.filter_k}
    for start in range(0, len(mine), chunk):
        part = mine[start: start + chunk]
        with torch.no_grad():
            trajs = rollout(policy, tokenizer, part, args.protocol, seed=args.seed * 7919 + rank * 104729 + start, **kw)
        for i, ex in enumerate(part):
            group = trajs[i * args.filter_k: (i + 1) * args.filter_k]
            rate = np.mean([REWARDS[args.reward](t, ex)["correct"] for t in group])
            if rate < args.filter_pass_rate and (rate > 0 or not args.filter_drop_unsolved):
                kept.append(ex["id"])
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, kept)
        kept = [i for part in gathered for i in part]
    kept = set(kept)
    return [ex for ex in examples if ex["id"] in kept]


def rl_step_metrics(trajs, rewards, times, grpo_metrics, world):
    """Means over this step's trajectories on all ranks, plus grpo's (already global) metrics."""
    keys = sorted({k for r in rewards for k, v in r.items() if isinstance(v, (int, float))})
    local = {f"reward_{k}": sum(float(r.get(k) or 0.0) for r in rewards) for k in keys}
    local |= {"ex": sum(r["correct"] for r in rewards), "turns": sum(t.num_turns for t in trajs),
              "tool_calls": sum(t.num_tool_calls for t in trajs),
              "sampled_tokens": sum(sum(t.loss_mask) for t in trajs),
              "seq_tokens": sum(len(t.token_ids) for t in trajs),
              "answered": sum(t.episode.final_sql is not None for t in trajs), "n": len(trajs)}
    tot = all_reduce_sum(torch.tensor(list(local.values()), dtype=torch.float64)).tolist()
    tot = dict(zip(local, tot))
    n = max(tot.pop("n"), 1)
    out = {k: v / n for k, v in tot.items()}
    out |= {f"time_{k}": v for k, v in times.items()}
    out |= {k: v for k, v in grpo_metrics.items() if isinstance(v, (int, float, bool))}
    return out

# -----------------------------------------------------------------------------
# evaluation, logging, curves


def evaluate_ex(model, tokenizer, evalsets, args, rank, world):
    """Greedy EX of every eval set {name: examples} from ONE continuous batch over this rank's share of all of them
    (one tail of long rows instead of one per set), each set scored by its own rule; summed over ranks."""
    from eval import run_agent, score
    mine = {name: examples[rank::world] for name, examples in evalsets.items()}
    flat = [ex for examples in mine.values() for ex in examples]
    trajs, _ = run_agent(unwrap(model), tokenizer, flat, group_size=1, batch_size=args.eval_batch_size, desc="eval",
                         protocol=args.protocol, schema_mode=args.schema_mode, max_turns=args.max_turns,
                         max_new_tokens=args.max_new_tokens, max_total_tokens=args.max_total_tokens,
                         temperature=0.0, top_p=1.0, seed=args.seed)
    out, start = {}, 0
    for name, examples in mine.items():
        part, start = trajs[start:start + len(examples)], start + len(examples)
        spider = all(ex.get("source") == "spider" for ex in evalsets[name])
        ok = score(examples, [t.episode.final_sql for t in part], "spider" if spider else "bird")[0] if part else []
        tot = all_reduce_sum(torch.tensor([sum(ok), sum(t.num_turns for t in part), len(part)],
                                          dtype=torch.float64)).tolist()
        out[name] = {"ex": tot[0] / max(tot[2], 1), "turns": tot[1] / max(tot[2], 1), "n": int(tot[2])}
    return out


class Logger:
    """metrics.jsonl (+ wandb) on rank 0. On resume, lines past the checkpoint are dropped so the log stays exact."""

    def __init__(self, run_dir, args, rank, gstep):
        self.on, self.path, self.wandb = rank == 0, run_dir / "metrics.jsonl", None
        if not self.on:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        old = self.path.read_text().splitlines() if self.path.exists() and args.resume else []
        self.path.write_text("".join(line + "\n" for line in old if json.loads(line)["gstep"] <= gstep))
        if args.wandb:
            import wandb
            self.wandb = wandb.init(project="sqlrl", name=args.run_name, config=vars(args), resume="allow")

    def log(self, row):
        if self.on:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            if self.wandb:
                self.wandb.log(row, step=row["gstep"])

    def rows(self):
        return [json.loads(line) for line in self.path.read_text().splitlines()] if self.path.exists() else []


def plot_curves(rows, path):
    """curves.png: SFT loss, RL reward, dev EX and turns on one time line of global steps, the SFT -> RL switch
    dashed. Returns False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sft = [r for r in rows if r["stage"] == "sft" and "loss" in r]
    rl = [r for r in rows if r["stage"] == "rl" and "reward_full" in r]
    ev = [r for r in rows if any(k.endswith("_ex") for k in r)]
    x = lambda rs: [r["gstep"] for r in rs]  # noqa: E731
    fig, ax = plt.subplots(1, 4, figsize=(17, 3.8), sharex=True)
    ax[0].plot(x(sft), [r["loss"] for r in sft])
    ax[0].set(title="SFT", ylabel="masked NLL per agent token")
    ax[1].plot(x(rl), [r["reward_full"] for r in rl], label="reward (full track)")
    if rl and "reward_schema" in rl[0]:
        ax[1].plot(x(rl), [r["reward_schema"] for r in rl], label="reward (schema track)")
    ax[1].plot(x(rl), [r["ex"] for r in rl], label="EX of the rollouts")
    ax[1].set(title="RL rollouts (mean per step)", ylabel="reward / EX")
    ax[1].legend(fontsize=8)
    for key in ("dev_ex", "test_ex", "spider_ex"):  # the evals after each stage (and every --eval-every steps)
        pts = [(r["gstep"], 100 * r[key]) for r in ev if key in r]
        if pts:
            ax[2].plot(*zip(*pts), "o-", label=key[:-3])
            for p in pts:
                ax[2].annotate(f"{p[1]:.0f}", p, textcoords="offset points", xytext=(0, 5), ha="center", fontsize=8)
    ax[2].set(title="greedy EX", ylabel="EX (%)")
    ax[2].legend(fontsize=8)
    ax[3].plot(x(rl), [r["turns"] for r in rl])
    ax[3].set(title="RL rollouts", ylabel="turns per trajectory")
    for a in ax:
        a.set_xlabel("global step (SFT, then RL)")
        if sft and rl:
            a.axvline(sft[-1]["gstep"] + 0.5, color="gray", ls="--", lw=0.8)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True

# -----------------------------------------------------------------------------
# the two stages


def train_sft(model, tokenizer, rows, args, ctx, state, ckpt):
    """Masked-NLL SFT for args.sft_steps steps of args.sft_batch_size trajectories (all ranks together)."""
    rank, world, device, log = ctx["rank"], ctx["world"], ctx["device"], ctx["log"]
    opt, sched = make_optimizer(model, args.sft_lr, args.sft_steps, args)
    if ckpt is not None:
        load_trainer_state(ckpt, model, opt, sched, args, rank)
    wrapped = ctx["wrap"](AgentTokenLoss(model, full_forward=args.fsdp))
    micro = args.micro_batch_size or args.sft_batch_size
    model.train()
    bar = tqdm(range(state["step"], args.sft_steps), desc="sft", disable=rank != 0, initial=state["step"],
               total=args.sft_steps)
    for step in bar:
        t0 = time.perf_counter()
        idx = take(len(rows), args.sft_batch_size, args.seed, step * args.sft_batch_size)
        mine = sorted((rows[i] for i in idx[rank::world]), key=lambda r: len(r[0]))  # similar lengths: less padding
        tokens = all_reduce_sum(torch.tensor(float(sum(sum(m[1:]) for _, m in mine)))).item()
        loss_sum = 0.0
        chunks = [mine[i: i + micro] for i in range(0, len(mine), micro)]  # global normaliser: split-invariant
        for j, chunk in enumerate(chunks):
            ids, mask = pad_batch(chunk, tokenizer.pad_token_id, device)
            sync = j == len(chunks) - 1 or not hasattr(wrapped, "no_sync")
            with (ctx["autocast"]()), (wrapped.no_sync() if not sync else nullcontext()):
                loss = wrapped(ids, mask, tokens, world)
                loss.backward()
            loss_sum += loss.item() / world
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip).item()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_all = all_reduce_sum(torch.tensor(loss_sum, dtype=torch.float64)).item()
        state["step"], state["gstep"] = step + 1, state["gstep"] + 1
        log.log({"stage": "sft", "step": step + 1, "gstep": state["gstep"], "loss": loss_all, "grad_norm": grad_norm,
                 "lr": sched.get_last_lr()[0], "tokens": tokens, "time_update": time.perf_counter() - t0})
        bar.set_postfix(loss=f"{loss_all:.3f}")
        ctx["maybe_save"](opt, sched, final=step + 1 == args.sft_steps)
    model.eval()


def train_rl(model, tokenizer, pool, args, ctx, state, ckpt):
    """Multi-turn GRPO: each rank rolls out its share of prompts (whole groups), rewards, one grpo_step."""
    from grpo import GRPOConfig, grpo_step
    from rewards import REWARDS
    from rollout import rollout
    rank, world, log = ctx["rank"], ctx["world"], ctx["log"]
    if args.fsdp and world > 1:
        raise NotImplementedError("--fsdp covers SFT only: rollout.py and grpo.grpo_step read the LM head directly and "
                                  "all-reduce full gradients, which assumes replicated (DDP-style) parameters. Run RL "
                                  "without --fsdp from the SFT checkpoint (--stage rl --model out/<run-name>/ckpt-...)")
    if args.rl_batch_size % world:
        raise ValueError(f"--rl-batch-size {args.rl_batch_size} must be a multiple of the world size {world}")
    opt, sched = make_optimizer(model, args.rl_lr, args.rl_steps, args)
    if ckpt is not None:
        load_trainer_state(ckpt, model, opt, sched, args, rank)
    cfg = GRPOConfig(group_size=args.group_size, schema_lambda=args.schema_lambda, eps_low=args.eps_low,
                     eps_high=args.eps_high, temperature=args.temperature, grad_clip=args.grad_clip,
                     micro_batch_size=args.micro_batch_size or args.rl_batch_size * args.group_size,
                     trajectory_filter=bool(args.traj_filter), dynamic_sampling=bool(args.dynamic_sampling),
                     ppo_epochs=args.ppo_epochs, pad_id=tokenizer.pad_token_id)
    reward_fn = REWARDS[args.reward]
    bar = tqdm(range(state["step"], args.rl_steps), desc="rl", disable=rank != 0, initial=state["step"],
               total=args.rl_steps)
    for step in bar:
        idx = take(len(pool), args.rl_batch_size, args.seed + 1, step * args.rl_batch_size)
        mine = [pool[i] for i in idx[rank::world]]  # whole groups stay on one rank
        t0 = time.perf_counter()
        seed = (args.seed * 100_003 + step) * 1009 + rank
        trajs = rollout(ctx["policy"](), tokenizer, mine, args.protocol, seed=seed, **rollout_kwargs(args))
        t1 = time.perf_counter()
        rewards = [reward_fn(t, t.example) for t in trajs]
        t2 = time.perf_counter()
        model.train()
        with ctx["autocast"]():
            gm = grpo_step(model, opt, trajs, rewards, cfg)
        sched.step()
        t3 = time.perf_counter()
        # rollout = generation + the tool calls it makes; env = executing final SQL against gold for the rewards
        times = {"rollout": t1 - t0, "env": t2 - t1, "update": t3 - t2}
        state["step"], state["gstep"] = step + 1, state["gstep"] + 1
        row = {"stage": "rl", "step": step + 1, "gstep": state["gstep"], "lr": sched.get_last_lr()[0],
               **rl_step_metrics(trajs, rewards, times, gm, world)}
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.rl_steps:
            row["dev_ex"] = evaluate_ex(ctx["policy"](), tokenizer, {"dev": ctx["dev"]}, args, rank, world)["dev"]["ex"]
        log.log(row)
        bar.set_postfix(reward=f"{row['reward_full']:.2f}", ex=f"{row['ex']:.2f}", turns=f"{row['turns']:.1f}")
        ctx["maybe_save"](opt, sched, final=step + 1 == args.rl_steps)

# -----------------------------------------------------------------------------


def main(argv=None):
    args = get_args(argv)
    rank, world, device = setup_distributed(args)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    if args.run_name is None:
        if args.resume:
            raise env.UserError("--resume needs --run-name: the folder under --out-dir of the run to continue")
        name = [time.strftime("run-%Y%m%d-%H%M%S")]  # a new folder per run, rank 0's name on every rank
        if dist.is_initialized():
            dist.broadcast_object_list(name, src=0)
        args.run_name = name[0]
    run_dir = Path(args.out_dir) / args.run_name
    stages = ["sft", "rl"] if args.stage == "both" else [args.stage]
    master = rank == 0
    trained = trained_settings(args.model)
    if master and trained:
        print("settings the checkpoint was trained in (a flag overrides): "
              + ", ".join(f"{k}={getattr(args, k)}" for k in trained))

    # --- checked before any work: the model can load, and a run never deletes what it did not write
    try:
        model_path = resolve(args.model)  # a missing folder, a Hub id neither cached nor reachable, smollm2's fetch
    except (OSError, RuntimeError) as e:
        raise env.UserError(e) from None
    old = [] if args.resume else sorted(run_dir.glob("ckpt-*"))
    if old and Path(args.model).resolve().is_relative_to(run_dir.resolve()):
        raise env.UserError(f"--model {args.model} is inside {run_dir}, whose checkpoints a new run would replace: "
                            "pass another --run-name (or --resume to continue that run)")
    if old and not args.overwrite:
        raise env.UserError(f"{run_dir} holds checkpoints of an earlier run: pass --resume to continue it, another "
                            "--run-name, or --overwrite to replace them")

    # --- data: default to the gym (built once, by rank 0)
    if None in (args.data, args.dev_data, args.test_data):
        from data.gym.prepare import ensure_gym
        if master:
            ensure_gym(seed=0)
        barrier()
        gym = ensure_gym(seed=0)
        args.data = args.data or str(gym / "train.jsonl")
        args.dev_data = args.dev_data or str(gym / "dev.jsonl")
        args.test_data = args.test_data or str(gym / "test.jsonl")
    try:
        train = env.load_examples(args.data)
        dev = env.load_examples(args.dev_data)[: args.eval_limit or None]
        test = env.load_examples(args.test_data)[: args.eval_limit or None]
    except (FileNotFoundError, ValueError) as e:  # a bad record or a missing database
        raise env.UserError(e) from None
    if master:  # recipe, then model and --quick presets, then the command line: what this run uses
        print(textwrap.fill("config: " + ", ".join(f"{k}={v}" for k, v in sorted(vars(args).items())), 118,
                            subsequent_indent="  "))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(vars(args), indent=1) + "\n")

    # --- resume: the latest checkpoint's state decides which stage and step we are at
    ckpt = latest_checkpoint(run_dir) if args.resume else None
    state = {"stage": stages[0], "step": 0, "gstep": 0, "evals": {}, "rl_pool": None}
    if ckpt is not None:
        saved = json.loads((ckpt / "state.json").read_text())
        state.update({k: v for k, v in saved.items() if k in state}, gstep=saved["global_step"])
        if master:
            print(f"resuming {ckpt} ({state['stage']} step {state['step']})")
    elif master and old:  # --overwrite (checked above)
        print(f"--overwrite: deleting the {len(old)} checkpoints of an earlier run in {run_dir}")
        for c in old:
            shutil.rmtree(c)
    barrier()

    # --- model: fp32 master weights (the optimizer's); bf16 compute per --dtype; gradient checkpointing on GPU
    try:
        model, tokenizer = load_model(model_path, device=device, seed=args.seed)  # resolved once, above
    except ValueError as e:  # e.g. a tokenizer without a chat template
        raise env.UserError(e) from None
    spider = spider_sample(args.spider_dir, args.spider_limit) if args.spider_limit else []
    if master and args.spider_limit and not spider:
        print(f"spider: {args.spider_dir} has no dev.json; Spider evaluation skipped")
    base_protocol = args.protocol
    args.protocol = env.protocol_variant(args.protocol, args.brief_prompt, args.obs_rows)
    try:
        evalsets = {"dev": dev, "test": test} | ({"spider": spider} if spider else {})
        return run(args, model, tokenizer, state, ckpt, stages, train, evalsets, run_dir, rank, world, device)
    finally:
        if args.protocol != base_protocol:
            env.PROTOCOLS.pop(args.protocol, None)  # leave the registry as we found it (in-process callers, tests)
        if dist.is_initialized():
            dist.destroy_process_group()


def run(args, model, tokenizer, state, ckpt, stages, train, evalsets, run_dir, rank, world, device):
    """Both stages and the report, after setup (main)."""
    master, cuda = rank == 0, device.startswith("cuda")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{args.model}: tokenizer has no chat template; sqlrl needs one to render turns")
    if ckpt is not None:  # weights first; optimizer state is loaded by the stage that owns it
        model = load_weights(model, ckpt)
    bf16 = args.dtype == "bf16"
    sampler = copy.deepcopy(model).to(torch.bfloat16) if bf16 and not args.fsdp else model
    if cuda:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    autocast = (lambda: torch.autocast(torch.device(device).type, dtype=torch.bfloat16)) if bf16 else nullcontext
    if args.fsdp and world > 1:
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif world > 1:  # same starting weights everywhere (DDP would do it too, but RL uses the bare model)
        for p in model.state_dict().values():
            dist.broadcast(p, 0)

    def wrap(m):
        if world > 1 and not args.fsdp:
            from torch.nn.parallel import DistributedDataParallel
            return DistributedDataParallel(m, device_ids=[int(os.environ.get("LOCAL_RANK", 0))] if cuda else None)
        return m

    log = Logger(run_dir, args, rank, state["gstep"])

    def maybe_save(opt, sched, final=False):
        due = args.ckpt_every and state["gstep"] % args.ckpt_every == 0
        if due or final:
            save_checkpoint(run_dir, state["gstep"], model, tokenizer, opt, sched, state, args, rank, world)
        if args.stop_after and state["gstep"] == args.stop_after:
            if master:
                print(f"--stop-after {args.stop_after}: stopping like a killed run")
            sys.exit(0)

    def policy():
        """The weights to decode with: under bf16 a bf16 copy, refreshed here. Decoding under autocast would cast
        every fp32 weight again at each step (1.8x slower per decode step on this CPU)."""
        if sampler is not model:
            with torch.no_grad():
                for s, p in zip(sampler.parameters(), model.parameters()):
                    s.copy_(p)
        return sampler.eval()

    times = {}

    def timed(name, fn, *a):
        t0 = time.perf_counter()
        out = fn(*a)
        times[name] = times.get(name, 0.0) + time.perf_counter() - t0
        return out

    ctx = dict(rank=rank, world=world, device=device, log=log, wrap=wrap, autocast=autocast, maybe_save=maybe_save,
               dev=evalsets["dev"], policy=policy)

    def record_eval(tag):
        if tag in state["evals"]:
            return
        with torch.no_grad():
            state["evals"][tag] = timed("eval", evaluate_ex, policy(), tokenizer, evalsets, args, rank, world)
        e = state["evals"][tag]
        log.log({"stage": "eval", "after": tag, "step": state["step"], "gstep": state["gstep"],
                 **{f"{name}_ex": e[name]["ex"] for name in e}})
        if master:
            print(f"[{tag}] " + "  ".join(f"{name} EX {100 * e[name]['ex']:.1f}% ({e[name]['n']})" for name in e))

    # --- stage 1: SFT on teacher (or any) trajectories
    if "sft" in stages and state["stage"] == "sft":
        sft_path = Path(args.sft_data) if args.sft_data else run_dir / f"teacher_{args.protocol}.jsonl"
        if args.sft_data is None and master and not (args.resume and sft_path.exists()):  # fresh run: fresh data
            from data.teacher import write_teacher_data
            write_teacher_data(train[: args.teacher_limit or None], sft_path, args.protocol, max_turns=args.max_turns,
                               schema_mode=args.schema_mode, seed=args.seed, max_probes=args.teacher_probes,
                               distractors=args.teacher_distractors, list_tables=bool(args.teacher_list_tables))
        barrier()
        rows = load_sft_data(sft_path, tokenizer, args.max_total_tokens, rank)
        timed("sft", train_sft, model, tokenizer, rows, args, ctx, state,
              ckpt if ckpt is not None and state["step"] else None)
        ckpt = None
    if "sft" in stages:
        record_eval("sft")

    # --- stage 2: GRPO on questions the policy does not already solve
    if "rl" in stages:
        if state["stage"] != "rl":
            state.update(stage="rl", step=0)
        if state["rl_pool"] is None:
            pool = train
            if args.filter_k:
                cands = train[: args.filter_limit or None]
                pool = timed("filter", difficulty_filter, policy(), tokenizer, cands, args, rank, world)
                if master:
                    print(f"difficulty filter: kept {len(pool)}/{len(cands)} ({100 * len(pool) / len(cands):.1f}%) "
                          f"with pass rate < {args.filter_pass_rate}{' and > 0' if args.filter_drop_unsolved else ''} "
                          f"over {args.filter_k} rollouts")
                log.log({"stage": "filter", "step": 0, "gstep": state["gstep"], "filter_candidates": len(cands),
                         "filter_kept": len(pool)})
                if not pool:
                    raise ValueError("the difficulty filter kept no question: raise --filter-pass-rate")
            state["rl_pool"] = [ex["id"] for ex in pool]
        by_id = {ex["id"]: ex for ex in train}
        pool = [by_id[i] for i in state["rl_pool"]]
        timed("rl", train_rl, model, tokenizer, pool, args, ctx, state,
              ckpt if ckpt is not None and state["step"] else None)
        record_eval("rl")

    # --- report
    if master:
        print("\n| checkpoint | " + " | ".join(f"{name} EX %" for name in evalsets) + " |\n"
              + "|---" * (1 + len(evalsets)) + "|")
        for label, tag in [("SFT", "sft"), ("SFT + RL", "rl")]:
            if tag in state["evals"]:
                e = state["evals"][tag]
                print(f"| {label} | " + " | ".join(f"{100 * e[name]['ex']:.1f}" for name in e) + " |")
        print("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
        if plot_curves(log.rows(), run_dir / "curves.png"):
            print(f"wrote {run_dir / 'curves.png'}")
        (run_dir / "results.json").write_text(json.dumps({**state["evals"], "seconds": times}, indent=1))
        if log.wandb:
            log.wandb.finish()
    return state


if __name__ == "__main__":
    try:
        main()
    except env.UserError as e:
        env.die(e)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # DDP keeps gloo's worker threads alive past destroy_process_group; one that frees a tensor during interpreter
        # teardown takes the GIL and aborts (SIGABRT, ~1 run in 20), failing a finished run. Everything is written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
