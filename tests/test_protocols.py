"""protocols.py: each paper's turn parser, invalid turns as feedback, and the prompts of every protocol.

    python -m pytest -q tests/test_protocols.py
"""
import pytest

import env
import protocols
from test_env import _example


TOOL = '{"name": "execute_sql_query", "arguments": {"db_id": "pets_1", "sql": "SELECT count(*) FROM Pets"}}'
JUNK = "<think>" + "a<b>c</d>{" * 10_000  # 100k characters of unbalanced junk


def test_trust_well_formed_turns():
    a = protocols.parse_trust(f"<think>look</think>\n<action>explore_schema</action>\n<tool_call>\n{TOOL}\n</tool_call>")
    assert (a.name, a.sql, a.valid) == ("explore_schema", "SELECT count(*) FROM Pets", True)
    schema = '{"tables": ["Pets"], "columns": {"Pets": ["PetID"]}}'
    a = protocols.parse_trust(f"<think>commit</think><action>propose_schema</action><schema>{schema}</schema>")
    assert a.name == "propose_schema" and a.valid and a.schema == {"tables": ["Pets"], "columns": {"Pets": ["PetID"]},
                                                                   "joins": []}
    a = protocols.parse_trust("<think>done</think><action>confirm_answer</action><answer>\nSELECT 1\n</answer>")
    assert (a.name, a.sql, a.valid) == ("confirm_answer", "SELECT 1", True)
    multiline = TOOL.replace("SELECT count(*)", "SELECT\n count(*)")  # raw newline inside a JSON string
    assert protocols.parse_trust(f"<think>x</think><action>generate_sql</action><tool_call>{multiline}</tool_call>").sql


@pytest.mark.parametrize("text, reason", [
    ("<think>x</think><action>generate_sql</action><tool_call>{not json}</tool_call>", "not valid JSON"),
    ("<think>x</think><tool_call>" + TOOL + "</tool_call>", "missing <action>"),
    ("<think>x</think><action>generate_sql</action><tool_call>" + TOOL, "unclosed <tool_call>"),
    ("<think>x</think><action>generate_sql</action><tool_call>" + TOOL + "</tool_call><action>confirm_answer"
     "</action><answer>SELECT 1</answer>", "more than one <action>"),
    ("<think>x</think><action>generate_sql</action><tool_call>" + TOOL + "</tool_call><answer>SELECT 1</answer>",
     "more than one content block"),
    ("<think>x</think><action>generate_sql</action><answer>SELECT 1</answer>", "needs a <tool_call>"),
    ("<think>x</think><action>run_sql</action><answer>SELECT 1</answer>", "unknown action"),
    ("<think>x</think><action>confirm_answer</action><answer>  </answer>", "empty SQL"),
    ('<think>x</think><action>generate_sql</action><tool_call>{"name": "execute_sql_query", "arguments": '
     '{"db_id": "pets_1", "sql": ""}}</tool_call>', "empty SQL"),
    ('<think>x</think><action>propose_schema</action><schema>{"tables": "Pets"}</schema>', "<schema> must be"),
    (JUNK, "unclosed <think>"),
    (None, "not text"),
])
def test_trust_malformed_turns_become_invalid_actions(text, reason):
    a = protocols.parse_trust(text)
    assert a.name == "invalid" and not a.valid and a.sql is None and reason in a.feedback
    assert len(a.feedback) < 300  # never echoes 100k characters back


def test_trust_missing_think_is_carried_out_but_fails_the_format_check():
    a = protocols.parse_trust(f"<action>generate_sql</action><tool_call>{TOOL}</tool_call>")
    assert a.name == "generate_sql" and a.sql and not a.valid and "missing <think>" in a.feedback
    a = protocols.parse_trust(f"<think>a</think><think>b</think><action>generate_sql</action><tool_call>{TOOL}</tool_call>")
    assert not a.valid and "more than one <think>" in a.feedback


@pytest.mark.parametrize("proto, think, call, answer", [
    ("trail", "reasoning", "sql", "solution"), ("skyrl", "think", "sql", "solution")])
def test_trail_and_skyrl_parsers(proto, think, call, answer):
    parse = protocols.PROTOCOLS[proto].parse_turn
    a = parse(f"<{think}>count</{think}>\n<{call}>SELECT count(*) FROM Pets</{call}>")
    assert (a.name, a.sql, a.valid) == ("sql", "SELECT count(*) FROM Pets", True)
    a = parse(f"<{think}>done</{think}><{answer}>SELECT 1;</{answer}>")
    assert (a.name, a.sql, a.valid) == ("answer", "SELECT 1;", True)
    assert not parse(f"<{call}>SELECT 1</{call}>").valid and parse(f"<{call}>SELECT 1</{call}>").sql == "SELECT 1"
    for bad, reason in [(f"<{think}>x</{think}>", "no <"), (f"<{think}>x</{think}><{call}>SELECT 1", "unclosed"),
                        (f"<{think}>x</{think}><{call}>SELECT 1</{call}><{call}>SELECT 2</{call}>", "more than one"),
                        (f"<{think}>x</{think}><{call}>SELECT 1</{call}><{answer}>SELECT 1</{answer}>", "more than one"),
                        (f"<{think}>x</{think}><{call}> </{call}>", "empty SQL"), (JUNK, ""), (12, "not text")]:
        a = parse(bad)
        assert a.name == "invalid" and not a.valid and reason in a.feedback


def test_mtir_parser_and_rethink_feedback(pets):
    parse = protocols.PROTOCOLS["mtir"].parse_turn
    call = '{"name": "sql-execute_sql_query", "arguments": {"db_name": "pets_1", "sql": "SELECT 1"}}'
    a = parse(f"<think>check</think>\n<tool_call>\n{call}\n</tool_call>")
    assert (a.name, a.sql, a.valid) == ("sql", "SELECT 1", True)
    a = parse("<think>final</think><answer>```sql\nSELECT count(*) FROM Pets\n```</answer>")
    assert (a.name, a.sql) == ("answer", "SELECT count(*) FROM Pets")
    assert parse("<think>final</think><answer> ```sql SELECT 2 </answer>").sql == "SELECT 2"  # the paper's unclosed fence
    assert parse("<think>x</think><tool_call>{bad json</tool_call>").name == "invalid"
    assert parse(f"<think>x</think><tool_call>{call}</tool_call><answer>SELECT 1</answer>").name == "invalid"
    ep = env.new_episode(_example(pets), protocols.get("mtir"), max_turns=3)
    obs, done = env.step(ep, "I think the answer is 3.")
    assert not done and "My action is not correct. Let me rethink." in obs and "You have 2 turns left" in obs


@pytest.mark.parametrize("proto", sorted(protocols.PROTOCOLS))
@pytest.mark.parametrize("schema_mode", env.SCHEMA_MODES)
def test_prompts_for_every_protocol_and_schema_mode(pets, proto, schema_mode):
    p = protocols.PROTOCOLS[proto]
    msgs = p.build_messages(_example(pets), schema_mode, 6)
    assert [m["role"] for m in msgs[:2]] == ["system", "user"]
    assert "How many pets are there?" in msgs[1]["content"] and "6 turns" in msgs[1]["content"]
    has_schema = "PetType" in msgs[1]["content"]
    assert has_schema == (schema_mode == "prompt")
    if schema_mode == "explore_turn":  # the synthetic explore turn is a well-formed tool call + its observation
        assert [m["role"] for m in msgs[2:]] == ["assistant", p.obs_role]
        a = p.parse_turn(msgs[2]["content"])
        assert a.valid and a.sql == protocols.SCHEMA_SQL
        assert "CREATE TABLE Pets" in msgs[3]["content"] and "You have 6 turns left" in msgs[3]["content"]
    else:
        assert len(msgs) == 2
