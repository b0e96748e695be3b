"""
Evaluate a text-to-SQL agent the way the papers report it: greedy execution accuracy (EX), execution-consensus
majority voting (maj@K, as OmniSQL does), unbiased pass@k, a per-difficulty table, TRUST-SQL's cost table
(Table 10: latency, output tokens, turns, tool calls) and an automatic version of TRUST-SQL's error taxonomy (§3.1).
Writes out/eval/<model>-<protocol>-<schema mode>-<data folder>-<split>/predictions.jsonl and summary.json (for Spider
scorings also the test-suite evaluator's pred.txt and gold.txt) and prints markdown tables.

Scoring (--scoring): bird = BIRD's set equality, plus its VES and R-VES (--ves-runs timed runs per correct answer);
spider = the official test-suite evaluator's verdicts (DISTINCT removed, order compared iff the gold text says
"order by", its `value` placeholder); spider-strict = DISTINCT kept, order only for an outermost ORDER BY.
--spider-ts-dir: the test-suite databases; a prediction is then correct only if it matches on each. The official
scorers' own conventions (query rewriting, VES timing, their files) live in data/spider/prepare.py and
data/bird/prepare.py.

    python eval.py --model tiny --limit 20 --samples 4 --max-turns 3          # gym dev split, untrained tiny model
    python eval.py --model out/demo-seed0/ckpt-000049 --samples 8   # a train.py checkpoint: its own protocol
    python eval.py --model out/ckpt --data data/spider/dev.jsonl --scoring spider --samples 8
    python eval.py --model out/ckpt --data data/spider/dev.jsonl --spider-ts-dir ~/test-suite-database  # TS accuracy
    python eval.py --model Qwen/Qwen3-4B --data data/bird/dev.jsonl --bird-predictions out/predict_dev.json
    python eval.py --gold-as-prediction --data data/spider/dev.jsonl --scoring spider   # scorer self-check
"""
import json
import os
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from distributed import all_ranks, over_ranks
from model import AUTO_DTYPE, DTYPE_CHOICES, TORCH_DTYPES, resolve_dtype
from cli import ArgumentParser, die, existing_file, nonneg_int, positive_int
from env import load_examples, run_many
from memory import cache_rows
from rollout import RolloutConfig
from rewards import SCORE_MAX_ROWS, gold_order_matters, gold_results, is_correct  # shared with the rewards
from taxonomy import classify_failure
from data.spider.prepare import spider_hardness, spider_sql, ts_databases, write_spider_files  # test-suite rules
from data.bird.prepare import bird_ves, machine, write_bird_predictions  # BIRD's VES and prediction file

ERROR_CLASSES = ("generation", "syntax", "hallucination", "schema_linking", "semantic")
DIFFICULTY_ORDER = ("easy", "medium", "hard", "extra", "simple", "moderate", "challenging")

# -----------------------------------------------------------------------------
# metrics: unbiased pass@k, intervals and execution-consensus majority voting


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0  # every k-subset contains a correct sample
    # C(n-c,k)/C(n,k) = prod_{i=n-c+1..n} (1 - k/i): a product of terms in (0,1], no huge binomials
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_ks(samples: int) -> list[int]:
    """The k reported for pass@k: TRUST's {1, 4, 6, 8}, powers of two, and the sample count itself."""
    return sorted({k for k in (1, 2, 4, 6, 8, 16, 32, 64) if k <= samples} | {samples})


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of an accuracy correct / n: honest at 100 questions and near 0 or 1."""
    if n == 0:
        return (0.0, 1.0)
    p = correct / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, float(center - half)), min(1.0, float(center + half)))  # rounding may step past 0 or 1


def paired_bootstrap(before: list, after: list, samples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95 % interval of mean(after) - mean(before), the same questions resampled for both: a change in EX between two
    checkpoints, with the questions' own difficulty cancelled out."""
    diff = np.asarray(after, dtype=float) - np.asarray(before, dtype=float)  # (n,)
    if diff.size == 0:
        return (0.0, 0.0)
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, diff.size, size=(samples, diff.size))].mean(axis=1)  # (samples,)
    return (float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5)))


def majority_vote(results: list) -> int | None:
    """Index of the sample whose result wins the vote, or None when every sample failed.
    results: one SQLResult per sample (None = no final SQL). Samples vote with their result as a frozenset of rows;
    errors and timeouts don't vote, empty results do; the largest group wins and ties go to the group seen first."""
    groups = {}  # result -> [index of its first member, votes]; dicts keep insertion order
    for i, r in enumerate(results):
        if r is None or r.error is not None:
            continue
        key = frozenset(r.rows)
        if key not in groups:
            groups[key] = [i, 0]
        groups[key][1] += 1
    if not groups:
        return None
    return max(groups.values(), key=lambda g: g[1])[0]  # max keeps the first of equal maxima


# -----------------------------------------------------------------------------
# scoring. bird: BIRD's evaluation.py, set(pred rows) == set(gold rows). spider: the official test-suite evaluator
# (taoyds/test-suite-sql-eval, exec_eval.eval_exec_match, defaults) verdict for verdict, which papers report: both
# queries rewritten as it rewrites them (data/spider/prepare.py: spider_sql), bags of rows up to a column permutation,
# row order compared iff "order by" is in the gold text (a subquery's too). spider-strict: the same on the queries as
# written: DISTINCT kept (officially `SELECT country` answers `SELECT DISTINCT country`) and order only for an
# outermost ORDER BY (the rule of the training rewards). With ts_dir (test-suite databases, a folder per db_id) a
# prediction must match on each.

SCORINGS = ("bird", "spider", "spider-strict")


def execute_predictions(examples: list[dict], sqls: list, timeout_s: float = 30.0, workers: int = 4) -> list:
    """Run each example's predicted SQL (None stays None) in one run_many batch."""
    jobs = [(ex["db_path"], sql) for ex, sql in zip(examples, sqls) if sql]
    results = iter(run_many(jobs, workers=workers, timeout_s=timeout_s, max_rows=SCORE_MAX_ROWS)) if jobs else iter(())
    return [next(results) if sql else None for sql in sqls]


def score(examples: list[dict], sqls: list, scoring="bird", timeout_s=30.0, workers=4, ts_dir=None) -> tuple:
    """(correct, pred results, gold results) of one predicted SQL per example (None = none); the results are those
    on the example's first database, for majority voting and the error taxonomy."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    jobs = []  # one job per (example, database)
    preds = []
    firsts = []
    for ex, sql in zip(examples, sqls):
        gold = ex["gold_sql"]
        pred = sql
        order = scoring == "spider-strict" and gold_order_matters(ex["gold_sql"])
        if scoring == "spider":
            gold = spider_sql(gold, pred=False)
            pred = sql and spider_sql(sql, pred=True)
            order = "order by" in gold.lower()
        dbs = ts_databases(ex, ts_dir)
        if not dbs:
            raise ValueError(f"no .sqlite file for {ex['db_id']} in {ts_dir}")
        firsts.append(len(jobs))
        jobs += [dict(ex, db_path=db, gold_sql=gold, order=order) for db in dbs]
        preds += [pred] * len(dbs)
    golds = gold_results(jobs, timeout_s, workers)
    results = execute_predictions(jobs, preds, timeout_s, workers)
    mode = "bird" if scoring == "bird" else "spider"  # env.results_match: sets, or bags up to a column permutation
    ok = [is_correct(r, g, mode, job["order"]) for r, g, job in zip(results, golds, jobs)]
    return ([all(ok[a:b]) for a, b in zip(firsts, firsts[1:] + [len(jobs)])], [results[i] for i in firsts],
            [golds[i] for i in firsts])


def score_sqls(examples: list[dict], sqls: list, scoring="bird", timeout_s=30.0, workers=4, ts_dir=None) -> list:
    """Correctness of one predicted SQL per example (the self-check passes the gold SQL here)."""
    return score(examples, sqls, scoring, timeout_s, workers, ts_dir)[0]


def difficulty_of(example: dict) -> str:
    if example.get("difficulty"):
        return example["difficulty"]
    if example.get("source") == "spider":  # Spider's hardness is a function of the gold SQL
        return spider_hardness(example["gold_sql"])
    return "unknown"


# -----------------------------------------------------------------------------
# evaluation loop: batched rollouts, then batched execution for scoring


def run_agent(model, tokenizer, examples, cfg, *, group_size, batch_size, desc, seed, draw_keys=None):
    """Trajectories (group-major, group_size per example) and wall-clock seconds per question: one continuous batch
    of at most batch_size rows under the RolloutConfig cfg, so a question's latency is its own rows' time, not its
    batch's longest row."""
    from rollout import rollout  # looked up at call time: tests replace it with a scripted policy
    # shown by rank 0 also when stderr is a log file: the filter and an evaluation round run for minutes
    with tqdm(total=len(examples) * group_size, desc=desc, unit="traj", disable=os.environ.get("RANK", "0") != "0",
              mininterval=2) as bar:
        trajs = rollout(model, tokenizer, examples, **vars(cfg), group_size=group_size, seed=seed, max_rows=batch_size,
                        bar=bar, draw_keys=draw_keys)
    latency = [max(sum(t.turn_times) for t in trajs[i * group_size:(i + 1) * group_size]) for i in range(len(examples))]
    return trajs, latency


def cost_row(trajs: list, latency: list[float]) -> dict:
    """TRUST-SQL Table 10 columns: per-question latency, and per-trajectory output tokens, turns, tool calls."""
    return {"latency_s": float(np.mean(latency)) if latency else 0.0,
            "output_tokens": float(np.mean([sum(t.loss_mask) for t in trajs])) if trajs else 0.0,
            "turns": float(np.mean([t.num_turns for t in trajs])) if trajs else 0.0,
            "tool_calls": float(np.mean([t.num_tool_calls for t in trajs])) if trajs else 0.0}


def traj_record(t, correct: bool, text: str | None = None) -> dict:
    rec = {"final_sql": t.episode.final_sql, "correct": correct, "turns": t.num_turns,
           "tool_calls": t.num_tool_calls, "output_tokens": int(sum(t.loss_mask)), "total_tokens": len(t.token_ids),
           "stop_reason": t.stop_reason}
    if text is not None:
        rec["text"] = text
    return rec


def evaluate(model, tokenizer, examples, cfg=RolloutConfig(), *, samples=1, scoring="bird", batch_size=16, seed=0,
             exec_timeout_s=30.0, workers=4, out_dir=None, name="eval", ts_dir=None, ves_runs=0) -> dict:
    """Greedy EX always (cfg at temperature 0); maj@K and pass@k (sampled at cfg's temperature and top-p) when
    samples > 1; BIRD's VES and R-VES of the greedy answers when scoring is bird and ves_runs > 0. Returns the summary
    dict; with out_dir, also writes predictions.jsonl and summary.json there, and for Spider scorings the test-suite
    evaluator's pred.txt and gold.txt. ts_dir: the test-suite databases (see score)."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if not examples:
        raise ValueError("evaluate() got no examples")
    t_start = time.perf_counter()
    n = len(examples)

    # greedy: temperature 0, one trajectory per question
    g_trajs, g_lat = run_agent(model, tokenizer, examples, replace(cfg, temperature=0.0), group_size=1,
                               batch_size=batch_size, desc="greedy", seed=seed)
    g_sqls = [t.episode.final_sql for t in g_trajs]
    g_ok, g_res, golds = score(examples, g_sqls, scoring, exec_timeout_s, workers, ts_dir)
    ves = bird_ves(examples, g_sqls, g_ok, ves_runs, exec_timeout_s) if scoring == "bird" and ves_runs else None

    # sampled: K trajectories per question for maj@K and pass@k
    K = samples
    if K > 1:
        s_trajs, s_lat = run_agent(model, tokenizer, examples, cfg, group_size=K, batch_size=batch_size,
                                   desc=f"sample x{K}", seed=seed + 1)
        s_ok, s_res, _ = score([ex for ex in examples for _ in range(K)], [t.episode.final_sql for t in s_trajs],
                               scoring, exec_timeout_s, workers, ts_dir)
        maj_idx = [majority_vote(s_res[i * K:(i + 1) * K]) for i in range(n)]
        maj_ok = [m is not None and s_ok[i * K + m] for i, m in enumerate(maj_idx)]
        n_ok = [sum(s_ok[i * K:(i + 1) * K]) for i in range(n)]

    # per-question metrics, then means overall and per difficulty
    ks = pass_ks(K) if K > 1 else []
    per_q = []
    for i in range(n):
        m = {"greedy_ex": float(g_ok[i])}
        if ves:
            m["ves"], m["r_ves"] = ves[i]
        if K > 1:
            m[f"maj@{K}"] = float(maj_ok[i])
            m.update({f"pass@{k}": pass_at_k(K, n_ok[i], k) for k in ks})
        per_q.append(m)

    def mean(rows):
        return {key: float(np.mean([r[key] for r in rows])) for key in rows[0]}
    diffs = [difficulty_of(ex) for ex in examples]
    order = [d for d in DIFFICULTY_ORDER if d in diffs] + sorted(set(diffs) - set(DIFFICULTY_ORDER))
    by_diff = {d: {"n": diffs.count(d), **mean([m for m, dd in zip(per_q, diffs) if dd == d])} for d in order}

    # error taxonomy of the greedy failures
    labels = [None] * n
    for i in range(n):
        if g_ok[i]:
            continue
        labels[i] = ("gold_error", golds[i].error) if golds[i].error is not None else \
            classify_failure(examples[i], g_trajs[i].episode.final_sql, g_res[i])
    counts = Counter(lab[0] for lab in labels if lab is not None)
    err_examples = {}
    for i, lab in enumerate(labels):
        if lab is not None and lab[0] not in err_examples:
            ex = examples[i]
            err_examples[lab[0]] = {"id": ex.get("id"), "question": ex["question"], "gold_sql": ex["gold_sql"],
                                    "final_sql": g_trajs[i].episode.final_sql, "detail": lab[1]}

    summary = {"name": name, "n": n, "protocol": cfg.protocol, "schema_mode": cfg.schema_mode,
               "max_turns": cfg.max_turns, "samples": K, "temperature": cfg.temperature, "scoring": scoring,
               "seed": seed,
               "spider_ts_dir": str(ts_dir) if ts_dir else None, "ves_machine": machine() if ves else None,
               "metrics": mean(per_q), "by_difficulty": by_diff,
               "cost": {"greedy": cost_row(g_trajs, g_lat)},
               "errors": {"counts": {c: counts.get(c, 0) for c in ERROR_CLASSES + ("gold_error",)},
                          "examples": err_examples},
               "seconds": time.perf_counter() - t_start}
    if K > 1:
        summary["cost"][f"sampled x{K}"] = cost_row(s_trajs, s_lat)

    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / "predictions.jsonl", "w") as f:
            for i, ex in enumerate(examples):
                t = g_trajs[i]
                rec = {"idx": i, "id": ex.get("id"), "db_id": ex.get("db_id"), "question": ex["question"],
                       "difficulty": diffs[i], "gold_sql": ex["gold_sql"],
                       **traj_record(t, g_ok[i], tokenizer.decode(t.token_ids, skip_special_tokens=False)),
                       "error_label": labels[i][0] if labels[i] else None,
                       "error_detail": labels[i][1] if labels[i] else None, "latency_s": g_lat[i]}
                if K > 1:  # samples keep their SQL and counts; their text would multiply the file size by K
                    group = s_trajs[i * K:(i + 1) * K]
                    rec["maj_sql"] = group[maj_idx[i]].episode.final_sql if maj_idx[i] is not None else None
                    rec["maj_correct"] = maj_ok[i]
                    rec["n_correct"] = n_ok[i]
                    rec["samples"] = [traj_record(s, s_ok[i * K + j]) for j, s in enumerate(group)]
                f.write(json.dumps(rec) + "\n")
        with open(out_dir / "summary.json", "w") as f:
            json.dump(summary, f, indent=2)
        if scoring != "bird":
            write_spider_files(out_dir, examples, g_sqls)
    return summary


# -----------------------------------------------------------------------------
# during training (train.py): greedy EX of the eval sets in one batch


def evaluate_ex(model, tokenizer, evalsets, cfg, batch_size, seed, rank, world):
    """Greedy EX (cfg's settings at temperature 0, top-p 1) of every eval set {name: examples} from ONE continuous
    batch over this rank's share of all of them (one tail of long rows instead of one per set), each set scored by
    its own rule; summed over ranks."""
    mine = {name: examples[rank::world] for name, examples in evalsets.items()}
    flat = [ex for examples in mine.values() for ex in examples]
    greedy = replace(cfg, temperature=0.0, top_p=1.0)
    trajs, _ = run_agent(model, tokenizer, flat, greedy, group_size=1, batch_size=batch_size, desc="eval",
                         seed=seed)
    out = {}
    start = 0
    for name, examples in mine.items():
        part = trajs[start:start + len(examples)]
        start += len(examples)
        spider = all(ex.get("source") == "spider" for ex in evalsets[name])
        ok = score(examples, [t.episode.final_sql for t in part], "spider" if spider else "bird")[0] if part else []
        tot = over_ranks(torch.tensor([sum(ok), sum(t.num_turns for t in part), len(part)],
                                      dtype=torch.float64)).tolist()
        correct = {ex["id"]: bool(c) for ex, c in zip(examples, ok)}  # per question: paired comparisons later
        correct = {i: c for shard in all_ranks(correct) for i, c in shard.items()}
        out[name] = {"ex": tot[0] / max(tot[2], 1), "turns": tot[1] / max(tot[2], 1), "n": int(tot[2]),
                     "correct": correct}
    return out

# -----------------------------------------------------------------------------
# report: markdown tables


def markdown_table(header: list[str], rows: list[list]) -> str:

    def fmt(v):
        return f"{v:.2f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown_report(summary: dict) -> str:
    m = summary["metrics"]
    keys = list(m)
    by_diff = [[d, row["n"]] + [100 * row[k] for k in keys] for d, row in summary["by_difficulty"].items()]
    cost = [[run, 100 * acc, c["latency_s"], c["output_tokens"] / 1000, c["turns"], c["tool_calls"]]
            for (run, c), acc in zip(summary["cost"].items(), [m["greedy_ex"], m.get("pass@1")])]
    counts = summary["errors"]["counts"]
    examples = summary["errors"]["examples"]
    errors = [[c, n, _one_line(examples.get(c))] for c, n in counts.items() if n or c != "gold_error"]
    return "\n\n".join([
        f"## {summary['name']}: {summary['n']} questions, {summary['protocol']} protocol, schema "
        f"{summary['schema_mode']}, {summary['scoring']} scoring (EX %)",
        markdown_table(keys, [[100 * v for v in m.values()]]),
        "### by difficulty", markdown_table(["difficulty", "n"] + keys, by_diff),
        "### cost, as TRUST-SQL Table 10 (means: latency per question, the rest per trajectory; sampled EX = pass@1)",
        markdown_table(["run", "EX %", "latency (s)", "output tokens (K)", "turns", "tool calls"], cost),
        "### greedy failures", markdown_table(["class", "count", "example"], errors)]
        + ([f"VES and R-VES timed on {summary['ves_machine']}"] if summary.get("ves_machine") else []))


def _one_line(example: dict | None, width: int = 90) -> str:
    if example is None:
        return ""
    text = f"{example['final_sql'] or '(none)'} -- {example['detail']}"
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[:width - 3] + "..."


# -----------------------------------------------------------------------------
# CLI

ROLLOUT_FLAGS = dict(protocol="trust", schema_mode="none", max_turns=15, max_new_tokens=1024, max_total_tokens=16384)
TRAINED_FLAGS = ("protocol", "brief_prompt", "obs_rows", "schema_mode", "max_turns", "max_new_tokens",
                 "max_total_tokens")
LATER_FLAGS = {"force_final_answer": 0}  # trained settings added since: a checkpoint without them had the default


def trained_settings(model_path) -> dict:
    """The flags that fix what a train.py checkpoint has seen, from its state.json ({} for anything else): the base
    protocol, the demo's prompt variant (brief_prompt, obs_rows), schema mode, turn and token limits.
    eval.py and `train.py --model <checkpoint>` default to them: the CPU demo's model has never seen the full trust
    prompt, and scores ~0 % in it."""
    state = Path(model_path) / "state.json"
    if not state.is_file():
        return {}
    saved = json.loads(state.read_text()).get("args")
    if not isinstance(saved, dict) or not set(TRAINED_FLAGS) <= set(saved):
        return {}  # some other tool's state.json
    # train.py saves the registered variant name ("trust-brief-rows40"); the flags above rebuild it
    return ({k: saved[k] for k in TRAINED_FLAGS} | {k: saved.get(k, v) for k, v in LATER_FLAGS.items()}
            | {"protocol": saved["protocol"].split("-")[0]})


def output_name(model: str, protocol: str, schema_mode: str, data) -> str:
    """Default output folder: model, protocol, schema mode and the data's folder and stem (data/gym/dev.jsonl ->
    gym-dev), so that gym dev and Spider dev never write to the same place."""
    data = Path(data)
    return "-".join([Path(model.rstrip("/")).name, protocol, schema_mode, data.resolve().parent.name, data.stem])


if __name__ == "__main__":
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2", help="checkpoint folder, 'smollm2' (the demo's model), "
                        "'tiny' (the test model) or a Hugging Face id")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="weights during "
                        f"evaluation, as train.py rolls out; {AUTO_DTYPE}")
    parser.add_argument("--data", type=existing_file, default=None,
                        help="examples JSONL (default: the gym dev split, built if missing)")
    # these five default to what a train.py checkpoint was trained with, else to ROLLOUT_FLAGS
    parser.add_argument("--protocol", default=None, choices=["trust", "trail", "mtir", "skyrl"],
                        help="agent turn format (default: a checkpoint's own, else trust)")
    parser.add_argument("--schema-mode", default=None, choices=["none", "prompt", "explore_turn"],
                        help="(default: a checkpoint's own, else none)")
    parser.add_argument("--max-turns", type=positive_int, default=None,
                        help="assistant turns per episode (default: a checkpoint's own, else 15)")
    parser.add_argument("--samples", type=positive_int, default=8, help="K for maj@K and pass@k; 1 = greedy only")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (greedy uses 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling of the --samples runs")
    parser.add_argument("--scoring", default=None, choices=SCORINGS,
                        help="bird: set equality (+ VES); spider: the official test-suite verdicts; spider-strict: "
                             "DISTINCT kept, order only for an outermost ORDER BY (default: spider for Spider data)")
    parser.add_argument("--spider-ts-dir", default=None,
                        help="test-suite databases (one folder per db_id): correct = matches on each of them")
    parser.add_argument("--ves-runs", type=nonneg_int, default=100, help="timed runs per correct answer for bird's VES "
                        "(100 as BIRD's script; 0 = no VES)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=None, help="per assistant turn")
    parser.add_argument("--max-total-tokens", type=positive_int, default=None, help="per trajectory, prompt included")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="trajectories decoded at once (continuous "
                        "batching: a finished one's slot goes to the next); fewer where memory lacks it")
    parser.add_argument("--kv-cache-gb", type=float, default=4.0,
                        help="CPU: the most GiB the KV cache may take; --batch-size shrinks to fit it and the "
                        "machine's available memory (a GPU fits its free memory)")
    parser.add_argument("--limit", type=positive_int, default=None, help="evaluate only the first N questions")
    parser.add_argument("--exec-timeout", type=float, default=30.0, help="seconds per scoring query")
    parser.add_argument("--name", default=None, help="output folder name under --out-dir")
    parser.add_argument("--out-dir", default="out/eval", help="outputs go to <out-dir>/<name>/")
    parser.add_argument("--bird-predictions", default=None, help="also write BIRD's prediction JSON here (keyed by "
                        "question_id), and beside it the gold file of the same questions (predict_dev -> dev_gold.sql)")
    parser.add_argument("--gold-as-prediction", action="store_true",
                        help="no model: score the gold SQL as the prediction (a scorer self-check, expect 100%%)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    args = parser.parse_args()
    if not args.gold_as_prediction:
        from model import load_model, resolve
        try:  # before any work: a missing folder, a Hub id neither cached nor reachable, smollm2's one-time fetch
            model_path = resolve(args.model)
        except (OSError, RuntimeError) as e:
            die(e)
    trained = trained_settings(args.model)
    if trained and args.protocol is None:  # the checkpoint's own prompt variant; an explicit --protocol is used as is
        from protocols import protocol_variant  # registers e.g. "trust-brief-rows40" in PROTOCOLS
        args.protocol = protocol_variant(trained["protocol"], trained["brief_prompt"], trained["obs_rows"],
                                         trained["force_final_answer"])
    for key, default in ROLLOUT_FLAGS.items():
        if getattr(args, key) is None:
            setattr(args, key, trained.get(key, default))
    if trained:
        print("rollout settings from the checkpoint's state.json (a flag overrides): "
              + ", ".join(f"{k}={getattr(args, k)}" for k in ROLLOUT_FLAGS))

    ts_dir = args.spider_ts_dir
    if ts_dir and not Path(ts_dir).is_dir():
        die(f"--spider-ts-dir {ts_dir} is not a folder; pass the test-suite's database folder (one folder of "
            ".sqlite files per db_id)")
    if ts_dir and args.scoring == "bird":
        die("--spider-ts-dir needs --scoring spider or spider-strict")
    if args.data is None:
        from data.gym.prepare import ensure_gym
        args.data = str(ensure_gym(seed=0) / "dev.jsonl")
    try:
        examples = load_examples(args.data)[:args.limit]
    except (FileNotFoundError, ValueError) as e:
        die(f"{e}; pass --data an examples JSONL written by a data/*/prepare.py")
    spider_data = ts_dir or all(ex.get("source") == "spider" for ex in examples)
    scoring = args.scoring or ("spider" if spider_data else "bird")
    missing = sorted({ex["db_id"] for ex in examples if ts_dir and not ts_databases(ex, ts_dir)})
    if missing:
        die(f"--spider-ts-dir {ts_dir} has no .sqlite files for {len(missing)} database(s), e.g. {missing[0]}; "
            "pass the folder that holds one folder per db_id")

    if args.gold_as_prediction:
        ok, _, golds = score(examples, [ex["gold_sql"] for ex in examples], scoring, args.exec_timeout, ts_dir=ts_dir)
        gold_failed = sum(r.error is not None for r in golds)
        print(f"gold as prediction, {scoring} scoring: {100 * sum(ok) / len(ok):.2f}% EX "
              f"({sum(ok)}/{len(ok)}; {gold_failed} gold queries fail to run)")
        sys.exit(0)

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = TORCH_DTYPES[resolve_dtype(args.dtype, args.device)]
    try:
        model, tokenizer = load_model(model_path, device=args.device, dtype=dtype, seed=args.seed)  # resolved above
    except ValueError as e:  # e.g. a tokenizer without a chat template
        die(e)
    budget = args.kv_cache_gb * 2 ** 30 if torch.device(args.device).type == "cpu" else None
    try:  # a CPU cache commits pages as rows grow: sized here, before the first token, not when memory runs out
        args.batch_size = cache_rows(model, args.batch_size, args.device, model.dtype, args.max_total_tokens, budget)
    except ValueError as e:
        die(e)
    if model.config._attn_implementation not in ("sdpa", "eager"):
        model.set_attn_implementation("sdpa")  # rollout's batched rows need per-row attention masks
    name = args.name or output_name(args.model, args.protocol, args.schema_mode, args.data)
    with torch.no_grad():
        cfg = RolloutConfig(protocol=args.protocol, schema_mode=args.schema_mode, max_turns=args.max_turns,
                            max_new_tokens=args.max_new_tokens, max_total_tokens=args.max_total_tokens,
                            temperature=args.temperature, top_p=args.top_p)
        summary = evaluate(model, tokenizer, examples, cfg, samples=args.samples, scoring=scoring,
                           batch_size=args.batch_size, seed=args.seed, exec_timeout_s=args.exec_timeout, ts_dir=ts_dir,
                           ves_runs=args.ves_runs, out_dir=Path(args.out_dir) / name, name=name)
    if args.bird_predictions:
        with open(Path(args.out_dir) / name / "predictions.jsonl") as f:
            write_bird_predictions(args.bird_predictions, examples, [json.loads(line)["final_sql"] for line in f])
    print(markdown_report(summary))
    print(f"\nwrote {Path(args.out_dir) / name}/predictions.jsonl and summary.json"
          + (", pred.txt and gold.txt" if scoring != "bird" else "")
          + (f", {args.bird_predictions} and its gold file" if args.bird_predictions else ""))
