"""
SFT: a trajectory's chat messages become token ids and a loss mask that covers only the agent's own tokens (the
assistant turns and their closing eos, never the prompt, role headers or observations); rows are batched, and the
loss is the masked NLL over agent tokens. train.py's SFT stage runs on these; data/teacher.py writes the
trajectories.

    python train.py --model tiny --quick --stage sft     # a few SFT steps of the tiny model on the teacher's data
"""
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from distributed import sum_grads_over_ranks
from model import predicting_logits

# -----------------------------------------------------------------------------
# rows: chat messages -> (ids, mask)


def render(tokenizer, messages, add_generation_prompt=False):
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def tokenize_chat(messages, tokenizer):
    """(ids, mask) for one trajectory. The chat template renders growing prefixes; each new piece is tokenized on its
    own, which is how rollout builds sequences (prompt, sampled turn, observation...). mask = 1 on an assistant
    turn's content and its closing eos, 0 on the prompt, role headers and observations."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; SFT renders trajectories with it. Use a chat model or "
                         "set tokenizer.chat_template (a ChatML template, say)")
    eos = tokenizer.eos_token
    ids = []
    mask = []
    done = ""

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
    rows = []
    too_long = 0
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
# -----------------------------------------------------------------------------
# batches and the loss


def agent_tokens(rows):
    """Tokens the loss counts in (ids, mask) rows: each mask after its first position (position t-1 predicts t)."""
    return float(sum(sum(mask[1:]) for _, mask in rows))


def pad_batch(rows, pad_id, device):
    """Right-padded (B, T) ids, (B, T) loss mask."""
    T = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, (x, m) in enumerate(rows):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(m)] = torch.tensor(m)
    return ids.to(device), mask.to(device)


def sft_loss(model, ids, mask, global_tokens, full_forward=False):
    """Summed next-token NLL over agent tokens divided by ALL ranks' agent tokens, so that the ranks' gradients add
    up to the global one (the LM head on agent tokens only). ids, mask: (B, T), right padded. full_forward: FSDP
    goes through the root module's forward."""
    logits, targets = predicting_logits(model, ids, mask, full_forward)  # (N, V), (N,)
    return F.cross_entropy(logits, targets, reduction="sum") / global_tokens


def sft_step(model, optimizer, rows, global_tokens, pad_id, *, micro_batch_size, grad_clip, autocast,
             full_forward=False):
    """One optimizer step on this rank's rows, micro_batch_size rows per forward and backward: the gradients add up
    (the global normaliser makes the step split-invariant), then the sum over ranks, the clip and the step. Returns
    this rank's share of the loss and the gradient norm."""
    device = next(model.parameters()).device
    loss_sum = 0.0
    for i in range(0, len(rows), micro_batch_size):
        ids, mask = pad_batch(rows[i: i + micro_batch_size], pad_id, device)
        with autocast():
            loss = sft_loss(model, ids, mask, global_tokens, full_forward)
            loss.backward()
        loss_sum += loss.item()
    sum_grads_over_ranks(model)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip).item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm
