"""train.py: recipes, SFT loss masking (token-exact), a 2-step RL smoke run, kill + resume, DDP gradients.
python -m pytest -q tests/test_train.py"""
import copy
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import cli
import config
import grpo
import memory
import practice
import train
from rollout import RolloutConfig
from data.spider.prepare import spider_sample
from sft import load_sft_data
from grpo import GRPOConfig, grpo_step
from checkpoint import latest_checkpoint, load_trainer_state, load_weights, save_checkpoint
from model import load_model, make_optimizer

ROOT = Path(__file__).resolve().parents[1]


# -----------------------------------------------------------------------------
# recipes


def test_recipe_sets_defaults_and_explicit_flags_win():
    trust = config.get_args(["--model", "tiny"])  # the recipe alone (smollm2 adds the demo's sizes)
    assert (trust.recipe, trust.protocol, trust.schema_lambda, trust.max_turns, trust.group_size, trust.eps_high) == \
        ("trust", "trust", 0.25, 10, 8, 0.28)
    trail = config.get_args(["--recipe", "trail", "--model", "tiny"])
    assert (trail.protocol, trail.reward, trail.group_size, trail.schema_lambda, trail.top_p) == \
        ("trail", "trail", 6, 0.0, 0.99)
    assert (trust.schema_mode, trust.rl_lr, trust.rl_batch_size, trust.filter_k, trust.stage) == \
        ("none", 1e-6, 32, 8, "both")  # TRUST runs unknown-schema, Table 8 and App. A.3
    assert (trail.schema_mode, trail.temperature, trail.filter_top_n, trail.force_final_answer) == \
        ("prompt", 1.0, 700, 1)
    mtir, skyrl = (config.get_args(["--recipe", r, "--model", "tiny"]) for r in ("mtir", "skyrl"))
    assert mtir.traj_filter and (mtir.schema_mode, mtir.temperature, mtir.stage) == ("prompt", 0.6, "rl")
    assert (skyrl.temperature, skyrl.top_p, skyrl.max_turns, skyrl.stage) == (0.6, 0.95, 5, "rl")
    assert config.get_args(["--recipe", "skyrl", "--group-size", "3"]).group_size == 3  # explicit beats recipe
    assert config.get_args(["--quick", "--sft-steps", "7"]).sft_steps == 7  # explicit beats --quick too
    quick = config.get_args(["--quick"])  # the default model's demo sizes stay out of a --quick run
    assert (quick.rl_batch_size, quick.ppo_mini_batches, quick.sft_steps) == (2, 1, 2)


def test_the_demo_takes_skyrls_reward_under_the_trust_recipe_and_no_other():
    demo = config.get_args([])  # smollm2 and the trust recipe: the demo's reward, its sizes
    assert (demo.reward, demo.filter_limit, demo.filter_top_n, demo.rl_batch_size) == ("skyrl", 256, 0, 8)
    assert (demo.filter_pass_rate, demo.filter_solved_once, demo.practice_k, demo.spider_limit) == (1.0, True, 4, 0)
    assert config.get_args(["--recipe", "trail"]).reward == "trail"  # the demo's sizes, the paper's reward
    assert config.get_args(["--model", "tiny"]).reward == "trust"  # no demo: the recipe's reward
    assert config.get_args(["--reward", "trust"]).reward == "trust"  # explicit beats the demo
    assert config.describe(config.get_args([])) == "recipe trust, preset demo, reward skyrl (the demo's, in place of " \
        "the recipe's trust)"  # the first line a run prints
    assert config.describe(config.get_args(["--recipe", "trail"])) == "recipe trail, preset demo"


def test_the_demo_is_a_preset_any_model_can_run_and_a_typed_model_leaves_out():
    folder = config.get_args(["--preset", "demo", "--model", "/models/SmolLM2-135M-Instruct"])
    assert (folder.preset, folder.sft_steps, folder.reward, folder.practice_k) == ("demo", 48, "skyrl", 4)
    gpu = config.get_args(["--recipe", "trust", "--model", "Qwen/Qwen3-4B"])  # a GPU user's line: the recipe's sizes
    assert (gpu.preset, gpu.sft_epochs, gpu.rl_batch_size, gpu.reward) == ("none", 2, 32, "trust")
    assert config.get_args(["--model", "smollm2"]).preset == "none"  # the model's name sets nothing
    assert config.get_args(["--quick"]).preset == "none"


def test_training_length_in_the_papers_units_and_steps_from_above_win():
    trust = config.get_args(["--model", "tiny"])  # Table 8: SFT 2 epochs, RL 3 epochs
    assert (trust.sft_epochs, trust.rl_epochs, trust.ppo_mini_batches) == (2, 3, 4)
    trail = config.get_args(["--recipe", "trail", "--model", "tiny"])  # A.5: SFT 2 epochs, RL reported at step 108
    assert (trail.sft_epochs, trail.rl_epochs, trail.rl_steps) == (2, 0, 108)
    assert config.get_args(["--model", "tiny", "--sft-steps", "7"]).sft_epochs == 0  # typed steps win
    demo = config.get_args([])  # the demo's SFT steps win over the recipe's epochs; RL: two passes over its questions
    assert (demo.sft_epochs, demo.sft_steps, demo.rl_epochs, demo.ppo_mini_batches) == (0, 48, 2, 1)


def test_sft_epochs_become_whole_steps_over_the_sft_data(tmp_path):
    state = train.main(["--quick", "--model", "tiny", "--stage", "sft", "--sft-epochs", "1", "--teacher-limit", "12",
                        "--eval-limit", "2", "--out-dir", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "quick" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["stage"] == "sft"] == [1, 2, 3]  # 12 trajectories at batch 4
    assert state["gstep"] == 3


def test_a_kv_budget_too_small_for_one_row_stops_before_any_work(tmp_path):
    with pytest.raises(cli.UserError, match="--kv-cache-gb"):
        train.main(QUICK + ["--kv-cache-gb", "1e-6", "--out-dir", str(tmp_path)])
    assert not (tmp_path / "quick").exists()  # no teacher data, no config.json: nothing ran


def test_training_must_fit_the_free_memory_and_the_kv_cache_takes_what_is_left(tmp_path, monkeypatch):
    argv = QUICK + ["--dtype", "fp32", "--out-dir", str(tmp_path)]
    args = config.get_args(argv)
    model = load_model("tiny")[0]
    need = memory.training_bytes(model, args, bf16=False)
    held = sum(p.numel() for p in model.parameters()) * 12 + memory.CACHE_HEADROOM  # weights, AdamW, prefill
    per_row = memory.kv_bytes_per_row(model.config, args.max_total_tokens, torch.float32)
    free = {"bytes": need - 1}
    monkeypatch.setattr(memory, "free_memory", lambda device: free["bytes"])
    with pytest.raises(cli.UserError, match="training needs about .* --micro-batch-size"):
        train.main(argv)
    assert not (tmp_path / "quick").exists()  # stopped before the teacher data: nothing ran

    seen = {}
    decode_rows = memory.decode_rows

    def stop(*a, **k):  # the rows chosen, then stop before any work
        seen["rows"] = decode_rows(*a, **k)
        raise Killed
    monkeypatch.setattr(memory, "decode_rows", stop)
    free["bytes"] = max(need, held + 3.5 * per_row)
    with pytest.raises(Killed):
        train.main(argv)
    assert seen["rows"] == 3  # three rows beside the optimizer's moments, where the KV budget alone holds 64


def test_every_preset_key_is_a_flag():
    # set_defaults accepts any name, so a renamed flag would leave its preset value silently unused
    dests = {a.dest for a in config.get_parser()._actions}
    for name, preset in [*config.RECIPES.items(), ("DEMO", config.DEMO), ("QUICK", config.QUICK)]:
        assert set(preset) <= dests, f"{name}: {set(preset) - dests} are not train.py flags"


def test_help_shows_every_flag_with_the_default_the_presets_give_it(capsys):
    with pytest.raises(SystemExit):
        config.get_args(["--help"])  # no flags: --model smollm2, so the demo preset's values are the defaults
    text = " ".join(capsys.readouterr().out.split())
    assert f"(default: {config.DEMO['sft_steps']})" in text and f"(default: {config.DEMO['rl_lr']})" in text
    flags = [a for a in config.get_parser()._actions if a.option_strings and a.dest != "help"]
    assert all(a.help for a in flags), [a.dest for a in flags if not a.help]


def test_torchrun_hands_every_flag_to_train_py():
    # torchrun's parser allows abbreviations even after the script name: "--run" would be claimed as --run-path
    from torch.distributed.run import get_args_parser
    for flag in (o for a in config.get_parser()._actions for o in a.option_strings):
        try:
            script_args = get_args_parser().parse_args(["train.py", flag, "x"]).training_script_args
        except SystemExit:
            script_args = None
        assert script_args == [flag, "x"], f"torchrun does not pass {flag} through to train.py"

def test_spider_sample_is_fixed_and_skipped_without_the_folder(spider_dir, tmp_path):
    sample = spider_sample(spider_dir, 5)
    assert len(sample) == 5 and all(ex["source"] == "spider" and Path(ex["db_path"]).is_file() for ex in sample)
    state = random.getstate()
    random.seed(123)  # a run's seed must not change which questions are evaluated
    assert [ex["id"] for ex in spider_sample(spider_dir, 5)] == [ex["id"] for ex in sample]
    random.setstate(state)
    assert spider_sample(tmp_path, 5) == []

# -----------------------------------------------------------------------------
# SFT inputs


def test_missing_sft_data_and_missing_database_are_clear_errors(tmp_path, tiny):
    _, tok = tiny
    with pytest.raises(FileNotFoundError, match="teacher.py"):
        load_sft_data(tmp_path / "nope.jsonl", tok, 1024)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "db_id": "d", "db_path": "missing.sqlite", "question": "q", "evidence": "",
                               "gold_sql": "SELECT 1", "difficulty": "easy", "source": "gym"}) + "\n")
    with pytest.raises(cli.UserError, match="database"):  # train.py's __main__ prints it as one `error:` line
        train.main(["--quick", "--model", "tiny", "--data", str(bad), "--out-dir", str(tmp_path)])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(cli.UserError, match="no examples"):
        train.main(["--quick", "--model", "tiny", "--data", str(empty), "--out-dir", str(tmp_path)])

# -----------------------------------------------------------------------------
# end to end: quick run, kill + resume


QUICK = ["--quick", "--model", "tiny", "--sft-steps", "2", "--rl-steps", "2", "--eval-limit", "2", "--teacher-limit", "12"]


def final_weights(run_dir):
    from safetensors.torch import load_file
    ckpt = latest_checkpoint(run_dir)
    return ckpt, load_file(next(ckpt.glob("*.safetensors")))


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One in-process --quick run (run dir out/quick), shared by the tests that read it."""
    out = tmp_path_factory.mktemp("quick")
    state = train.main(QUICK + ["--out-dir", str(out)])
    assert set(state["evals"]) == {"sft", "rl"}
    return out / "quick"


def test_quick_run_sft_then_two_rl_steps(tmp_path, quick_run):
    run = quick_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    for key in ("reward_full", "reward_schema", "ex", "turns", "tool_calls", "sampled_tokens", "loss_full",
                "loss_schema", "clip_frac_high", "time_rollout", "time_update"):
        assert key in rl[0], key
    ckpt, _ = final_weights(run)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(ckpt)  # a plain HF folder
    assert AutoTokenizer.from_pretrained(ckpt).chat_template
    assert json.loads((ckpt / "state.json").read_text())["global_step"] == 4
    from model import TINY
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (TINY["hidden_size"],
                                                                         TINY["num_hidden_layers"])
    assert (run / "teacher_trust-brief-rows3.jsonl").exists()  # --quick's protocol
    assert json.loads((run / "results.json").read_text())["seconds"]["sft"] > 0
    saved = json.loads((run / "config.json").read_text())  # the final flags: recipe, presets, command line, memory
    assert (saved["sft_steps"], saved["rl_steps"], saved["model"], saved["recipe"]) == (2, 2, "tiny", "trust")
    assert (saved["group_size"], saved["eps_high"], saved["seed"], saved["preset"]) == (2, 0.28, 0, "none")
    assert saved["sft_epochs"] == 0  # the typed steps decided the length, not trust's 2 epochs
    # each row logs the lr its own step used: the peak first (one warmup step), then cosine's half-way point
    for stage, peak in (("sft", saved["sft_lr"]), ("rl", saved["rl_lr"])):
        assert [r["lr"] for r in rows if r["stage"] == stage] == pytest.approx([peak, peak / 2]), stage
    # eval.py evaluates the checkpoint in the protocol it was trained with, not the full trust prompt
    out = subprocess.run([sys.executable, str(ROOT / "eval.py"), "--model", str(ckpt), "--limit", "2", "--samples",
                          "1", "--out-dir", str(tmp_path / "eval"), "--name", "e"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads((tmp_path / "eval" / "e" / "summary.json").read_text())
    saved = json.loads((ckpt / "state.json").read_text())["args"]
    assert summary["protocol"] == "trust-brief-rows3"
    assert f"max_turns={saved['max_turns']}, max_new_tokens={saved['max_new_tokens']}," in out.stdout


def test_rl_from_a_checkpoint_goes_on_in_the_prompt_it_was_trained_in(tmp_path, quick_run):
    # `--stage rl --model <SFT checkpoint>` is not --model smollm2, so the demo's preset does not apply; the checkpoint's
    # state.json must, or RL would start in the full trust prompt and 2 048-token turns the model has never seen
    ckpt, _ = final_weights(quick_run)
    args = config.get_args(["--stage", "rl", "--model", str(ckpt)])
    assert (args.protocol, args.brief_prompt, args.obs_rows) == ("trust", 1, 3)
    assert (args.max_new_tokens, args.max_total_tokens, args.max_turns) == (24, 1024, 5)  # QUICK's, not 2048/16384/10
    flags = config.get_args(["--stage", "rl", "--model", str(ckpt), "--max-new-tokens", "50", "--brief-prompt", "0"])
    assert (flags.max_new_tokens, flags.brief_prompt, flags.obs_rows) == (50, 0, 3)  # a flag still wins
    train.main(["--stage", "rl", "--model", str(ckpt), "--rl-steps", "1", "--rl-batch-size", "1", "--group-size", "2",
                "--ppo-mini-batches", "1", "--filter-k", "0", "--eval-limit", "1", "--ckpt-every", "0",
                "--out-dir", str(tmp_path), "--run-name", "rl"])
    rl_ckpt = latest_checkpoint(tmp_path / "rl")
    saved = json.loads((rl_ckpt / "state.json").read_text())["args"]
    assert (saved["protocol"], saved["brief_prompt"], saved["obs_rows"]) == ("trust", 1, 3)  # the flags, as typed
    assert train.trained_settings(rl_ckpt) == train.trained_settings(ckpt)  # and the next stage reads them back
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "state.json").write_text('{"step": 3}')  # another tool's file of the same name
    assert train.trained_settings(tmp_path / "other") == {}


def test_kill_and_resume_matches_an_uninterrupted_run(tmp_path, monkeypatch):
    args = QUICK + ["--sft-steps", "2", "--rl-steps", "2", "--filter-k", "2", "--filter-limit", "2",
                    "--filter-pass-rate", "1.01", "--eval-limit", "1", "--max-new-tokens", "12", "--practice-k", "2"]
    train.main(args + ["--out-dir", str(tmp_path / "a")])
    with pytest.raises(SystemExit):  # "killed" right after the checkpoint at global step 3 (RL step 1)
        train.main(args + ["--out-dir", str(tmp_path / "b"), "--stop-after", "3"])
    assert latest_checkpoint(tmp_path / "b" / "quick").name == "ckpt-000003"
    train.main(args + ["--out-dir", str(tmp_path / "b"), "--resume"])
    (ca, wa), (cb, wb) = final_weights(tmp_path / "a" / "quick"), final_weights(tmp_path / "b" / "quick")
    assert ca.name == cb.name == "ckpt-000004"
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k

    def strip(p):
        return [{k: v for k, v in json.loads(l).items() if not k.startswith("time")}
                for l in (p / "quick" / "metrics.jsonl").read_text().splitlines()]
    assert strip(tmp_path / "a") == strip(tmp_path / "b")

    def trajectories(p):
        return (p / "quick" / "rollouts.jsonl").read_text()
    assert trajectories(tmp_path / "a") == trajectories(tmp_path / "b")  # each RL step and measurement once
    assert len(list((tmp_path / "b" / "quick").glob("ckpt-*"))) == 2  # keep last K
    assert not list((tmp_path / "b" / "quick").glob(".tmp-*"))

    # killed in the filter, after SFT's evaluation and before any RL checkpoint (the demo's longest stretch without
    # one): the resume does not evaluate SFT again, and its log holds each evaluation and the filter once
    def killed(*a, **k):
        raise Killed
    monkeypatch.setattr(practice, "difficulty_filter", killed)
    with pytest.raises(Killed):
        train.main(args + ["--out-dir", str(tmp_path / "c")])
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path / "c" / "quick").name == "ckpt-000002"
    evaluated = []
    evaluate_ex = train.evaluate_ex

    def counted(*a, **k):
        evaluated.append(a)
        return evaluate_ex(*a, **k)
    monkeypatch.setattr(train, "evaluate_ex", counted)
    train.main(args + ["--out-dir", str(tmp_path / "c"), "--resume"])
    assert len(evaluated) == 1  # RL's only
    _, wc = final_weights(tmp_path / "c" / "quick")
    for k in wa:
        assert torch.equal(wa[k], wc[k]), k
    assert strip(tmp_path / "a") == strip(tmp_path / "c")
    assert trajectories(tmp_path / "a") == trajectories(tmp_path / "c")

def test_a_resume_keeps_the_runs_settings_and_stops_at_a_flag_that_would_change_them(tmp_path):
    run = QUICK + ["--out-dir", str(tmp_path), "--eval-limit", "1"]
    with pytest.raises(SystemExit):  # killed after RL's first step
        train.main(run + ["--rl-lr", "3e-6", "--stop-after", "3"])
    with pytest.raises(cli.UserError, match=r"continues quick with its own settings, and --rl-lr 1e-05 \(the run has "
                       r"3e-06\) would change what it trains: drop that flag"):
        train.main(run + ["--rl-lr", "1e-5", "--run-name", "quick", "--resume"])  # before any work
    assert latest_checkpoint(tmp_path / "quick").name == "ckpt-000003"
    # only the run's name, and another --stop-after: the run's own settings, to its end
    state = train.main(["--out-dir", str(tmp_path), "--run-name", "quick", "--resume", "--stop-after", "0"])
    assert state["gstep"] == 4
    saved = json.loads((tmp_path / "quick" / "config.json").read_text())
    assert (saved["rl_lr"], saved["model"], saved["sft_steps"], saved["stop_after"]) == (3e-6, "tiny", 2, 0)

# -----------------------------------------------------------------------------
# a run never deletes what it did not write


class Killed(Exception):
    pass


def fake_checkpoint(path):
    path.mkdir(parents=True)
    (path / "model.safetensors").write_text("an earlier run's weights")
    return path


def test_a_new_run_into_a_folder_with_checkpoints_refuses_and_keeps_them(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "r" / "ckpt-000002")
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), *QUICK, "--out-dir", tmp_path, "--run-name", "r"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-3000:]
    assert out.stderr.startswith("error: ") and "--resume" in out.stderr and "--overwrite" in out.stderr
    assert (ckpt / "model.safetensors").read_text() == "an earlier run's weights"
    with pytest.raises(cli.UserError, match="--run-name"):  # the default run name is new each run: nothing to resume
        train.main(["--model", "tiny", "--resume", "--out-dir", str(tmp_path)])


def test_rl_from_a_checkpoint_in_its_own_run_folder_never_deletes_it(tmp_path, monkeypatch):
    # `--stage rl --model out/demo/ckpt-000040 --run-name demo` once deleted the checkpoint it was asked to load
    ckpt = fake_checkpoint(tmp_path / "demo" / "ckpt-000040")
    argv = ["--stage", "rl", "--model", str(ckpt), "--out-dir", str(tmp_path), "--run-name", "demo"]
    for extra, why in [([], "another --run-name"), (["--overwrite"], "another --run-name")]:
        with pytest.raises(cli.UserError, match=why):
            train.main(argv + extra)
        assert (ckpt / "model.safetensors").exists()

    # --overwrite with a --model elsewhere replaces the folder's checkpoints, once every check has passed (the model
    # loaded, its KV cache fits): stopped just before training starts
    def stop(*a, **k):
        raise Killed
    monkeypatch.setattr(train, "Logger", stop)  # built right after the checks and the deletion
    with pytest.raises(Killed):
        train.main(["--quick", "--model", "tiny", "--out-dir", str(tmp_path), "--run-name", "demo", "--overwrite"])
    assert not ckpt.exists()


def test_a_kill_between_the_temp_write_and_the_rename_leaves_the_previous_checkpoint(tmp_path, monkeypatch, tiny):
    model, tok = tiny
    args = config.get_args(QUICK)
    opt, sched = make_optimizer(model, 1e-4, 10, args.weight_decay, args.warmup_ratio)
    state = {"stage": "sft", "step": 1, "gstep": 1, "evals": {}, "rl_pool": None}
    first = save_checkpoint(tmp_path, 1, model, tok, opt, sched, state, args, 0, 1)
    replace = os.replace

    def killed(src, dst, **kw):  # the process dies after writing .tmp-ckpt-000002, before renaming it
        if Path(src).name.startswith(".tmp-ckpt"):
            raise Killed
        replace(src, dst, **kw)
    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(Killed):
        save_checkpoint(tmp_path, 2, model, tok, opt, sched, dict(state, step=2, gstep=2), args, 0, 1)
    monkeypatch.undo()
    assert (tmp_path / ".tmp-ckpt-000002").is_dir() and latest_checkpoint(tmp_path) == first
    fresh, _ = load_model("tiny", seed=1)  # other weights, so that loading visibly restores the saved ones
    load_weights(fresh, first)
    opt2, sched2 = make_optimizer(fresh, 1e-4, 10, args.weight_decay, args.warmup_ratio)
    load_trainer_state(first, fresh, opt2, sched2, args, 0)
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k
    assert json.loads((first / "state.json").read_text())["global_step"] == 1  # --resume goes on from step 1...
    again = save_checkpoint(tmp_path, 2, model, tok, opt, sched, dict(state, step=2, gstep=2), args, 0, 1)
    assert latest_checkpoint(tmp_path) == again and not list(tmp_path.glob(".tmp-*"))  # ...past the debris

# -----------------------------------------------------------------------------
# DDP: 2 gloo processes compute the same gradient as one process


def torchrun(world, script, *argv, cwd=None):
    """Launch script on `world` gloo ranks the way users do (torchrun), on a free port; asserts a clean exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--master_port", str(port),
           str(script), *map(str, argv)]
    run = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=cwd, timeout=120, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr[-3000:]


DDP_SCRIPT = r"""
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from distributed import over_ranks, sum_grads_over_ranks
from model import load_model
from sft import agent_tokens, pad_batch, sft_loss
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model, tok = load_model("tiny", seed=0)
model.train()
g = torch.Generator().manual_seed(0)
rows = []
for n in (30, 50, 20, 40):  # 4 sequences of different lengths and agent-token counts
    ids = torch.randint(0, len(tok), (n,), generator=g).tolist()
    rows.append((ids, [int(i > n // 3) for i in range(n)]))
if rank == 0:  # one process over the whole batch: a copy of the same weights
    alone = load_model("tiny", seed=0)[0].train()
    ids, mask = pad_batch(rows, tok.pad_token_id, "cpu")
    sft_loss(alone, ids, mask, agent_tokens(rows)).backward()
    torch.save({n: p.grad for n, p in alone.named_parameters()}, sys.argv[2] + "/grad1.pt")
mine = rows[rank::world]
tokens = over_ranks(torch.tensor(agent_tokens(mine))).item()
ids, mask = pad_batch(mine, tok.pad_token_id, "cpu")
sft_loss(model, ids, mask, tokens).backward()
sum_grads_over_ranks(model)  # what sft_step does after the backward
if rank == 0:
    torch.save({n: p.grad for n, p in model.named_parameters()}, sys.argv[2] + "/grad2.pt")
dist.barrier()
dist.destroy_process_group()
os._exit(0)  # gloo's worker threads can abort interpreter teardown (SIGABRT, ~1 run in 20): skip it
"""


def test_two_ranks_sft_gradients_match_single_process(tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    torchrun(2, script, ROOT, tmp_path, cwd=tmp_path)  # rank 0 also takes the whole batch's gradients alone
    one, two = torch.load(tmp_path / "grad1.pt"), torch.load(tmp_path / "grad2.pt")
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=1e-6)


def test_torchrun_two_ranks_match_one_process(tmp_path, quick_run):
    # the command users launch: torchrun, two gloo ranks, each SFT step's batch split between them
    torchrun(2, ROOT / "train.py", *QUICK, "--out-dir", tmp_path, "--run-name", "two")
    rows = {n: [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
            for n, d in (("one", quick_run), ("two", tmp_path / "two"))}
    sft = {n: [r["loss"] for r in rows[n] if r["stage"] == "sft"] for n in rows}
    assert len(sft["two"]) == 2 and sft["two"] == pytest.approx(sft["one"], rel=1e-4)
    assert [r["step"] for r in rows["two"] if r["stage"] == "rl"] == [1, 2]
    assert set(json.loads((tmp_path / "two" / "results.json").read_text())) == \
        {"sft", "rl", "intervals", "practice_passes", "seconds"}
    trajectories = {n: [json.loads(line) for line in (d / "rollouts.jsonl").read_text().splitlines()]
                    for n, d in (("one", quick_run), ("two", tmp_path / "two"))}
    assert len(trajectories["two"]) == len(trajectories["one"]) > 0  # every rank's, gathered into rank 0's file


def test_sql_trail_difficulty_score_keeps_hard_but_solvable_then_unsolved():
    examples = [{"id": c} for c in "abcdef"]
    rates = {"a": 1.0, "b": 1 / 6, "c": 0.0, "d": 0.5, "e": 0.0, "f": 5 / 6}
    rule = practice.PoolRule(pass_rate=0.75, top_n=2, unsolved_n=1)
    # S(q) (eq. 13): a 1, b 1/6, c 1, d 1/2, e 1, f 5/6 -> the 2 lowest are b and d; exploration: the first unsolved
    assert [ex["id"] for ex in practice.select_rl_pool(examples, rates, rule)] == ["b", "c", "d"]
    rule = practice.PoolRule(pass_rate=0.75)  # TRUST App. A.3: pass rate < 6/8
    assert [ex["id"] for ex in practice.select_rl_pool(examples, rates, rule)] == ["b", "c", "d", "e"]
    rule = practice.PoolRule(pass_rate=1.0, solved_once=True)  # the demo's practice set: solved sometimes, not always
    assert [ex["id"] for ex in practice.select_rl_pool(examples, rates, rule)] == ["b", "d", "f"]


def _fake_rollouts(monkeypatch, signal):
    """rollout.rollout replaced: a group has reward variance iff its prompt id is in signal."""
    import rollout
    calls = []

    def fake(policy, tokenizer, prompts, protocol, *, seed, group_size, **kw):
        calls.append([p["id"] for p in prompts])
        return [SimpleNamespace(example=p, k=k, turn_times=[0.0]) for p in prompts for k in range(group_size)]
    monkeypatch.setattr(rollout, "rollout", fake)

    def reward(t, ex):
        return {"full": float(ex["id"] in signal and t.k == 0)}
    return calls, reward


def rollout_with_signal(prompts, reward, cfg=None, **kw):
    """practice.rollout_with_signal on fake rollouts of group size 2: trajectories, rewards, stats."""
    cfg = cfg or GRPOConfig(group_size=2)
    trajs, rewards, tracks, ds = practice.rollout_with_signal(None, None, prompts, RolloutConfig(), reward, cfg, seed=0,
                                                              max_rows=None, **kw)
    assert torch.equal(tracks.adv_full, grpo.advantages(trajs, rewards, cfg).adv_full)  # the batch's own advantages
    return trajs, rewards, ds


def test_dynamic_sampling_rolls_fresh_prompts_until_every_group_has_signal(monkeypatch):
    pool = iter([{"id": i} for i in range(2, 20)])

    def refill(n):
        return [next(pool) for _ in range(n)]
    calls, reward = _fake_rollouts(monkeypatch, signal={3, 5, 6})  # the first batch, prompts 0 and 1, is flat
    trajs, rewards, ds = rollout_with_signal([{"id": 0}, {"id": 1}], reward, refill=refill, rounds=3)
    assert calls == [[0, 1], [2, 3], [4, 5]] and ds == {"ds_rounds": 3, "ds_signal_groups": 2, "ds_cap_hit": False}
    assert [t.example["id"] for t in trajs] == [3, 3, 5, 5] and [r["full"] for r in rewards] == [1, 0, 1, 0]
    # no prompt with signal: the cap ends the search, is logged, and the batch keeps its size with the first prompts
    calls, reward = _fake_rollouts(monkeypatch, signal=set())
    trajs, _, ds = rollout_with_signal([{"id": 0}, {"id": 1}], reward, refill=refill, rounds=2)
    assert ds["ds_cap_hit"] and ds["ds_rounds"] == 3 == len(calls) and [t.example["id"] for t in trajs] == [0, 0, 1, 1]
    # without refill (--dynamic-sampling 0) one rollout, flat groups and all
    calls, reward = _fake_rollouts(monkeypatch, signal=set())
    trajs, _, ds = rollout_with_signal([{"id": 0}, {"id": 1}], reward)
    assert len(calls) == 1 and ds == {} and len(trajs) == 4


def test_refill_counts_as_signal_only_what_the_update_learns_from(monkeypatch):
    """Prompt 0's schema rewards differ and its terminal rewards do not: with the schema track off (lambda 0) the
    update drops that group, so the refill must replace it; with the track on it is a group to keep."""
    pool = iter([{"id": i} for i in range(2, 20)])

    def refill(n):
        return [next(pool) for _ in range(n)]
    calls, _ = _fake_rollouts(monkeypatch, signal=set())

    def reward(t, ex):
        return {"full": float(ex["id"] >= 1 and t.k == 0), "schema": float(t.k == 0)}
    off = GRPOConfig(group_size=2, schema_lambda=0.0)
    trajs, _, ds = rollout_with_signal([{"id": 0}, {"id": 1}], reward, off, refill=refill, rounds=3)
    assert calls == [[0, 1], [2, 3]] and [t.example["id"] for t in trajs] == [1, 1, 2, 2]
    assert grpo.group_signal(grpo.advantages(trajs, [reward(t, t.example) for t in trajs], off), 2).all()
    calls.clear()
    on = GRPOConfig(group_size=2, schema_lambda=0.25)
    trajs, _, ds = rollout_with_signal([{"id": 0}, {"id": 1}], reward, on, refill=refill, rounds=3)
    assert calls == [[0, 1]] and [t.example["id"] for t in trajs] == [0, 0, 1, 1]


def test_the_filters_groups_are_the_first_rl_batch(monkeypatch):
    # 6 candidates, 2 rollouts each: 1 and 4 solved once (S 0.5), 2 solved twice (S 1), the rest never (S 1)
    calls, _ = _fake_rollouts(monkeypatch, signal=set())

    def solved(t, ex):
        return float(ex["id"] in (1, 4) and t.k == 0 or ex["id"] == 2)
    def reward(t, ex):
        return {"full": solved(t, ex), "correct": solved(t, ex)}

    def keep_top_3(reuse):  # 2 rollouts each, RL's batch 2, seed 1
        return practice.difficulty_filter(None, None, [{"id": i} for i in range(6)], RolloutConfig(), reward,
                                          practice.PoolRule(top_n=3), 2, batch_size=8, rl_batch_size=2, seed=1,
                                          reuse=reuse, rank=0, world=1)
    pool, _, (trajs, rewards) = keep_top_3(reuse=True)
    assert calls == [list(range(6))]  # one rollout of every candidate, none again for RL
    assert sorted(ex["id"] for ex in pool) == [0, 1, 4]  # S(q) ranks 1, 4, then the first tie
    assert [t.example["id"] for t in trajs] == [1, 1, 4, 4] and [r["full"] for r in rewards] == [1, 0, 1, 0]
    assert [pool[i]["id"] for i in practice.rl_batch(len(pool), 2, 1, 0)] == [1, 4]  # RL's own first step reads them
    assert keep_top_3(reuse=False)[2] is None  # e.g. RL's groups of another size: not the batch RL would sample


def test_the_filter_stops_once_the_practice_set_is_full(monkeypatch):
    # candidates 1, 3 and 4 are solved once in 2 rollouts; a practice set of 2 is full after the second pair
    calls, _ = _fake_rollouts(monkeypatch, signal=set())

    def reward(t, ex):
        solved = float(ex["id"] in (1, 3, 4) and t.k == 0)
        return {"full": solved, "correct": solved}
    pool, rates, _ = practice.difficulty_filter(None, None, [{"id": i} for i in range(6)], RolloutConfig(), reward,
                                                practice.PoolRule(solved_once=True), 2, size=2, batch_size=8,
                                                rl_batch_size=2, seed=1, reuse=False, rank=0, world=1)
    assert calls == [[0, 1], [2, 3]] and sorted(rates) == [0, 1, 2, 3]  # candidates 4 and 5 never rolled out
    assert [ex["id"] for ex in pool] == [1, 3]


def test_on_two_ranks_each_ranks_filter_groups_are_its_share_of_rls_first_step(monkeypatch):
    # rank r rolled out candidates r, r + 2, ...; each keeps its own groups, and RL's first step hands them back to it
    rates = {i: [0.5, 0.0, 0.75, 0.25, 0.5, 1.0, 0.25, 0.5][i] for i in range(8)}

    def fake_pass_rates(model, tokenizer, mine, cfg, reward_fn, k, **kw):
        trajs = [SimpleNamespace(example=ex) for ex in mine for _ in range(k)]
        return rates, trajs, [{"full": 0.0}] * len(trajs)
    monkeypatch.setattr(practice, "pass_rates", fake_pass_rates)
    out = [practice.difficulty_filter(None, None, [{"id": i} for i in range(8)], RolloutConfig(), None,
                                      practice.PoolRule(top_n=6), 2, batch_size=8, rl_batch_size=4, seed=0,
                                      reuse=True, rank=rank, world=2) for rank in (0, 1)]
    assert [ex["id"] for ex in out[0][0]] == [ex["id"] for ex in out[1][0]]  # one pool order on every rank
    pool = out[0][0]
    first_step = [pool[i]["id"] for i in practice.rl_batch(len(pool), 4, 0, 0)]
    for rank, (_, _, (trajs, _)) in enumerate(out):
        assert [t.example["id"] for t in trajs[::2]] == first_step[rank::2]
    assert sorted(first_step) == [0, 3, 6, 7]  # each rank's two lowest S(q): 6, then 0 before 4 (a tie); 3, 7


def test_rls_first_epoch_after_the_filters_batch_visits_every_kept_question_once():
    # the filter's batch (3 of 12 questions) opens RL's data order; steps 2-4 then read the other nine, none twice
    pool = practice.rl_order([{"id": f"q{i}"} for i in range(12)], ["q7", "q2", "q9"], rl_batch_size=3, seed=5)
    steps = [[pool[i]["id"] for i in practice.rl_batch(len(pool), 3, 5, step)] for step in range(4)]
    assert steps[0] == ["q7", "q2", "q9"]
    assert sorted(q for batch in steps for q in batch) == sorted(f"q{i}" for i in range(12))


def test_a_run_with_the_filter_rolls_out_once_less(tmp_path, monkeypatch):
    import rollout
    real = rollout.rollout
    sizes = []
    monkeypatch.setattr(rollout, "rollout", lambda *a, **kw: sizes.append(kw["group_size"]) or real(*a, **kw))
    train.main(QUICK + ["--filter-k", "2", "--filter-limit", "2", "--filter-pass-rate", "1.01", "--out-dir",
                        str(tmp_path)])
    rl = [r for r in map(json.loads, (tmp_path / "quick" / "metrics.jsonl").read_text().splitlines())
          if r["stage"] == "rl"]
    # eval after SFT, the filter, RL step 2 (step 1 trains on the filter's groups), eval after RL
    assert sizes == [1, 2, 2, 1] and len(rl) == 2 and rl[0]["trajectories"] == 4


def _recipe_batch(group_size, prompts, seed=0):
    """prompts groups of synthetic 2-turn trajectories, alternately a rewarded and an unrewarded answer (the same
    two token sequences in every group), so every group carries an advantage on both tracks and each step pushes
    the same tokens the same way."""
    g = torch.Generator().manual_seed(seed)
    good = torch.randint(0, 49152, (16,), generator=g).tolist()
    bad = torch.randint(0, 49152, (16,), generator=g).tolist()
    trajs = []
    for i in range(prompts * group_size):
        ep = SimpleNamespace(propose_turn=0, turn_valid=[True, True], final_sql="SELECT 1")
        trajs.append(SimpleNamespace(token_ids=good if i % 2 else bad, loss_mask=[0] * 4 + [1] * 12,
                                     turn_ids=[-1] * 4 + [0] * 6 + [1] * 6, sample_logprobs=[0.0] * 16, episode=ep,
                                     stop_reason="answer"))
    rewards = [{"full": float(i % 2), "schema": float(i % 2)} for i in range(len(trajs))]
    return trajs, rewards


@pytest.mark.parametrize("recipe, steps", [("trust", 4), ("trail", 4), ("mtir", 1), ("skyrl", 1)])
def test_each_recipe_takes_its_papers_optimizer_steps_and_the_clip_acts_where_there_are_several(recipe, steps, tiny,
                                                                                                one_thread):
    model = copy.deepcopy(tiny[0])
    args = config.get_args(["--recipe", recipe, "--model", "tiny", "--rl-batch-size", "8"])
    cfg = config.grpo_config(args, pad_id=2)
    trajs, rewards = _recipe_batch(cfg.group_size, 8)
    m = grpo_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), trajs, rewards, cfg)
    assert cfg.mini_batches == m["optimizer_steps"] == steps
    clipped = m["clip_frac_high"] + m["clip_frac_low"]
    assert clipped > 0 if steps > 1 else clipped == 0
    # the ratio before clipping: exactly 1 on one step, spread around 1 on several
    assert m["ratio_min"] <= m["ratio_mean"] <= m["ratio_max"]
    assert (m["ratio_max"] - m["ratio_min"] > 0.2) if steps > 1 else m["ratio_min"] == m["ratio_max"] == 1.0


def test_switches_are_booleans_whichever_way_they_are_written():
    for text, value in [("1", True), ("0", False), ("true", True), ("False", False), ("yes", True), ("off", False)]:
        assert config.get_args(["--model", "tiny", "--dynamic-sampling", text]).dynamic_sampling is value
    assert config.get_args(["--model", "tiny"]).scale_std is True and config.get_args([]).brief_prompt is True


def test_grpo_flags_reach_the_update():
    args = config.get_args(["--model", "tiny", "--rl-batch-size", "4", "--ppo-mini-batches", "2", "--kl-beta",
                           "0.01", "--agg", "dr_grpo", "--scale-std", "0", "--mask-truncated", "1",
                           "--naive-schema-weight", "0.25"])
    cfg = config.grpo_config(args, pad_id=2)
    assert (cfg.mini_batches, cfg.kl_beta, cfg.agg, cfg.scale_std, cfg.mask_truncated, cfg.naive_schema_weight,
            cfg.dr_grpo_len) == (2, 0.01, "dr_grpo", False, True, 0.25, args.max_total_tokens)
    # old log-probs: a bf16 sampler copy needs them recomputed; fp32 weights that sampled have logged them
    bf16, fp32 = (config.grpo_config(config.get_args(["--model", "tiny", "--dtype", d]), 2) for d in ("bf16", "fp32"))
    assert bf16.recompute_old_logp and not fp32.recompute_old_logp


# -----------------------------------------------------------------------------
# RL under FSDP2: the sharded update equals DDP's, and a resumed run equals an uninterrupted one

RL_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
import train

def by_tokens(t, ex):  # a reward that varies with the sampled tokens: the random tiny model has advantages to learn
    return {"full": (sum(t.token_ids) % 7) / 7, "schema": None, "correct": 0.0}

train.REWARDS["by_tokens"] = by_tokens
dist.init_process_group("gloo")
for argv in json.loads(sys.argv[2]):  # runs one after another in one launch, on this script's process group
    try:
        train.main(argv)
    except SystemExit:  # --stop-after
        pass
os._exit(0)  # gloo's worker threads can abort interpreter teardown: skip it
"""


def test_fsdp_rl_matches_ddp_and_resumes_exactly(tmp_path):
    script = tmp_path / "rl.py"
    script.write_text(RL_SCRIPT)
    common = ["--model", "tiny", "--stage", "rl", "--dtype", "fp32", "--reward", "by_tokens", "--rl-steps", "2",
              "--rl-batch-size", "2", "--ppo-mini-batches", "1", "--group-size", "2", "--max-turns", "2",
              "--max-new-tokens", "8",
              "--max-total-tokens", "2048", "--filter-k", "0", "--eval-limit", "1", "--spider-limit", "0",
              "--kl-beta", "0.1", "--rl-lr", "1e-3", "--warmup-ratio", "0", "--ckpt-every", "1", "--out-dir",
              str(tmp_path)]
    runs = [common + ["--run-name", "ddp"],
            common + ["--fsdp", "--run-name", "fsdp"],
            common + ["--fsdp", "--run-name", "resumed", "--stop-after", "1"],
            common + ["--fsdp", "--run-name", "resumed", "--resume"]]
    torchrun(2, script, ROOT, json.dumps(runs), cwd=tmp_path)
    rl = {n: [r for r in map(json.loads, (tmp_path / n / "metrics.jsonl").read_text().splitlines())
              if r["stage"] == "rl"] for n in ("ddp", "fsdp", "resumed")}
    # the same prompts and seeds per rank, decoded from a full copy of the weights: the same rollouts, so the
    # sharded update (and its sharded KL reference) must give DDP's loss, KL and weights
    # (one step per batch: the loss is -mean(A) = 0 up to the 1e-7 that the rollout's logged log-probs differ by)
    assert [r["loss_full"] for r in rl["fsdp"]] == pytest.approx([r["loss_full"] for r in rl["ddp"]], rel=1e-4,
                                                                 abs=1e-6)
    assert [r["kl_ref"] for r in rl["fsdp"]] == pytest.approx([r["kl_ref"] for r in rl["ddp"]], rel=1e-4, abs=1e-9)
    assert rl["ddp"][0]["grad_norm"] > 0 and rl["ddp"][1]["kl_ref"] > 0  # the test has signal: the weights move
    assert [r["grad_norm"] for r in rl["fsdp"]] == pytest.approx([r["grad_norm"] for r in rl["ddp"]], rel=1e-4)
    assert [r["grad_norm"] for r in rl["resumed"]] == pytest.approx([r["grad_norm"] for r in rl["fsdp"]], rel=1e-5)
    weights = {n: final_weights(tmp_path / n)[1] for n in rl}
    for k in weights["ddp"]:
        torch.testing.assert_close(weights["fsdp"][k], weights["ddp"][k], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(weights["resumed"][k], weights["fsdp"][k], rtol=1e-5, atol=1e-7)
