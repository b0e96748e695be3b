"""
model.py: the tiny model and tokenizer, load_model on a saved checkpoint, SHAPES sizes.

    python -m pytest -q tests/test_model.py
"""
import random

import pytest
import torch

import model as M

CHAT = [
    {"role": "system", "content": "You answer questions with SQL."},
    {"role": "user", "content": "How many students attend schools in the city 'Fresno'?"},
    {"role": "assistant",
     "content": "<tool_call>SELECT COUNT(*) FROM \"schools\" WHERE \"City\" = 'Fresno'</tool_call>"},
    {"role": "tool", "content": "COUNT(*)\n42\nYou have 4 turns left."},
]


@pytest.fixture(scope="module")
def tiny():
    return M.load_model("tiny", seed=0)


def contains(seq, sub):
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))

# -----------------------------------------------------------------------------
# the tiny model


def test_tiny_forward_shapes_size_and_seeded_weights(tiny):
    model, tok = tiny
    n_params = sum(p.numel() for p in model.parameters())
    assert 1.5e6 < n_params < 4e6, n_params
    assert model.config.model_type == "qwen3" and model.config.tie_word_embeddings
    assert model.config.vocab_size == len(tok) and model.config._attn_implementation == "sdpa"
    ids = torch.randint(0, len(tok), (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # (B, T, V)
    assert logits.shape == (2, 16, len(tok)) and torch.isfinite(logits).all()
    # same seed -> same weights, other seed -> other weights; the global RNG is left alone
    state = torch.get_rng_state()
    again, other = M.build_tiny(tok, seed=0), M.build_tiny(tok, seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    w = model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(again.model.layers[0].self_attn.q_proj.weight, w)
    assert not torch.equal(other.model.layers[0].self_attn.q_proj.weight, w)


def test_generate_stops_at_eos_after_learning_one_reply(tiny):
    # overfit one reply, then greedy generation must reproduce it and stop right after <|im_end|>
    _, tok = tiny
    model = M.build_tiny(tok, seed=0).train()
    prompt = tok.apply_chat_template(CHAT[:2], add_generation_prompt=True, return_dict=False)
    reply = tok.encode("<answer>SELECT COUNT(*) FROM schools</answer>", add_special_tokens=False) + [tok.eos_token_id]
    ids = torch.tensor([prompt + reply])
    labels = torch.tensor([[-100] * len(prompt) + reply])  # loss on the reply only
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):  # stop once teacher-forced argmax reproduces the reply (typically well under 100 steps)
        out = model(input_ids=ids, labels=labels)
        if torch.equal(out.logits[0, len(prompt) - 1:-1].argmax(-1), labels[0, len(prompt):]):
            break
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=40, do_sample=False)
    new = out[0, len(prompt):].tolist()
    assert new == reply, tok.decode(new)
    assert len(new) < 40 and new[-1] == tok.eos_token_id

# -----------------------------------------------------------------------------
# the tiny tokenizer


def test_chat_template_renders_exact_chatml(tiny):
    _, tok = tiny
    expected = ("<|im_start|>system\nYou answer questions with SQL.<|im_end|>\n"
                "<|im_start|>user\nHow many students attend schools in the city 'Fresno'?<|im_end|>\n"
                "<|im_start|>assistant\n<tool_call>SELECT COUNT(*) FROM \"schools\" WHERE \"City\" = 'Fresno'"
                "</tool_call><|im_end|>\n"
                "<|im_start|>tool\nCOUNT(*)\n42\nYou have 4 turns left.<|im_end|>\n")
    assert tok.apply_chat_template(CHAT, tokenize=False) == expected
    assert tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        expected + "<|im_start|>assistant\n"
    # rendering then tokenizing == tokenizing through the template
    assert tok.apply_chat_template(CHAT, return_dict=False) == tok.encode(expected, add_special_tokens=False)
    with pytest.raises(Exception, match="unknown chat role"):
        tok.apply_chat_template([{"role": "robot", "content": "hi"}], tokenize=False)


def test_assistant_tokens_mask_covers_reply_and_im_end(tiny):
    _, tok = tiny
    enc = tok.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True)
    masked = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    assert tok.decode(masked) == CHAT[2]["content"] + "<|im_end|>"


def test_special_tokens_and_tags_are_single_tokens(tiny):
    _, tok = tiny
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id != tok.pad_token_id
    for token in M.SPECIAL_TOKENS + M.TAGS + ["assistant", "user", "system"]:
        assert len(tok.encode(token, add_special_tokens=False)) == 1, token
    # skipping special tokens drops the ChatML markers but keeps the protocol tags
    ids = tok.encode("<|im_start|>assistant\n<think>t</think><answer>SELECT 1</answer><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>t</think><answer>SELECT 1</answer>"


@pytest.mark.parametrize("value", ["Fresno", "Los Angeles", "Directly funded", "2019-05-01", "37.5",
                                   "Charter School (Y/N)", "Qzxv Wubble-9"])
def test_quoted_value_is_the_same_tokens_in_question_and_sql(tiny, value):
    # the gym quotes values identically in question and SQL, so copying is copying token ids
    _, tok = tiny
    question = f"How many students attend schools in the city '{value}'?"
    sql = f"SELECT COUNT(*) FROM \"schools\" WHERE \"City\" = '{value}' AND x IN ('{value}', 'b')"
    quoted = tok.encode(f" '{value}'", add_special_tokens=False)
    assert tok.encode(f" '{value}'?", add_special_tokens=False)[:len(quoted)] == quoted
    assert contains(tok.encode(question), quoted) and contains(tok.encode(sql), quoted)
    bare = tok.encode(value, add_special_tokens=False)
    assert quoted[1:-1] == bare  # the value's tokens do not depend on the quote around it
    assert tok.encode(sql).count(bare[0]) >= 2


@pytest.mark.parametrize("number", ["18", "2007", "515", "4512345"])
def test_a_number_is_the_same_tokens_in_question_and_sql(tiny, number):
    # numbers are not split into digits: "above 18" and "> 18" end in the same ids, so copying is copying ids
    _, tok = tiny
    in_question = tok.encode(f"How many teachers have years experience above {number}?", add_special_tokens=False)
    in_sql = tok.encode(f"SELECT COUNT(*) FROM teachers WHERE \"Years Experience\" > {number}", add_special_tokens=False)
    piece = tok.encode(f" {number}", add_special_tokens=False)
    assert contains(in_question, piece) and in_sql[-len(piece):] == piece
    year = tok.encode(f"'{number}'", add_special_tokens=False)[1:-1]
    assert contains(tok.encode(f"in the year '{number}'?"), year) and contains(tok.encode(f"= '{number}'"), year)


def test_gym_numbers_are_whole_tokens(tiny):
    _, tok = tiny
    for number in [" 18", "2007", " 515", " 36"]:  # thresholds, years and counts as the gym's questions write them
        assert len(tok.encode(number, add_special_tokens=False)) == 1, number


def test_tool_call_json_is_a_few_tokens_and_decode_round_trips(tiny):
    _, tok = tiny
    call = '{"name": "execute_sql_query", "arguments": {"db_id": "schools", "sql": "SELECT 1"}}'
    pieces = tok.convert_ids_to_tokens(tok.encode(call, add_special_tokens=False))
    assert pieces[0] == M.TOOL_CALL_PIECES[0] and pieces[-1] == '"}}' and len(pieces) <= 8, pieces
    for text in ["SELECT \"Charter School (Y/N)\" FROM t WHERE d >= '2019-05-01'  -- two  spaces\n\n\tok",
                 "<think>café naïve 東京 🙂</think><answer>SELECT 1;</answer>", " leading space , odd spacing .",
                 "<|im_start|>user\nQ<|im_end|>\n", call, '{"name": "sql-execute_sql_query", "arguments": {}}']:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_tokenizer_build_is_deterministic_and_cached(tmp_path):
    corpus = M._FALLBACK_CORPUS * 3
    a, b = M.build_tokenizer(corpus, vocab_size=400), M.build_tokenizer(corpus, vocab_size=400)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    first = M.tiny_tokenizer(cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 1  # one folder, named by the corpus hash
    second = M.tiny_tokenizer(cache_dir=tmp_path)
    assert second.backend_tokenizer.to_str() == first.backend_tokenizer.to_str()


def test_copy_pretraining_teaches_a_random_model_to_copy():
    # the tiny model starts knowing nothing; a few dozen copy steps on gym text give it working induction heads
    _, tok = M.load_model("tiny")
    model = M.build_tiny(tok, seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                         num_key_value_heads=1, num_hidden_layers=2)
    words = "Fresno Napa Davis Chico Lodi Tracy Vista Yuba Merced Irvine Ukiah Delano schools teachers budget".split()
    rng = random.Random(0)
    texts = [" ".join(rng.choices(words, k=rng.randint(2, 5))) for _ in range(300)]  # only copying predicts a repeat
    before = {k: v.clone() for k, v in model.state_dict().items()}
    acc = M.pretrain_copy(model, tok, texts, steps=60, batch_size=16, length=24, lr=1e-2, seed=0, quiet=True)
    assert acc > 0.6, acc  # a model that cannot copy scores about 1/len(words)
    assert not model.training and any(not torch.equal(before[k], v) for k, v in model.state_dict().items())

# -----------------------------------------------------------------------------
# load_model on any Hugging Face checkpoint


def test_load_model_on_a_saved_checkpoint(tiny, tmp_path):
    model, tok = tiny
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = M.load_model(str(tmp_path))
    assert type(loaded).__name__ == "Qwen3ForCausalLM" and loaded.config._attn_implementation == "sdpa"
    ids = torch.tensor([tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)])
    assert loaded_tok(tok.decode(ids[0]), add_special_tokens=False)["input_ids"] == ids[0].tolist()
    assert loaded_tok.apply_chat_template(CHAT, tokenize=False) == tok.apply_chat_template(CHAT, tokenize=False)
    assert loaded_tok.eos_token_id == tok.eos_token_id and loaded.generation_config.eos_token_id == tok.eos_token_id
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)


def test_load_model_without_chat_template_is_a_clear_error(tiny, tmp_path):
    model, tok = tiny
    model.save_pretrained(tmp_path)
    tok.chat_template, saved = None, tok.chat_template
    try:
        tok.save_pretrained(tmp_path)
    finally:
        tok.chat_template = saved
    with pytest.raises(ValueError, match="no chat template"):
        M.load_model(str(tmp_path))


def test_attention_implementation_choice():
    assert M.attn_implementation("cpu") == "sdpa"
    assert M.attn_implementation(torch.device("cpu"), torch.bfloat16) == "sdpa"
    assert M.attn_implementation("cuda", torch.float32) == "sdpa"  # flash-attn has no fp32 kernels

# -----------------------------------------------------------------------------
# SHAPES: real published shapes, built on the meta device (no memory)


@pytest.mark.parametrize("name", sorted(M.SHAPES))
def test_shapes_match_published_parameter_counts(name):
    model = M.build_random(name, dtype=torch.bfloat16, device="meta")
    n_params = sum(p.numel() for p in model.parameters())
    assert abs(n_params - M.PUBLISHED_PARAMS[name]) / M.PUBLISHED_PARAMS[name] < 0.02, n_params
    assert model.config.num_attention_heads % model.config.num_key_value_heads == 0  # GQA groups
    assert model.config.model_type == ("qwen2" if name.startswith("Qwen2") else "qwen3")


def test_unknown_shape_names_the_choices():
    with pytest.raises(ValueError, match="Qwen3-8B"):
        M.build_random("Qwen3-80B", device="meta")
