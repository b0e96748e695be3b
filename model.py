"""
Models and tokenizers: load_model() for any Hugging Face causal LM, the built-in "tiny" model, and SHAPES.

    python model.py                     # build/load the tiny model, show its tokenizer at work and SHAPES sizes
    python model.py --model Qwen/Qwen3-0.6B

"tiny" is a randomly initialised Qwen3-architecture model (~2.4M params) with a byte-level BPE trained on the gym's
own text. It goes through exactly the same code path as a real chat model (chat template, eos, generate).
The tokenizer isolates quote characters and keeps numbers whole, so a literal value such as 'Fresno', 'QR377' or 18
is the same token ids in the question and in the SQL: the tiny model only has to copy ids, not re-spell values.
Unlike a real LLM it knows nothing when it starts, so pretrain_copy() gives it the one pretrained skill SQL agents
lean on most, copying text it has already seen (induction heads), in about a minute.
"""
import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sqlite3
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen3Config

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # so data.gym.prepare and env import when model.py runs as a script

# -----------------------------------------------------------------------------
# Published shapes (config.json of each Hugging Face checkpoint), for random-init benchmarks on a GPU

_QWEN3 = dict(hidden_act="silu", vocab_size=151936, max_position_embeddings=40960, rope_theta=1_000_000.0,
              rms_norm_eps=1e-6, attention_bias=False)
SHAPES = {
    "Qwen3-0.6B": dict(_QWEN3, num_hidden_layers=28, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "Qwen3-1.7B": dict(_QWEN3, num_hidden_layers=28, hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "Qwen3-4B": dict(_QWEN3, num_hidden_layers=36, hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "Qwen3-8B": dict(_QWEN3, num_hidden_layers=36, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    # Qwen2 architecture: q/k/v projections carry a bias, head_dim = hidden_size / num_attention_heads = 128
    "Qwen2.5-Coder-7B": dict(hidden_act="silu", vocab_size=152064, max_position_embeddings=32768,
                             rope_theta=1_000_000.0, rms_norm_eps=1e-6, num_hidden_layers=28, hidden_size=3584,
                             intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                             tie_word_embeddings=False),
}
PUBLISHED_PARAMS = {"Qwen3-0.6B": 0.6e9, "Qwen3-1.7B": 1.7e9, "Qwen3-4B": 4.0e9, "Qwen3-8B": 8.2e9,
                    "Qwen2.5-Coder-7B": 7.61e9}  # model cards' "Number of Parameters"


def attn_implementation(device, dtype=torch.bfloat16):
    """flash_attention_2 on CUDA in fp16/bf16 when flash-attn is installed (optional), else PyTorch's sdpa."""
    half = dtype in (torch.float16, torch.bfloat16)  # flash-attn kernels have no fp32 path
    on_cuda = str(device).startswith("cuda")
    return "flash_attention_2" if on_cuda and half and importlib.util.find_spec("flash_attn") else "sdpa"


def shape_config(shape_name):
    if shape_name not in SHAPES:
        raise ValueError(f"unknown shape {shape_name!r}; choose one of {sorted(SHAPES)}")
    config_cls = Qwen2Config if shape_name.startswith("Qwen2") else Qwen3Config
    return config_cls(**SHAPES[shape_name])


def build_random(shape_name, dtype=torch.bfloat16, device="cuda"):
    """A randomly initialised model of a real published shape (no weights download). device="meta" costs nothing."""
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape_config(shape_name), dtype=dtype,
                                                 attn_implementation=attn_implementation(device, dtype))
    return model

# -----------------------------------------------------------------------------
# The tiny tokenizer: byte-level BPE trained on the gym, ChatML chat template

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # pad, turn start, turn end (= eos)
TAGS = [f"<{slash}{name}>" for name in ["think", "action", "tool_call", "tool_response", "schema", "answer",
                                        "reasoning", "sql", "observation", "solution"] for slash in ["", "/"]]
# the fixed JSON around every tool call: whole tokens, so a tool call costs the tiny model a few tokens, not ~30
TOOL_CALL_PIECES = ['{"name": "execute_sql_query", "arguments": {"db_id": "',
                    '{"name": "sql-execute_sql_query", "arguments": {"db_name": "', '", "sql": "', '"}}']
ROLES = ["system", "user", "assistant", "tool"]
# {% generation %} marks the assistant's own tokens, so return_assistant_tokens_mask=True gives the SFT loss mask
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('unknown chat role ' ~ message['role'] ~ ': use system, user, assistant or tool') -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{- message['content'] + '<|im_end|>' -}}{% endgeneration %}"
    "{%- else -%}{{- message['content'] + '<|im_end|>' -}}{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
TOKENIZER_SETTINGS = dict(version=2, vocab_size=4096, min_frequency=1)
_TAG_RE = re.compile("|".join(re.escape(t) for t in TAGS + TOOL_CALL_PIECES + SPECIAL_TOKENS))
_CHAT_TEXT = [f"{role}\n" for role in ROLES] * 4  # role names follow <|im_start|> in every turn: make them 1 token
_SQL_TEXT = ["SELECT DISTINCT FROM WHERE AND OR NOT IN IS NULL LIKE GLOB BETWEEN EXISTS GROUP BY HAVING ORDER ASC "
             "DESC LIMIT OFFSET JOIN INNER LEFT OUTER CROSS ON USING AS UNION INTERSECT EXCEPT ALL CASE WHEN THEN ELSE "
             "END CAST COUNT SUM AVG MIN MAX ROUND ABS LENGTH LOWER UPPER SUBSTR TRIM REPLACE COALESCE IFNULL NULLIF "
             "STRFTIME DATE JULIANDAY INSTR TOTAL GROUP_CONCAT INTEGER REAL TEXT WITH PRAGMA table_info sqlite_master"]
# used only while the gym generator is missing (development), with a warning
_FALLBACK_CORPUS = _CHAT_TEXT + _SQL_TEXT + [
    "How many students attend schools in the city 'Fresno'?",
    "SELECT COUNT(*) FROM \"schools\" WHERE \"City\" = 'Fresno'",
    "List the names of the 5 most expensive products ordered after '2019-05-01'.",
    "SELECT name, price FROM products WHERE price > 100 GROUP BY name HAVING COUNT(*) >= 2 ORDER BY price DESC LIMIT 5",
    "Which tables exist? Show the schema of the table and the first rows. You have 3 turns left.",
]


def _db_text(db_path, max_values=200):
    """Table and column names (bare and quoted, as SQL writes them) and distinct cell values, opened read-only."""
    from env import quote_ident  # the project's one quoting rule: escapes a quote inside a name
    con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        texts = []
        for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name"):
            cols = [row[1] for row in con.execute(f"PRAGMA table_info({quote_ident(table)})")]
            texts.append(f"CREATE TABLE {table} (" + ", ".join(cols) + ")")
            texts.append(f'FROM "{table}" ' + " ".join(f'"{c}"' for c in cols))
            for col in map(quote_ident, cols):
                rows = con.execute(f"SELECT DISTINCT {col} FROM {quote_ident(table)} WHERE {col} IS NOT NULL "
                                   f"ORDER BY 1 LIMIT {max_values}").fetchall()
                texts.append(" ".join(f"'{value}'" for (value,) in rows))
        return texts
    finally:
        con.close()


def _protocol_text(examples):
    """System prompts, observation wrappers and rendered observations from env.py, when it is importable."""
    try:
        import env
        texts = []
        for name in ["trust", "trail", "skyrl", "mtir"]:  # the base protocols only: variants must not change it
            protocol = env.PROTOCOLS[name]
            for example in examples:
                for schema_mode in ["none", "explore_turn"]:
                    texts += [m["content"] for m in protocol.build_messages(example, schema_mode, 5)]
            texts.append(protocol.wrap_observation("", 3))
        for example in examples:
            texts.append(env.format_observation(env.run_sql(example["db_path"], example["gold_sql"])))
        return texts
    except Exception as e:  # env.py is written concurrently; the tokenizer must still build without it
        warnings.warn(f"tiny tokenizer: env.py protocol prompts left out of the corpus ({type(e).__name__}: {e})")
        return []


def tiny_corpus(gym_dir=None):
    """Training text for the tiny tokenizer: the gym's train split, its databases, and the protocol prompts."""
    if gym_dir is None:
        try:
            from data.gym.prepare import ensure_gym
        except ImportError as e:
            warnings.warn(f"tiny tokenizer: gym generator not importable ({e}); using a small fallback corpus")
            return list(_FALLBACK_CORPUS)
        gym_dir = ensure_gym(seed=0)
    gym = Path(gym_dir)
    # questions and SQL of the train split only; names and values of every database, held-out ones included, so that
    # words are whole tokens everywhere as with a real tokenizer's large vocabulary (vocabulary only, no test answers)
    examples = [json.loads(line) for line in (gym / "train.jsonl").read_text().splitlines() if line.strip()]
    for example in examples:
        example["db_path"] = str((gym / example["db_path"]).resolve())
    texts = [example[key] for example in examples for key in ["question", "evidence", "gold_sql"] if example[key]]
    for db_path in sorted((gym / "databases").glob("*/*.sqlite")):
        texts += _db_text(db_path)
    one_per_db = list({example["db_id"]: example for example in examples}.values())
    return texts + _protocol_text(one_per_db) + _CHAT_TEXT + _SQL_TEXT


def build_tokenizer(corpus, vocab_size=4096, min_frequency=1):
    """Train a byte-level BPE on corpus (a list of strings) and wrap it with the ChatML template. Deterministic."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(" ?['\"`]"), behavior="isolated"),  # quotes alone: ' + Fresno + '
        # numbers stay whole (" 18", "2007"): one token each where BPE merged them. With one token per digit the tiny
        # model had to copy numbers digit by digit, and it never learned to
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # tags and tool-call pieces become whole added tokens below, so keep their pieces from using up merges
    tok.train_from_iterator([_TAG_RE.sub("\n", text) for text in corpus], trainer)
    # added but not "special": decode(skip_special_tokens=True) keeps them
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in TAGS + TOOL_CALL_PIECES])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
                                   model_max_length=TINY["max_position_embeddings"])


def tiny_tokenizer(cache_dir=ROOT / "out" / "tiny_tokenizer", gym_dir=None):
    """The tiny tokenizer, cached on disk under a hash of its corpus and settings (rebuilt when the gym changes)."""
    corpus = tiny_corpus(gym_dir)
    key = hashlib.sha256(json.dumps([TOKENIZER_SETTINGS, TAGS, TOOL_CALL_PIECES, corpus]).encode()).hexdigest()[:16]
    path = Path(cache_dir) / key
    if not (path / "tokenizer.json").exists():
        tok = build_tokenizer(corpus, TOKENIZER_SETTINGS["vocab_size"], TOKENIZER_SETTINGS["min_frequency"])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{key}-"))
        tok.save_pretrained(tmp)
        os.chmod(tmp, 0o755)
        try:
            os.replace(tmp, path)  # atomic: concurrent ranks never see a half-written folder
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    return PreTrainedTokenizerFast.from_pretrained(path)

# -----------------------------------------------------------------------------
# The tiny model and load_model

TINY = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=6,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rope_theta=10_000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=True)


def build_tiny(tokenizer, seed=0, device="cpu", dtype=torch.float32, **overrides):
    """Random Qwen3 model sized for the tokenizer; same seed -> same weights, global RNG untouched."""
    ids = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
               bos_token_id=None)
    config = Qwen3Config(**{**TINY, **overrides, **ids})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 attn_implementation=attn_implementation(device, dtype))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model.to(device=device, dtype=dtype)


def pretrain_copy(model, tokenizer, texts, steps=250, batch_size=16, length=160, lr=3e-3, seed=0, quiet=False):
    """Copy pretraining for a randomly initialised model: each sequence is `length` tokens of texts (drawn at random,
    concatenated), then the same tokens again, with the loss on the repeat only. A real LLM brings this skill from
    pretraining (induction heads); without it the tiny model writes plausible values from training instead of the
    ones in the question. Returns the copy accuracy of the last step."""
    import random
    import torch.nn.functional as F
    from tqdm import tqdm
    rng, device = random.Random(seed), next(model.parameters()).device
    pieces = [tokenizer.encode(t + "\n", add_special_tokens=False) for t in texts]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    acc, bar = 0.0, tqdm(range(steps), desc="copy pretraining", disable=quiet)
    for _ in bar:
        batch = []
        for _ in range(batch_size):
            doc = []
            while len(doc) < length:
                doc += rng.choice(pieces)
            batch.append(doc[:length] * 2)
        ids = torch.tensor(batch, device=device)  # (B, 2·length)
        logits = model(input_ids=ids).logits[:, length:-1].float()  # predicts tokens length+1 .. 2·length-1
        target = ids[:, length + 1:]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        acc = (logits.argmax(-1) == target).float().mean().item()
        bar.set_postfix(loss=f"{loss.item():.3f}", copy_acc=f"{acc:.2f}")
    model.eval()
    return acc


def load_model(name_or_path, device="cpu", dtype=torch.float32, seed=0):
    """(model, tokenizer) for "tiny" or any Hugging Face causal LM (hub id or local save_pretrained folder)."""
    if name_or_path == "tiny":
        tokenizer = tiny_tokenizer()
        return build_tiny(tokenizer, seed=seed, device=device, dtype=dtype).eval(), tokenizer
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{name_or_path}: the tokenizer has no chat template, and sqlrl talks to models in chat "
                         "turns. Use an instruct/chat checkpoint, or set tokenizer.chat_template (e.g. "
                         "model.CHAT_TEMPLATE for ChatML) and save it next to the weights.")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # batched rollouts need a pad id; it is always masked out
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype,
                                                 attn_implementation=attn_implementation(device, dtype))
    return model.to(device).eval(), tokenizer

# -----------------------------------------------------------------------------

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help='"tiny" or a Hugging Face id / local folder')
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, seed=args.seed)
    print(f"{args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, vocab {len(tokenizer)}")
    chat = [{"role": "user", "content": "How many students attend schools in the city 'Fresno'?"},
            {"role": "assistant", "content": "<answer>SELECT COUNT(*) FROM \"schools\" WHERE \"City\" = 'Fresno'"
                                             "</answer>"}]
    ids = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)
    print(f"{len(ids)} tokens:", " | ".join(tokenizer.convert_ids_to_tokens(ids)))
    for name in SHAPES:
        numel = sum(p.numel() for p in build_random(name, device="meta").parameters())
        print(f"{name:18s} {numel / 1e9:6.2f}B params (published {PUBLISHED_PARAMS[name] / 1e9:.2f}B)")
