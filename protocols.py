"""
The four agent protocols, one turn format each: the prompts (after each paper's appendix, adapted to our one SQL
tool), turn parsing into env.Action, and how observations come back. TRUST-SQL (four actions, "tool" messages),
SQL-Trail and SkyRL-SQL (<sql> tool calls, <observation> in user messages), MTIR-SQL (JSON tool calls).

    python protocols.py data/gym/dev.jsonl --protocol trail --schema-mode prompt   # print one episode's prompt

    >>> ep = env.new_episode(example, PROTOCOLS["trail"], max_turns=5)
    >>> obs, done = env.step(ep, "<reasoning>count them</reasoning><sql>SELECT count(*) FROM singer</sql>")
"""
import json
import re
from dataclasses import replace
from pathlib import Path

import cli
import env

# -----------------------------------------------------------------------------
# parsing a turn

SCHEMA_SQL = "SELECT sql FROM sqlite_master WHERE type = 'table'"
NO_SCHEMA = ("You are not given the database schema. Explore it with SQL first, e.g. "
             "SELECT name FROM sqlite_master WHERE type = 'table' and PRAGMA table_info(<table>).")


def _blocks(text, tag):
    """Contents of every <tag>...</tag> in order, plus the index of the first one; or an error for unbalanced tags."""
    o = f"<{tag}>"
    c = f"</{tag}>"
    n_open = text.count(o)
    n_close = text.count(c)
    if n_open != n_close:
        return [], -1, f"unclosed <{tag}> tag" if n_open > n_close else f"</{tag}> without an opening <{tag}>"
    out = []
    i = 0
    for _ in range(n_open):
        a = text.find(o, i)
        b = text.find(c, a + len(o)) if a >= 0 else -1
        if b < 0:
            return [], -1, f"</{tag}> before <{tag}>"
        out.append(text[a + len(o):b])
        i = b + len(c)
    return out, text.find(o), None


def _strip_fence(s):
    s = s.strip()
    if s.startswith("```"):  # MTIR's answers may wrap the SQL in a ```sql fence (closed or not)
        s = s[3:]
        s = s[3:] if s[:3].lower() == "sql" else s
        s = s[:s.rfind("```")] if "```" in s else s
    return s.strip()


def _tool_sql(body):
    """SQL from a JSON tool call {"name": "...execute_sql_query", "arguments": {"sql": ..., <db id ignored>}}."""
    try:
        call = json.loads(body, strict=False)  # strict=False: raw newlines inside the SQL string are fine
        args = call.get("arguments", {}) if isinstance(call, dict) else None
        args = json.loads(args, strict=False) if isinstance(args, str) else args
    except (ValueError, RecursionError) as e:
        return None, f"the <tool_call> is not valid JSON ({str(e)[:80]})"
    if not isinstance(args, dict) or not str(call.get("name", "")).endswith("execute_sql_query"):
        return None, 'the <tool_call> must be {"name": "execute_sql_query", "arguments": {..., "sql": "..."}}'
    sql = args.get("sql")
    if not isinstance(sql, str) or not sql.strip():
        return None, "empty SQL in the tool call"
    return sql.strip(), None


def _parse_schema(body):
    try:
        s = json.loads(body, strict=False)
    except (ValueError, RecursionError) as e:
        return None, f"the <schema> is not valid JSON ({str(e)[:80]})"

    def strs(x):
        return isinstance(x, list) and all(isinstance(v, str) for v in x)
    if not (isinstance(s, dict) and strs(s.get("tables")) and isinstance(s.get("columns"), dict)
            and all(isinstance(k, str) and strs(v) for k, v in s["columns"].items())
            and isinstance(s.get("joins", []), list)):
        return None, ('the <schema> must be {"tables": ["t1", ...], "columns": {"t1": ["c1", ...]}, '
                      '"joins": [...]}')
    return {"tables": s["tables"], "columns": s["columns"], "joins": s.get("joins", [])}, None


def _invalid(reason):
    return env.Action("invalid", None, None, False, reason)


def _parse_simple(text, think, call, answer, json_call):
    """trail/skyrl/mtir: <think-tag> then exactly one tool call (<call>) or one final answer (<answer>)."""
    if not isinstance(text, str):
        return _invalid("the turn is not text")
    thinks, i_think, err1 = _blocks(text, think)
    calls, i_call, err2 = _blocks(text, call)
    answers, i_ans, err3 = _blocks(text, answer)
    if err1 or err2 or err3:
        return _invalid(err2 or err3 or err1)
    if len(calls) + len(answers) == 0:
        return _invalid(f"no <{call}> or <{answer}> block")
    if len(calls) + len(answers) > 1:
        return _invalid(f"more than one action in one turn: use exactly one <{call}> or one <{answer}>")
    issue = (f"missing <{think}> block" if not thinks else f"more than one <{think}> block" if len(thinks) > 1
             else f"the <{think}> block must come first" if i_think > max(i_call, i_ans) else None)
    if calls:
        sql, err = _tool_sql(calls[0]) if json_call else (calls[0].strip() or None, f"empty SQL in <{call}>")
        return _invalid(err) if sql is None else env.Action("sql", sql, None, issue is None, issue)
    sql = _strip_fence(answers[0])
    return env.Action("answer", sql, None, issue is None, issue) if sql else _invalid(f"empty SQL in <{answer}>")


TRUST_CONTENT = {"explore_schema": "tool_call", "generate_sql": "tool_call", "propose_schema": "schema",
                 "confirm_answer": "answer"}


def parse_trust(text) -> env.Action:
    """TRUST App. C.2: exactly one <think>, exactly one <action> naming one of the four actions, and that action's
    content block (<tool_call> JSON, <schema> JSON or <answer> SQL). A turn with a clear action and content but a bad
    <think> is still carried out (valid=False); anything less is an "invalid" action."""
    if not isinstance(text, str):
        return _invalid("the turn is not text")
    found = {t: _blocks(text, t) for t in ("think", "action", "tool_call", "schema", "answer")}
    errs = [e for _, _, e in found.values() if e]
    if errs:
        return _invalid(errs[0])
    actions = found["action"][0]
    if len(actions) != 1:
        return _invalid("missing <action> block" if not actions else "more than one <action> in one turn")
    name = actions[0].strip()
    if name not in TRUST_CONTENT:
        return _invalid(f"unknown action {name[:40]!r}")
    need = TRUST_CONTENT[name]
    if not found[need][0]:
        return _invalid(f"{name} needs a <{need}> block")
    if sum(len(found[t][0]) for t in ("tool_call", "schema", "answer")) > 1:
        return _invalid("more than one content block in one turn: one action per turn")
    n_think = len(found["think"][0])
    issue = None if n_think == 1 else "missing <think> block" if n_think == 0 else "more than one <think> block"
    body = found[need][0][0]
    if need == "schema":
        schema, err = _parse_schema(body)
        return _invalid(err) if err else env.Action(name, None, schema, issue is None, issue)
    sql, err = _tool_sql(body) if need == "tool_call" else (_strip_fence(body) or None, "empty SQL in <answer>")
    return _invalid(err) if sql is None else env.Action(name, sql, None, issue is None, issue)


def _turns_note(n, final_hint):
    if n <= 0:  # the forced final turn (Protocol.force_final)
        return f"You have no turns left: {final_hint}"
    return f"You have {n} turns left." + (f" This is your last turn: {final_hint}" if n == 1 else "")


def _schema_text(example, schema_mode, style, example_values):
    if schema_mode == "prompt":
        return env.describe_schema(example["db_path"], style, example_values)
    return NO_SCHEMA if schema_mode == "none" else "The full schema is shown in the first tool result below."


def _messages(system, user, schema, explore_call, wrap, obs_role, example, schema_mode, max_turns):
    """System + filled-in user message (+ for schema_mode="explore_turn" the explore turn and its observation)."""
    if schema_mode not in env.SCHEMA_MODES:
        raise ValueError(f"schema_mode must be one of {env.SCHEMA_MODES}, got {schema_mode!r}")
    evidence = f"External Knowledge: {example['evidence']}\n" if example.get("evidence") else ""
    user = _fill(user, db_id=example["db_id"], schema=schema, evidence=evidence, question=example["question"],
                 max_turns=max_turns)
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    if schema_mode == "explore_turn":  # TRUST's prefill variant: a synthetic explore turn, not a sampled turn
        schema = env.describe_schema(example["db_path"], "create")
        msgs += [{"role": "assistant", "content": explore_call}, {"role": obs_role, "content": wrap(schema, max_turns)}]
    return msgs


def _prompt(name):
    """A paper's prompt text, data/prompts/<name>.txt (edit it there; the file's final newline is not part of it)."""
    return (Path(__file__).resolve().parent / "data" / "prompts" / f"{name}.txt").read_text().removesuffix("\n")


def _fill(template, **kw):
    # one pass over the template only: questions and schemas may themselves contain "{question}" or other braces
    return re.sub(r"\{(\w+)\}", lambda m: str(kw[m[1]]) if m[1] in kw else m[0], template)

# --- TRUST-SQL (App. C.3): four actions, tool results come back in "tool" messages

TRUST_SYSTEM = _prompt("trust_system")

TRUST_USER = _prompt("trust_user")


def _trust_messages(example, schema_mode, max_turns):
    schema = ""
    if schema_mode == "prompt":
        schema = f"Database Schema:\n{env.describe_schema(example['db_path'], 'create')}\n"
    call = json.dumps({"name": "execute_sql_query", "arguments": {"db_id": example["db_id"], "sql": SCHEMA_SQL}})
    explore = ("<think>I know nothing about this database yet, so I read every table's CREATE statement.</think>\n"
               f"<action>explore_schema</action>\n<tool_call>\n{call}\n</tool_call>")
    return _messages(TRUST_SYSTEM, TRUST_USER, schema, explore, _wrap_trust, "tool", example, schema_mode, max_turns)


def _wrap_trust(obs, turns_left):
    return f"{obs}\n\n{_turns_note(turns_left, 'confirm_answer now.')}"

# --- SQL-Trail (App. A.3, Algorithm 1) and SkyRL-SQL (App. A): <sql> tool calls, <observation> in user messages


SQL_AGENT_SYSTEM = _prompt("sql_agent_system")

SQL_AGENT_USER = _prompt("sql_agent_user")


def _sql_agent_messages(think, role, step3, example_values):
    system = _fill(SQL_AGENT_SYSTEM, think=think, role=role, step3=step3)

    def build(example, schema_mode, max_turns):
        schema = _schema_text(example, schema_mode, "list", example_values)
        explore = (f"<{think}>I first read the CREATE statement of every table.</{think}>\n"
                   f"<sql>{SCHEMA_SQL}</sql>")
        return _messages(system, SQL_AGENT_USER, schema, explore, _wrap_observation_tag, "user", example, schema_mode,
                         max_turns)
    return build


def _wrap_observation_tag(obs, turns_left):  # Algorithm 1 line 26 of SQL-Trail
    return f"<observation>\n{obs}\n{_turns_note(turns_left, 'give the final SQL in <solution>.')}\n</observation>"

# --- MTIR-SQL (App. C): JSON <tool_call>, results in <tool_response> user messages, final SQL in <answer>


MTIR_SYSTEM = _prompt("mtir_system")

MTIR_USER = _prompt("mtir_user")


def _mtir_messages(example, schema_mode, max_turns):
    schema = _schema_text(example, schema_mode, "create", 2)
    call = json.dumps({"name": "sql-execute_sql_query", "arguments": {"db_name": example["db_id"], "sql": SCHEMA_SQL}})
    explore = f"<think>I first read the CREATE statement of every table.</think>\n<tool_call>\n{call}\n</tool_call>"
    return _messages(MTIR_SYSTEM, MTIR_USER, schema, explore, _wrap_mtir, "user", example, schema_mode, max_turns)


def _wrap_mtir(obs, turns_left):
    return f"<tool_response>\n{obs}\n</tool_response>\n{_turns_note(turns_left, 'give the final SQL in <answer>.')}"


def feedback_trust(reason):
    """What an invalid turn gets back, in each paper's words where it has any."""
    return (f"Invalid response: {reason}. Every response needs exactly one <think>...</think>, one "
            f"<action>...</action> (explore_schema, propose_schema, generate_sql or confirm_answer) and that "
            f"action's block: <tool_call>, <schema> or <answer>.")


def feedback_sql_agent(think):
    def feedback(reason):
        return (f"Your previous action is invalid: {reason}. Think and try again: <{think}>...</{think}> and then "
                f"either one <sql>...</sql> or one <solution>...</solution>.")
    return feedback


def feedback_mtir(reason):
    return (f"My action is not correct. Let me rethink. ({reason}; use <think>...</think> and then either one "
            f"<tool_call>...</tool_call> or one <answer>...</answer>)")


def parse_trail(text):
    return _parse_simple(text, "reasoning", "sql", "solution", False)


def parse_skyrl(text):
    return _parse_simple(text, "think", "sql", "solution", False)


def parse_mtir(text):
    return _parse_simple(text, "think", "tool_call", "answer", True)


PROTOCOLS = {
    "trust": env.Protocol("trust", ["</tool_call>", "</schema>", "</answer>"], "tool", 30, _trust_messages,
                          parse_trust, _wrap_trust, feedback_trust, answer_action="confirm_answer"),
    "trail": env.Protocol("trail", ["</sql>", "</solution>"], "user", 50,
                          _sql_agent_messages("reasoning", "helpful text-to-SQL expert assistant",
                                              "In your first response, identify all tables and columns from the "
                                              "database schema that are relevant to answering the question.", 0),
                          parse_trail, _wrap_observation_tag, feedback_sql_agent("reasoning")),
    "skyrl": env.Protocol("skyrl", ["</sql>", "</solution>"], "user", 50,
                          _sql_agent_messages("think", "data science expert",
                                              "Think through how to write the query: analyse the question, summarise "
                                              "relevant findings, verify the current steps and revisit previous "
                                              "ones.", 2),
                          parse_skyrl, _wrap_observation_tag, feedback_sql_agent("think")),
    "mtir": env.Protocol("mtir", ["</tool_call>", "</answer>"], "user", 10, _mtir_messages, parse_mtir, _wrap_mtir,
                         feedback_mtir),
}


def get(protocol):
    """A Protocol by name (variants too, once protocol_variant registered them), or a Protocol as it is."""
    if isinstance(protocol, env.Protocol):
        return protocol
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}: choose one of {sorted(PROTOCOLS)}")
    return PROTOCOLS[protocol]

# --- variants (train.py --brief-prompt / --obs-rows): the paper prompts cost hundreds of tokens
# per sequence, which the CPU demo pays on every step. A variant is registered as "<base>-..." and otherwise unchanged.

BRIEF_SYSTEM = {
    "trust": "Answer with SQL. Each turn: <think>, then one <action>: explore_schema or generate_sql with a "
             "<tool_call>, propose_schema with a <schema>, confirm_answer with an <answer>.",
    "trail": "Answer with SQL. Each turn: <reasoning>, then <sql> to run a query or <solution> to answer.",
    "skyrl": "Answer with SQL. Each turn: <think>, then <sql> to run a query or <solution> to answer.",
    "mtir": "Answer with SQL. Each turn: <think>, then a <tool_call> to run a query or an <answer>.",
}


def protocol_variant(name, brief, obs_rows, force_final=False):
    """Register (idempotently) and return the protocol name to use: name itself, or e.g. "trust-brief-rows40"."""
    if not brief and not obs_rows and not force_final:
        return name
    base = PROTOCOLS[name]
    variant = name + ("-brief" if brief else "") + (f"-rows{obs_rows}" if obs_rows else "") + \
        ("-final" if force_final else "")

    def build_messages(example, schema_mode, max_turns):
        msgs = base.build_messages(example, schema_mode, max_turns)
        return [{"role": "system", "content": BRIEF_SYSTEM[name]}] + msgs[1:] if brief else msgs
    PROTOCOLS[variant] = replace(base, name=variant, build_messages=build_messages, max_rows=obs_rows or base.max_rows,
                                 force_final=bool(force_final))
    return variant

# -----------------------------------------------------------------------------

if __name__ == "__main__":
    parser = cli.ArgumentParser(description=__doc__)
    parser.add_argument("examples", type=cli.existing_file,
                        help="example JSONL file (see the README for the format)")
    parser.add_argument("--protocol", default="trail", choices=sorted(PROTOCOLS), help="agent turn format")
    parser.add_argument("--schema-mode", default="prompt", choices=env.SCHEMA_MODES,
                        help="none: unknown schema; prompt: schema in the prompt; explore_turn: a prefilled exploring "
                        "turn")
    parser.add_argument("--max-turns", type=cli.positive_int, default=5, help="assistant turns per episode")
    parser.add_argument("--index", type=cli.nonneg_int, default=0, help="which example to show")
    args = parser.parse_args()
    try:
        examples = env.load_examples(args.examples)
    except (FileNotFoundError, ValueError) as e:
        cli.die(e)
    if args.index >= len(examples):
        cli.die(f"--index {args.index}: {args.examples} has {len(examples)} examples")
    ex = examples[args.index]
    for m in PROTOCOLS[args.protocol].build_messages(ex, args.schema_mode, args.max_turns):
        print(f"--- {m['role']}\n{m['content']}")
    gold = env.run_sql(ex["db_path"], ex["gold_sql"])
    print(f"--- gold SQL\n{ex['gold_sql']}\n--- result\n{env.format_observation(gold)}")
